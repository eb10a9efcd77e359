// The "network" kind: a promise/future pair whose producer may run on another host, over the
// key-value store a torch.distributed job already runs (a c10d TCPStore), not a protocol of our own
// (torch-free: the store is a KeyValueStore the torch glue provides, ops/network_store.cpp; values
// are written and read by a ValueCodec<T>, as the file kind's).
//
// Names. Each process that uses a store has an id there, 32 random hex digits (its "store id"),
// and each pair one too. A serialized promise names how its consumer receives values (format 2,
// "v2:g:" first: over point-to-point links as well, links.h; format 1, without it: through the
// store only; "v2:s:" is read as format 1), the store's address, the consumer's store id and the
// pair: "dtorch-promise:1:network:[v2:g:]<type>:<host>:<port>:<consumer>:<pair>[:<options>]" (an
// IPv6 host in brackets). Values over links: links.h; the rest of this contract holds for both. Every key of the kind starts with "dtorch/n/":
//   q/<consumer>   the consumer's queue: producers push their messages to it (attach, drop, value)
//   hb/<process>   a process's heartbeat, a counter it bumps while it has pairs in flight
//   id/<process>   a consumer's identity ("<uid>:<pid>:<start time>:<pid namespace>:<boot
//                  id>"), written with its first pair: a producer of its user on its kernel
//                  checks it by pid
//   c/<pair>       the claim, while the pair lives: first the pair's record (its serialized
//                  promise, written by the consumer as it creates the pair), then a producer's
//                  claim ("<store id>/<16 hex digits naming its attachment>": compare_set from the
//                  record, so fulfilled once, across hosts), or "!" once the consumer failed it
//   v/<pair>/<i>   chunk i of a value too large for one message
//   p/<link>/...   a point-to-point link's rendezvous keys (Gloo's), until both ends connected
//
// Roles. The consumer (the process that created the pair) has one watcher thread per store
// ("dtorch-net-watch") that blocks in a queue pop on its own connection (a blocking pop holds its
// connection, so it is never the one the producers' calls use) and completes the pairs it is
// told about; no thread per future. A process that deserializes a handle is a holder at once: it
// connects, checks the handle against the pair's record and tells the consumer (an attach
// message naming its pid, start time, pid namespace, kernel boot id and host) before the
// deserialization returns. A handle a process inherited (fork) attaches on first use, without a
// round trip: the tick thread tells the consumer at its next round, unless the value went first
// (its message says all the attach message would: a value set at once costs two round trips,
// the claim and the value); or at once when the binding says the process received it (a
// multiprocessing child's arguments). Serializing a handle in a holder sends a message first (a
// handle in flight); in the creator it is counted there. It
// claims with one compare_set from the pair's record to its own claim value, which also checks
// the handle: a handle that names the pair with another consumer, value type, options or
// address was altered (kInvalidHandle); one whose pair is not in flight (its consumer dropped
// it) is closed, and setting it is a no-op, as for a file promise. A producer that drops its
// handle unset tells the consumer, checking the handle first (and announcing itself) if it was
// not announced yet. It
// publishes the value: its bytes in the message when they fit (kInlineValueBytes), else in chunks of
// kChunkBytes (the store's server refuses a value over 8 MiB), with a checksum of the bytes
// either way. Everything the consumer reads back is validated before a value is built; a
// message it cannot read fails its pair, never the process.
//
// Liveness. One process-wide thread ("dtorch-net-tick") bumps this process's heartbeats every
// kTickMs and checks the others, while any pair is in flight (a holder's too), and from a
// process's first network future on until it exits (producers with messages for an idle consumer
// must not take it for a dead one). A holder on the consumer's kernel (the same boot id) is
// checked itself, by pid and start time, as the file kind does: alive while it runs, gone the
// round after it is (exited if its exit deleted its heartbeat or it said it was exiting, else
// died). Another host's holder whose heartbeat stopped changing for the heartbeat timeout
// (SetNetworkHeartbeatTimeoutMs) is gone (exited if it said so, else died), and one whose
// heartbeat key, once seen, is gone exited. (A process bumps it at once when it starts a pair or
// announces itself, before anyone can look for it.) A pair that knows of no producer has its
// claim read each round: a producer that claimed it and died before it was announced is watched
// too. The tick's verdict goes through the watcher's queue (a recheck message): a value a
// producer pushed just before it exited completes the pair first, and a message that changed
// what the verdict was made from (a holder attached, a handle serialized) makes the tick decide
// again. The future fails with "broken promise" once every holder has died, exited or dropped
// its handle without setting, unless more handles were serialized than deserialized (one is in
// flight: then after the attach deadline, attach_deadline.h's AttachTimeoutMs, from the moment the
// last holder was gone); with "no producer attached" after the attach deadline when the promise
// left the process (serialized, or the process forked), no holder ever registered and its
// creator dropped it; at once if it never left the process and the creator dropped it. The
// store going away (the watcher's connection lost) fails every pair in flight on it.
//
// Nothing left behind. The consumer deletes a value's chunks once it has read them, and the claim
// once the pair is gone (its future and promise dropped; a second producer is refused until
// then); at exit, those of its pairs in flight and its heartbeat. A producer keeps what it sent
// a consumer until that consumer's queue is empty (read); if the consumer died first, the
// producer drains that queue and deletes the keys its messages name, its heartbeat and its
// identity: a consumer on the producer's kernel is found dead by pid (no chunk of a value is
// written for it; at the producer's exit at the latest), one elsewhere by its heartbeat. (What a
// killed consumer leaves of pairs no producer attached to stays.) A queue the store holds no item
// of is no key at all.
//
// Bounds. Every exchange with the store has a deadline, NetworkStoreTimeoutMs(): a store that
// stops answering breaks the session (its pairs fail, its blocked calls give up) within it.
// Every count, size and index read from the store is bounded before it causes work (anyone who
// reaches the store can push to a queue), so that one bad message costs at most the pair it
// names and never holds the watcher: a value's size must be what its header implies (the
// codec's PayloadBytes) and fit in this machine's memory before a chunk is read, its chunk count
// must match its size, and chunks are deleted only up to the first one missing, in pipelined
// batches, on the tick thread (between its rounds), not the watcher; a value message naming no
// pair made here causes no store call; a pair tracks at most 1024 holders (more fail it); drop,
// serialize and exiting messages count only from holders the pair knows; the watcher pops a
// backlog in batches; a queue drained for a dead consumer (or at exit) gives up as many items as
// it held when the drain began. Heartbeats are read without making keys.
//
// Security: none of the store's (it has no authentication, and listens on every interface):
// run it on a trusted network. Everything read from it is checked.
//
// Thread-safety: every function and method may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "../../promise_future.h"
#include "../../received_future.h"
#include "../../remote_promise.h"
#include "../../shared_state.h"
#include "../../value_codec.h"

