// The "file" kind: a promise/future pair across processes of one host, over POSIX shared memory
// (Boost.Interprocess) (torch-free; values are written and read by a ValueCodec<T>).
//
// Roles. The process that creates the pair (the consumer) owns a control segment: one page
// holding the completion's state word, the table of producer processes, and the completion
// itself (an error, or a value's header and the name of its payload segment), and what a handle
// must match: a nonce, the value type and the consumer's value options. The promise is serialized
// ("dtorch-promise:1:file:<type>:<segment>:<nonce>[:<options>]") and shipped to producers. A
// process that receives a handle is a holder from that moment: deserializing it maps the control
// segment, checks the handle against it and registers the process in the table (no payload is
// mapped, no thread started: the consumer's doorbell is mapped at the first claim), so that a
// worker that dies before it uses the promise fails the future at once. A handle inherited by a
// forked child registers on first use, or when the binding says the child received it
// (RegisterHolder: a multiprocessing child's arguments). A promise shipped ahead of its value is
// then set without a system call for it.
//
// Completing. The state word goes pending -> claimed (by one handle, a compare-and-swap: fulfil
// once, across processes) -> value or error, the last step a compare-and-swap from that same
// claim (the consumer may have failed the pair meanwhile). A value is copied, by the producer,
// into a payload segment before the state says "value": one that producer process keeps for that
// consumer process, reused across values (payload_pool.h), named for the consumer (so that the
// consumer's death reaps it) until the consumer first maps it. The consumer's value views the
// mapping for as long as it lives. A pair its consumer dropped is closed: a producer's set is
// then a no-op.
//
// Waking. A thread blocked in Get()/WaitUntil() sleeps on a futex on the state word: the producer
// wakes it directly (one hop). Callbacks and `await` are served by one watcher thread per process
// ("dtorch-doorbell"): producers ring the consumer's doorbell segment (a counter and a futex)
// when the pair has a callback (a flag in the control block says so). Nothing on the wake path
// is a lock: a killed producer cannot poison it. The same thread releases idle payload segments
// and the consumers' doorbells a producer mapped. The robust interprocess mutex of each control
// segment guards only the producer table (a producer that finds its owner dead fails the pair).
//
// Liveness (checked by the watcher every 250 ms). Processes are told apart by pid, start time and
// pid namespace (a promise refuses producers of another pid namespace). Once a holder has
// registered, the future fails with "broken promise" when every registered holder has exited
// (and is gone), died (SIGKILL included; zombies count as dead) or dropped its handle without
// setting, unless a handle is in flight: the block counts serializations and deserializations,
// and while more were serialized (a holder passed it on before it went) the attach deadline is
// the backstop instead. The creator's own handle never counts as a holder. A producer that died
// after claiming fails the pair at once. A promise that never left its process breaks when the
// creator drops it; one that did (serialized, or the process forked) and that no holder
// registered for fails with "no producer attached" after the attach deadline, counted from the
// creator's drop.
//
// Nothing left behind. Segments are created exclusively, mode 0600; the consumer unlinks the
// control segment when the value is taken or the pair is gone, and a new payload's name when it
// first maps it, or when the value can no longer be taken (a payload a producer was still
// writing for a pair that went away is settled once that producer is done or dead); a process's
// doorbell goes 2 s after its last pending pair; at exit a process unlinks what it owns; what a
// killed process left is reaped when the library next loads in a process of the same user and
// pid namespace, and by a producer that finds its consumer dead when it sets (it then makes no
// payload for it, and ends the pair as broken) or at its own exit.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <unistd.h>

#include "../../promise_future.h"
#include "../../received_future.h"
#include "../../remote_promise.h"
#include "../../shared_state.h"
#include "shm_segment.h"
#include "../../value_codec.h"

namespace dtorch::core {


// What a serialized file promise names (validated when parsed: untrusted input).
struct FileHandle {
  std::string type_name;  // the codec's TypeName()
  std::string segment;    // the control segment
  std::string nonce_hex;  // 32 hex digits; must match the nonce stored in the segment
  // The consumer's options for the value (its codec's, e.g. "device=cpu"): [a-z0-9_=]{0,32},
  // empty for none; checked by the codec, and must match the options the consumer recorded in
  // the segment (a producer delivers only as the consumer chose).
  std::string value_options;

