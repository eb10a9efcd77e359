#include "network_kind.h"

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

#include "attach_deadline.h"
#include "base/clock.h"
#include "base/process.h"
#include "base/random.h"
#include "base/fork_generation.h"
#include "kind_registry.h"

namespace dtorch::core {
namespace {

using std::chrono::milliseconds;

constexpr char kKeyPrefix[] = "dtorch/n/";
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

// The next batch's size, given the backlog and the largest item of the last batch.
size_t PopBatchSize(int64_t backlog, size_t largest_item) {
  if (largest_item > kLargeItemBytes) return 1;
  return static_cast<size_t>(std::max<int64_t>(1, std::min<int64_t>(backlog, kPopBatch)));
}

size_t LargestItem(const std::vector<std::string>& items) {
  size_t largest = 0;
  for (const auto& item : items) largest = std::max(largest, item.size());
  return largest;
}

std::atomic<StoreConnector> store_connector{nullptr};
std::atomic<int64_t> heartbeat_timeout_ms{kDefaultNetworkHeartbeatTimeoutMs};
std::atomic<int64_t> store_timeout_ms{kDefaultNetworkStoreTimeoutMs};
std::atomic<size_t> kind_threads{0};

// Forks of this process (counted in the parent): a pair created before one may have reached the
// child without being serialized, so it has left the process.
std::atomic<uint64_t> forks_in_parent{0};
const bool fork_counter_installed = [] {
  pthread_atfork(nullptr, [] { ++forks_in_parent; }, nullptr);
  return true;
}();

std::string NewId() {
  unsigned char bytes[kIdHexDigits / 2];
  RandomBytes(bytes, sizeof(bytes));
  return HexOf(bytes, sizeof(bytes));
}

bool IsId(std::string_view s) {
  return s.size() == kIdHexDigits && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// The attachment's part of a claim value ("<store id>/<attachment>").
std::string AttachmentOf(const std::string& claim) { return claim.substr(kIdHexDigits + 1); }

bool IsClaimValue(std::string_view s) {
  return s.size() == kIdHexDigits + 1 + kAttachmentHexDigits && s[kIdHexDigits] == '/' &&
         IsId(s.substr(0, kIdHexDigits)) &&
         std::all_of(s.begin() + kIdHexDigits + 1, s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string QueueKey(const std::string& process) { return kKeyPrefix + std::string("q/") + process; }
std::string HeartbeatKey(const std::string& process) {
  return kKeyPrefix + std::string("hb/") + process;
}
std::string IdentityKey(const std::string& process) {
  return kKeyPrefix + std::string("id/") + process;
}
std::string ClaimKey(const std::string& pair) { return kKeyPrefix + std::string("c/") + pair; }
std::string ChunkKey(const std::string& pair, uint32_t i) {
  return kKeyPrefix + std::string("v/") + pair + "/" + std::to_string(i);
}

// What of a pair is to be deleted: its claim (when `claim`), and chunks 0, 1, ... of its value
// up to the first one missing, at most `chunks`: a genuine producer writes them in order before
// its message, so a count read from the store (a forged message may claim 2^32 - 1) costs at most
// the keys that exist.
struct PairKeys {
  std::string pair;
  bool claim;
  uint32_t chunks;
};

// Deletes what `doomed` names, in pipelined batches of kBatch deletes (a pair's first chunk goes
// with its claim; the rest in batches while they exist). Throws StoreError; what is left to
// delete then stays in `doomed`.
void DeleteKeysOf(KeyValueStore& store, std::vector<PairKeys>& doomed) {
  struct Next {
    size_t index;      // in doomed
    uint32_t chunk;    // the next chunk to try
  };
  std::vector<Next> open;  // pairs whose chunks may go on
  while (!doomed.empty()) {
    // One batch: claims and first chunks of the pairs at the back, then more chunks of those
    // that had theirs.
    std::vector<std::string> keys;
    std::vector<std::pair<size_t, uint32_t>> chunk_of;  // key -> (doomed index, chunk), or npos
    const size_t first = doomed.size() - std::min(doomed.size(), kBatch / 2);
    for (size_t i = first; i < doomed.size(); ++i) {
      PairKeys& p = doomed[i];
      if (p.claim) {
        keys.push_back(ClaimKey(p.pair));
        chunk_of.emplace_back(std::string::npos, 0);
      }
      if (p.chunks > 0) {
        keys.push_back(ChunkKey(p.pair, 0));
        chunk_of.emplace_back(i, 0);
      }
    }
    const std::vector<bool> existed = store.DeleteKeys(keys);
    for (size_t k = 0; k < keys.size(); ++k) {
      const size_t i = chunk_of[k].first;
      if (i != std::string::npos && existed[k] && doomed[i].chunks > 1) open.push_back({i, 1});
    }
    // The chunks after the first, of the pairs that had one.
    while (!open.empty()) {
      keys.clear();
      std::vector<size_t> owner;  // open index per key
      for (size_t o = 0; o < open.size() && keys.size() < kBatch; ++o) {
        const PairKeys& p = doomed[open[o].index];
        for (uint32_t c = open[o].chunk; c < p.chunks && keys.size() < kBatch; ++c) {
          keys.push_back(ChunkKey(p.pair, c));
          owner.push_back(o);
        }
      }
      const std::vector<bool> gone = store.DeleteKeys(keys);
      std::vector<bool> done(open.size(), false);
      std::vector<uint32_t> tried(open.size(), 0);
      for (size_t k = 0; k < keys.size(); ++k) {
        ++tried[owner[k]];
        if (!gone[k]) done[owner[k]] = true;  // (the first missing: its last)
      }
      std::vector<Next> still;
      for (size_t o = 0; o < open.size(); ++o) {
        const uint32_t next = open[o].chunk + tried[o];
        if (!done[o] && next < doomed[open[o].index].chunks) still.push_back({open[o].index, next});
      }
      open.swap(still);
    }
    doomed.resize(first);
  }
}

// Pops what `queue` holds now, in batches of kPopBatch, and passes each item to `each`: as many
// items as it held when this began, at most (a sender that goes on pushing does not hold the
// caller). Throws StoreError.
void DrainQueue(KeyValueStore& store, const std::string& queue,
                const std::function<void(const std::string&)>& each) {
  int64_t left = store.QueueLength(queue);
  size_t largest = 0;
  for (int64_t budget = left; left > 0 && budget > 0;) {
    const auto items =
        store.QueuePopSome(queue, PopBatchSize(std::min(budget, left), largest), false, &left);
    if (items.empty()) return;
    largest = LargestItem(items);
    budget -= static_cast<int64_t>(items.size());
    for (const auto& bytes : items) each(bytes);
  }
}

// What CompareSet(key, kMissing, kMissing) answers for a missing key: it reads a key without
// waiting or making it (a get waits for a missing key, an add makes it).
constexpr char kMissing[] = "-";

// A heartbeat key's counter as read, 0 when it has none (or holds no counter: untrusted).
int64_t HeartbeatOf(const std::string& text) {
  int64_t beat = 0;
  const auto parsed = std::from_chars(text.data(), text.data() + text.size(), beat);
  return parsed.ec == std::errc() && parsed.ptr == text.data() + text.size() && beat > 0 ? beat
                                                                                          : 0;
}

// A process's heartbeat counter (HeartbeatOf), read without making its key. Throws StoreError.
int64_t ReadHeartbeat(KeyValueStore& store, const std::string& process) {
  return HeartbeatOf(store.CompareSet(HeartbeatKey(process), kMissing, kMissing));
}

// The heartbeats of `processes`, in pipelined batches of kBatch.
std::vector<int64_t> ReadHeartbeats(KeyValueStore& store, const std::vector<std::string>& processes) {
  std::vector<int64_t> beats;
  beats.reserve(processes.size());
  for (size_t at = 0; at < processes.size(); at += kBatch) {
    std::vector<std::string> keys;
    for (size_t i = at; i < std::min(processes.size(), at + kBatch); ++i) {
      keys.push_back(HeartbeatKey(processes[i]));
    }
    for (const auto& text : store.CompareSets(keys, kMissing, kMissing)) {
      beats.push_back(HeartbeatOf(text));
    }
  }
  return beats;
}

std::unique_ptr<KeyValueStore> Connect(const StoreAddress& address, milliseconds timeout) {
  const StoreConnector connector = store_connector.load();
  if (connector == nullptr) {
    throw StoreError(StoreError::Kind::kOther, "this build of dtorch_ops has no store client");
  }
  return connector(address.host, address.port, timeout);
}

FutureError Unreachable(const StoreAddress& address, const std::exception& e) {
  return FutureError(FutureErrc::kBrokenPromise,
                     "the store at " + address.ToString() + " cannot be reached (" + e.what() +
                         "): is its server (the TCPStore created with is_master=True) running, "
                         "and reachable from this host?");
}

// A checksum of a value's bytes (against corruption and truncation, not tampering: the store is
// trusted as far as its network is). Four independent multiply-xor lanes over 8-byte words: a
// few GB/s, next to the network's speed.
uint64_t Checksum(const char* data, size_t n) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                   0x082EFA98EC4E6C89ull};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int lane = 0; lane < 4; ++lane) {
      uint64_t word;
      std::memcpy(&word, data + i + 8 * lane, 8);
      h[lane] = (h[lane] ^ word) * kMul;
      h[lane] ^= h[lane] >> 29;
    }
  }
  for (; i < n; ++i) {
    h[0] = (h[0] ^ static_cast<unsigned char>(data[i])) * kMul;
    h[0] ^= h[0] >> 29;
  }
  uint64_t r = n;
  for (uint64_t lane : h) {
    r = (r ^ lane) * kMul;
    r ^= r >> 32;
  }
  return r;
}

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
  kExiting = 'X'
};

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

bool IsHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool IsHostText(std::string_view s) {
  return s.size() <= kMaxHostBytes && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '-' || c == '_';
         });
}

// This kernel's boot id, without dashes ("" when it cannot be read).
const std::string& BootId() {
  // (Leaked: read by the exit's store thread, which may outlive static destruction.)
  static const std::string& id = *new std::string([] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string text, hex;
    std::getline(in, text);
    for (char c : text) {
      if (c != '-') hex += static_cast<char>(c >= 'A' && c <= 'F' ? c - 'A' + 'a' : c);
    }
    return hex.size() == 32 && IsHex(hex) ? hex : std::string();
  }());
  return id;
}

const std::string& HostName() {
  static const std::string& name = *new std::string([] {  // (leaked: as BootId)
    char buffer[256] = {};
    if (gethostname(buffer, sizeof(buffer) - 1) != 0) return std::string();
    std::string host(buffer, strnlen(buffer, kMaxHostBytes));
    return IsHostText(host) ? host : std::string();
  }());
  return name;
}

uint64_t ThisPidNamespace() {
  try {
    return Self().pid_namespace;
  } catch (...) {
    return 0;
  }
}

// This process, for the attach messages of its attachment `attachment`.
HolderInfo ThisHolder(bool deserialized, const std::string& attachment) {
  HolderInfo info;
  info.deserialized = deserialized;
  info.attachment = attachment;
  const ProcessId self = Self();
  info.pid = self.pid;
  info.start_time = self.start_time;
  info.pid_namespace = self.pid_namespace;
  info.boot_id = BootId();
  // (Tests make a holder look as if it ran on another host: 32 hex digits.)
  if (const char* fake = std::getenv("DTORCH_BOOT_ID_FOR_TESTING")) {
    if (std::strlen(fake) == 32 && IsHex(fake)) info.boot_id = fake;
  }
  info.host = HostName();
  return info;
}

// A consumer's identity, written as it starts its first pair ("<uid>:<pid>:<start time>:<pid
// namespace>:<boot id>"): a producer of the same user on the same kernel finds it gone at once,
// by pid, rather than after its heartbeat timeout, and deletes what it sent it (also at its own
// exit). "" where this process cannot tell who it is (no /proc of its own): none is written.
std::string EncodeIdentity() {
  try {
    const HolderInfo self = ThisHolder(false, "");
    if (self.boot_id.empty()) return {};
    return std::to_string(geteuid()) + ":" + std::to_string(self.pid) + ":" +
           std::to_string(self.start_time) + ":" + std::to_string(self.pid_namespace) + ":" +
           self.boot_id;
  } catch (...) {
    return {};
  }
}

