// The network kind's shared internals (private to the kind): its bounds, the store's key names,
// the messages on a consumer's queue and their wire format, the process's identity as it
// announces it, and the helpers over the store that the sessions, consumers and producers share.
#pragma once

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "../../attach_deadline.h"
#include "../../base/clock.h"
#include "../../base/process.h"
#include "../../base/random.h"
#include "../../base/fork_generation.h"
#include "../../kind_registry.h"
#include "network_kind.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

constexpr char kKeyPrefix[] = "dtorch/n/";
// The handle's format where the consumer takes links: 2 says how it receives values
// (NetworkHandle::links; format 1, the type first, where it takes none).
constexpr char kHandleFormat[] = "v2";
constexpr size_t kIdHexDigits = 32;
// A value this large or smaller travels in its message (one push); a larger one in chunks.
constexpr size_t kInlineValueBytes = size_t{4} << 20;
constexpr size_t kChunkBytes = size_t{4} << 20;  // under the libuv server's 8 MiB per value
constexpr size_t kMaxErrorDetailBytes = 8192;
constexpr int64_t kTickMs = 500;
// Claims of pairs that know no producer, read per tick (FindClaimHolders).
constexpr size_t kClaimsReadPerTick = 64;
constexpr milliseconds kConnectTimeout{10000};
// The watcher's connection waits this long in one pop (a pop that times out logs a warning in
// c10d, so it is long: the watcher is woken by messages, its tick by the tick thread).
constexpr milliseconds kWatcherTimeout{600000};
constexpr char kFailedClaim[] = "!";
// A producer's claim: its store id, "/", and 16 hex digits naming its attachment (so that a later
// attachment of the same process cannot take a claim of an earlier one for its own).
constexpr size_t kAttachmentHexDigits = 16;
// Bounds on what messages read from the store make the consumer do or keep.
// Store calls in one pipelined batch (deletes, pops: one round trip each).
constexpr size_t kBatch = 64;
// The watcher's pops in one batch while a backlog waits (each item may be a 4 MiB value).
constexpr size_t kPopBatch = 32;
// After an item this large, pops go one at a time (values of megabytes: what one batch holds).
constexpr size_t kLargeItemBytes = size_t{64} << 10;
// Holders one pair tracks (each is watched every tick): a pair that more processes attach to
// fails (a forged flood of attach messages costs that pair, not the session's tick).
constexpr size_t kMaxHoldersPerPair = 1024;
// Pairs dropped here that a value message may still name (a late value, its producer having
// claimed before the drop; a forged repeat): their keys are deleted for a value message naming
// no pair in flight, and nothing for one naming a pair never made here.
constexpr size_t kForgottenPairsKept = size_t{1} << 16;

extern std::atomic<StoreConnector> store_connector;
extern std::atomic<int64_t> heartbeat_timeout_ms;
extern std::atomic<int64_t> store_timeout_ms;
extern std::atomic<size_t> kind_threads;
// Forks of this process (counted in the parent): a pair created before one may have reached the
// child without being serialized, so it has left the process.
extern std::atomic<uint64_t> forks_in_parent;

// What of a pair is to be deleted: its claim (when `claim`), and chunks 0, 1, ... of its value
// up to the first one missing, at most `chunks`: a genuine producer writes them in order before
// its message, so a count read from the store (a forged message may claim 2^32 - 1) costs at most
// the keys that exist.
struct PairKeys {
  std::string pair;
  bool claim;
  uint32_t chunks;
};

// What CompareSet(key, kMissing, kMissing) answers for a missing key: it reads a key without
// waiting or making it (a get waits for a missing key, an add makes it).
constexpr char kMissing[] = "-";

// ---- messages on a consumer's queue ----