  std::string Serialize() const;
  // Parses what follows "dtorch-promise:1:file:"; throws FutureError(kInvalidHandle).
  static FileHandle Parse(std::string_view rest, std::string_view expected_type);
};

// A value the consumer took: its header and its payload's mapping (kept alive by keep_alive).
using PublishedValue = ReceivedValue;

// One handle's way to complete a pair: the creator's own, or a producer process's attachment
// (which registered the process in the producer table, and marks its entry dropped when the last
// handle of that process goes).
class FileChannel : public RemoteAttachment {
 public:
  // TryClaim() (RemoteAttachment) throws FutureError(kInvalidHandle) when the consumer's doorbell
  // is not what the pair names; kFailedByConsumer also when its lock was abandoned by a producer
  // that died.

  // A handle of the pair was serialized (deserialized) in this process (FileControlBlock's
  // counts).
  virtual void CountSerialized() noexcept = 0;
  virtual void CountDeserialized() noexcept = 0;
  // After TryClaim(): publishes a value (a payload of payload_bytes, filled by `write`), or an
  // error. PublishValue throws FutureError(kSharedMemory) when the payload cannot be made, after
  // publishing that error to the consumer instead. Nothing is published if the consumer failed
  // the pair meanwhile.
  // `keep` (may be null) is held until the consumer has released the payload (or died).
  virtual void PublishValue(const std::string& header, size_t payload_bytes,
                            const std::function<void(void*)>& write,
                            std::shared_ptr<void> keep = nullptr) = 0;
  virtual void PublishError(const ErrorInfo& error) noexcept = 0;
};

// Attaches this process to the pair `handle` names, as a producer (one attachment per process and
// pair, shared by its handles). nullptr when the pair is gone (its future was taken or dropped, or
// its consumer exited): there is nobody to deliver to. Throws FutureError(kInvalidHandle), before
// registering anything, for a segment that is not the one the handle names (its nonce, value type,
// creator or value options differ; also when this process is already attached to that segment
// through another handle), kBrokenPromise when the promise's lock was left
// by a producer that died holding it, kSharedMemory when mapping fails.
// `mapped`: the control segment MapFileControlSegment mapped ahead, if it could.
std::shared_ptr<FileChannel> AttachFileProducer(const FileHandle& handle,
                                                std::shared_ptr<shm::Segment> mapped = nullptr);
// A promise was deserialized in this process: registers it as a holder (AttachFileProducer on
// `mapped`, the control segment MapFileControlSegment mapped) and counts the deserialization;
// in the pair's creator process only counts it (its copies are no holders). Null when it did
// not attach (the creator process, a pair that is gone, nothing mapped, any failure: the first
// use attaches and says why); *counted says whether the deserialization was counted (else the
// first attach counts it).
std::shared_ptr<FileChannel> RegisterFileHolder(const FileHandle& handle,
                                                std::shared_ptr<shm::Segment> mapped,
                                                bool* counted) noexcept;
// A handle of the pair was serialized in a process that holds it without being attached (or
// holds nothing): counts it in the control segment (`mapped`, or opened here), registering
// nothing.
void CountFileSerialization(const FileHandle& handle,
                            std::shared_ptr<shm::Segment> mapped) noexcept;
// Maps the control segment `handle` names, ahead of the first use of a promise deserialized
// here (so that setting it makes no system call for it): null when that fails (the attach at
// first use then says why). Registers nothing.
std::shared_ptr<shm::Segment> MapFileControlSegment(const FileHandle& handle) noexcept;

// The consumer's end of a pair, in the process that created it.
class FileConsumer : public RemoteConsumer {
 public:
  // Creates the control segment and registers the pair with the doorbell watcher.
  // `value_options` travel in the handle (FileHandle::value_options).
  static std::shared_ptr<FileConsumer> Create(std::string_view type_name,
                                              std::string_view value_options = {});
  virtual ~FileConsumer() = default;

  virtual const FileHandle& handle() const = 0;
  // The creator's own way to complete the pair.
  virtual std::shared_ptr<FileChannel> CreatorChannel() = 0;
  // A handle was serialized in a forked child of the creator (the mapping is inherited).
  virtual void CountSerialized() noexcept = 0;
  // The creator's promise handle is gone: breaks the pair at once if it never left the process,
  // or starts the attach deadline.
  virtual void CreatorDropped() = 0;