// The process `text` names when it is this user's and runs on this kernel in this pid namespace
// (another user's may be hidden from /proc: hidepid); nullopt when it runs elsewhere or `text` is
// no identity (read from the store: untrusted).
std::optional<ProcessId> LocalProcessOf(std::string_view text) {
  uint64_t fields[4] = {};
  size_t pos = 0;
  for (uint64_t& field : fields) {
    const size_t colon = text.find(':', pos);
    if (colon == std::string_view::npos || colon == pos || colon - pos > 20) return std::nullopt;
    const auto parsed = std::from_chars(text.data() + pos, text.data() + colon, field);
    if (parsed.ec != std::errc() || parsed.ptr != text.data() + colon) return std::nullopt;
    pos = colon + 1;
  }
  const std::string_view boot_id = text.substr(pos);
  if (fields[0] != geteuid() || fields[1] == 0 || fields[1] > INT32_MAX || boot_id.size() != 32 ||
      !IsHex(boot_id) || boot_id != BootId() || fields[3] == 0 ||
      fields[3] != ThisPidNamespace()) {
    return std::nullopt;
  }
  return ProcessId{static_cast<int32_t>(fields[1]), fields[2], fields[3]};
}

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

std::string EncodeHead(MessageType type, const std::string& pair, const std::string& producer) {
  std::string out(1, static_cast<char>(type));
  out += pair;
  out += producer;
  return out;
}

template <typename V>
void Put(std::string& out, V v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// 'A': u8 flags (1: a deserialization) | i32 pid | u64 start time | u64 pid namespace |
// u8 boot id bytes (0 or 32) | boot id | u8 host bytes | host | the attachment (16 hex digits).
// 'D': the head | the attachment.
std::string EncodeAttach(const std::string& pair, const std::string& producer,
                         const HolderInfo& h) {
  std::string out = EncodeHead(kAttach, pair, producer);
  Put<uint8_t>(out, h.deserialized ? 1 : 0);
  Put<int32_t>(out, h.pid);
  Put<uint64_t>(out, h.start_time);
  Put<uint64_t>(out, h.pid_namespace);
  Put<uint8_t>(out, static_cast<uint8_t>(h.boot_id.size()));
  out += h.boot_id;
  Put<uint8_t>(out, static_cast<uint8_t>(h.host.size()));
  out += h.host;
  out += h.attachment;
  return out;
}

// A value message's error: u8 exception type bytes | type | u16 detail bytes | detail |
// the traceback (the rest), in its header field.
std::string EncodeErrorText(const ErrorInfo& error) {
  std::string type = ValidExceptionType(error.origin.exception_type)
                         ? error.origin.exception_type : std::string();
  const std::string detail = error.detail.substr(0, kMaxErrorDetailBytes / 2);
  const size_t room = kMaxErrorDetailBytes - 3 - type.size() - detail.size();
  const std::string& traceback = error.origin.traceback;
  std::string out;
  Put<uint8_t>(out, static_cast<uint8_t>(type.size()));
  out += type;
  Put<uint16_t>(out, static_cast<uint16_t>(detail.size()));
  out += detail;
  out += traceback.size() <= room ? traceback : traceback.substr(traceback.size() - room);
  return out;
}

// The error a value message carries (untrusted: nullopt when it is malformed).
std::optional<ErrorInfo> DecodeErrorText(uint32_t code, std::string_view text) {
  if (text.size() < 3) return std::nullopt;
  const size_t type_bytes = static_cast<unsigned char>(text[0]);
  if (text.size() < 3 + type_bytes) return std::nullopt;
  ErrorInfo error{static_cast<FutureErrc>(code), ""};
  error.origin.exception_type = std::string(text.substr(1, type_bytes));
  if (!ValidExceptionType(error.origin.exception_type)) return std::nullopt;
  uint16_t detail_bytes = 0;
  std::memcpy(&detail_bytes, text.data() + 1 + type_bytes, 2);
  const size_t start = 3 + type_bytes;
  if (text.size() - start < detail_bytes) return std::nullopt;
  error.detail = std::string(text.substr(start, detail_bytes));
  error.origin.traceback = std::string(text.substr(start + detail_bytes));
  return error;
}

std::string EncodeValue(const std::string& pair, const std::string& producer,
                        const ValueMessage& v, std::string_view inline_payload) {
  std::string out = EncodeHead(kValue, pair, producer);
  out.reserve(out.size() + 33 + v.header.size() + inline_payload.size());
  Put<uint8_t>(out, v.error ? 1 : 0);
  Put<uint32_t>(out, v.code);
  Put<uint64_t>(out, v.payload_bytes);
  Put<uint32_t>(out, v.chunks);
  Put<uint64_t>(out, v.checksum);
  Put<uint32_t>(out, static_cast<uint32_t>(v.header.size()));
  out += v.header;
  out.append(inline_payload.data(), inline_payload.size());
  return out;
}

// Parses a message (untrusted); nullopt when it is not one. `bytes` outlives the result's
// inline_payload.
std::optional<Message> Decode(const std::string& bytes) {
  Message m;
  if (bytes.empty()) return std::nullopt;
  m.type = static_cast<MessageType>(bytes[0]);
  if (m.type == kWake) return bytes.size() == 1 ? std::optional<Message>(m) : std::nullopt;
  if (m.type != kAttach && m.type != kDropped && m.type != kValue && m.type != kRecheck &&
      m.type != kSerialized && m.type != kExiting) {
    return std::nullopt;
  }
  if (bytes.size() < 1 + 2 * kIdHexDigits) return std::nullopt;
  m.pair = bytes.substr(1, kIdHexDigits);
  m.producer = bytes.substr(1 + kIdHexDigits, kIdHexDigits);
  if (!IsId(m.pair) || !IsId(m.producer)) return std::nullopt;
  size_t pos = 1 + 2 * kIdHexDigits;
  const auto get = [&](void* out, size_t n) {
    if (bytes.size() - pos < n) return false;
    std::memcpy(out, bytes.data() + pos, n);
    pos += n;
    return true;
  };
  if (m.type == kAttach) {
    HolderInfo& h = m.holder;
    uint8_t flags = 0, boot_bytes = 0, host_bytes = 0;
    if (!get(&flags, 1) || flags > 1 || !get(&h.pid, 4) || !get(&h.start_time, 8) ||
        !get(&h.pid_namespace, 8) || !get(&boot_bytes, 1) ||
        (boot_bytes != 0 && boot_bytes != 32) || bytes.size() - pos < boot_bytes) {
      return std::nullopt;
    }
    h.deserialized = flags == 1;
    h.boot_id = bytes.substr(pos, boot_bytes);
    pos += boot_bytes;
    if (!get(&host_bytes, 1) || host_bytes > kMaxHostBytes ||
        bytes.size() - pos != host_bytes + kAttachmentHexDigits) {
      return std::nullopt;
    }
    h.host = bytes.substr(pos, host_bytes);
    h.attachment = bytes.substr(pos + host_bytes);
    if (h.pid <= 0 || !IsHex(h.boot_id) || !IsHostText(h.host) || !IsHex(h.attachment)) {
      return std::nullopt;
    }
    return m;
  }
  if (m.type == kDropped) {
    if (bytes.size() - pos != kAttachmentHexDigits) return std::nullopt;
    m.attachment = bytes.substr(pos);
    return IsHex(m.attachment) ? std::optional<Message>(m) : std::nullopt;
  }
  if (m.type != kValue) return pos == bytes.size() ? std::optional<Message>(m) : std::nullopt;
  uint8_t status = 0;
  uint32_t header_bytes = 0;
  ValueMessage& v = m.value;
  if (!get(&status, 1) || !get(&v.code, 4) || !get(&v.payload_bytes, 8) || !get(&v.chunks, 4) ||
      !get(&v.checksum, 8) || !get(&header_bytes, 4)) {
    return std::nullopt;
  }
  if (status > 1) return std::nullopt;
  v.error = status == 1;
  const size_t header_limit = v.error ? kMaxErrorDetailBytes : kMaxValueHeaderBytes;
  if (header_bytes > header_limit || bytes.size() - pos < header_bytes) return std::nullopt;
  v.header = bytes.substr(pos, header_bytes);
  pos += header_bytes;
  if (v.error) {
    if (v.code > static_cast<uint32_t>(kLastFutureErrc) || v.payload_bytes != 0 || v.chunks != 0 ||
        pos != bytes.size()) {
      return std::nullopt;
    }
    return m;
  }
  if (v.chunks == 0) {
    if (v.payload_bytes != bytes.size() - pos || v.payload_bytes > kInlineValueBytes) {
      return std::nullopt;
    }
    v.inline_payload = std::string_view(bytes).substr(pos);
  } else {
    // Exactly as many chunks as the size needs (each full but the last).
    if (pos != bytes.size() || v.payload_bytes <= kInlineValueBytes ||
        v.chunks != (v.payload_bytes + kChunkBytes - 1) / kChunkBytes) {
      return std::nullopt;
    }
  }
  return m;
}

// A value as it arrived: the codec's header and the payload's bytes (checked against the
// producer's size and checksum).
struct NetworkValue {
  std::string header;
  std::shared_ptr<std::string> payload;
};

class Session;
class ConsumerImpl;

// ---- the sessions: one per store per process ----

// What this process knows of another's heartbeat.
struct Liveness {
  int64_t last_beat = -1;  // the heartbeat counter last read
  Clock::time_point changed_at = Clock::now();
  enum class State { kAlive, kExited, kDead } state = State::kAlive;
  bool exiting = false;  // it said so ('X'): once gone, it exited
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(StoreAddress address, std::unique_ptr<KeyValueStore> connection)
      : address_(std::move(address)), id_(NewId()), store_(std::move(connection)) {}

  const StoreAddress& address() const { return address_; }
  const std::string& id() const { return id_; }
  KeyValueStore& store() { return *store_; }
  // Its connection was lost (a call that failed or timed out on it, on any thread), or it broke.
  bool broken() const { return broken_ || store_->Broken(); }

  // Bumps this process's heartbeat: always when `force`, else unless it was bumped within half a
  // tick (a process that starts a pair between two ticks must not look exited, or dead with a
  // counter others read long ago). Throws StoreError.
  void Beat(bool force);

  // Consumer side. Register writes the pair's record (throws StoreError).
  void Register(const std::string& pair, const std::string& record,
                const std::shared_ptr<ConsumerImpl>& consumer);
  void Forget(const std::string& pair, bool value_arrived);
  size_t PendingPairs() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pairs_.size();
  }
  // Producer side.
  void ProducerAttached() {
    std::lock_guard<std::mutex> lock(mu_);
    ++producers_;
  }
  void ProducerDetached() {
    std::lock_guard<std::mutex> lock(mu_);
    --producers_;
  }
  // Runs `work` on the tick thread, at its next round (a producer's attach message: not on the
  // path of a value set at once, which tells the consumer all the attach message would).
  void AtNextTick(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // (A broken session is ticked by nobody: what `work` holds, the session itself among it,
      // goes now, outside mu_.)
      if (!broken_) {
        next_tick_.push_back(std::move(work));
        return;
      }
    }
    work = nullptr;
  }
  // Runs now what waits for the next round: the process exits, and that round may never come
  // (a handle dropped just before the exit tells its consumer, which would otherwise find this
  // process gone and say "died").
  void RunDeferred() noexcept {
    for (int round = 0; round < 4; ++round) {  // (work may queue more: a last reference dropped)
      std::vector<std::function<void()>> work;
      {
        std::lock_guard<std::mutex> lock(mu_);
        work.swap(next_tick_);
      }
      if (work.empty()) return;
      for (auto& w : work) w();  // (noexcept: see ProducerImpl::Announce)
    }
  }
  // Whether `consumer` ran on this kernel and is gone (its identity read once from the store).
  // Throws StoreError.
  bool ConsumerGoneHere(const std::string& consumer);
  // `consumer` is gone: its queue drained, the keys its messages name and the claims of `pairs`
  // deleted, and its heartbeat and identity. Throws StoreError.
  void DeleteWhatADeadConsumerLeft(const std::string& consumer,
                                   const std::vector<std::string>& pairs);
  // A message about `pair` went to `consumer`'s queue: what it names is this process's to delete
  // should that consumer die before reading it.
  void Sent(const std::string& consumer, const std::string& pair, uint32_t chunks) {
    std::lock_guard<std::mutex> lock(mu_);
    sent_[consumer].push_back({pair, chunks});
  }
  // The pairs this process sent `consumer` messages about, not yet known read.
  std::vector<std::string> SentPairs(const std::string& consumer) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> pairs;
    if (const auto it = sent_.find(consumer); it != sent_.end()) {
      for (const auto& sent : it->second) pairs.push_back(sent.pair);
    }
    return pairs;
  }
  // Fails `pair` once the watcher has handled the messages queued before now (kRecheck), unless
  // one of them changed what the decision was made from (the consumer's epoch, at `epoch` now).
  void FailAfterQueued(const std::string& pair, FutureErrc code, const std::string& detail,
                       uint64_t epoch, std::set<std::string> gone);
  // Heartbeats, liveness and clean-up; on the tick thread. False once it has nothing to do.
  bool Tick();
  // What DeleteSoon queued, now (the tick thread, between rounds).
  void DeleteQueued();
  // The store went away: fails every pair in flight here.
  void Break(const std::string& why);
  // At exit: fails the pairs in flight, deletes their keys and this process's heartbeat, wakes
  // the watcher.
  void Stop() noexcept;

 private:
  struct SentPair {
    std::string pair;
    uint32_t chunks;
  };
  void StartWatcherLocked();
  void Watch(const std::shared_ptr<KeyValueStore>& connection);
  void Handle(KeyValueStore& connection, const Message& m);
  void Receive(KeyValueStore& connection, const Message& m, const std::shared_ptr<ConsumerImpl>& c);
  // Deletes `keys` soon, on the tick thread (off the watcher, which delivers the other pairs'
  // values): at once, between its rounds.
  void DeleteSoon(PairKeys keys);
  // A value message names a pair not in flight here: a pair dropped here (kept in forgotten_)
  // may have a late value's chunks in the store (deleted); one never made here (forged) has
  // nothing of ours (no store call).
  void ValueForNoPair(const Message& m);
  // The holder of a message that names one: a known holder of the pair (kSerialized and
  // kExiting come only from holders that announced themselves).
  static bool FromHolder(const ConsumerImpl* consumer, const Message& m);
  void CheckProducers(Clock::time_point now);
  // Watches the claim holders of pairs that know of no producer (one that claimed, then died
  // before it was announced, would otherwise never be watched).
  void FindClaimHolders(const std::vector<std::shared_ptr<ConsumerImpl>>& consumers);
  void CleanUpForConsumers();
  std::vector<std::shared_ptr<ConsumerImpl>> LiveConsumers();

 public:
  // The consumer of `pair` in this process, if it is still in flight.
  std::shared_ptr<ConsumerImpl> Find(const std::string& pair);

 private:
  // Wakes the watcher from its pop, if it is in one and no wake is on its way (caller: mu_ held;
  // push the wake after releasing it when this returns true).
  bool WakeWatcherLocked();

  const StoreAddress address_;
  const std::string id_;
  const std::unique_ptr<KeyValueStore> store_;
  std::atomic<bool> broken_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> last_beat_ms_{std::numeric_limits<int64_t>::min() / 2};
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::weak_ptr<ConsumerImpl>> pairs_;  // guarded by mu_
  // The watcher's connection, kept for the next watcher (guarded by mu_).
  std::shared_ptr<KeyValueStore> watch_connection_;
  bool watching_ = false;        // guarded by mu_: a watcher thread runs
  bool watcher_blocked_ = false;  // guarded by mu_: it is in (or entering) its pop
  bool wake_pending_ = false;     // guarded by mu_: a wake message is on its way to it
  std::map<std::string, Liveness> producers_liveness_;  // guarded by mu_: as a consumer
  std::map<std::string, Liveness> consumers_liveness_;  // guarded by mu_: as a producer
  // guarded by mu_: as a producer, the consumers' processes on this kernel, by store id (nullopt:
  // elsewhere, or no identity)
  std::map<std::string, std::optional<ProcessId>> consumer_processes_;
  std::mutex cleanup_mu_;          // held by CleanUpForConsumers (not with mu_)
  bool identity_tried_ = false;    // guarded by mu_: as a consumer
  bool identity_written_ = false;  // guarded by mu_: as a consumer
  int64_t producers_ = 0;  // guarded by mu_: announced NetworkProducers of this process here
  std::map<std::string, std::vector<SentPair>> sent_;  // guarded by mu_: by consumer
  std::vector<PairKeys> cleanups_;                     // guarded by mu_
  // guarded by mu_: pairs dropped here, oldest first (at most kForgottenPairsKept)
  std::deque<std::string> forgotten_order_;
  std::unordered_set<std::string> forgotten_;
  std::vector<std::function<void()>> next_tick_;       // guarded by mu_
  struct QueuedFailure {
    ErrorInfo error;
    uint64_t epoch;              // the consumer's epoch when it was decided
    std::set<std::string> gone;  // the holders it found gone
  };
  std::map<std::string, QueuedFailure> failures_after_queued_;  // guarded by mu_: by pair
  size_t claims_read_ = 0;  // FindClaimHolders' rounds (the tick thread's only)
  // guarded by mu_: this process has awaited values here. Its heartbeat then goes on until it
  // exits: producers with messages for it must not take an idle consumer for a dead one.
  bool consumed_ = false;
};