namespace dtorch::core {

// ---- the store ----

// What a KeyValueStore throws. kUnreachable: the store cannot be reached (connection refused,
// reset, closed); kTimeout: it did not answer within the connection's timeout.
class StoreError : public std::runtime_error {
 public:
  enum class Kind { kUnreachable, kTimeout, kOther };
  StoreError(Kind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  Kind kind() const noexcept { return kind_; }

 private:
  Kind kind_;
};

// The operations of a c10d Store the kind uses, on one connection (thread-safe: calls on one
// connection are serialized by it). Throws StoreError.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual void Set(const std::string& key, std::string_view value) = 0;
  // Sets `desired` if the key holds `expected` ("" also matches a missing key); returns the value
  // it holds afterwards, except for a missing key and a non-empty `expected`: the key stays
  // missing and `expected` is returned (c10d's answer; the kind tells the two apart by Check).
  virtual std::string CompareSet(const std::string& key, const std::string& expected,
                                 const std::string& desired) = 0;
  // Waits (up to the connection's timeout) for the key to exist.
  virtual std::string Get(const std::string& key) = 0;
  virtual int64_t Add(const std::string& key, int64_t delta) = 0;
  virtual bool DeleteKey(const std::string& key) = 0;
  // Whether the key exists (without waiting for it).
  virtual bool Check(const std::string& key) = 0;
  virtual void QueuePush(const std::string& key, std::string_view value) = 0;
  // Waits for an item, up to the connection's timeout (then throws StoreError(kTimeout)).
  virtual std::string QueuePopBlocking(const std::string& key) = 0;
  // The oldest item, or nullopt when the queue is empty.
  virtual std::optional<std::string> QueuePopNow(const std::string& key) = 0;
  virtual int64_t QueueLength(const std::string& key) = 0;
  // Batches (one round trip where the store's protocol lets requests be pipelined; c10d has no
  // multi-delete or multi-pop). Deletes `keys`, in order; returns which existed.
  virtual std::vector<bool> DeleteKeys(const std::vector<std::string>& keys) {
    std::vector<bool> existed;
    existed.reserve(keys.size());
    for (const auto& key : keys) existed.push_back(DeleteKey(key));
    return existed;
  }
  // CompareSet on each of `keys` with the same values; the answers, in order.
  virtual std::vector<std::string> CompareSets(const std::vector<std::string>& keys,
                                               const std::string& expected,
                                               const std::string& desired) {
    std::vector<std::string> answers;
    answers.reserve(keys.size());
    for (const auto& key : keys) answers.push_back(CompareSet(key, expected, desired));
    return answers;
  }
  // Pops up to `max_items` (>= 1) items, oldest first: when `block`, waits for the first as
  // QueuePopBlocking does. `*left` (if given): the items the queue held after them.
  virtual std::vector<std::string> QueuePopSome(const std::string& key, size_t max_items,
                                                bool block, int64_t* left) {
    std::vector<std::string> items;
    if (block) items.push_back(QueuePopBlocking(key));
    while (items.size() < max_items) {
      std::optional<std::string> item = QueuePopNow(key);
      if (!item) break;
      items.push_back(std::move(*item));
    }
    if (left != nullptr) *left = QueueLength(key);
    return items;
  }
  // Gives the connection up: a call blocked in it, and every later one, throws
  // StoreError(kUnreachable). Callable from any thread, also during a call.
  virtual void Abort() noexcept {}
  // Whether a call failed in a way that left the connection unusable (every later call throws).
  virtual bool Broken() const noexcept { return false; }
};

// The bound of every exchange with a store (config.network_store_timeout_s): a store that does
// not answer within it is unreachable (a frozen server, a partition). Waits for a key have their
// own timeout.
inline constexpr int64_t kDefaultNetworkStoreTimeoutMs = 30000;
void SetNetworkStoreTimeoutMs(int64_t ms);  // throws std::invalid_argument when < 100 ms
int64_t NetworkStoreTimeoutMs();

// Opens a connection to the store at host:port (torch glue). Throws StoreError: kUnreachable at
// once where nothing listens there or the host does not resolve.
using StoreConnector = std::unique_ptr<KeyValueStore> (*)(const std::string& host, uint16_t port,
                                                          std::chrono::milliseconds timeout);
void SetStoreConnector(StoreConnector connector);

// A store's address: "host:port" (an IPv6 host in brackets: "[::1]:29500").
struct StoreAddress {
  std::string host;  // without brackets
  uint16_t port = 0;