  // FutureBackend semantics (promise_future.h).
  bool WaitUntil(Deadline deadline) const override = 0;
  bool IsReady() const override = 0;
  virtual bool Valid() const = 0;
  void OnReady(std::function<void()> callback) override = 0;
  // Blocks until complete, then takes the value (throws the error instead); consumes.
  PublishedValue Take() override = 0;
};

// The library's exit: stops the watcher (by `deadline`), fails this process's pending pairs with
// "dropped at interpreter exit", marks its producer entries "exited", and unlinks every segment
// it still owns.
void StopFileKind(std::chrono::steady_clock::time_point deadline) noexcept;
// This process will not use its promises any more (it exits): its producer entries say "exited"
// (a consumer then reports "producer exited (pid N)" rather than "died"). Part of StopFileKind;
// also run by dtorch_ops in a fork-started multiprocessing child, which skips the exit handlers.
void MarkFileProducersExited() noexcept;
// Unlinks this process's doorbell now if no pair of it is pending (the watcher would in 2 s):
// for a process about to end without the library's exit handler (that same multiprocessing
// child).
void ReleaseIdleFileSegments() noexcept;
// Fork handlers (registration.cc makes them the kind's lifecycle participant's).
void PrepareForkFileKind() noexcept;
void AfterForkFileKindInParent() noexcept;
void AfterForkFileKindInChild() noexcept;
// The doorbell watcher threads (0 or 1), for CountLibraryThreads.
int FileWatcherThreads();
// Pending file pairs of this process (registered with the watcher), and the name of its doorbell
// segment ("" when it has none: no pair pending for a while), for tests.
size_t PendingFilePairs();
std::string FileDoorbellSegment();
// Test-only: attaches as a producer, takes the promise's lock and never returns (the test kills
// the process holding it).
[[noreturn]] void HoldFilePromiseLockForTesting(const FileHandle& handle);

// ---- the kind's backends ----

// The future is a ReceivedFuture<T> (received_future.h) of the pair's FileConsumer; the promise
// is a RemotePromise (remote_promise.h) over these traits.
struct FileKind {
  static constexpr const char* kName = "file";
  static constexpr const char* kTooLate =
      "the promise was already failed (no producer alive, none attached in time, or its lock "
      "abandoned by a producer that died)";
  static constexpr bool kHolderAttachesAnew = false;
  using Handle = FileHandle;
  using Consumer = FileConsumer;
  using Attachment = FileChannel;
  // The control segment MapFileControlSegment mapped ahead (so that the first set makes no
  // system call for it); beyond its cap of handles mapped ahead, null.
  using Prepared = std::shared_ptr<shm::Segment>;

  // `value_options`: the codec's options (codec was made with them), which producers need too.
  template <typename T>
  static std::shared_ptr<FileConsumer> CreateConsumer(
      const std::shared_ptr<const ValueCodec<T>>& codec, std::string_view value_options = {}) {
    return FileConsumer::Create(codec->TypeName(), value_options);
  }
  static std::shared_ptr<FileChannel> Received(const FileHandle& handle, Prepared* prepared,
                                               bool* counted) noexcept {
    *prepared = MapFileControlSegment(handle);
    return RegisterFileHolder(handle, *prepared, counted);
  }
  static std::shared_ptr<FileChannel> Attach(FileConsumer* consumer, const FileHandle& handle,
                                             Prepared prepared, bool /*uncounted*/,
                                             bool /*holder*/) {
    return consumer && consumer->InCreatorProcess()
               ? consumer->CreatorChannel()
               : AttachFileProducer(handle, std::move(prepared));
  }
  // (After the producer entry: a holder counts its deserialization once it is in the table.)
  static void CountedOnAttach(FileChannel& channel) noexcept { channel.CountDeserialized(); }
  // (Counted without attaching: serializing uses nothing of the pair.)
  template <typename AttachNow>
  static void CountSerialized(FileConsumer* consumer, const FileHandle& handle,
                              FileChannel* channel, Prepared prepared, const AttachNow&) {
    if (consumer) {
      consumer->CountSerialized();  // (a forked child of the creator: the mapping is inherited)
    } else if (channel) {
      channel->CountSerialized();
    } else {
      CountFileSerialization(handle, std::move(prepared));
    }
  }
  static void CreatorDropped(FileConsumer& consumer, bool /*claimed_here*/) {
    consumer.CreatorDropped();
  }
  template <typename T>
  static void Deliver(FileConsumer* /*consumer*/, FileChannel& channel, const ValueCodec<T>& codec,
                      Result<T> result) {
    if (!result.ok()) {
      channel.PublishError(result.error());
      return;
    }
    size_t payload_bytes = 0;
    const std::string header = codec.Header(result.value(), &payload_bytes);
    channel.PublishValue(
        header, payload_bytes,
        [&](void* payload) { codec.WritePayload(result.value(), payload, payload_bytes); },
        codec.KeepUntilReleased(result.value()));
  }
};

template <typename T>
using FilePromise = RemotePromise<T, FileKind>;

}  // namespace dtorch::core