// ---- the consumer's pair ----

class ConsumerImpl final : public NetworkConsumer,
                           public std::enable_shared_from_this<ConsumerImpl> {
 public:
  ConsumerImpl(std::shared_ptr<Session> session, NetworkHandle handle,
               PayloadBytesOf payload_bytes_of)
      : session_(std::move(session)),
        handle_(std::move(handle)),
        record_(handle_.Serialize()),
        payload_bytes_of_(std::move(payload_bytes_of)) {}
  ~ConsumerImpl() override {
    if (ForkGeneration() == generation_) session_->Forget(handle_.pair, value_arrived_);
  }

  const NetworkHandle& handle() const override { return handle_; }
  const std::string& record() const { return record_; }
  bool InCreatorProcess() const override { return ForkGeneration() == generation_; }
  void MarkLeftProcess() override {
    left_process_ = true;
    CountSerialized();
  }
  void CreatorDropped(bool claimed_here) override;
  bool RetrieveFuture() override { return !future_retrieved_.exchange(true); }
  SharedState<NetworkValue>& state() { return state_; }
  // ReceivedSource (the future's).
  bool WaitUntil(Deadline deadline) const override {
    CheckInCreatorProcess();
    return state_.WaitUntil(deadline);
  }
  bool IsReady() const override { return state_.IsReady(); }
  void OnReady(std::function<void()> callback) override { state_.OnReady(std::move(callback)); }
  ReceivedValue Take() override {
    CheckInCreatorProcess();
    NetworkValue value = state_.Take();
    std::string* bytes = value.payload.get();
    const bool empty = bytes == nullptr || bytes->empty();
    return ReceivedValue{std::move(value.header), empty ? nullptr : bytes->data(),
                         empty ? 0 : bytes->size(), std::move(value.payload)};
  }
  void FutureDropped() override { state_.DropResult(); }

  // A future inherited by a forked child: the pair's watcher is the parent's, nothing would
  // complete it here (throws, as memory futures pending at fork fail).
  void CheckInCreatorProcess() const {
    if (ForkGeneration() == generation_) return;
    throw FutureError(FutureErrc::kDroppedAtFork,
                      "the network future was in flight in the parent process when it forked; "
                      "its value goes to the parent: get it there, or create the pair in this "
                      "process");
  }
  // Complete, whether or not its result was taken (get() consumes: IsReady() is then false).
  bool Settled() const { return state_.IsReady() || !state_.Valid(); }
  bool KnowsNoProducer() const {
    std::lock_guard<std::mutex> lock(mu_);
    return producers_.empty();
  }
  void ValueArrived() { value_arrived_ = true; }
  // Why a value message's payload size cannot be this pair's ("" when it can): the size its
  // header implies (the codec's word), and at most this machine's memory.
  std::string CheckPayloadBytes(std::string_view header, uint64_t bytes) const {
    if (payload_bytes_of_) {
      uint64_t implied = 0;
      try {
        implied = payload_bytes_of_(header);
      } catch (const FutureError& e) {
        return "its header is no " + handle_.type_name + " value's (" + e.detail() + ")";
      } catch (const std::exception& e) {
        return "its header is no " + handle_.type_name + " value's (" + e.what() + ")";
      }
      if (implied != bytes) {
        return "it says it has " + std::to_string(bytes) + " bytes, and its header " +
               std::to_string(implied);
      }
    }
    static const uint64_t memory = [] {
      const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
      return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page)
                                   : std::numeric_limits<uint64_t>::max();
    }();
    if (bytes > memory) {
      return "its " + std::to_string(bytes) + " bytes are more than this machine's memory (" +
             std::to_string(memory) + " bytes)";
    }
    return {};
  }

  // A holder of this pair: a process that deserialized a handle or used one (its attach
  // message), or claimed the pair (FindClaimHolders; nothing more known of it then).
  struct Holder {
    bool dropped = false;
    std::string attachment;  // its latest attachment's id ("" when not known)
    int32_t pid = 0;     // 0: not known
    std::string host;    // its host's name when it is not this one
    std::optional<ProcessId> local;  // on this kernel: checked by pid, not by heartbeat
  };

  // On the session's threads. Each message that changes what the tick decides from (a holder,
  // a handle serialized) bumps the epoch: a failure decided before it is not applied.
  // False (nothing recorded) for a holder past kMaxHoldersPerPair.
  bool Attached(const std::string& producer, const std::optional<HolderInfo>& info) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!TrackLocked(producer)) return false;
    Holder& holder = producers_[producer];
    holder.dropped = false;  // (a process that dropped a handle and attached again: live)
    if (info) {
      holder.attachment = info->attachment;
      holder.pid = info->pid;
      if (!info->boot_id.empty() && info->boot_id == BootId() &&
          info->pid_namespace == ThisPidNamespace()) {
        // (A process of another pid namespace cannot be checked from here: its heartbeat.)
        holder.local = ProcessId{info->pid, info->start_time, info->pid_namespace};
      } else if (info->boot_id != BootId()) {
        holder.host = info->host.empty() ? "another host" : info->host;
      }
      if (info->deserialized) ++deserialized_;
    }
    ++epoch_;
    return true;
  }
  // `attachment` of `producer` dropped the pair (an earlier one's late message changes nothing).
  // (Only a known holder's: FromHolder.)
  void Dropped(const std::string& producer, const std::string& attachment) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = producers_.find(producer);
    if (it == producers_.end()) return;
    Holder& holder = it->second;
    if (!holder.attachment.empty() && holder.attachment != attachment) return;
    holder.dropped = true;
    ++epoch_;
  }
  // Whether `producer` is a holder of the pair not known to have dropped it.
  bool HasLiveHolder(const std::string& producer) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = producers_.find(producer);
    return it != producers_.end() && !it->second.dropped;
  }
  // A handle was serialized: in the creator's process (MarkLeftProcess), or by a holder.
  void CountSerialized() {
    std::lock_guard<std::mutex> lock(mu_);
    ++serialized_;
    ++epoch_;
  }
  // A handle was deserialized in this (the creator's) process.
  void CountDeserialized() {
    std::lock_guard<std::mutex> lock(mu_);
    ++deserialized_;
    ++epoch_;
  }
  uint64_t Epoch() const {
    std::lock_guard<std::mutex> lock(mu_);
    return epoch_;
  }
  // Something the tick's verdict depends on changed (a holder said it is exiting).
  void Changed() {
    std::lock_guard<std::mutex> lock(mu_);
    ++epoch_;
  }
  // Why the pair should fail now (empty: it should not): every holder gone (unless a handle is
  // still in flight: then the attach deadline), or none attached by the deadline. `liveness` is
  // the session's, read under its lock.
  std::string WhyFail(const std::map<std::string, Liveness>& liveness, Clock::time_point now);
  // The holders not known to have dropped the pair, and what is known of each.
  std::vector<std::pair<std::string, Holder>> LiveProducers() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<std::string, Holder>> out;
    for (const auto& [id, holder] : producers_) {
      if (!holder.dropped) out.emplace_back(id, holder);
    }
    return out;
  }
  // The creator's own handle set an exception object: kept for the error message its value
  // message brings back to this process.
  void KeepNative(std::shared_ptr<const NativeError> native) override {
    std::lock_guard<std::mutex> lock(mu_);
    native_ = std::move(native);
  }
  std::shared_ptr<const NativeError> Native() const {
    std::lock_guard<std::mutex> lock(mu_);
    return native_;
  }
  // Fails the pair now (the store went away; a promise that never left the process dropped).
  void Fail(FutureErrc code, const std::string& detail) {
    if (!Settled()) state_.TryComplete(Result<NetworkValue>::Error(code, detail));
  }
  // The watcher applies the tick's verdict (every holder gone): first takes the claim on
  // `connection` (so that a producer cannot claim it after), unless a producer holds it that is
  // not one of the holders the verdict found gone (`gone`): its value is on the way.
  void FailAsDecided(KeyValueStore& connection, const ErrorInfo& error,
                     const std::set<std::string>& gone);
  // The holders known now (the tick's verdict names them gone).
  std::set<std::string> HolderIds() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<std::string> ids;
    for (const auto& [id, holder] : producers_) ids.insert(id);
    return ids;
  }

 private:
  bool LeftProcess() const {
    return left_process_ || forks_in_parent.load() != forks_at_creation_;
  }
  // Whether `producer` is, or may become, one of producers_ (mu_ held).
  bool TrackLocked(const std::string& producer) const {
    return producers_.size() < kMaxHoldersPerPair || producers_.count(producer) != 0;
  }

  const std::shared_ptr<Session> session_;
  const NetworkHandle handle_;
  const std::string record_;  // what the claim key holds until a producer claims the pair
  const PayloadBytesOf payload_bytes_of_;  // the codec's (null: not checked)
  const uint64_t generation_ = ForkGeneration();
  const uint64_t forks_at_creation_ = forks_in_parent.load();
  SharedState<NetworkValue> state_;
  std::atomic<bool> left_process_{false};
  std::atomic<bool> future_retrieved_{false};
  std::atomic<bool> value_arrived_{false};  // its value message was read (its chunks deleted)
  mutable std::mutex mu_;
  std::map<std::string, Holder> producers_;  // guarded by mu_: by store id
  std::optional<Clock::time_point> creator_dropped_at_;  // guarded by mu_
  // guarded by mu_: handles serialized and deserialized (wrapping counts; see WhyFail)
  uint32_t serialized_ = 0;
  uint32_t deserialized_ = 0;
  uint64_t epoch_ = 0;                                 // guarded by mu_
  std::optional<Clock::time_point> all_gone_since_;    // guarded by mu_: the tick's
  std::shared_ptr<const NativeError> native_;          // guarded by mu_
};