  std::string ToString() const;
  // Parses "host:port"; throws std::invalid_argument saying what is wrong.
  static StoreAddress Parse(std::string_view text);
  bool operator<(const StoreAddress& o) const {
    return host != o.host ? host < o.host : port < o.port;
  }
};

// ---- point-to-point links ----

// A connection between two processes for values, beside the store (torch glue: a 2-rank Gloo
// group on a PrefixStore of the store, ops/kinds/network_pairs.cpp, made by Python: only
// processes that run Python with torch.distributed's Gloo have one). Rank 0 is the consumer's
// end, rank 1 the producer's. Messages on one tag arrive in order; a receive is posted with a
// buffer at least as large as what the peer sends on that tag (a larger message would end the
// receiving process: sizes come first, validated, in a fixed-size frame).
//
// Thread-safety: one thread calls Send and Receive on one link at a time (per tag); Abort may be
// called from any thread, also during a call.
class PairLink {
 public:
  virtual ~PairLink() = default;
  // Blocks until the peer has received (posted its receive and taken the bytes), or `timeout`
  // ran out. Throws std::runtime_error when the link failed (the peer gone, a timeout, an abort):
  // the link is then unusable.
  virtual void Send(const void* data, size_t bytes, uint32_t tag,
                    std::chrono::milliseconds timeout) = 0;
  // Blocks until a message arrived on `tag` into [data, data + bytes) (it may be shorter), or the
  // link failed (throws std::runtime_error, as Send). No timeout: Abort wakes it.
  virtual void Receive(void* data, size_t bytes, uint32_t tag) = 0;
  // Wakes a blocked Send or Receive, which then throws.
  virtual void Abort() noexcept = 0;
};

// Makes this process's end of the link whose rendezvous keys start with `prefix` on the store at
// `store` (blocks until both ends connected, or `timeout`). Throws std::runtime_error.
using PairLinkFactory = std::function<std::unique_ptr<PairLink>(
    const StoreAddress& store, const std::string& prefix, int rank,
    std::chrono::milliseconds timeout)>;
// Set by the bindings when this process can make links (empty: it cannot; the store path serves).
void SetPairLinkFactory(PairLinkFactory factory);
bool HasPairLinkFactory();
// config.network_pair_groups: 1 (the default) sends values over links where both ends can, 0
// over the store only (pairs created meanwhile say so in their handle, and a producer that has
// it 0 uses the store).
void SetNetworkPairGroups(int64_t enabled);  // throws std::invalid_argument unless 0 or 1
int64_t NetworkPairGroups();
// config.network_pair_idle_s: a producer's link that sent nothing for this long is closed (its
// consumer's receiving thread exits); the next value makes a new one.
inline constexpr int64_t kDefaultNetworkPairIdleMs = 60000;
void SetNetworkPairIdleMs(int64_t ms);  // throws std::invalid_argument when < 100 ms
int64_t NetworkPairIdleMs();
// Links of this process now (as a consumer, as a producer), for tests and diagnostics.
size_t NetworkLinksIn();
size_t NetworkLinksOut();

// ---- the kind ----

// What a serialized network promise names (validated when parsed: untrusted input).
struct NetworkHandle {
  std::string type_name;      // the codec's TypeName()
  StoreAddress store;
  std::string consumer;       // the consumer's store id: 32 hex digits
  std::string pair;           // 32 hex digits
  std::string value_options;  // the consumer's codec options ([a-z0-9_=]{0,32}), checked by it
  // Whether the consumer receives values over point-to-point links ("g": a Gloo pair group per
  // producer process) or only through the store ("s"; also every handle of format 1).
  bool links = false;