// 'R' (recheck): the tick thread decided to fail a pair (its producers gone); the watcher fails
// it when it pops this, after the messages queued before (a value a producer pushed just before
// it exited completes the pair instead, and an attach or serialize message the tick did not know
// of makes it decide again). Only a failure the session recorded is applied.
// 'S' (serialized): a holder passed a handle on (a handle in flight until one is deserialized).
// 'X' (exiting): the holder process is exiting (the library's exit, a multiprocessing child's
// end): once it is gone it "exited", rather than died. Its threads may still set values meanwhile.
enum MessageType : char {
  kAttach = 'A', kDropped = 'D', kValue = 'V', kWake = 'W', kRecheck = 'R', kSerialized = 'S',
  kExiting = 'X', kLinkRequest = 'G'
};
// 'G' (link request): the head, whose pair field names a new link (links.h): the consumer makes
// its end of it.

// Who a producer process is, as its attach message tells: its pid, start time and pid namespace,
// the boot id of its kernel (a consumer on the same kernel checks the process itself, as the file
// kind does, rather than waiting for its heartbeat to stop) and its host's name (for messages).
struct HolderInfo {
  bool deserialized = false;  // the attach counts a deserialization (else a first use)
  int32_t pid = 0;
  uint64_t start_time = 0;
  uint64_t pid_namespace = 0;
  std::string boot_id;  // 32 hex digits, or "" when unknown
  std::string host;     // at most kMaxHostBytes of [A-Za-z0-9._-]
  // Its attachment (kAttachmentHexDigits): a drop message of an earlier attachment of the same
  // process, sent later, must not mark a later one dropped.
  std::string attachment;
};
constexpr size_t kMaxHostBytes = 64;


// 'V': u8 status (0 value, 1 error) | u32 error code | u64 payload bytes | u32 chunks |
// u64 checksum | u32 header bytes | header (the codec's, or the error's detail) | the payload
// itself when chunks == 0.
struct ValueMessage {
  bool error = false;
  uint32_t code = 0;
  uint64_t payload_bytes = 0;
  uint32_t chunks = 0;
  uint64_t checksum = 0;
  std::string header;
  std::string_view inline_payload;
};

struct Message {
  MessageType type = kWake;
  std::string pair;
  std::string producer;
  ValueMessage value;  // kValue
  HolderInfo holder;   // kAttach
  std::string attachment;  // kDropped: the attachment that dropped it
};