bool Session::FromHolder(const ConsumerImpl* consumer, const Message& m) {
  return consumer != nullptr && consumer->HasLiveHolder(m.producer);
}

// ---- the registry and the tick thread ----

struct Registry {
  uint64_t generation = ForkGeneration();
  std::mutex mu;
  std::map<StoreAddress, std::shared_ptr<Session>> sessions;  // guarded by mu
  std::condition_variable tick_cv;
  bool ticking = false;   // guarded by mu: the tick thread runs
  uint64_t work = 0;      // guarded by mu: EnsureTicking calls (work given since a round began)
  bool stopped = false;   // guarded by mu: the library's exit ran
  bool delete_soon = false;  // guarded by mu: a session queued keys to delete (DeleteSoon)
};

std::atomic<Registry*> registry{new Registry()};  // replaced (the old one leaked) in a fork child

Registry& Current() { return *registry.load(); }

void TickLoop(Registry* reg) {
  Clock::time_point next_round = Clock::now() + milliseconds(kTickMs);
  for (;;) {
    std::vector<std::shared_ptr<Session>> sessions;
    uint64_t work_seen;
    bool round;
    {
      std::unique_lock<std::mutex> lock(reg->mu);
      reg->tick_cv.wait_until(lock, next_round, [&] { return reg->stopped || reg->delete_soon; });
      if (reg->stopped) break;
      reg->delete_soon = false;
      round = Clock::now() >= next_round;
      work_seen = reg->work;
      for (auto& [address, session] : reg->sessions) sessions.push_back(session);
    }
    // Between rounds: only what was queued for deletion (a value's chunks, once read).
    for (auto& session : sessions) session->DeleteQueued();
    if (!round) continue;
    next_round = Clock::now() + milliseconds(kTickMs);
    bool busy = false;
    for (auto& session : sessions) busy = session->Tick() || busy;
    if (!busy) {
      std::lock_guard<std::mutex> lock(reg->mu);
      // Work given during the round (EnsureTicking found this thread running) is the next one's.
      if (reg->work != work_seen) continue;
      reg->ticking = false;
      --kind_threads;  // (counted while reg->mu is held: a new tick thread cannot overlap)
      return;
    }
  }
  std::lock_guard<std::mutex> lock(reg->mu);
  reg->ticking = false;
  --kind_threads;
}

void EnsureTicking() {
  Registry* reg = &Current();
  std::lock_guard<std::mutex> lock(reg->mu);
  ++reg->work;
  if (reg->ticking || reg->stopped) return;
  std::thread thread(&TickLoop, reg);
  pthread_setname_np(thread.native_handle(), "dtorch-net-tick");
  thread.detach();
  reg->ticking = true;
  ++kind_threads;
}

// Wakes the tick thread to delete what a session queued (starting it if need be).
void DeleteSoonOnTickThread() {
  {
    Registry& reg = Current();
    std::lock_guard<std::mutex> lock(reg.mu);
    reg.delete_soon = true;
  }
  Current().tick_cv.notify_all();
  EnsureTicking();
}

std::shared_ptr<Session> SessionFor(const StoreAddress& address) {
  Registry& reg = Current();
  // A session whose connection was lost (a call that timed out on any thread) breaks before it
  // is replaced: its pairs fail now rather than waiting on a session nothing ticks. (Outside
  // reg.mu: Break unregisters.)
  const auto break_lost = [](const std::shared_ptr<Session>& lost) {
    if (lost) lost->Break("its connection to the store was lost");
  };
  std::shared_ptr<Session> lost;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    if (reg.stopped) {
      throw FutureError(FutureErrc::kDroppedAtExit, "the library is shutting down");
    }
    auto it = reg.sessions.find(address);
    if (it != reg.sessions.end()) {
      if (!it->second->broken()) return it->second;
      lost = it->second;
    }
  }
  break_lost(lost);
  std::unique_ptr<KeyValueStore> connection;
  try {
    connection = Connect(address, kConnectTimeout);
  } catch (const StoreError& e) {
    throw Unreachable(address, e);
  }
  auto session = std::make_shared<Session>(address, std::move(connection));
  std::shared_ptr<Session> chosen;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto& slot = reg.sessions[address];
    if (!slot || slot->broken()) {
      lost = std::move(slot);
      slot = session;
    }
    chosen = slot;  // (else another thread connected first)
  }
  break_lost(lost);
  return chosen;
}

void Unregister(const Session* session) {
  Registry& reg = Current();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.sessions.find(session->address());
  if (it != reg.sessions.end() && it->second.get() == session) reg.sessions.erase(it);
}

// ---- Session ----

void Session::Beat(bool force) {
  const int64_t now = NowMs();
  if (!force && now - last_beat_ms_.load() < kTickMs / 2) return;
  store_->Add(HeartbeatKey(id_), 1);
  last_beat_ms_ = now;
}

void Session::Register(const std::string& pair, const std::string& record,
                       const std::shared_ptr<ConsumerImpl>& consumer) {
  bool identity_tried;
  {
    std::lock_guard<std::mutex> lock(mu_);
    identity_tried = identity_tried_;
  }
  if (!identity_tried) {
    const std::string identity = EncodeIdentity();
    if (!identity.empty()) store_->Set(IdentityKey(id_), identity);  // (before anyone looks)
    std::lock_guard<std::mutex> lock(mu_);
    identity_tried_ = true;
    identity_written_ = !identity.empty();
  }
  store_->Set(ClaimKey(pair), record);  // (first: a pair that failed to register has no key)
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // (Break fails the pairs it finds: one registered after it would never fail.)
    if (broken_) throw StoreError(StoreError::Kind::kUnreachable, "its connection was lost");
    first = pairs_.empty();
    consumed_ = true;
    pairs_[pair] = consumer;
    if (!watching_) StartWatcherLocked();
  }
  // The consumer's heartbeat exists before its promise can leave the process: a producer that
  // finds none takes the consumer for dead.
  Beat(/*force=*/first);
  EnsureTicking();
}

bool Session::WakeWatcherLocked() {
  if (!watcher_blocked_ || wake_pending_) return false;
  wake_pending_ = true;
  return true;
}

void Session::Forget(const std::string& pair, bool value_arrived) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pairs_.erase(pair);
    // (No value message read: a producer may have written chunks, or may yet.)
    cleanups_.push_back({pair, true, value_arrived ? 0 : std::numeric_limits<uint32_t>::max()});
    if (forgotten_.insert(pair).second) {
      forgotten_order_.push_back(pair);
      if (forgotten_order_.size() > kForgottenPairsKept) {
        forgotten_.erase(forgotten_order_.front());
        forgotten_order_.pop_front();
      }
    }
    // The watcher exits when it finds no pair left; one in its pop is woken to find that.
    wake = pairs_.empty() && WakeWatcherLocked();
  }
  if (wake && !broken_) {
    // From the tick thread: a store call here could block the thread dropping the future.
    AtNextTick([self = shared_from_this()] {
      try {
        self->store_->QueuePush(QueueKey(self->id_), std::string(1, kWake));
      } catch (...) {
        // (The store went away, and with it the watcher's pop; a later wake may be sent.)
        std::lock_guard<std::mutex> lock(self->mu_);
        self->wake_pending_ = false;
      }
    });
  }
  EnsureTicking();  // (the tick deletes the pair's keys)
}

void Session::StartWatcherLocked() {
  // Its own connection: a blocking pop holds the connection it runs on. (Kept for the next
  // watcher: this one leaves it only once it is done with it.)
  if (!watch_connection_) {
    try {
      watch_connection_ = Connect(address_, kWatcherTimeout);
    } catch (const StoreError& e) {
      throw Unreachable(address_, e);
    }
  }
  std::thread thread([self = shared_from_this(), connection = watch_connection_] {
    self->Watch(connection);
  });
  pthread_setname_np(thread.native_handle(), "dtorch-net-watch");
  thread.detach();
  watching_ = true;
  ++kind_threads;
}

std::shared_ptr<ConsumerImpl> Session::Find(const std::string& pair) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pairs_.find(pair);
  return it == pairs_.end() ? nullptr : it->second.lock();
}

std::vector<std::shared_ptr<ConsumerImpl>> Session::LiveConsumers() {
  std::vector<std::shared_ptr<ConsumerImpl>> consumers;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [pair, weak] : pairs_) {
    if (auto c = weak.lock()) consumers.push_back(std::move(c));
  }
  return consumers;
}

void Session::Watch(const std::shared_ptr<KeyValueStore>& connection) {
  const std::string queue = QueueKey(id_);
  const auto leave = [&] {  // (mu_ held)
    watching_ = false;
    watcher_blocked_ = false;
    --kind_threads;
  };
  bool drained = false;
  // The items the queue held after the last pop: popped in batches, without waiting, until none
  // is left (a flood of messages costs a round trip per kPopBatch of them, not per message).
  int64_t backlog = 0;
  size_t largest = 0;  // the largest item of the last batch
  for (;;) {
    bool pop = true;
    const bool block = backlog <= 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // (A wake on its way is popped first: none is left in the queue.)
      if (stopping_ || broken_) return leave();
      if (pairs_.empty() && !wake_pending_) {
        if (drained) return leave();
        pop = false;
      } else {
        drained = false;
        watcher_blocked_ = block;
      }
    }
    if (!pop) {
      // No pair left: what the queue still holds (a late drop message, a value for a pair
      // dropped meanwhile) is handled now, so that nothing of it is left in the store; as many
      // items as it held now, at most (a sender that goes on pushing does not hold it here).
      try {
        DrainQueue(*connection, queue, [&](const std::string& bytes) {
          if (const std::optional<Message> m = Decode(bytes)) Handle(*connection, *m);
        });
      } catch (...) {
        // (The store went away: nothing is left to wait for.)
      }
      backlog = 0;
      drained = true;
      continue;
    }
    std::vector<std::string> items;
    std::string failure;
    try {
      items = connection->QueuePopSome(queue, block ? 1 : PopBatchSize(backlog, largest), block,
                                       &backlog);
      largest = LargestItem(items);
    } catch (const StoreError& e) {
      backlog = 0;
      if (e.kind() != StoreError::Kind::kTimeout) failure = e.what();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      watcher_blocked_ = false;
      for (const auto& bytes : items) {
        if (bytes.size() == 1 && bytes[0] == kWake) wake_pending_ = false;
      }
    }
    if (!failure.empty()) {
      if (!stopping_) Break(failure);
      std::lock_guard<std::mutex> lock(mu_);
      return leave();
    }
    for (const auto& bytes : items) {
      const std::optional<Message> m = Decode(bytes);
      if (!m) continue;  // not a message of this kind (the queue is ours: junk is dropped)
      try {
        Handle(*connection, *m);
      } catch (const StoreError& e) {
        if (!stopping_) Break(e.what());
        std::lock_guard<std::mutex> lock(mu_);
        return leave();
      } catch (...) {
        // (Handle fails the pair of a message it cannot complete; nothing else can throw.)
      }
    }
  }
}