  std::string Serialize() const;
  // Parses what follows "dtorch-promise:1:network:"; throws FutureError(kInvalidHandle).
  static NetworkHandle Parse(std::string_view rest, std::string_view expected_type);
};

// The payload size a value's header implies (ValueCodec::PayloadBytes; throws for a bad header).
using PayloadBytesOf = std::function<size_t(std::string_view header)>;

// The consumer's end of a pair, in the process that created it.
class NetworkConsumer : public RemoteConsumer {
 public:
  // Registers the pair with this process's session on the store (connecting, and starting its
  // watcher, if needed). A value message whose size is not what its header implies
  // (`payload_bytes_of`) fails the pair before anything more is read. Throws
  // FutureError(kBrokenPromise) when the store cannot be reached.
  static std::shared_ptr<NetworkConsumer> Create(std::string_view type_name,
                                                 const StoreAddress& store,
                                                 std::string_view value_options,
                                                 PayloadBytesOf payload_bytes_of);
  virtual ~NetworkConsumer() = default;
  virtual const NetworkHandle& handle() const = 0;
  // MarkLeftProcess (RemoteConsumer): counted as a handle in flight.
  // The creator's promise handle is gone; `claimed_here`: that handle claimed the pair (its
  // value or error is on its way through the store).
  virtual void CreatorDropped(bool claimed_here) = 0;
  // The creator's own handle fails the pair with an exception object: the future of this process
  // raises that object when the error comes back through the store.
  virtual void KeepNative(std::shared_ptr<const NativeError> native) = 0;
};

// Why a process attaches: its first use of a handle it inherited (announced at the tick thread's
// next round, unless the value goes first), it holds one it received without deserializing (a
// forked child's arguments), or it deserialized one (both announced before Attach returns).
enum class AttachAs { kFirstUse, kHolder, kDeserialized };

// This process's attachment to a pair as a producer (one per process and pair, shared by its
// handles; made on first use). Dropping the last one without publishing tells the consumer.
class NetworkProducer : public RemoteAttachment {
 public:
  // Attaches (a message to the consumer, if the pair waits for a producer). Throws
  // FutureError: kInvalidHandle when the handle does not match the pair it names (altered),
  // kBrokenPromise when the store cannot be reached.
  static std::shared_ptr<NetworkProducer> Attach(const NetworkHandle& handle,
                                                 AttachAs as = AttachAs::kFirstUse);
  // TryClaim (RemoteAttachment): kClaimed for one handle of the attachment only (the others
  // sharing it came second); kPairGone: the pair is not in flight (its consumer dropped it).