template <typename V>
void Put(std::string& out, V v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// A value as it arrived: the codec's header and the payload's bytes (checked against the
// producer's size and checksum).
struct NetworkValue {
  std::string header;
  std::shared_ptr<void> keep_alive;  // owns [payload, payload + payload_bytes)
  char* payload = nullptr;
  size_t payload_bytes = 0;
};

class Session;
class ConsumerImpl;

struct Registry;

// ---- functions (store.cc, messages.cc, registry.cc, producer.cc) ----

// The next batch's size, given the backlog and the largest item of the last batch.
size_t PopBatchSize(int64_t backlog, size_t largest_item);

size_t LargestItem(const std::vector<std::string>& items);

std::string NewId();

bool IsId(std::string_view s);

// The attachment's part of a claim value ("<store id>/<attachment>").
std::string AttachmentOf(const std::string& claim);

bool IsClaimValue(std::string_view s);

std::string QueueKey(const std::string& process);

std::string HeartbeatKey(const std::string& process);

std::string IdentityKey(const std::string& process);

std::string ClaimKey(const std::string& pair);

std::string ChunkKey(const std::string& pair, uint32_t i);

// Deletes what `doomed` names, in pipelined batches of kBatch deletes (a pair's first chunk goes
// with its claim; the rest in batches while they exist). Throws StoreError; what is left to
// delete then stays in `doomed`.
void DeleteKeysOf(KeyValueStore& store, std::vector<PairKeys>& doomed);

// Pops what `queue` holds now, in batches of kPopBatch, and passes each item to `each`: as many
// items as it held when this began, at most (a sender that goes on pushing does not hold the
// caller). Throws StoreError.
void DrainQueue(KeyValueStore& store, const std::string& queue,
                const std::function<void(const std::string&)>& each);

// A heartbeat key's counter as read, 0 when it has none (or holds no counter: untrusted).
int64_t HeartbeatOf(const std::string& text);

// A process's heartbeat counter (HeartbeatOf), read without making its key. Throws StoreError.
int64_t ReadHeartbeat(KeyValueStore& store, const std::string& process);

// The heartbeats of `processes`, in pipelined batches of kBatch.
std::vector<int64_t> ReadHeartbeats(KeyValueStore& store, const std::vector<std::string>& processes);

std::unique_ptr<KeyValueStore> Connect(const StoreAddress& address, milliseconds timeout);

FutureError Unreachable(const StoreAddress& address, const std::exception& e);

// A checksum of a value's bytes (against corruption and truncation, not tampering: the store is
// trusted as far as its network is). Four independent multiply-xor lanes over 8-byte words: a
// few GB/s, next to the network's speed.
uint64_t Checksum(const char* data, size_t n);

bool IsHex(std::string_view s);

bool IsHostText(std::string_view s);

// This kernel's boot id, without dashes ("" when it cannot be read).
const std::string& BootId();

const std::string& HostName();

uint64_t ThisPidNamespace();

// This process, for the attach messages of its attachment `attachment`.
HolderInfo ThisHolder(bool deserialized, const std::string& attachment);

// A consumer's identity, written as it starts its first pair ("<uid>:<pid>:<start time>:<pid
// namespace>:<boot id>"): a producer of the same user on the same kernel finds it gone at once,
// by pid, rather than after its heartbeat timeout, and deletes what it sent it (also at its own
// exit). "" where this process cannot tell who it is (no /proc of its own): none is written.
std::string EncodeIdentity();

// The process `text` names when it is this user's and runs on this kernel in this pid namespace
// (another user's may be hidden from /proc: hidepid); nullopt when it runs elsewhere or `text` is
// no identity (read from the store: untrusted).
std::optional<ProcessId> LocalProcessOf(std::string_view text);

std::string EncodeHead(MessageType type, const std::string& pair, const std::string& producer);

// 'A': u8 flags (1: a deserialization) | i32 pid | u64 start time | u64 pid namespace |
// u8 boot id bytes (0 or 32) | boot id | u8 host bytes | host | the attachment (16 hex digits).
// 'D': the head | the attachment.
std::string EncodeAttach(const std::string& pair, const std::string& producer,
                         const HolderInfo& h);

// A value message's error: u8 exception type bytes | type | u16 detail bytes | detail |
// the traceback (the rest), in its header field.
std::string EncodeErrorText(const ErrorInfo& error);

// The error a value message carries (untrusted: nullopt when it is malformed).
std::optional<ErrorInfo> DecodeErrorText(uint32_t code, std::string_view text);

std::string EncodeValue(const std::string& pair, const std::string& producer,
                        const ValueMessage& v, std::string_view inline_payload);

// Parses a message (untrusted); nullopt when it is not one. `bytes` outlives the result's
// inline_payload.
std::optional<Message> Decode(const std::string& bytes);

Registry& Current();

// `count` of every session of this process, added up (pairs in flight, links), for diagnostics.
size_t SumOverSessions(size_t (Session::*count)() const);

void TickLoop(Registry* reg);

void EnsureTicking();

// Wakes the tick thread to delete what a session queued (starting it if need be).
void DeleteSoonOnTickThread();

std::shared_ptr<Session> SessionFor(const StoreAddress& address);

void Unregister(const Session* session);

FutureError Altered(const NetworkHandle& handle);

// The point-to-point links' transport thread (0 or 1), for NetworkKindThreads (links.cc).
size_t LinkTransportThreads();
void ForgetLinkTransportInChild() noexcept;
}  // namespace dtorch::core::network_internal