void Session::Handle(KeyValueStore& connection, const Message& m) {
  if (m.type == kWake) return;
  const std::shared_ptr<ConsumerImpl> consumer = Find(m.pair);
  if (m.type == kRecheck) {
    if (m.producer != id_) return;  // (only this process's own tick sends them)
    std::optional<QueuedFailure> failure;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = failures_after_queued_.find(m.pair);
      if (it == failures_after_queued_.end()) return;  // (not this session's)
      failure = std::move(it->second);
      failures_after_queued_.erase(it);
    }
    // (A holder or a handle in flight the tick did not know of: it decides again.)
    if (consumer && consumer->Epoch() == failure->epoch) {
      consumer->FailAsDecided(connection, failure->error, failure->gone);
    }
    return;
  }
  // (This process's own handles are no holders and send none of these: a message that says it
  // is from this process is forged.)
  if (m.type != kValue && m.producer == id_) return;
  if (m.type == kExiting) {
    if (!FromHolder(consumer.get(), m)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Liveness& l = producers_liveness_[m.producer];
      l.exiting = true;
      // (Found gone by the tick before this message was read: it exited, and a verdict that
      // said "died" is decided again.)
      if (l.state == Liveness::State::kDead) l.state = Liveness::State::kExited;
    }
    consumer->Changed();
    return;
  }
  if (m.type == kAttach || m.type == kDropped || m.type == kSerialized) {
    if (!consumer) return;
    bool tracked = true;
    if (m.type == kAttach) {
      tracked = consumer->Attached(m.producer, m.holder);
      if (tracked) {
        // A process that attaches is alive, whatever it was found to be before.
        std::lock_guard<std::mutex> lock(mu_);
        Liveness& l = producers_liveness_[m.producer];
        if (l.state != Liveness::State::kAlive) l = Liveness{};
      }
    } else if (m.type == kDropped) {
      if (FromHolder(consumer.get(), m)) consumer->Dropped(m.producer, m.attachment);
    } else if (FromHolder(consumer.get(), m)) {
      consumer->CountSerialized();
    }
    if (!tracked) {
      consumer->Fail(FutureErrc::kInvalidHandle,
                     "more than " + std::to_string(kMaxHoldersPerPair) + " processes attached "
                     "to the promise on the store at " + address_.ToString() + " (the limit of "
                     "holders one network promise tracks): pass a promise to fewer processes, "
                     "or make one per producer");
    }
    return;
  }
  // A value: for a pair in flight whose value has not come, else (a pair dropped here, or a
  // repeat) only its keys go.
  if (!consumer) return ValueForNoPair(m);
  if (consumer->Settled()) {
    if (m.value.chunks > 0) DeleteSoon({m.pair, false, m.value.chunks});
    return;
  }
  Receive(connection, m, consumer);
}

void Session::Receive(KeyValueStore& connection, const Message& m,
                      const std::shared_ptr<ConsumerImpl>& consumer) {
  const ValueMessage& v = m.value;
  consumer->ValueArrived();
  if (v.error) {
    std::optional<ErrorInfo> error = DecodeErrorText(v.code, v.header);
    if (!error) {
      error = ErrorInfo{FutureErrc::kInvalidHandle, "the error read from the store at " +
                                                        address_.ToString() + " is corrupt"};
    } else if (m.producer == id_) {
      error->origin.native = consumer->Native();  // (set by the creator's own handle)
    }
    consumer->state().TryComplete(Result<NetworkValue>::Error(std::move(*error)));
    return;
  }
  auto payload = std::make_shared<std::string>();
  // Its size is checked before any chunk is read: it must be the size its header implies, and
  // fit in this machine's memory (the message's word, read from the store, is untrusted).
  std::string problem = consumer->CheckPayloadBytes(v.header, v.payload_bytes);
  // The chunks found (deleted once read, or once found wrong).
  uint32_t chunks_found = 0;
  if (!problem.empty()) {
    chunks_found = v.chunks;  // (whatever of them exists, up to the first one missing)
  } else if (v.chunks == 0) {
    payload->assign(v.inline_payload.data(), v.inline_payload.size());
  } else {
    try {
      // Grown as the chunks come, never from the producer's word alone.
      payload->reserve(std::min<uint64_t>(v.payload_bytes, uint64_t{64} << 20));
      for (uint32_t i = 0; i < v.chunks && problem.empty(); ++i) {
        // (Checked first: a get waits for a missing key, here for the watcher's long timeout.)
        if (!connection.Check(ChunkKey(m.pair, i))) {
          problem = "chunk " + std::to_string(i) + " is missing";
          break;
        }
        const std::string chunk = connection.Get(ChunkKey(m.pair, i));
        chunks_found = i + 1;
        const uint64_t expected =
            i + 1 < v.chunks ? kChunkBytes : v.payload_bytes - uint64_t{kChunkBytes} * i;
        if (chunk.size() != expected) {
          problem = "chunk " + std::to_string(i) + " has " + std::to_string(chunk.size()) +
                    " bytes, expected " + std::to_string(expected);
        } else {
          payload->append(chunk);
        }
      }
    } catch (const StoreError& e) {
      if (e.kind() != StoreError::Kind::kTimeout) throw;  // (the store went away: Break)
      problem = std::string("a chunk could not be read (") + e.what() + ")";
      chunks_found = v.chunks;  // (not known: up to the first one missing)
    } catch (const std::bad_alloc&) {
      problem = "it does not fit in this process's memory";
      chunks_found = v.chunks;
    } catch (const std::length_error&) {
      problem = "it does not fit in this process's memory";
      chunks_found = v.chunks;
    }
  }
  if (problem.empty() && Checksum(payload->data(), payload->size()) != v.checksum) {
    problem = "its checksum does not match its bytes";
  }
  if (problem.empty()) {
    consumer->state().TryComplete(Result<NetworkValue>::Value(NetworkValue{v.header, payload}));
  } else {
    consumer->state().TryComplete(Result<NetworkValue>::Error(
        FutureErrc::kInvalidHandle, "the value read from the store at " + address_.ToString() +
                                        " is corrupt: " + problem));
  }
  // (The claim stays while the pair does: a second producer is told it came second. The
  // chunks go on the tick thread: the watcher goes on to the next message.)
  if (chunks_found > 0) DeleteSoon({m.pair, false, chunks_found});
}

void Session::Break(const std::string& why) {
  if (broken_.exchange(true)) return;
  Unregister(this);
  // (A call blocked on a store that stopped answering gives up now: the watcher's pop too.)
  std::shared_ptr<KeyValueStore> watch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watch = watch_connection_;
  }
  if (watch) watch->Abort();
  store_->Abort();
  // (What waits for a tick holds this session: dropped, outside mu_, so that nothing keeps the
  // broken session and its connections alive.)
  std::vector<std::function<void()>> deferred;
  {
    std::lock_guard<std::mutex> lock(mu_);
    deferred.swap(next_tick_);
  }
  for (auto& c : LiveConsumers()) {
    c->Fail(FutureErrc::kBrokenPromise, "the store at " + address_.ToString() +
                                            " went away while the value was awaited (" + why + ")");
  }
}

void Session::DeleteSoon(PairKeys keys) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cleanups_.push_back(std::move(keys));
  }
  DeleteSoonOnTickThread();
}

void Session::DeleteQueued() {
  if (broken_ || stopping_) return;
  std::vector<PairKeys> cleanups;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cleanups.swap(cleanups_);
  }
  if (cleanups.empty()) return;
  try {
    DeleteKeysOf(*store_, cleanups);
  } catch (const StoreError& e) {
    if (e.kind() != StoreError::Kind::kTimeout) Break(e.what());
  } catch (...) {
    // (The next round tries again.)
  }
  if (!cleanups.empty()) {  // (what a failed pass did not delete: the next round's)
    std::lock_guard<std::mutex> lock(mu_);
    cleanups_.insert(cleanups_.end(), cleanups.begin(), cleanups.end());
  }
}

void Session::ValueForNoPair(const Message& m) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // (Never made here: nothing of it can be ours. One dropped here is kept while it is one of
    // the latest kForgottenPairsKept: each message naming it costs a delete pass, on the tick
    // thread.)
    if (forgotten_.count(m.pair) == 0) return;
  }
  DeleteSoon({m.pair, true, m.value.chunks});
}

void Session::FailAfterQueued(const std::string& pair, FutureErrc code,
                              const std::string& detail, uint64_t epoch,
                              std::set<std::string> gone) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failures_after_queued_[pair] = QueuedFailure{ErrorInfo{code, detail}, epoch, std::move(gone)};
  }
  try {
    store_->QueuePush(QueueKey(id_), EncodeHead(kRecheck, pair, id_));
  } catch (...) {
    // (The store went away: the watcher fails every pair anyway. Not kept: the next tick
    // decides again while the pair is unsettled.)
    std::lock_guard<std::mutex> lock(mu_);
    failures_after_queued_.erase(pair);
  }
}

void Session::FindClaimHolders(const std::vector<std::shared_ptr<ConsumerImpl>>& consumers) {
  std::vector<std::shared_ptr<ConsumerImpl>> unknown;
  for (auto& c : consumers) {
    if (!c->Settled() && c->KnowsNoProducer()) unknown.push_back(c);
  }
  if (unknown.empty()) return;
  // At most kClaimsReadPerTick a round, in turn: a claim read is a round trip. (compare_set with
  // the record as both values reads without waiting: a get would wait for a deleted key.)
  const size_t n = std::min(unknown.size(), kClaimsReadPerTick);
  const size_t first = claims_read_++ * kClaimsReadPerTick % unknown.size();
  for (size_t k = 0; k < n; ++k) {
    ConsumerImpl& c = *unknown[(first + k) % unknown.size()];
    const std::string holder = store_->CompareSet(ClaimKey(c.handle().pair), c.record(), c.record());
    if (IsClaimValue(holder) && holder.compare(0, kIdHexDigits, id_) != 0) {
      // (Watched from the next round; past the holders' limit the pair fails at the next
      // attach message.)
      c.Attached(holder.substr(0, kIdHexDigits), std::nullopt);
    }
  }
}

bool Session::Tick() {
  if (broken_ || stopping_) return false;
  bool consumers, producers;
  std::vector<PairKeys> cleanups;
  std::vector<std::function<void()>> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    consumers = !pairs_.empty() || consumed_;
    producers = producers_ > 0 || !sent_.empty();
    cleanups.swap(cleanups_);
    work.swap(next_tick_);
  }
  if (!consumers && !producers && cleanups.empty() && work.empty()) return false;
  for (auto& w : work) w();  // (noexcept: see ProducerImpl::Announce)
  try {
    // (The heartbeat first: however long the deletes take, this process does not look dead.)
    if (consumers || producers) Beat(/*force=*/true);
    DeleteKeysOf(*store_, cleanups);
    if (consumers) {
      FindClaimHolders(LiveConsumers());
      CheckProducers(Clock::now());
    }
    if (producers) CleanUpForConsumers();
  } catch (const StoreError& e) {
    if (e.kind() != StoreError::Kind::kTimeout) {
      Break(e.what());
      return false;
    }
  } catch (const std::exception&) {
    // (A failure of one round: the next tries again.)
  }
  if (!cleanups.empty()) {  // (what a failed round did not delete)
    std::lock_guard<std::mutex> lock(mu_);
    cleanups_.insert(cleanups_.end(), cleanups.begin(), cleanups.end());
  }
  return true;
}