  // After kClaimed. Throws FutureError(kBrokenPromise) when the store cannot be reached.
  virtual void PublishValue(const std::string& header, std::string payload) = 0;
  // Whether a value goes over a point-to-point link (links.h) when it can: its payload is then
  // sent from the value's own memory (PublishValueFrom), not copied first.
  virtual bool SendsOverLink() const = 0;
  // PublishValue from `bytes` at `payload`, which stay valid until this returns.
  virtual void PublishValueFrom(const std::string& header, const void* payload, size_t bytes) = 0;
  virtual void PublishError(const ErrorInfo& error) noexcept = 0;
  // A handle was serialized in this process: the consumer counts it in flight (a message, sent
  // before this returns). Never throws.
  virtual void Serialized() noexcept = 0;
};

// A handle was deserialized in this process: registers it as a holder (Attach, kDeserialized);
// in the pair's creator process only counts the deserialization (null then). Throws as Attach.
std::shared_ptr<NetworkProducer> RegisterNetworkHolder(const NetworkHandle& handle);
// A copy of a handle was serialized in this process: true (counted there) when this is the
// pair's creator process, whose copies are no holders. Throws as Attach.
bool CountSerializedInCreatorProcess(const NetworkHandle& handle);

// The library's exit: fails this process's pairs in flight ("dropped at interpreter exit"),
// deletes its heartbeats, stops the threads (by `deadline`).
void StopNetworkKind(std::chrono::steady_clock::time_point deadline) noexcept;
// This process is about to exit without the library's exit handler (a multiprocessing child):
// the consumers of the pairs it holds are told, so that once it is gone they say "exited".
void MarkNetworkProducersExiting() noexcept;
void AfterForkNetworkKindInChild() noexcept;
// Threads of the kind now (watchers and the tick thread), for CountLibraryThreads.
size_t NetworkKindThreads();
// How long a producer's heartbeat may stand still before its consumers count it dead.
inline constexpr int64_t kDefaultNetworkHeartbeatTimeoutMs = 5000;
void SetNetworkHeartbeatTimeoutMs(int64_t ms);  // throws std::invalid_argument when < 1 tick
int64_t NetworkHeartbeatTimeoutMs();
// Pairs in flight on all stores (consumer side), for tests.
size_t PendingNetworkPairs();

// ---- the kind's backends ----

// The future is a ReceivedFuture<T> (received_future.h) of the pair's NetworkConsumer; the promise
// is a RemotePromise (remote_promise.h) over these traits.
struct NetworkKind {
  using Handle = NetworkHandle;
  using Consumer = NetworkConsumer;
  using Attachment = NetworkProducer;
  struct Prepared {};  // (nothing: a received handle connects when it registers)
  static constexpr const char* kName = "network";
  // A holder announces itself as one (AttachAs::kHolder) even where this process is attached.
  static constexpr bool kHolderAttachesAnew = true;
  static constexpr const char* kTooLate =
      "the consumer already failed the promise (no producer alive, none attached in time) or is "
      "gone";

  template <typename T>
  static std::shared_ptr<NetworkConsumer> CreateConsumer(
      const std::shared_ptr<const ValueCodec<T>>& codec, const StoreAddress& store,
      std::string_view value_options) {
    return NetworkConsumer::Create(
        codec->TypeName(), store, value_options,
        [codec](std::string_view header) { return codec->PayloadBytes(header); });
  }
  // It connects to the store now; if it cannot, the first use says why (and counts it).
  static std::shared_ptr<NetworkProducer> Received(const NetworkHandle& handle, Prepared*,
                                                   bool* counted) noexcept {
    try {
      auto producer = RegisterNetworkHolder(handle);
      *counted = true;
      return producer;
    } catch (...) {
      *counted = false;
      return nullptr;
    }
  }
  static std::shared_ptr<NetworkProducer> Attach(NetworkConsumer*, const NetworkHandle& handle,
                                                 Prepared, bool uncounted, bool holder) {
    return NetworkProducer::Attach(handle, holder      ? AttachAs::kHolder
                                           : uncounted ? AttachAs::kDeserialized
                                                       : AttachAs::kFirstUse);
  }
  static void CountedOnAttach(NetworkProducer&) noexcept {}  // (Attach counted it: kDeserialized)
  template <typename AttachNow>
  static void CountSerialized(NetworkConsumer*, const NetworkHandle& handle, NetworkProducer*,
                              Prepared, const AttachNow& attach) {
    try {
      if (!CountSerializedInCreatorProcess(handle)) attach()->Serialized();
    } catch (const FutureError&) {
      // (The store cannot be reached from here: the handle is passed on all the same.)
    }
  }
  static void CreatorDropped(NetworkConsumer& consumer, bool claimed_here) {
    consumer.CreatorDropped(claimed_here);
  }
  template <typename T>
  static void Deliver(NetworkConsumer* consumer, NetworkProducer& producer,
                      const ValueCodec<T>& codec, Result<T> result) {
    if (!result.ok()) {
      if (result.error().origin.native && consumer && consumer->InCreatorProcess()) {
        consumer->KeepNative(result.error().origin.native);
      }
      producer.PublishError(result.error());
      return;
    }
    size_t payload_bytes = 0;
    std::string header;
    std::string payload;
    const void* in_place = nullptr;
    try {
      header = codec.Header(result.value(), &payload_bytes);
      // (Its own memory, as it is, where it goes over a link: no copy before the send.)
      in_place = producer.SendsOverLink() ? codec.PayloadInPlace(result.value(), payload_bytes)
                                          : nullptr;
      if (in_place == nullptr) payload.resize(payload_bytes);
      if (payload_bytes != 0 && in_place == nullptr) {
        codec.WritePayload(result.value(), payload.data(), payload_bytes);
      }
    } catch (const std::exception& e) {
      // Claimed, so nothing else will complete the pair: it fails with this error too.
      producer.PublishError(ErrorInfo{
          FutureErrc::kProducerError, std::string("the value could not be sent: ") + e.what()});
      throw;
    }
    // (Outside the codec's try: the send's own errors are the send's, not "could not be sent".)
    if (in_place != nullptr) {
      producer.PublishValueFrom(header, in_place, payload_bytes);
      return;
    }
    producer.PublishValue(header, std::move(payload));
  }
};

template <typename T>
using NetworkPromise = RemotePromise<T, NetworkKind>;

}  // namespace dtorch::core