void Session::CheckProducers(Clock::time_point now) {
  // The producers the pairs in flight wait for.
  std::vector<std::shared_ptr<ConsumerImpl>> consumers = LiveConsumers();
  // By store id: the process itself where it runs on this kernel (checked by pid: at once).
  std::map<std::string, std::optional<ProcessId>> watched;
  for (auto& c : consumers) {
    if (c->Settled()) continue;
    for (auto& [id, holder] : c->LiveProducers()) {
      if (id == id_) continue;  // (this process: alive)
      auto& local = watched[id];
      if (holder.local) local = holder.local;
    }
  }
  // Their heartbeats (read without making a key: a holder named by a forged attach message has
  // none, and none is left for it). A missing key reads 0: a producer that exited cleanly
  // deleted its key. A key missing from the start is not taken for an exit: another consumer may
  // have deleted it, wrongly, or the producer exited before it was first read; the timeout
  // decides.
  const int64_t timeout_ms = heartbeat_timeout_ms.load();
  std::vector<std::string> ids;
  for (const auto& [id, local] : watched) ids.push_back(id);
  const std::vector<int64_t> beats = ReadHeartbeats(*store_, ids);
  std::vector<std::string> newly_gone;
  size_t k = 0;
  for (const auto& [id, local] : watched) {
    const int64_t beat = beats[k++];
    // A process on this kernel is checked itself: alive while it runs (its threads may still set
    // values after its exit began), gone once its pid is gone and its heartbeat is too or has
    // stood still for two ticks (the pid came in an attach message: a forged one naming a live
    // process's id with a dead pid must not make it gone).
    const std::optional<bool> local_alive =
        local ? std::optional<bool>(IsAlive(*local)) : std::nullopt;
    std::lock_guard<std::mutex> lock(mu_);
    Liveness& l = producers_liveness_[id];
    const auto gone_as = [&] {
      return l.exiting ? Liveness::State::kExited : Liveness::State::kDead;
    };
    if (l.state != Liveness::State::kAlive) continue;
    const bool advanced = beat != 0 && beat != l.last_beat;
    if (advanced) {
      l.last_beat = beat;
      l.changed_at = now;
    }
    if (local_alive) {
      if (*local_alive) continue;
      if (beat == 0 || now - l.changed_at >= milliseconds(2 * kTickMs)) {
        // (Its exit said so first: the library's exit handler, a multiprocessing child's end.
        // Its heartbeat cannot tell: another consumer that saw it gone may have deleted it.)
        l.state = gone_as();
        newly_gone.push_back(id);
      }
    } else if (beat == 0 && l.last_beat > 0) {
      l.state = Liveness::State::kExited;  // (its heartbeat was seen, then deleted)
      newly_gone.push_back(id);
    } else if (!advanced && now - l.changed_at > milliseconds(timeout_ms)) {
      l.state = gone_as();
      newly_gone.push_back(id);
    }
  }
  // Whoever sees death deletes (a consumer's identity too), in batches, once.
  for (size_t at = 0; at < newly_gone.size(); at += kBatch / 2) {
    std::vector<std::string> keys;
    for (size_t i = at; i < std::min(newly_gone.size(), at + kBatch / 2); ++i) {
      keys.push_back(HeartbeatKey(newly_gone[i]));
      keys.push_back(IdentityKey(newly_gone[i]));
    }
    store_->DeleteKeys(keys);
  }
  std::map<std::string, Liveness> snapshot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Only the producers waited for are remembered (one attaching again starts afresh).
    for (auto it = producers_liveness_.begin(); it != producers_liveness_.end();) {
      it = watched.count(it->first) != 0 ? std::next(it) : producers_liveness_.erase(it);
    }
    snapshot = producers_liveness_;
  }
  for (auto& c : consumers) {
    if (c->Settled()) continue;
    const uint64_t epoch = c->Epoch();  // (before deciding: a message after it re-decides)
    const std::string why = c->WhyFail(snapshot, now);
    if (!why.empty()) {
      FailAfterQueued(c->handle().pair, FutureErrc::kBrokenPromise, why, epoch, c->HolderIds());
    }
  }
}

void Session::CleanUpForConsumers() {
  // (One at a time: the exit's and a tick round in progress would each forget what the other
  // read.)
  std::lock_guard<std::mutex> one_at_a_time(cleanup_mu_);
  std::map<std::string, std::vector<SentPair>> sent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sent = sent_;
  }
  const Clock::time_point now = Clock::now();
  const int64_t timeout_ms = heartbeat_timeout_ms.load();
  for (auto& [consumer, pairs] : sent) {
    bool received = store_->QueueLength(QueueKey(consumer)) == 0;
    bool dead = false;
    if (!received && consumer != id_) {
      const int64_t beat = ReadHeartbeat(*store_, consumer);
      std::lock_guard<std::mutex> lock(mu_);
      Liveness& l = consumers_liveness_[consumer];
      if (beat == 0 && l.last_beat > 0) {
        dead = true;  // (it exited: its heartbeat was seen, then deleted)
      } else if (beat != l.last_beat) {
        l.last_beat = beat;
        l.changed_at = now;
      } else if (now - l.changed_at > milliseconds(timeout_ms)) {
        dead = true;
      }
    }
    if (!received && !dead && consumer != id_) dead = ConsumerGoneHere(consumer);
    if (dead) {
      std::vector<std::string> names;
      for (const auto& p : pairs) names.push_back(p.pair);
      DeleteWhatADeadConsumerLeft(consumer, names);
      received = true;
    }
    if (received) {
      std::lock_guard<std::mutex> lock(mu_);
      auto& now_sent = sent_[consumer];
      // (Only what was read above: more may have been sent meanwhile.)
      now_sent.erase(now_sent.begin(),
                     now_sent.begin() + std::min(now_sent.size(), pairs.size()));
      if (now_sent.empty()) {
        sent_.erase(consumer);
        consumers_liveness_.erase(consumer);
        consumer_processes_.erase(consumer);
      }
    }
  }
}

void Session::DeleteWhatADeadConsumerLeft(const std::string& consumer,
                                          const std::vector<std::string>& pairs) {
  // The consumer will not read its queue: drain it (as many items as it holds now: a sender
  // that goes on pushing does not hold this thread), and delete the keys of `pairs` (what this
  // process sent it, or at its own exit its own pairs: claims, and the chunks a value message
  // for one names), in batches. A message naming another pair is not this process's to act on
  // (a forged one may name anyone's pair): another producer's goes back to the queue, for that
  // producer's own clean-up; one that claims to be this process's is forged, and dropped.
  const std::string queue = QueueKey(consumer);
  const bool own = consumer == id_;
  std::set<std::string> ours(pairs.begin(), pairs.end());
  std::vector<PairKeys> doomed;
  for (const auto& pair : ours) doomed.push_back({pair, true, 0});
  if (own) {  // (the pairs dropped here too: a late value's chunks are named by its message)
    std::lock_guard<std::mutex> lock(mu_);
    ours.insert(forgotten_.begin(), forgotten_.end());
  }
  std::vector<std::string> others;
  DrainQueue(*store_, queue, [&](const std::string& bytes) {
    const std::optional<Message> m = Decode(bytes);
    if (!m || m->type == kWake) return;
    if (ours.count(m->pair) == 0) {
      if (!own && m->producer != id_) others.push_back(bytes);
      return;
    }
    if (m->type == kValue && m->value.chunks > 0) doomed.push_back({m->pair, false, m->value.chunks});
  });
  DeleteKeysOf(*store_, doomed);
  for (const auto& bytes : others) store_->QueuePush(queue, bytes);
  store_->DeleteKeys({HeartbeatKey(consumer), IdentityKey(consumer)});
  std::lock_guard<std::mutex> lock(mu_);
  consumer_processes_.erase(consumer);
}

bool Session::ConsumerGoneHere(const std::string& consumer) {
  std::optional<ProcessId> process;
  bool known;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = consumer_processes_.find(consumer);
    known = it != consumer_processes_.end();
    if (known) process = it->second;
  }
  if (!known) {
    // (compare_set with one value as both reads without waiting: a get would wait for a missing
    // key. A consumer that wrote none, or exited and deleted it, is not found gone here.)
    const std::string text = store_->CompareSet(IdentityKey(consumer), kMissing, kMissing);
    process = text == kMissing ? std::nullopt : LocalProcessOf(text);
    std::lock_guard<std::mutex> lock(mu_);
    consumer_processes_[consumer] = process;
  }
  return process && !IsAlive(*process);
}

void Session::Stop() noexcept {
  stopping_ = true;
  std::vector<std::shared_ptr<ConsumerImpl>> consumers = LiveConsumers();
  for (auto& c : consumers) {
    c->state().TryComplete(Result<NetworkValue>::Error(
        FutureErrc::kDroppedAtExit, "the process exits with the value still in flight"));
  }
  if (broken()) return;
  RunDeferred();
  // First what is this process's own to delete: a clean-up for others that fails or runs past
  // the exit's deadline must not leave it.
  bool sent = false, consumed = false;
  std::vector<std::string> ours;  // this process's pairs in flight
  try {
    bool wake, identity_written;
    std::vector<PairKeys> cleanups;
    {
      std::lock_guard<std::mutex> lock(mu_);
      consumed = consumed_;
      for (const auto& [pair, weak] : pairs_) ours.push_back(pair);
      cleanups.swap(cleanups_);
      // (A wake deferred to a tick that will not run: sent now, unless RunDeferred sent it.)
      wake = watcher_blocked_ && !wake_pending_;
      identity_written = identity_written_;
      sent = !sent_.empty();
    }
    for (auto& c : consumers) {
      cleanups.push_back({c->handle().pair, true, std::numeric_limits<uint32_t>::max()});
    }
    DeleteKeysOf(*store_, cleanups);
    store_->DeleteKey(HeartbeatKey(id_));  // others see "exited", not "died"
    if (identity_written) store_->DeleteKey(IdentityKey(id_));
    if (wake) store_->QueuePush(QueueKey(id_), std::string(1, kWake));
  } catch (...) {
  }
  // What this process sent consumers that are gone (one on this kernel: at once) goes with it.
  try {
    if (sent) CleanUpForConsumers();
  } catch (...) {
  }
  // Last (a flooded queue must not hold the rest up): what is left in this process's queue
  // (values for the pairs failed above, messages nobody will read) goes with it, with what
  // those messages name of its pairs, and what was queued for deletion meanwhile.
  try {
    if (consumed) DeleteWhatADeadConsumerLeft(id_, ours);
    std::vector<PairKeys> late;
    {
      std::lock_guard<std::mutex> lock(mu_);
      late.swap(cleanups_);
    }
    DeleteKeysOf(*store_, late);
  } catch (...) {
  }
}

// ---- ConsumerImpl ----

void ConsumerImpl::CreatorDropped(bool claimed_here) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    creator_dropped_at_ = Clock::now();
  }
  // A promise that never left this process has no other producer: broken now, unless it set
  // the pair itself (the value is on its way through the store). (One that left waits for its
  // producers, or the attach deadline: the tick.)
  if (!LeftProcess() && !claimed_here) {
    Fail(FutureErrc::kBrokenPromise,
         "the promise was destroyed before a value or an exception was set");
  }
}

std::string ConsumerImpl::WhyFail(const std::map<std::string, Liveness>& liveness,
                                  Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t attach_ms = AttachTimeoutMs();
  if (producers_.empty()) {
    if (creator_dropped_at_ && LeftProcess() &&
        now - *creator_dropped_at_ > milliseconds(attach_ms)) {
      return "no producer attached within " + std::to_string(attach_ms) +
             " ms of the promise being dropped here (config.attach_timeout_s)";
    }
    return {};
  }
  // What names a holder in a message: its pid (and host, when it is another), else its store id.
  const auto who = [](const std::string& id, const Holder& holder) {
    if (holder.pid == 0) return "store id " + id.substr(0, 8);
    return "pid " + std::to_string(holder.pid) + (holder.host.empty() ? "" : " on " + holder.host);
  };
  std::string died, exited, dropped;
  for (const auto& [id, holder] : producers_) {
    if (holder.dropped) {
      if (dropped.empty()) dropped = who(id, holder);
      continue;
    }
    const auto it = liveness.find(id);
    if (id == session_->id() || it == liveness.end() ||
        it->second.state == Liveness::State::kAlive) {
      all_gone_since_.reset();  // (this process's own handle decides for it)
      return {};
    }
    if (it->second.state == Liveness::State::kExited) {
      if (exited.empty()) exited = who(id, holder);
    } else if (died.empty()) {
      died = who(id, holder) + (holder.local ? "" : ": its heartbeat stopped for " +
                                                     std::to_string(heartbeat_timeout_ms.load()) +
                                                     " ms");
    }
  }
  if (!all_gone_since_) all_gone_since_ = now;
  if (static_cast<int32_t>(serialized_ - deserialized_) > 0) {
    // A holder passed the promise on before it went, and that handle has not arrived: the attach
    // deadline is the backstop for one that never will.
    if (now - *all_gone_since_ < milliseconds(attach_ms)) return {};
    return "no producer attached within " + std::to_string(attach_ms) +
           " ms after the last process holding the promise was gone, and " +
           std::to_string(serialized_ - deserialized_) +
           " serialized handle(s) of it were never deserialized (config.attach_timeout_s)";
  }
  if (!died.empty()) return "producer died (" + died + ") without setting a value";
  if (!exited.empty()) return "producer exited (" + exited + ") without setting a value";
  return "producer dropped the promise (" + dropped + ") without setting a value";
}

void ConsumerImpl::FailAsDecided(KeyValueStore& connection, const ErrorInfo& error,
                                 const std::set<std::string>& gone) {
  if (Settled()) return;
  if (LeftProcess()) {
    try {
      const std::string holder =
          connection.CompareSet(ClaimKey(handle_.pair), record_, kFailedClaim);
      // A producer claimed it: its value is on the way, unless that producer is one found gone.
      if (IsClaimValue(holder) && gone.count(holder.substr(0, kIdHexDigits)) == 0) return;
    } catch (const std::exception&) {
      // (The store cannot be reached: the pair fails all the same.)
    }
  }
  state_.TryComplete(Result<NetworkValue>::Error(error));
}

// ---- the producer's attachment ----

class ProducerImpl;

// Attachments of this process, shared by its handles of a pair: "<store>/<pair>" -> attachment.
std::mutex attachments_mu;
std::map<std::string, std::weak_ptr<ProducerImpl>>& Attachments() {
  static auto* map = new std::map<std::string, std::weak_ptr<ProducerImpl>>();  // guarded
  return *map;
}

class ProducerImpl final : public NetworkProducer,
                           public std::enable_shared_from_this<ProducerImpl> {
 public:
  ProducerImpl(std::shared_ptr<Session> session, NetworkHandle handle)
      : session_(std::move(session)),
        handle_(std::move(handle)),
        record_(handle_.Serialize()),
        claim_(session_->id() + "/" + NewId().substr(0, kAttachmentHexDigits)) {}
  ~ProducerImpl() override;

  // Counts this producer for the heartbeats and announces it: now (a holder, so that a process
  // that dies at once is noticed), or on the tick thread at its next round (a first use: not on
  // the path of a value set at once).
  void Open(AttachAs as);
  // Unless this producer's value went meanwhile, checks the handle against the pair's record
  // and, if the pair waits for a producer, tells the consumer (its liveness is then watched).
  // `deserialized`: the message counts a deserialization (another one of this process too).
  // Never throws.
  void Announce(bool deserialized) noexcept;
  // A handle of the pair was serialized here: the consumer counts it in flight (now, before the
  // string leaves this process). Never throws.
  void Serialized() noexcept override;
  // This process exits: a consumer that knows of this producer is told (kExiting). Never throws.
  void Exiting() noexcept;
  // Pushes `message` to the consumer's queue, noted as sent (mu_ held). Throws StoreError.
  void SendLocked(const std::string& message);
  // Announce's work (mu_ held, standing_ pending): tells the consumer of this producer if the
  // pair waits for it, else goes silent. Throws StoreError (standing_ stays pending).
  void AnnounceLocked(bool deserialized);
  // The attach message of this attachment (throws what ThisHolder does).
  std::string AttachMessage(bool deserialized) const {
    return EncodeAttach(handle_.pair, session_->id(),
                        ThisHolder(deserialized, AttachmentOf(claim_)));
  }
  // Whether the pair is in flight and waits for the producer of `handle` (its record matches the
  // pair's, and no other producer than `claim`'s claimed it). Throws StoreError.
  static bool Awaited(Session& session, const NetworkHandle& handle, const std::string& record,
                      const std::string& claim);
  const std::string& record() const { return record_; }
  // Another thread of this process attached first: this one goes without telling the consumer.
  void Withdraw() { withdrawn_ = true; }

  NetworkClaim TryClaim() override;
  void PublishValue(const std::string& header, std::string payload) override;
  void PublishError(const ErrorInfo& error) noexcept override;

 private:
  enum class Standing {
    kPending,    // not announced yet (the tick thread will, unless the value goes first)
    kAnnounced,  // the pair waited for a producer: the consumer was told of this one
    kSilent,     // nothing to tell: the pair is claimed by another, failed, gone, or not the
                 // handle's (the claim says which when this producer sets)
  };

  const std::shared_ptr<Session> session_;
  const NetworkHandle handle_;
  const std::string record_;
  const std::string claim_;  // what the claim key holds once this attachment claimed the pair
  const uint64_t generation_ = ForkGeneration();
  std::mutex mu_;                           // held while announcing
  Standing standing_ = Standing::kPending;  // guarded by mu_
  std::atomic<bool> claimed_{false};       // by one of the handles sharing this attachment
  std::atomic<bool> published_{false};
  std::atomic<bool> withdrawn_{false};
};

FutureError Altered(const NetworkHandle& handle) {
  return FutureError(FutureErrc::kInvalidHandle,
                     "a serialized network promise that does not match the pair it names on the "
                     "store at " + handle.store.ToString() + " (its consumer, value type, value "
                     "options or store address were altered); pass the string serialize() "
                     "returned, unchanged");
}

void ProducerImpl::Open(AttachAs as) {
  session_->ProducerAttached();
  EnsureTicking();
  if (as != AttachAs::kFirstUse) {
    Announce(as == AttachAs::kDeserialized);
    return;
  }
  session_->AtNextTick([weak = std::weak_ptr<ProducerImpl>(shared_from_this())] {
    if (auto producer = weak.lock()) producer->Announce(false);
  });
}

bool ProducerImpl::Awaited(Session& session, const NetworkHandle& handle,
                           const std::string& record, const std::string& claim) {
  KeyValueStore& store = session.store();
  const std::string key = ClaimKey(handle.pair);
  // (c10d's compare_set answers `expected` for a missing key, as for a matching one: the check
  // tells them apart.)
  if (!store.Check(key)) return false;  // no such pair in flight
  const std::string holder = store.CompareSet(key, record, record);
  // Waiting for a producer, or claimed by this one (a device value on its way).
  return holder == record || holder == claim;
}

void ProducerImpl::SendLocked(const std::string& message) {
  session_->store().QueuePush(QueueKey(handle_.consumer), message);
  session_->Sent(handle_.consumer, handle_.pair, 0);
}

void ProducerImpl::AnnounceLocked(bool deserialized) {
  // Nothing to tell: the value's message said it all, or this is the creator's own process
  // (its handle holds the pair; a copy there is no holder), or the pair does not wait for this
  // handle's producer. (Still pending if the store cannot be reached: a later call may tell.)
  if (published_ || withdrawn_ || session_->id() == handle_.consumer ||
      !Awaited(*session_, handle_, record_, claim_)) {
    standing_ = Standing::kSilent;
    return;
  }
  session_->Beat(/*force=*/false);  // (its heartbeat exists before the consumer watches it)
  SendLocked(AttachMessage(deserialized));
  standing_ = Standing::kAnnounced;
}

void ProducerImpl::Announce(bool deserialized) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    if (standing_ == Standing::kPending) {
      AnnounceLocked(deserialized);
    } else if (standing_ == Standing::kAnnounced && deserialized && !published_) {
      // (Known to the consumer already: another deserialization of this process is counted.)
      SendLocked(AttachMessage(true));
    }
  } catch (...) {
    // (The store cannot be reached: the consumer learns of that through its own connection, and
    // this producer's set raises.)
  }
}

void ProducerImpl::Exiting() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (published_ || ForkGeneration() != generation_ || session_->broken()) return;
  try {
    // (An attach still waiting for the tick goes first, here: whichever thread would have sent
    // it, the exiting message must come after it.)
    if (standing_ == Standing::kPending) AnnounceLocked(false);
    if (standing_ != Standing::kAnnounced) return;
    SendLocked(EncodeHead(kExiting, handle_.pair, session_->id()));
  } catch (...) {
  }
}

void ProducerImpl::Serialized() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    // (Not announced yet: first, so that the consumer knows this process held it.)
    if (standing_ == Standing::kPending) AnnounceLocked(false);
    if (standing_ != Standing::kAnnounced || published_) return;  // (nobody waits for a count)
    SendLocked(EncodeHead(kSerialized, handle_.pair, session_->id()));
  } catch (...) {
    // (The store cannot be reached: the pair fails through the consumer's own connection.)
  }
}

ProducerImpl::~ProducerImpl() {
  if (ForkGeneration() != generation_) return;
  if (!published_ && !withdrawn_ && standing_ != Standing::kSilent && !session_->broken() &&
      session_->id() != handle_.consumer) {  // (the creator's own process holds no handle)
    // Dropped unset: the consumer is told, by the tick thread (a store call here could block the
    // thread that drops the promise), if the pair waits for this handle's producer (an altered
    // handle must not break the real pair: checked first when it was not announced).
    try {
      session_->AtNextTick([session = session_, handle = handle_, record = record_,
                            claim = claim_, announced = standing_ == Standing::kAnnounced] {
        try {
          if (announced || Awaited(*session, handle, record, claim)) {
            // (Never announced: its attach message first. A consumer takes a drop only from a
            // holder it knows: a forged one for a made-up process changes nothing.)
            if (!announced) {
              std::string attach;
              try {
                attach = EncodeAttach(handle.pair, session->id(),
                                      ThisHolder(false, AttachmentOf(claim)));
              } catch (...) {
                // (Who this process is cannot be read: the drop is told all the same.)
              }
              if (!attach.empty()) session->store().QueuePush(QueueKey(handle.consumer), attach);
            }
            session->store().QueuePush(
                QueueKey(handle.consumer),
                EncodeHead(kDropped, handle.pair, session->id()) + AttachmentOf(claim));
            session->Sent(handle.consumer, handle.pair, 0);
          }
        } catch (...) {
        }
      });
      EnsureTicking();
    } catch (...) {
    }
  }
  session_->ProducerDetached();
  std::lock_guard<std::mutex> lock(attachments_mu);
  auto& map = Attachments();
  auto it = map.find(handle_.store.ToString() + "/" + handle_.pair);
  if (it != map.end() && it->second.expired()) map.erase(it);
}

NetworkClaim ProducerImpl::TryClaim() {
  if (claimed_) return NetworkClaim::kClaimedByAnother;  // another handle sharing this attachment
  std::string holder;
  try {
    holder = session_->store().CompareSet(ClaimKey(handle_.pair), record_, claim_);
  } catch (const StoreError& e) {
    throw Unreachable(handle_.store, e);
  }
  if (holder == claim_) {
    return claimed_.exchange(true) ? NetworkClaim::kClaimedByAnother : NetworkClaim::kClaimed;
  }
  if (holder == kFailedClaim) return NetworkClaim::kFailedByConsumer;
  if (IsClaimValue(holder)) return NetworkClaim::kClaimedByAnother;
  if (holder == record_) return NetworkClaim::kClosed;  // (a missing key: no such pair in flight)
  throw Altered(handle_);
}

void ProducerImpl::PublishValue(const std::string& header, std::string payload) {
  ValueMessage v;
  v.header = header;
  v.payload_bytes = payload.size();
  v.checksum = Checksum(payload.data(), payload.size());
  try {
    if (payload.size() <= kInlineValueBytes) {
      session_->store().QueuePush(QueueKey(handle_.consumer),
                                  EncodeValue(handle_.pair, session_->id(), v, payload));
    } else {
      if (handle_.consumer != session_->id() && session_->ConsumerGoneHere(handle_.consumer)) {
        // Nobody will read it: no chunk is written, and what the consumer left goes (the claim
        // among it). (Asked for chunked values only: one round trip at most, beside megabytes.)
        std::vector<std::string> pairs = session_->SentPairs(handle_.consumer);
        pairs.push_back(handle_.pair);
        session_->DeleteWhatADeadConsumerLeft(handle_.consumer, pairs);
        published_ = true;
        return;
      }
      v.chunks = static_cast<uint32_t>((payload.size() + kChunkBytes - 1) / kChunkBytes);
      for (uint32_t i = 0; i < v.chunks; ++i) {
        const size_t start = size_t{i} * kChunkBytes;
        session_->store().Set(
            ChunkKey(handle_.pair, i),
            std::string_view(payload).substr(start, std::min(kChunkBytes, payload.size() - start)));
      }
      session_->store().QueuePush(QueueKey(handle_.consumer),
                                  EncodeValue(handle_.pair, session_->id(), v, {}));
    }
  } catch (const StoreError& e) {
    const FutureError error = Unreachable(handle_.store, e);
    PublishError(ErrorInfo{error.code(), error.detail()});  // (if the store still takes it)
    try {  // (what was written of the value, if the store still answers)
      for (uint32_t i = 0; i < v.chunks; ++i) session_->store().DeleteKey(ChunkKey(handle_.pair, i));
    } catch (...) {
    }
    throw error;
  }
  published_ = true;
  session_->Sent(handle_.consumer, handle_.pair, v.chunks);
}

void ProducerImpl::PublishError(const ErrorInfo& error) noexcept {
  try {
    ValueMessage v;
    v.error = true;
    v.code = static_cast<uint32_t>(error.code);
    v.header = EncodeErrorText(error);
    session_->store().QueuePush(QueueKey(handle_.consumer),
                                EncodeValue(handle_.pair, session_->id(), v, {}));
    published_ = true;
    session_->Sent(handle_.consumer, handle_.pair, 0);
  } catch (...) {
    // (The store cannot be reached: the consumer learns of it through its own connection.)
  }
}

// ---- parsing ----

// `text` as it may appear in a message: at most 32 printable characters.
std::string Shown(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, 32)) out += (c >= 32 && c < 127) ? c : '?';
  return out;
}

bool IsHostName(std::string_view host) {
  return !host.empty() && host.size() <= 253 && std::all_of(host.begin(), host.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '-' || c == '_';
         });
}

bool IsIpv6(std::string_view host) {
  return host.size() >= 2 && host.size() <= 45 && host.find(':') != std::string_view::npos &&
         std::all_of(host.begin(), host.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') ||
                  c == ':' || c == '.';
         });
}

// Splits "host:port" (or "[v6]:port") off the front of `text`; the rest after the port stays.
// Returns false for anything else.
bool SplitAddress(std::string_view& text, StoreAddress* out) {
  std::string_view host;
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find(']');
    if (close == std::string_view::npos) return false;
    host = text.substr(1, close - 1);
    if (!IsIpv6(host)) return false;
    text.remove_prefix(close + 1);
  } else {
    const auto colon = text.find(':');
    if (colon == std::string_view::npos) return false;
    host = text.substr(0, colon);
    if (!IsHostName(host)) return false;
    text.remove_prefix(colon);
  }
  if (text.empty() || text[0] != ':') return false;
  text.remove_prefix(1);
  size_t digits = 0;
  uint32_t port = 0;
  while (digits < text.size() && digits < 6 && text[digits] >= '0' && text[digits] <= '9') {
    port = port * 10 + static_cast<uint32_t>(text[digits] - '0');
    ++digits;
  }
  if (digits == 0 || digits > 5 || port == 0 || port > 65535 || (digits > 1 && text[0] == '0')) {
    return false;
  }
  text.remove_prefix(digits);
  out->host = std::string(host);
  out->port = static_cast<uint16_t>(port);
  return true;
}

}  // namespace

// ---- public functions ----

void SetStoreConnector(StoreConnector connector) { store_connector = connector; }

std::string StoreAddress::ToString() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

StoreAddress StoreAddress::Parse(std::string_view text) {
  StoreAddress address;
  std::string_view rest = text;
  if (!SplitAddress(rest, &address) || !rest.empty()) {
    throw std::invalid_argument(
        "dtorch: a network promise's store is \"host:port\" (an IPv6 host in brackets, a port "
        "1-65535), got \"" + std::string(text.substr(0, 64)) + "\"");
  }
  return address;
}

std::string NetworkHandle::Serialize() const {
  std::string out = SerializedPrefix(kNetworkKind) + type_name + ":" + store.ToString() + ":" +
                    consumer + ":" + pair;
  if (!value_options.empty()) out += ":" + value_options;
  return out;
}

NetworkHandle NetworkHandle::Parse(std::string_view rest, std::string_view expected_type) {
  const auto invalid = [](const std::string& why) {
    return FutureError(FutureErrc::kInvalidHandle,
                       "a serialized network promise " + why +
                           "; pass the string serialize() returned, unchanged");
  };
  NetworkHandle h;
  const auto type_end = rest.find(':');
  if (type_end == std::string_view::npos) throw invalid("without a value type");
  h.type_name = std::string(rest.substr(0, type_end));
  if (h.type_name != expected_type) {
    throw FutureError(FutureErrc::kInvalidHandle,
                      "a serialized network promise of another value type ('" +
                          Shown(h.type_name) + "', expected '" + std::string(expected_type) +
                          "'): TensorPromise and VoidPromise are not interchangeable");
  }
  rest.remove_prefix(type_end + 1);
  if (!SplitAddress(rest, &h.store)) throw invalid("with a bad store address");
  if (rest.size() < 2 + 2 * kIdHexDigits || rest[0] != ':' || rest[1 + kIdHexDigits] != ':') {
    throw invalid("with bad ids");
  }
  h.consumer = std::string(rest.substr(1, kIdHexDigits));
  h.pair = std::string(rest.substr(2 + kIdHexDigits, kIdHexDigits));
  if (!IsId(h.consumer) || !IsId(h.pair)) throw invalid("with bad ids");
  rest.remove_prefix(2 + 2 * kIdHexDigits);
  if (!rest.empty()) {
    if (rest[0] != ':' || rest.size() < 2 || rest.size() > 33 ||
        !std::all_of(rest.begin() + 1, rest.end(), [](char c) {
          return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '=';
        })) {
      throw invalid("with bad value options");
    }
    h.value_options = std::string(rest.substr(1));
  }
  return h;
}

std::shared_ptr<NetworkConsumer> NetworkConsumer::Create(std::string_view type_name,
                                                         const StoreAddress& store,
                                                         std::string_view value_options,
                                                         PayloadBytesOf payload_bytes_of) {
  const std::shared_ptr<Session> session = SessionFor(store);
  NetworkHandle h;
  h.type_name = std::string(type_name);
  h.store = store;
  h.consumer = session->id();
  h.pair = NewId();
  h.value_options = std::string(value_options);
  auto consumer = std::make_shared<ConsumerImpl>(session, h, std::move(payload_bytes_of));
  try {
    session->Register(h.pair, consumer->record(), consumer);
  } catch (const StoreError& e) {
    throw Unreachable(store, e);
  }
  return consumer;
}

std::shared_ptr<NetworkProducer> NetworkProducer::Attach(const NetworkHandle& handle,
                                                         AttachAs as) {
  const std::string key = handle.store.ToString() + "/" + handle.pair;
  // An attachment found is released (and maybe destroyed, which takes attachments_mu) only after
  // the lock is: a shared_ptr outside it.
  std::shared_ptr<ProducerImpl> found;
  {
    std::lock_guard<std::mutex> lock(attachments_mu);
    auto& map = Attachments();
    if (auto it = map.find(key); it != map.end()) {
      found = it->second.lock();
      if (!found) map.erase(it);
    }
  }
  if (found) {
    // (Another handle of the same pair that is not this one's: altered.)
    if (found->record() != handle.Serialize()) throw Altered(handle);
    if (as != AttachAs::kFirstUse) found->Announce(as == AttachAs::kDeserialized);
    return found;
  }
  auto producer = std::make_shared<ProducerImpl>(SessionFor(handle.store), handle);
  producer->Open(as);
  {
    std::lock_guard<std::mutex> lock(attachments_mu);
    auto& slot = Attachments()[key];
    found = slot.lock();
    if (!found) {
      slot = producer;
      return producer;
    }
  }
  // Another thread attached meanwhile: its attachment serves.
  producer->Withdraw();
  if (found->record() != producer->record()) throw Altered(handle);
  return found;
}

void MarkNetworkProducersExiting() noexcept {
  std::vector<std::shared_ptr<Session>> sessions;
  try {
    Registry& reg = Current();
    std::lock_guard<std::mutex> lock(reg.mu);
    for (auto& [address, session] : reg.sessions) sessions.push_back(session);
  } catch (...) {
    return;
  }
  // What waits for a tick (attach messages not sent yet, handles dropped since the last round:
  // "dropped", not "died"), first, so that an exiting message follows an attach.
  const auto run_deferred = [&] {
    for (auto& s : sessions) {
      if (!s->broken()) s->RunDeferred();
    }
  };
  run_deferred();
  {
    std::vector<std::shared_ptr<ProducerImpl>> attachments;
    try {
      std::lock_guard<std::mutex> lock(attachments_mu);
      for (auto& [key, weak] : Attachments()) {
        if (auto attachment = weak.lock()) attachments.push_back(std::move(attachment));
      }
    } catch (...) {
      return;
    }
    for (auto& attachment : attachments) attachment->Exiting();
  }  // (the last reference to one may go here: its drop message waits for a tick)
  run_deferred();
}

namespace {
// The consumer of `handle`'s pair when this is its process and the handle is genuine (names it
// as its record does), else null.
std::shared_ptr<ConsumerImpl> ConsumerHere(Session& session, const NetworkHandle& handle) {
  if (session.id() != handle.consumer) return nullptr;
  auto consumer = session.Find(handle.pair);
  return consumer && consumer->record() == handle.Serialize() ? consumer : nullptr;
}
}  // namespace

std::shared_ptr<NetworkProducer> RegisterNetworkHolder(const NetworkHandle& handle) {
  const std::shared_ptr<Session> session = SessionFor(handle.store);
  if (session->id() == handle.consumer) {
    // The pair's own process: its creator's handle holds it; the deserialization is counted.
    if (const auto consumer = ConsumerHere(*session, handle)) consumer->CountDeserialized();
    return nullptr;
  }
  return NetworkProducer::Attach(handle, AttachAs::kDeserialized);
}

bool CountSerializedInCreatorProcess(const NetworkHandle& handle) {
  const std::shared_ptr<Session> session = SessionFor(handle.store);
  if (session->id() != handle.consumer) return false;
  if (const auto consumer = ConsumerHere(*session, handle)) consumer->CountSerialized();
  return true;
}

void StopNetworkKind(std::chrono::steady_clock::time_point deadline) noexcept {
  Registry& reg = Current();
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    if (reg.stopped) return;
    reg.stopped = true;
    for (auto& [address, session] : reg.sessions) sessions.push_back(session);
  }
  reg.tick_cv.notify_all();
  if (sessions.empty()) return;
  // The store calls may block (a server that stopped answering): on a thread of their own, waited
  // for until the deadline.
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  try {
    std::thread([sessions, done] {
      // (First: a consumer on this kernel then says "exited", whoever deleted the heartbeat.)
      MarkNetworkProducersExiting();
      for (auto& s : sessions) s->Stop();
      std::lock_guard<std::mutex> lock(done->mu);
      done->done = true;
      done->cv.notify_all();
    }).detach();
  } catch (...) {
    for (auto& s : sessions) s->Stop();
    return;
  }
  std::unique_lock<std::mutex> lock(done->mu);
  done->cv.wait_until(lock, deadline, [&] { return done->done; });
}

void AfterForkNetworkKindInChild() noexcept {
  // The parent's sessions (their connections and threads) are not this process's: leaked.
  try {
    registry.store(new Registry());
    new (&attachments_mu) std::mutex();
    Attachments().clear();
  } catch (...) {
  }
  kind_threads = 0;
}

size_t NetworkKindThreads() { return kind_threads.load(); }

void SetNetworkHeartbeatTimeoutMs(int64_t ms) {
  if (ms < 2 * kTickMs) {
    throw std::invalid_argument("the network heartbeat timeout must be >= " +
                                std::to_string(2 * kTickMs) + " ms (two heartbeats)");
  }
  heartbeat_timeout_ms = std::min(ms, kMaxTimeoutMs);
}

int64_t NetworkHeartbeatTimeoutMs() { return heartbeat_timeout_ms.load(); }

void SetNetworkStoreTimeoutMs(int64_t ms) {
  if (ms < 100) throw std::invalid_argument("the network store timeout must be >= 100 ms");
  store_timeout_ms = std::min(ms, kMaxTimeoutMs);
}

int64_t NetworkStoreTimeoutMs() { return store_timeout_ms.load(); }

size_t PendingNetworkPairs() {
  Registry& reg = Current();
  std::lock_guard<std::mutex> lock(reg.mu);
  size_t n = 0;
  for (auto& [address, session] : reg.sessions) n += session->PendingPairs();
  return n;
}

}  // namespace dtorch::core
