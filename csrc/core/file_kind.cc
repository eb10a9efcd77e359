#include "boost_config.h"  // first: checks the Boost version

#include "file_kind.h"

#include <pthread.h>
#include <sys/stat.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <boost/interprocess/sync/interprocess_mutex.hpp>
#include <boost/interprocess/sync/scoped_lock.hpp>

#include "attach_deadline.h"
#include "base/clock.h"
#include "base/random.h"
#include "kind_registry.h"
#include "payload_pool.h"

namespace dtorch::core {
namespace bip = boost::interprocess;
namespace {

using std::chrono::milliseconds;

constexpr uint64_t kControlMagic = 0x3170666863726f74ULL;  // "torchfp1" (little-endian)
constexpr uint64_t kDoorbellMagic = 0x3162646863726f74ULL;  // "torchdb1"
// 3: the consumer's value options are recorded in the block (a handle must name the same).
// 4: handles serialized and deserialized are counted; an error carries its exception's type and
//    the producer's traceback.
constexpr uint32_t kLayoutVersion = 4;
constexpr size_t kSegmentBytes = 4096;  // a control segment and a doorbell: one page each
constexpr size_t kNonceBytes = 16;
constexpr size_t kTypeNameBytes = 16;
constexpr size_t kMaxValueOptionsBytes = 32;  // FileHandle::value_options
constexpr uint32_t kMaxProducers = 32;
// An error's text: its detail (message), then as much of the producer's traceback as fits.
constexpr size_t kMaxErrorTextBytes = 1536;
constexpr size_t kNameField = shm::kMaxSegmentNameBytes + 1;  // NUL-terminated

// The state word: a phase, and (claimed, value, error) who claimed it.
constexpr uint32_t kPending = 0, kClaimed = 1, kValue = 2, kError = 3;
constexpr uint32_t kCreatorClaimant = 0xfe;   // the creator's own promise handle
constexpr uint32_t kConsumerClaimant = 0xfd;  // the consumer, breaking the pair
constexpr uint32_t kLockBreakerClaimant = 0xfc;  // a producer that found the lock's owner dead
uint32_t Phase(uint32_t state) { return state & 0xff; }
uint32_t Claimant(uint32_t state) { return state >> 8; }
uint32_t State(uint32_t phase, uint32_t claimant) { return phase | (claimant << 8); }
bool IsDone(uint32_t state) { return Phase(state) == kValue || Phase(state) == kError; }

// flags
constexpr uint32_t kLeftProcess = 1;     // serialized (or the creator forked)
constexpr uint32_t kCreatorDropped = 2;  // the creator's promise handle is gone
constexpr uint32_t kConsumerGone = 4;    // the pair is gone: a payload published now is withdrawn
constexpr uint32_t kWantsRing = 8;       // callbacks wait: a completion rings the doorbell

// A producer entry's state.
constexpr uint32_t kAttached = 1, kDropped = 2, kExited = 3;

// The liveness check of pending pairs (and the doorbell watcher's longest sleep).
constexpr milliseconds kLivenessPeriod{250};
// How long "no producer left" must hold before the pair breaks: a process dropping its last
// handle may be about to attach anew.
constexpr milliseconds kNoProducerGrace{500};
constexpr milliseconds kWatcherIdleExit{2000};
constexpr char kWatcherThreadName[] = "dtorch-doorbell";
constexpr int kLockTimeoutS = 10;

}  // namespace

struct ProducerEntry {
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> start_time;
  std::atomic<uint32_t> state;

  // The registered process (of this pid namespace: attach refuses others).
  ProcessId Process() const { return InThisNamespace(pid.load(), start_time.load()); }
};

struct FileControlBlock {
  // Written once by the creator, before the name is known to anybody.
  uint64_t magic;
  uint32_t layout_version;
  char type_name[kTypeNameBytes];
  unsigned char nonce[kNonceBytes];
  // The consumer's choice of delivery, NUL-terminated: a producer delivers only as it chose.
  char value_options[kMaxValueOptionsBytes + 1];
  int32_t creator_pid;
  uint64_t creator_start;
  char doorbell[kNameField];
  unsigned char doorbell_nonce[kNonceBytes];

  std::atomic<uint32_t> state;    // the futex word
  std::atomic<uint32_t> waiters;  // consumer threads sleeping on `state`
  std::atomic<uint32_t> flags;
  std::atomic<int64_t> creator_dropped_ms;  // steady clock (CLOCK_MONOTONIC), for the deadline
  // Handles of the promise serialized and deserialized, in any process (wrapping counts): while
  // more were serialized than deserialized, a handle may be on its way to a process that will
  // hold it. A holder increments `deserialized` only after its entry is in the table.
  std::atomic<uint32_t> serialized;
  std::atomic<uint32_t> deserialized;
  std::atomic<uint32_t> producer_count;     // entries in use; grows only, under producers_mu
  bip::interprocess_mutex producers_mu;     // robust; guards adding producer entries
  ProducerEntry producers[kMaxProducers];

  // The completion, written by the claimant before `state` says value or error.
  uint32_t error_code;
  uint32_t detail_bytes;     // of error_text: the detail
  uint32_t traceback_bytes;  // of error_text, after the detail: the producer's traceback
  char exception_type[kMaxExceptionTypeBytes + 1];  // NUL-terminated; "" for none
  char error_text[kMaxErrorTextBytes];
  char payload[kNameField];  // the payload segment (payload_pool.h), written before it is used
  uint64_t payload_sequence;  // the value's number in that segment
  uint64_t payload_bytes;
  uint32_t header_bytes;
  char header[kMaxValueHeaderBytes];
};
static_assert(sizeof(FileControlBlock) <= kSegmentBytes);

namespace {
// The producer entry whose process claimed the pair (`state` is its state word), or null: not
// claimed, or claimed by the creator, the consumer or a lock breaker.
const ProducerEntry* ClaimingProducer(const FileControlBlock* block, uint32_t state) {
  if (Phase(state) != kClaimed || Claimant(state) >= kMaxProducers) return nullptr;
  return &block->producers[Claimant(state)];
}
}  // namespace
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
              std::atomic<uint64_t>::is_always_lock_free);

struct DoorbellBlock {
  uint64_t magic;
  unsigned char nonce[kNonceBytes];
  std::atomic<uint32_t> rings;     // the futex word: bumped by every completion
  std::atomic<uint32_t> sleeping;  // the watcher sleeps on `rings`: wake it
};
static_assert(sizeof(DoorbellBlock) <= kSegmentBytes);

namespace {

std::string ReadName(const char (&field)[kNameField]) {
  return std::string(field, strnlen(field, kNameField));
}

void WriteName(char (&field)[kNameField], const std::string& name) {
  std::memset(field, 0, kNameField);
  std::memcpy(field, name.data(), std::min(name.size(), kNameField - 1));
}

// The payload segment's name a producer wrote into the block, checked (it must be named for this
// process, the consumer: a producer's names for it are): "" when there is none or it is not.
std::string PayloadNameIn(const FileControlBlock* block) {
  const std::string name = ReadName(block->payload);
  ProcessId owner;
  if (!shm::ParseSegmentName(name, &owner) || !(owner == Self())) return {};
  return name;
}

// Whether `name` (of this process's name form, from a block a producer wrote) may be a payload
// segment: not one page, the size of this process's control segments and doorbell, which a
// corrupt name must not get unlinked. (A payload a producer died creating may be empty.)
bool MayBePayload(const std::string& name) {
  struct stat info {};
  return stat(("/dev/shm/" + name).c_str(), &info) == 0 &&
         static_cast<uint64_t>(info.st_size) != kSegmentBytes;
}

// Unlinks the payload segment the block names if it is still named (a new segment nobody has
// received); returns its name ("" when there is none, or it is corrupt).
std::string UnlinkNamedPayload(const FileControlBlock* block) {
  const std::string name = PayloadNameIn(block);
  if (!name.empty() && MayBePayload(name)) shm::Unlink(name);
  return name;
}

// The dead consumers released already. (Leaked, so that a producer thread still setting during
// the exit finds them; made anew in a forked child, where another thread may have held mu.)
struct ReleasedConsumers {
  std::mutex mu;
  std::set<std::pair<int32_t, uint64_t>> released;  // guarded by mu: (pid, start time)
};
std::atomic<ReleasedConsumers*> released_consumers{new ReleasedConsumers()};

// A producer found `consumer` dead (nullopt: at its exit): the segments this process keeps for
// dead consumers are dropped and every name a dead process of this user left in /dev/shm is
// unlinked (the pairs' control segments, payloads it never received), rather than at the next
// sweep or import. Once per dead consumer (its other pairs' sets find nothing new of it): a scan
// of /dev/shm.
void ReleaseWhatDeadConsumersLeft(const std::optional<ProcessId>& consumer) noexcept {
  if (consumer) {
    ReleasedConsumers& r = *released_consumers.load();
    try {
      std::lock_guard<std::mutex> lock(r.mu);
      if (!r.released.emplace(consumer->pid, consumer->start_time).second) return;
      if (r.released.size() > 4096) r.released.clear();  // (bounded; a repeat only scans again)
    } catch (...) {
    }
  }
  try {
    payload::Sweep(Clock::now(), [](const ProcessId& p) { return IsAlive(p); });
  } catch (...) {
    // (Out of memory: the watcher's sweep drops them.)
  }
  shm::ReapSegmentsOfDeadProcesses();
}

// The pair's producer died before publishing: what it was writing goes.
void DiscardPayloadOfDeadProducer(const FileControlBlock* block) {
  const std::string name = UnlinkNamedPayload(block);
  if (!name.empty()) payload::Discard(name);  // (one this process mapped already)
}

bool ParseHex(std::string_view hex, unsigned char* out, size_t bytes) {
  if (hex.size() != 2 * bytes) return false;
  const auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < bytes; ++i) {
    const int high = digit(hex[2 * i]), low = digit(hex[2 * i + 1]);
    if (high < 0 || low < 0) return false;
    out[i] = static_cast<unsigned char>(high * 16 + low);
  }
  return true;
}

// How many bytes of `text`'s start (end) fit in `room`, cut at a UTF-8 character boundary.
size_t Utf8Prefix(const std::string& text, size_t room) {
  size_t bytes = std::min(text.size(), room);
  if (bytes < text.size()) {
    while (bytes > 0 && (static_cast<unsigned char>(text[bytes]) & 0xc0) == 0x80) --bytes;
  }
  return bytes;
}
size_t Utf8Suffix(const std::string& text, size_t room) {
  size_t bytes = std::min(text.size(), room);
  while (bytes > 0 && (static_cast<unsigned char>(text[text.size() - bytes]) & 0xc0) == 0x80) {
    --bytes;
  }
  return bytes;
}

void Ring(DoorbellBlock* doorbell) noexcept {
  if (doorbell == nullptr) return;
  doorbell->rings.fetch_add(1);
  if (doorbell->sleeping.load() != 0) shm::FutexWakeAll(&doorbell->rings);
}

FutureError InvalidSegment(const std::string& name, const std::string& why) {
  return FutureError(FutureErrc::kInvalidHandle,
                     "/dev/shm/" + name + " is not the promise this handle names (" + why + ")");
}

// Runs the watcher while this process keeps payload segments (it releases them when idle).
void WatchKeptPayloads() noexcept;

// Drops a control segment's mapping. If this is its last reference, the munmap is left to the
// watcher's next round (the caller being, mostly, a thread that just took or set a value: an
// munmap in a process with several threads costs a TLB shootdown, 10-20 us on these VMs); done
// here when no watcher runs. Never call it holding ProcessState::mu.
void RetireMapping(std::shared_ptr<shm::Segment> segment) noexcept;

// The payload of the value published in `block` (this process being its consumer): received
// (mapped, on first receipt, and its name unlinked). Null for a value without one.
std::tuple<void*, size_t, std::shared_ptr<void>> ReceivePublished(const FileControlBlock* block) {
  const size_t payload_bytes = block->payload_bytes;
  if (payload_bytes == 0) return {nullptr, 0, nullptr};
  const std::string name = PayloadNameIn(block);
  if (name.empty()) {
    throw FutureError(FutureErrc::kInvalidHandle, "the published payload's name is corrupt");
  }
  auto received = payload::Receive(name, block->payload_sequence, payload_bytes);
  WatchKeptPayloads();
  return {received.data, payload_bytes, std::move(received.keep_alive)};
}

// ---------------------------------------------------------------------------------------------
// Completing: what the creator's handle and a producer's attachment share.

class ChannelBase : public FileChannel {
 public:
  // `doorbell`: the consumer's, or null until SetDoorbell (a producer maps it at its first claim).
  ChannelBase(std::shared_ptr<shm::Segment> control, uint32_t claimant,
              std::shared_ptr<shm::Segment> doorbell)
      : control_(std::move(control)), claimant_(claimant) {
    SetDoorbell(std::move(doorbell));
  }
  ~ChannelBase() override { RetireMapping(std::move(control_)); }

  void CountSerialized() noexcept override { block()->serialized.fetch_add(1); }
  void CountDeserialized() noexcept override { block()->deserialized.fetch_add(1); }

  ClaimOutcome TryClaim() override {
    uint32_t state = State(kPending, 0);
    if (block()->state.compare_exchange_strong(state, State(kClaimed, claimant_))) {
      return ClaimOutcome::kClaimed;
    }
    // Producers and the creator complete pairs; the consumer and a lock breaker only fail them
    // (or, the consumer, close them when the pair is dropped).
    const uint32_t claimant = Claimant(state);
    if (claimant == kConsumerClaimant && (block()->flags.load() & kConsumerGone)) {
      return ClaimOutcome::kPairGone;
    }
    return claimant == kConsumerClaimant || claimant == kLockBreakerClaimant
               ? ClaimOutcome::kFailedByConsumer
               : ClaimOutcome::kClaimedByAnother;
  }

  void PublishValue(const std::string& header, size_t payload_bytes,
                    const std::function<void(void*)>& write,
                    std::shared_ptr<void> keep) override {
    auto* b = block();
    if (b->state.load() != State(kClaimed, claimant_)) return;  // broken meanwhile: no payload
    const auto fail = [&](const FutureError& error) {
      PublishError({error.code(), error.detail()});
      return error;
    };
    if (header.size() > kMaxValueHeaderBytes) {
      throw fail(FutureError(FutureErrc::kInvalidHandle, "the value's header does not fit"));
    }
    const ProcessId consumer = InThisNamespace(b->creator_pid, b->creator_start);
    // (Its own pairs: no /proc read. Another's: one before the payload is made, one after.)
    const bool elsewhere = !(consumer == Self());
    if (payload_bytes > 0 && elsewhere && !IsAlive(consumer)) {
      // Nobody will read it: nothing is made for a dead consumer (a SIGKILLed controller's
      // workers would fill /dev/shm), and what it left goes now. The pair ends as broken.
      ReleaseWhatDeadConsumersLeft(consumer);
      PublishError({FutureErrc::kBrokenPromise, "the consumer (pid " +
                                                    std::to_string(consumer.pid) +
                                                    ") died before the value was set"});
      return;
    }
    std::unique_ptr<payload::Lease> lease;
    if (payload_bytes > 0) {
      try {
        // The name goes into the block before a new segment exists: if this process dies
        // before publishing, the consumer unlinks it.
        lease = payload::Acquire(InThisNamespace(b->creator_pid, b->creator_start),
                                 payload_bytes,
                                 [&](const std::string& name) { WriteName(b->payload, name); });
        WriteName(b->payload, lease->name());
        write(lease->data());
      } catch (const FutureError& e) {
        throw fail(e);
      } catch (const std::exception& e) {
        fail(FutureError(FutureErrc::kProducerError,
                         std::string("writing the value failed: ") + e.what()));
        throw;
      }
      b->payload_sequence = lease->sequence();
      lease->MarkPublished();
      try {
        lease->HoldUntilReleased(std::move(keep));
      } catch (const std::exception& e) {  // (no memory to note it: nothing is published)
        lease->Withdraw();
        fail(FutureError(FutureErrc::kProducerError,
                         std::string("publishing the value failed: ") + e.what()));
        throw;
      }
    }
    b->payload_bytes = payload_bytes;
    b->header_bytes = static_cast<uint32_t>(header.size());
    std::memcpy(b->header, header.data(), header.size());
    // Not published (the consumer broke the pair meanwhile) or the pair went away: nobody will
    // receive the payload. (Dekker with the consumer's destructor, which sets kConsumerGone and
    // then receives what was published; the lease settles the race. A consumer that died is
    // the watcher's: payload::Sweep.)
    const bool published = Finish(kValue);
    // (And one that died while the value was written: its segment goes before the set returns.)
    const bool consumer_died = lease && elsewhere && !IsAlive(consumer);
    if (lease && (!published || consumer_died || (b->flags.load() & kConsumerGone))) {
      lease->Withdraw();
    }
    if (consumer_died) ReleaseWhatDeadConsumersLeft(consumer);
    if (lease) WatchKeptPayloads();
  }

  void PublishError(const ErrorInfo& error) noexcept override {
    auto* b = block();
    if (b->state.load() != State(kClaimed, claimant_)) return;  // broken meanwhile: its detail stays
    b->error_code = static_cast<uint32_t>(error.code);
    // The detail first, then the traceback's end (its most recent calls), each cut at a UTF-8
    // character boundary.
    const size_t detail = Utf8Prefix(error.detail, kMaxErrorTextBytes);
    std::memcpy(b->error_text, error.detail.data(), detail);
    const size_t traceback = Utf8Suffix(error.origin.traceback, kMaxErrorTextBytes - detail);
    std::memcpy(b->error_text + detail,
                error.origin.traceback.data() + error.origin.traceback.size() - traceback,
                traceback);
    b->detail_bytes = static_cast<uint32_t>(detail);
    b->traceback_bytes = static_cast<uint32_t>(traceback);
    std::memset(b->exception_type, 0, sizeof(b->exception_type));
    if (ValidExceptionType(error.origin.exception_type)) {
      std::memcpy(b->exception_type, error.origin.exception_type.data(),
                  error.origin.exception_type.size());
    }
    Finish(kError);
  }

 protected:
  FileControlBlock* block() const { return static_cast<FileControlBlock*>(control_->data()); }
  // The doorbell to ring (null: none known yet).
  DoorbellBlock* doorbell() const { return doorbell_block_.load(std::memory_order_acquire); }
  // Sets the doorbell, once (a later call changes nothing).
  void SetDoorbell(std::shared_ptr<shm::Segment> segment) {
    if (!segment) return;
    std::lock_guard<std::mutex> lock(doorbell_mu_);
    if (doorbell_) return;
    doorbell_ = std::move(segment);
    doorbell_block_.store(static_cast<DoorbellBlock*>(doorbell_->data()),
                          std::memory_order_release);
  }

 private:
  // Publishes the completion this channel claimed; false (nothing changes) if the pair is no
  // longer claimed by it: the consumer broke it meanwhile.
  bool Finish(uint32_t phase) noexcept {
    auto* b = block();
    uint32_t claimed = State(kClaimed, claimant_);
    // seq_cst: pairs with the waiters' count.
    if (!b->state.compare_exchange_strong(claimed, State(phase, claimant_))) return false;
    if (b->waiters.load() != 0) shm::FutexWakeAll(&b->state);
    if (b->flags.load() & kWantsRing) Ring(doorbell());  // (the watcher checks the rest)
    return true;
  }

  std::shared_ptr<shm::Segment> control_;  // (moved out only by the destructor)
  const uint32_t claimant_;
  std::mutex doorbell_mu_;
  std::shared_ptr<shm::Segment> doorbell_;  // guarded by doorbell_mu_: set once, then kept
  std::atomic<DoorbellBlock*> doorbell_block_{nullptr};  // doorbell_'s block, for lock-free rings
};

// The creator's own handle's channel: an error it publishes keeps its exception object for the
// consumer of this same process (the block carries only its type and traceback).
class CreatorsChannel final : public ChannelBase {
 public:
  CreatorsChannel(std::shared_ptr<shm::Segment> control, std::shared_ptr<shm::Segment> doorbell,
                 std::function<void(std::shared_ptr<const NativeError>)> keep_native)
      : ChannelBase(std::move(control), kCreatorClaimant, std::move(doorbell)),
        keep_native_(std::move(keep_native)) {}

  void PublishError(const ErrorInfo& error) noexcept override {
    if (error.origin.native) {
      try {
        keep_native_(error.origin.native);
      } catch (...) {  // (out of memory: the consumer raises the type and message instead)
      }
    }
    ChannelBase::PublishError(error);
  }

 private:
  const std::function<void(std::shared_ptr<const NativeError>)> keep_native_;
};

// The doorbell of the consumer whose control block this is, mapped for a producer of this
// process (shared by its attachments). Null when it is gone (nobody needs a ring then). Throws
// FutureError(kInvalidHandle) for a corrupt one.
std::shared_ptr<shm::Segment> ConsumerDoorbellOf(const std::string& segment,
                                                 const FileControlBlock* block);

// A channel of a process that is not the consumer's own handle: it maps the consumer's doorbell
// at its first claim, so that a process that only holds the promise maps nothing more and
// starts no thread (the watcher that releases mapped doorbells).
class ClaimingChannel : public ChannelBase {
 public:
  ClaimingChannel(std::shared_ptr<shm::Segment> control, uint32_t claimant, std::string segment)
      : ChannelBase(std::move(control), claimant, nullptr), segment_(std::move(segment)) {}

  ClaimOutcome TryClaim() override {
    if (doorbell() == nullptr) SetDoorbell(ConsumerDoorbellOf(segment_, block()));
    return ChannelBase::TryClaim();
  }

 private:
  const std::string segment_;
};

// A handle deserialized in the pair's creator process, there: it completes the pair as the
// creator's own handle does (no entry in the producer table: the creator's copies are no
// holders).
class CopyInCreatorChannel final : public ClaimingChannel {
 public:
  CopyInCreatorChannel(std::shared_ptr<shm::Segment> control, std::string segment)
      : ClaimingChannel(std::move(control), kCreatorClaimant, std::move(segment)) {}
};

bool IsCreatorProcess(const FileControlBlock* block) {
  const auto self = Self();
  return block->creator_pid == self.pid && block->creator_start == self.start_time;
}

// A producer process's attachment: its entry in the producer table.
class ProducerAttachment final : public ClaimingChannel {
 public:
  ProducerAttachment(std::shared_ptr<shm::Segment> control, std::string segment, uint32_t slot)
      : ClaimingChannel(std::move(control), slot, std::move(segment)),
        slot_(slot),
        pid_(CurrentPid()) {}

  ~ProducerAttachment() override { Leave(kDropped); }

  const FileControlBlock* control_block() const { return block(); }

  // This process no longer produces: its handles are gone (kDropped) or it exits (kExited).
  void Leave(uint32_t why) noexcept {
    if (CurrentPid() != pid_) return;  // a forked child's copy: the entry is the parent's
    uint32_t attached = kAttached;
    if (block()->producers[slot_].state.compare_exchange_strong(attached, why) &&
        !IsDone(block()->state.load())) {
      // (The pair may have lost its last producer: tell the watcher now. A holder that never
      // claimed knows no doorbell: the watcher's liveness round finds it.)
      Ring(doorbell());
    }
  }

 private:
  const uint32_t slot_;
  const int32_t pid_;
};

// ---------------------------------------------------------------------------------------------
// The process-wide parts: the doorbell watcher and the producer attachments.

class ConsumerImpl;
// Forks of this process (counted in the parent): a pair created before one may have reached the
// child without being serialized.
std::atomic<uint64_t> forks_in_parent{0};

// A pair whose consumer is gone while a producer may still be writing its payload: settled once
// the producer finished (it withdraws the payload itself) or died (its payload, named for this
// live process, would not be reaped: unlinked here).
struct OrphanPayload {
  std::shared_ptr<shm::Segment> control;
};

struct ProcessState {
  std::mutex mu;
  std::condition_variable watcher_exited;
  // Everything below is guarded by mu.
  std::vector<std::weak_ptr<ConsumerImpl>> consumers;  // this process's pending pairs
  std::vector<OrphanPayload> orphans;
  std::shared_ptr<shm::Segment> doorbell;              // this process's doorbell (made on demand)
  std::string doorbell_name;
  bool watcher_running = false;
  bool stopping = false;
  // Wakes a watcher that has no doorbell (the process keeps payloads but has no pending pair).
  std::atomic<uint32_t> wake{0};
  // Control segments to unmap on the watcher's next round (RetireMapping).
  std::vector<std::shared_ptr<shm::Segment>> retired_mappings;
  // This process's producer attachments, by control segment.
  std::map<std::string, std::weak_ptr<ProducerAttachment>> attachments;
  size_t attachments_after_sweep = 0;
  // Consumers' doorbells mapped here as a producer, by name: kept while used and for the
  // payload idle time after (a producer serving one promise after another would map and unmap
  // its consumer's doorbell for each).
  struct MappedDoorbell {
    std::shared_ptr<shm::Segment> segment;
    Clock::time_point last_used;
  };
  std::map<std::string, MappedDoorbell> doorbells;
};

// Replaced (the old one leaked) in a fork child: its mutex may be held by a thread of the parent.
ProcessState* process_state = new ProcessState();

void EnsureWatcherLocked(ProcessState& state);
void ReleaseDoorbellLocked(ProcessState& state);
std::vector<std::shared_ptr<ConsumerImpl>> LiveConsumersLocked(ProcessState& state);
void CheckOrphanPayloads(ProcessState& state,
                         const std::function<bool(const ProcessId&)>& alive);
void AdoptOrphanPayload(std::shared_ptr<shm::Segment> control);

DoorbellBlock* AsDoorbell(const std::shared_ptr<shm::Segment>& segment) {
  return static_cast<DoorbellBlock*>(segment->data());
}

// This process's doorbell, made on first use.
std::shared_ptr<shm::Segment> OwnDoorbellLocked(ProcessState& state) {
  if (!state.doorbell) {
    auto name = shm::NewSegmentName(Self());
    std::shared_ptr<shm::Segment> segment = shm::Segment::Create(name, kSegmentBytes);
    auto* block = new (segment->data()) DoorbellBlock();
    RandomBytes(block->nonce, kNonceBytes);
    block->magic = kDoorbellMagic;
    state.doorbell = std::move(segment);
    state.doorbell_name = std::move(name);
  }
  return state.doorbell;
}

// ---------------------------------------------------------------------------------------------
// The consumer.

class ConsumerImpl final : public FileConsumer {
 public:
  ConsumerImpl(std::shared_ptr<shm::Segment> control, FileHandle handle,
               std::shared_ptr<shm::Segment> doorbell)
      : control_(std::move(control)),
        handle_(std::move(handle)),
        doorbell_(std::move(doorbell)),
        creator_pid_(CurrentPid()),
        forks_at_creation_(forks_in_parent.load()) {}

  ~ConsumerImpl() override {
    if (InCreatorProcess()) Close();  // (else a forked child's copy: the pair is the parent's)
    RetireMapping(std::move(control_));
  }

  bool Pending() const { return !IsDone(block()->state.load()); }

  const FileHandle& handle() const override { return handle_; }
  bool InCreatorProcess() const override { return CurrentPid() == creator_pid_; }

  std::shared_ptr<FileChannel> CreatorChannel() override {
    return std::make_shared<CreatorsChannel>(
        control_, doorbell_, [native = native_error_](std::shared_ptr<const NativeError> error) {
          std::lock_guard<std::mutex> lock(native->mu);
          native->error = std::move(error);
        });
  }

  void MarkLeftProcess() override {
    block()->flags.fetch_or(kLeftProcess);
    CountSerialized();
  }
  void CountSerialized() noexcept override { block()->serialized.fetch_add(1); }

  void CreatorDropped() override {
    auto* b = block();
    if (IsDone(b->state.load())) return;
    const bool left = (b->flags.load() & kLeftProcess) || forks_in_parent != forks_at_creation_;
    if (!left) {
      Break(b->state.load(), FutureErrc::kBrokenPromise,
            "the promise was destroyed before a value or an exception was set");
      return;
    }
    b->creator_dropped_ms = NowMs();
    b->flags.fetch_or(kCreatorDropped);
  }

  bool RetrieveFuture() override { return !future_retrieved_.exchange(true); }

  bool WaitUntil(Deadline deadline) const override {
    CheckUsable();
    auto* b = block();
    for (;;) {
      uint32_t state = b->state.load();
      if (IsDone(state)) {
        NotifyReady();
        return true;
      }
      const auto now = Clock::now();
      if (now >= deadline) return false;
      b->waiters.fetch_add(1);
      state = b->state.load();  // after counting ourselves: the producer then sees the count
      if (!IsDone(state)) {
        // Slices: deadlines far away, and a producer that died without waking us (the
        // watcher's check breaks the pair and wakes us then).
        shm::FutexWait(&b->state, state, std::min<Clock::duration>(deadline - now, kLivenessPeriod));
      }
      b->waiters.fetch_sub(1);
    }
  }

  bool IsReady() const override {
    if (!InCreatorProcess()) return true;  // get() raises at once there
    std::lock_guard<std::mutex> lock(mu_);
    return retrieved_ || IsDone(block()->state.load());  // (taken: complete)
  }

  bool Valid() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return !retrieved_;
  }

  void OnReady(std::function<void()> callback) override {
    if (!InCreatorProcess()) {  // no watcher here serves the pair: get() raises at once
      callback();
      return;
    }
    has_callbacks_ = true;
    block()->flags.fetch_or(kWantsRing);  // (seq_cst: a producer finishing now sees it, or we
                                          // see its completion below)
    ready_->OnReady(std::move(callback));
    if (IsDone(block()->state.load())) NotifyReady();
  }

  PublishedValue Take() override {
    WaitUntil(Deadline::max());
    {
      std::lock_guard<std::mutex> lock(mu_);
      ThrowIfRetrievedLocked();
      retrieved_ = true;
    }
    auto* b = block();
    const uint32_t state = b->state.load();
    if (Phase(state) == kError) {
      const ErrorInfo error = ReadError();
      UnlinkAll();
      throw error.ToException();
    }
    PublishedValue value;
    const size_t header_bytes = b->header_bytes;
    if (header_bytes > kMaxValueHeaderBytes) {
      UnlinkAll();
      throw FutureError(FutureErrc::kInvalidHandle, "the published value's header is corrupt");
    }
    value.header.assign(b->header, header_bytes);
    try {
      std::tie(value.payload, value.payload_bytes, value.keep_alive) = ReceivePublished(b);
    } catch (...) {
      UnlinkAll();
      throw;
    }
    UnlinkAll();  // (after receiving: a producer that sees kConsumerGone then withdraws nothing)
    return value;
  }

  // ---- for the watcher ----

  bool HasCallbacks() const { return has_callbacks_; }

  // Whether the pair is complete (it then leaves the watcher); breaks it when its producers are
  // gone. `alive` memoizes process liveness for one round.
  bool Check(Clock::time_point now, bool liveness,
             const std::function<bool(const ProcessId&)>& alive) {
    auto* b = block();
    const uint32_t state = b->state.load();
    if (IsDone(state)) {
      NotifyReady();
      return true;
    }
    if (!liveness) return false;
    if (const auto* claimer = ClaimingProducer(b, state)) {
      const auto producer = claimer->Process();
      if (!alive(producer)) {
        Break(state, FutureErrc::kBrokenPromise,
              "producer died (pid " + std::to_string(producer.pid) + ") while setting the value");
      }
      return false;
    }
    if (Phase(state) != kPending) return false;
    // The counts first, then the table: a holder is in the table before it counts its
    // deserialization, so a handle that reached a process is seen in one or the other.
    const uint32_t serialized = b->serialized.load();
    const uint32_t deserialized = b->deserialized.load();
    const bool in_flight = static_cast<int32_t>(serialized - deserialized) > 0;
    const uint32_t count = std::min(b->producer_count.load(std::memory_order_acquire),
                                    kMaxProducers);
    if (count > 0) {
      int32_t died = 0, exited = 0, dropped = 0;
      for (uint32_t i = 0; i < count; ++i) {
        auto& entry = b->producers[i];
        const uint32_t entry_state = entry.state.load();
        const auto producer = entry.Process();
        // "Exited" is said at exit, when threads of the process may still set the value
        // (multiprocessing runs its finalizers before it joins them): live until it is gone.
        if (entry_state == kAttached || entry_state == kExited) {
          if (alive(producer)) {
            no_producer_since_.reset();
            return false;
          }
          if (entry_state == kAttached && died == 0) died = producer.pid;
          if (entry_state == kExited && exited == 0) exited = producer.pid;
        } else if (entry_state == kDropped && dropped == 0) {
          dropped = producer.pid;
        }
      }
      if (!no_producer_since_) no_producer_since_ = now;
      if (in_flight) {
        // A holder passed the promise on (serialized it) before it went, and it has not arrived
        // yet: the attach deadline is the backstop for a handle that never will.
        if (now - *no_producer_since_ < milliseconds(AttachTimeoutMs())) return false;
        Break(state, FutureErrc::kBrokenPromise,
              "no producer attached within " + std::to_string(AttachTimeoutMs()) +
                  " ms after the last process holding the promise was gone, and " +
                  std::to_string(serialized - deserialized) + " serialized handle(s) of it " +
                  "were never deserialized (config.attach_timeout_s)");
        return false;
      }
      if (now - *no_producer_since_ < kNoProducerGrace) return false;
      std::string why =
          died != 0 ? "producer died (pid " + std::to_string(died) + ") without setting a value"
          : exited != 0
              ? "producer exited (pid " + std::to_string(exited) + ") without setting a value"
              : "producer dropped the promise (pid " + std::to_string(dropped) +
                    ") without setting a value";
      Break(state, FutureErrc::kBrokenPromise, why);
      return false;
    }
    const int64_t dropped_ms = b->creator_dropped_ms.load();  // written here only; checked anyway
    const int64_t now_ms = NowMs();
    if ((b->flags.load() & kCreatorDropped) && dropped_ms <= now_ms &&
        now_ms - dropped_ms >= AttachTimeoutMs()) {
      Break(state, FutureErrc::kBrokenPromise,
            "no producer attached within " + std::to_string(AttachTimeoutMs()) +
                " ms after the creator dropped its promise (config.attach_timeout_s)");
    }
    return false;
  }

  // At exit: a value still pending fails its waiters (as device values do), and nothing is
  // left behind; producers that come later find the pair gone.
  void StopAtExit() {
    if (!InCreatorProcess()) return;
    const uint32_t state = block()->state.load();
    if (!IsDone(state)) {
      Break(state, FutureErrc::kDroppedAtExit,
            "the value was still pending when dtorch_ops stopped at process exit; wait for it "
            "before the program exits, or in an atexit handler registered after dtorch_ops was "
            "imported (those run before the library stops)");
    } else if (Phase(state) == kValue) {
      bool taken;
      {
        std::lock_guard<std::mutex> lock(mu_);
        taken = retrieved_;
      }
      if (!taken) UnlinkNamedPayload(block());
    }
    UnlinkAll();
  }

 private:
  FileControlBlock* block() const { return static_cast<FileControlBlock*>(control_->data()); }

  void CheckUsable() const {
    if (!InCreatorProcess()) {
      throw FutureError(FutureErrc::kCannotLeaveProcess,
                        "a file future belongs to the process that created its pair; this is a "
                        "forked child of it. Create the pair in this process instead");
    }
    std::lock_guard<std::mutex> lock(mu_);
    ThrowIfRetrievedLocked();
  }

  void ThrowIfRetrievedLocked() const {
    if (retrieved_) {
      throw FutureError(FutureErrc::kNoState,
                        "get() was already called on this future; a future yields its value once");
    }
  }

  void NotifyReady() const { ready_->TryComplete(Result<Unit>::Value({})); }

  // The pair's handles are gone: nothing more happens to it.
  void Close() {
    UnlinkAll();  // sets kConsumerGone first
    // Closed: a producer that attached already claims nothing now (and makes no payload).
    uint32_t state = State(kPending, 0);
    if (block()->state.compare_exchange_strong(state, State(kClaimed, kConsumerClaimant))) return;
    if (ClaimingProducer(block(), state)) {
      AdoptOrphanPayload(control_);  // a producer is writing it now
    } else if (Phase(state) == kValue && !retrieved_) {
      // Published, never taken: received and dropped, so that its segment is free again.
      try {
        ReceivePublished(block());
      } catch (...) {
      }
    }
  }

  // The published error (written by a producer: checked). Its exception object, when the
  // creator's own handle set it in this process (the block carries its type and traceback only).
  ErrorInfo ReadError() const {
    auto* b = block();
    const uint32_t code = b->error_code;
    const size_t detail = std::min<size_t>(b->detail_bytes, kMaxErrorTextBytes);
    const size_t traceback = std::min<size_t>(b->traceback_bytes, kMaxErrorTextBytes - detail);
    ErrorInfo error{static_cast<FutureErrc>(code), std::string(b->error_text, detail)};
    if (code > static_cast<uint32_t>(kLastFutureErrc)) {
      return {FutureErrc::kInvalidHandle, "the published error is corrupt"};
    }
    error.origin.exception_type.assign(
        b->exception_type, strnlen(b->exception_type, sizeof(b->exception_type)));
    if (!ValidExceptionType(error.origin.exception_type)) error.origin.exception_type.clear();
    error.origin.traceback.assign(b->error_text + detail, traceback);
    if (Claimant(b->state.load()) == kCreatorClaimant) {
      std::lock_guard<std::mutex> lock(native_error_->mu);
      error.origin.native = native_error_->error;
    }
    return error;
  }

  // Completes the pair with an error from here, unless it moved on from `expected` meanwhile.
  void Break(uint32_t expected, FutureErrc code, const std::string& detail) {
    auto* b = block();
    if (!b->state.compare_exchange_strong(expected, State(kClaimed, kConsumerClaimant))) return;
    if (Phase(expected) == kClaimed) DiscardPayloadOfDeadProducer(b);
    ChannelBase(control_, kConsumerClaimant, doorbell_).PublishError({code, detail});
    NotifyReady();
  }

  // Once the value is taken (or can no longer be): the control segment goes. A producer still
  // publishing sees kConsumerGone afterwards and withdraws its payload itself.
  void UnlinkAll() {
    if (unlinked_.exchange(true)) return;
    block()->flags.fetch_or(kConsumerGone);
    shm::Unlink(handle_.segment);
  }

  std::shared_ptr<shm::Segment> control_;  // (moved out only by the destructor)
  const FileHandle handle_;
  const std::shared_ptr<shm::Segment> doorbell_;
  const int32_t creator_pid_;
  const uint64_t forks_at_creation_;
  const std::shared_ptr<SharedState<Unit>> ready_ = std::make_shared<SharedState<Unit>>();
  // The exception object the creator's own handle set (CreatorsChannel), raised as it is here.
  struct NativeSlot {
    std::mutex mu;
    std::shared_ptr<const NativeError> error;  // guarded by mu
  };
  const std::shared_ptr<NativeSlot> native_error_ = std::make_shared<NativeSlot>();
  std::atomic<bool> future_retrieved_{false};
  std::atomic<bool> unlinked_{false};
  std::atomic<bool> has_callbacks_{false};
  mutable std::mutex mu_;
  bool retrieved_ = false;  // guarded by mu_
  std::optional<Clock::time_point> no_producer_since_;  // the watcher's only
};

// ---------------------------------------------------------------------------------------------
// The watcher: one thread per process while it has pending pairs (it serves their callbacks and
// checks their producers' liveness) or keeps payload segments (it releases idle ones).

void RunWatcher(ProcessState* state) {
  auto next_liveness = Clock::now();
  auto idle_since = Clock::now();
  std::map<int32_t, std::pair<ProcessId, bool>> liveness;
  for (;;) {
    std::shared_ptr<shm::Segment> doorbell_segment;
    std::vector<std::shared_ptr<ConsumerImpl>> consumers;
    std::vector<std::shared_ptr<shm::Segment>> unmapped_doorbells;  // (outside mu)
    std::vector<std::shared_ptr<shm::Segment>> retired;                // (outside mu)
    uint32_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->stopping) break;
      retired.swap(state->retired_mappings);
      doorbell_segment = state->doorbell;
      // Read before the pairs are checked: a ring after this is not missed.
      seen = doorbell_segment ? AsDoorbell(doorbell_segment)->rings.load() : state->wake.load();
      consumers = LiveConsumersLocked(*state);
      const auto now = Clock::now();
      // Consumers' doorbells no attachment here has used for the idle time: unmapped.
      const auto keep = milliseconds(payload::IdleMs());
      for (auto it = state->doorbells.begin(); it != state->doorbells.end();) {
        const bool unused = it->second.segment.use_count() == 1 &&
                            now - it->second.last_used >= keep;
        if (unused) unmapped_doorbells.push_back(std::move(it->second.segment));
        it = unused ? state->doorbells.erase(it) : std::next(it);
      }
      if (consumers.empty() && state->orphans.empty()) {
        if (now - idle_since >= kWatcherIdleExit) {
          // No pair of this process is pending: the doorbell goes (made again on demand), so
          // that nothing of a process that exits without the library's exit handler (a fork
          // child ending in os._exit) outlives it but what it still held.
          ReleaseDoorbellLocked(*state);
          doorbell_segment.reset();
          // (Asked now, under mu: a segment kept since the last sweep must not be missed.)
          if (!payload::AnyKept() && state->doorbells.empty()) {
            state->watcher_running = false;
            state->watcher_exited.notify_all();
            return;
          }
        }
      } else {
        idle_since = now;
      }
    }
    const auto now = Clock::now();
    const bool check_liveness = now >= next_liveness;
    if (check_liveness) {
      next_liveness = now + kLivenessPeriod;
      liveness.clear();
    }
    const auto alive = [&](const ProcessId& process) {
      auto it = liveness.find(process.pid);
      if (it == liveness.end() || !(it->second.first == process)) {
        it = liveness.insert_or_assign(process.pid, std::make_pair(process, IsAlive(process)))
                 .first;
      }
      return it->second.second;
    };
    std::vector<std::shared_ptr<ConsumerImpl>> done;
    try {
      for (auto& consumer : consumers) {
        if (!check_liveness && !consumer->HasCallbacks()) continue;
        if (consumer->Check(now, check_liveness, alive)) done.push_back(consumer);
      }
      if (check_liveness) {
        CheckOrphanPayloads(*state, alive);
        payload::Sweep(now, alive);
      }
    } catch (...) {
      // (Out of memory, say.) The next round checks again; the watcher must not die.
    }
    if (!done.empty()) {
      std::lock_guard<std::mutex> lock(state->mu);
      auto& list = state->consumers;
      // (Compared without locking the weak pointers: a shared_ptr made here could be the last
      // one, and its destructor takes mu.)
      list.erase(std::remove_if(list.begin(), list.end(),
                                [&](const std::weak_ptr<ConsumerImpl>& weak) {
                                  return weak.expired() ||
                                         std::any_of(done.begin(), done.end(), [&](auto& d) {
                                           return !weak.owner_before(d) && !d.owner_before(weak);
                                         });
                                }),
                 list.end());
    }
    consumers.clear();  // outside mu: a last reference may unlink segments
    done.clear();
    retired.clear();  // (unmapped now, not after the sleep)
    unmapped_doorbells.clear();
    const auto sleep = std::max<Clock::duration>(next_liveness - Clock::now(), milliseconds(1));
    if (doorbell_segment) {
      auto* doorbell = AsDoorbell(doorbell_segment);
      doorbell->sleeping.store(1);
      if (doorbell->rings.load() == seen) shm::FutexWait(&doorbell->rings, seen, sleep);
      doorbell->sleeping.store(0);
    } else {
      shm::FutexWait(&state->wake, seen, sleep);
    }
  }
  std::lock_guard<std::mutex> lock(state->mu);
  state->watcher_running = false;
  state->watcher_exited.notify_all();
}

void RetireMapping(std::shared_ptr<shm::Segment> segment) noexcept {
  if (!segment || segment.use_count() > 1) return;  // (mapped for others still)
  ProcessState& state = *process_state;
  std::unique_lock<std::mutex> lock(state.mu);
  if (state.watcher_running && !state.stopping && state.retired_mappings.size() < 256) {
    try {
      state.retired_mappings.push_back(std::move(segment));
    } catch (...) {  // (out of memory: unmapped here)
      lock.unlock();
      segment.reset();
      return;
    }
    // A batch: the watcher unmaps it now rather than at its next liveness round.
    if (state.retired_mappings.size() == 64) {
      if (state.doorbell) Ring(AsDoorbell(state.doorbell));
      state.wake.fetch_add(1);
      shm::FutexWakeAll(&state.wake);
    }
    return;
  }
  lock.unlock();
  segment.reset();
}

void WatchKeptPayloads() noexcept {
  ProcessState& state = *process_state;
  std::lock_guard<std::mutex> lock(state.mu);
  try {
    if (!state.watcher_running && payload::AnyKept()) EnsureWatcherLocked(state);
  } catch (...) {
    // No thread now (std::system_error): the next value tries again; until then, idle segments
    // stay mapped.
  }
}

// The consumers still alive (the list forgets the others). Destroy the result outside mu: it may
// hold the last reference to one, whose destructor takes mu.
std::vector<std::shared_ptr<ConsumerImpl>> LiveConsumersLocked(ProcessState& state) {
  std::vector<std::shared_ptr<ConsumerImpl>> live;
  live.reserve(state.consumers.size());
  auto& list = state.consumers;
  list.erase(std::remove_if(list.begin(), list.end(),
                            [&](const std::weak_ptr<ConsumerImpl>& weak) {
                              auto consumer = weak.lock();
                              if (!consumer) return true;
                              live.push_back(std::move(consumer));
                              return false;
                            }),
             list.end());
  return live;
}

void ReleaseDoorbellLocked(ProcessState& state) {
  if (!state.doorbell) return;
  shm::Unlink(state.doorbell_name);
  state.doorbell.reset();
}

void AdoptOrphanPayload(std::shared_ptr<shm::Segment> control) {
  ProcessState& state = *process_state;
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.stopping) {
    DiscardPayloadOfDeadProducer(static_cast<FileControlBlock*>(control->data()));
    return;
  }
  state.orphans.push_back({std::move(control)});
  EnsureWatcherLocked(state);
}

void CheckOrphanPayloads(ProcessState& state,
                         const std::function<bool(const ProcessId&)>& alive) {
  std::vector<OrphanPayload> orphans;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    orphans.swap(state.orphans);
  }
  std::vector<OrphanPayload> still_writing;
  for (auto& orphan : orphans) {
    auto* b = static_cast<FileControlBlock*>(orphan.control->data());
    const auto* claimer = ClaimingProducer(b, b->state.load());
    if (claimer && alive(claimer->Process())) {
      still_writing.push_back(std::move(orphan));
      continue;
    }
    // Died writing; or finished, and withdrew its payload, unless it died before it could: a
    // value nobody will take is received and dropped (a no-op if it was withdrawn).
    const uint32_t phase = Phase(b->state.load());
    if (phase == kClaimed) DiscardPayloadOfDeadProducer(b);
    if (phase == kValue) {
      try {
        ReceivePublished(b);
      } catch (...) {
      }
    }
  }
  std::lock_guard<std::mutex> lock(state.mu);
  for (auto& orphan : still_writing) state.orphans.push_back(std::move(orphan));
}

void EnsureWatcherLocked(ProcessState& state) {
  if (state.watcher_running || state.stopping) return;
  std::thread thread([s = &state] { RunWatcher(s); });
  pthread_setname_np(thread.native_handle(), kWatcherThreadName);
  thread.detach();
  state.watcher_running = true;
}

std::shared_ptr<shm::Segment> ProducerDoorbell(ProcessState& state, const std::string& name,
                                               const unsigned char* nonce) {
  std::shared_ptr<shm::Segment> segment;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    const auto it = state.doorbells.find(name);
    if (it != state.doorbells.end()) {
      it->second.last_used = Clock::now();
      segment = it->second.segment;
    }
  }
  if (!segment) {
    // Gone: the consumer has no pending pair (its watcher went idle) or it exited; this pair is
    // then complete or its consumer gone, and nobody needs the ring.
    segment = shm::Segment::Open(name, kSegmentBytes);
    if (!segment) return nullptr;
    std::lock_guard<std::mutex> lock(state.mu);
    state.doorbells[name] = {segment, Clock::now()};
    EnsureWatcherLocked(state);  // (it releases the mapping when unused)
  }
  const auto* block = AsDoorbell(segment);
  if (block->magic != kDoorbellMagic || std::memcmp(block->nonce, nonce, kNonceBytes) != 0) {
    throw InvalidSegment(name, "not the consumer's doorbell");
  }
  return segment;
}

std::shared_ptr<shm::Segment> ConsumerDoorbellOf(const std::string& segment,
                                                 const FileControlBlock* block) {
  const std::string name = ReadName(block->doorbell);
  if (!shm::ParseSegmentName(name)) throw InvalidSegment(segment, "its doorbell's name is corrupt");
  return ProducerDoorbell(*process_state, name, block->doorbell_nonce);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

static bool ValidValueOptions(std::string_view options) {
  return options.size() <= kMaxValueOptionsBytes &&
         std::all_of(options.begin(), options.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '=';
         });
}

std::string FileHandle::Serialize() const {
  std::string serialized = SerializedPrefix(kFileKind) + type_name + ":" + segment + ":" + nonce_hex;
  if (!value_options.empty()) serialized += ":" + value_options;
  return serialized;
}

FileHandle FileHandle::Parse(std::string_view rest, std::string_view expected_type) {
  const auto bad = [](const std::string& why) {
    return FutureError(FutureErrc::kInvalidHandle,
                       "a serialized file promise " + why + "; pass the string from serialize()");
  };
  FileHandle handle;
  const auto first = rest.find(':');
  const auto second = first == std::string_view::npos ? first : rest.find(':', first + 1);
  const auto third = second == std::string_view::npos ? second : rest.find(':', second + 1);
  if (second == std::string_view::npos ||
      (third != std::string_view::npos && rest.find(':', third + 1) != std::string_view::npos)) {
    throw bad("has the wrong number of fields (expected <type>:<segment>:<nonce>[:<options>])");
  }
  handle.type_name = std::string(rest.substr(0, first));
  handle.segment = std::string(rest.substr(first + 1, second - first - 1));
  handle.nonce_hex = std::string(rest.substr(second + 1, third - second - 1));
  if (third != std::string_view::npos) {
    handle.value_options = std::string(rest.substr(third + 1));
    if (handle.value_options.empty() || !ValidValueOptions(handle.value_options)) {
      throw bad("has malformed value options");
    }
  }
  if (handle.type_name != expected_type) {
    throw bad("carries another value type than this promise's '" + std::string(expected_type) +
              "', not a " + std::string(expected_type) + " one (TensorPromise and VoidPromise "
              "are not interchangeable)");
  }
  if (!shm::ParseSegmentName(handle.segment)) throw bad("names no segment of dtorch's form");
  unsigned char nonce[kNonceBytes];
  if (!ParseHex(handle.nonce_hex, nonce, kNonceBytes)) throw bad("has a malformed nonce");
  return handle;
}

// Control segments mapped ahead (MapFileControlSegment) and still mapped, at most
// kMaxMappedAhead: a process holding many promises it never uses keeps far from the kernel's
// limit on mappings (vm.max_map_count, 65530 by default); beyond, promises attach lazily.
std::atomic<int64_t> mapped_ahead{0};
constexpr int64_t kMaxMappedAhead = 4096;

std::shared_ptr<shm::Segment> MapFileControlSegment(const FileHandle& handle) noexcept {
  if (mapped_ahead.fetch_add(1) >= kMaxMappedAhead) {
    --mapped_ahead;
    return nullptr;
  }
  std::unique_ptr<shm::Segment> segment;
  try {
    segment = shm::Segment::Open(handle.segment, kSegmentBytes);
  } catch (...) {
  }
  if (!segment) {
    --mapped_ahead;
    return nullptr;
  }
  try {
    return std::shared_ptr<shm::Segment>(segment.release(), [](shm::Segment* mapped) {
      delete mapped;
      --mapped_ahead;
    });
  } catch (...) {  // (out of memory: the deleter ran)
    return nullptr;
  }
}

// Throws FutureError(kInvalidHandle) unless `block` (a mapped control segment: untrusted, read
// within its fields' bounds) is the pair `handle` names: its format, nonce, value type, creator
// and the consumer's value options. Nothing is registered or claimed before this passes.
static void CheckControlBlock(const FileControlBlock* block, const FileHandle& handle) {
  unsigned char nonce[kNonceBytes];
  ParseHex(handle.nonce_hex, nonce, kNonceBytes);  // validated by Parse
  ProcessId owner;
  shm::ParseSegmentName(handle.segment, &owner);
  if (owner.pid_namespace != Self().pid_namespace) {
    throw FutureError(FutureErrc::kInvalidHandle,
                      "the promise was created in another pid namespace (a container sharing "
                      "/dev/shm but not its processes): producers and consumer must see each "
                      "other's processes");
  }
  if (block->magic != kControlMagic || block->layout_version != kLayoutVersion) {
    throw InvalidSegment(handle.segment, "no control block of this format");
  }
  if (std::memcmp(block->nonce, nonce, kNonceBytes) != 0) {
    throw InvalidSegment(handle.segment, "the nonce does not match");
  }
  if (std::string(block->type_name, strnlen(block->type_name, kTypeNameBytes)) !=
          handle.type_name ||
      block->creator_pid != owner.pid || block->creator_start != owner.start_time) {
    throw InvalidSegment(handle.segment, "its value type or creator does not match");
  }
  // (A field without its NUL reads as one character too many: it matches no handle.)
  if (std::string_view(block->value_options,
                       strnlen(block->value_options, sizeof(block->value_options))) !=
      handle.value_options) {
    throw InvalidSegment(handle.segment,
                         "its value options are not the consumer's: the handle was altered; "
                         "pass the string from serialize() unchanged");
  }
}

std::shared_ptr<FileChannel> AttachFileProducer(const FileHandle& handle,
                                                std::shared_ptr<shm::Segment> mapped) {
  ProcessState& state = *process_state;
  std::shared_ptr<ProducerAttachment> existing;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    const auto it = state.attachments.find(handle.segment);
    if (it != state.attachments.end()) existing = it->second.lock();
  }
  if (existing) {
    // Attached through another handle of this segment: this one must name the same pair too.
    CheckControlBlock(existing->control_block(), handle);
    return existing;
  }
  std::shared_ptr<shm::Segment> control =
      mapped ? std::move(mapped) : shm::Segment::Open(handle.segment, kSegmentBytes);
  if (!control) return nullptr;  // the pair is gone
  auto* block = static_cast<FileControlBlock*>(control->data());
  CheckControlBlock(block, handle);
  if (IsCreatorProcess(block)) {
    return std::make_shared<CopyInCreatorChannel>(std::move(control), handle.segment);
  }

  uint32_t slot = 0;
  try {
    // Held for a few stores by any live process: a wait this long means a stuck peer.
    bip::scoped_lock<bip::interprocess_mutex> lock(block->producers_mu, bip::defer_lock);
    if (!lock.try_lock_for(std::chrono::seconds(kLockTimeoutS))) {
      throw FutureError(FutureErrc::kSharedMemory,
                        "another process has held this promise's lock for " +
                            std::to_string(kLockTimeoutS) + " s; it seems stuck");
    }
    const auto self = Self();
    const uint32_t count = std::min(block->producer_count.load(), kMaxProducers);
    slot = count;
    // This process's entry of a handle it dropped is taken again: a process that receives the
    // promise time and again (a queue, a loop) keeps one entry.
    for (uint32_t i = 0; i < count; ++i) {
      const auto& entry = block->producers[i];
      if (entry.pid.load() == self.pid && entry.start_time.load() == self.start_time &&
          entry.state.load() == kDropped) {
        slot = i;
        break;
      }
    }
    if (slot < count) {
      block->producers[slot].state = kAttached;
    } else {
      if (slot >= kMaxProducers) {
        throw FutureError(FutureErrc::kSharedMemory,
                          "more than " + std::to_string(kMaxProducers) +
                              " processes held this promise; a promise has at most that many "
                              "producer processes");
      }
      block->producers[slot].pid = self.pid;
      block->producers[slot].start_time = self.start_time;
      block->producers[slot].state = kAttached;
      block->producer_count.store(slot + 1, std::memory_order_release);
    }
  } catch (const bip::lock_exception&) {
    // The consumer may not know that producer (it may have died before registering): the pair
    // is failed here.
    const std::string why = "a producer died holding this promise's lock, so the promise can "
                            "no longer be used";
    std::shared_ptr<shm::Segment> doorbell;
    try {
      doorbell = ConsumerDoorbellOf(handle.segment, block);
    } catch (...) {  // (a corrupt doorbell: the watcher's liveness round still sees the failure)
    }
    ChannelBase breaker(control, kLockBreakerClaimant, doorbell);
    if (breaker.TryClaim() == ClaimOutcome::kClaimed) {
      breaker.PublishError({FutureErrc::kBrokenPromise, why});
    }
    throw FutureError(FutureErrc::kBrokenPromise, why);
  }
  auto attachment = std::make_shared<ProducerAttachment>(std::move(control), handle.segment, slot);
  std::lock_guard<std::mutex> lock(state.mu);
  auto& cached = state.attachments[handle.segment];
  if (auto raced = cached.lock()) return raced;  // another thread attached meanwhile
  cached = attachment;
  // A long-lived producer attaches to many pairs: forget those it no longer holds.
  if (state.attachments.size() >= 2 * state.attachments_after_sweep + 64) {
    for (auto it = state.attachments.begin(); it != state.attachments.end();) {
      it = it->second.expired() ? state.attachments.erase(it) : std::next(it);
    }
    state.attachments_after_sweep = state.attachments.size();
  }
  return attachment;
}

std::shared_ptr<FileChannel> RegisterFileHolder(const FileHandle& handle,
                                                std::shared_ptr<shm::Segment> mapped,
                                                bool* counted) noexcept {
  *counted = false;
  if (!mapped) return nullptr;
  try {
    auto* block = static_cast<FileControlBlock*>(mapped->data());
    CheckControlBlock(block, handle);
    if (IsCreatorProcess(block)) {
      block->deserialized.fetch_add(1);  // (the creator's own handle holds the pair here)
      *counted = true;
      return nullptr;
    }
    auto channel = AttachFileProducer(handle, mapped);
    if (channel) {
      block->deserialized.fetch_add(1);  // (after its entry: FileControlBlock)
      *counted = true;
    }
    return channel;
  } catch (...) {
    return nullptr;  // (the first use attaches again, and says why it cannot)
  }
}

void CountFileSerialization(const FileHandle& handle,
                            std::shared_ptr<shm::Segment> mapped) noexcept {
  try {
    if (!mapped) mapped = shm::Segment::Open(handle.segment, kSegmentBytes);
    if (!mapped) return;  // (the pair is gone: nothing waits for the count)
    auto* block = static_cast<FileControlBlock*>(mapped->data());
    CheckControlBlock(block, handle);
    block->serialized.fetch_add(1);
  } catch (...) {
    // (Not the pair's segment, or /dev/shm refuses: the handle is passed on all the same.)
  }
}

std::shared_ptr<FileConsumer> FileConsumer::Create(std::string_view type_name,
                                                   std::string_view value_options) {
  if (type_name.size() >= kTypeNameBytes) {
    throw std::logic_error("a file kind value type name is at most 15 characters");
  }
  if (!ValidValueOptions(value_options)) {
    throw std::logic_error("file kind value options are at most 32 of [a-z0-9_=]");
  }
  ProcessState& state = *process_state;
  // One critical section: the watcher, going idle, must not unlink the doorbell this pair names.
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.stopping) {
    throw FutureError(FutureErrc::kDroppedAtExit,
                      "file promises cannot be created once the process is exiting");
  }
  auto doorbell = OwnDoorbellLocked(state);
  EnsureWatcherLocked(state);  // first: it unlinks the doorbell if this pair is never made
  const auto self = Self();
  FileHandle handle;
  handle.type_name = std::string(type_name);
  handle.value_options = std::string(value_options);
  handle.segment = shm::NewSegmentName(self);
  std::shared_ptr<shm::Segment> control = shm::Segment::Create(handle.segment, kSegmentBytes);
  auto* block = new (control->data()) FileControlBlock();  // zeroed; atomics and mutex built
  RandomBytes(block->nonce, kNonceBytes);
  handle.nonce_hex = HexOf(block->nonce, kNonceBytes);
  std::memcpy(block->type_name, type_name.data(), type_name.size());
  std::memcpy(block->value_options, value_options.data(), value_options.size());
  block->creator_pid = self.pid;
  block->creator_start = self.start_time;
  WriteName(block->doorbell, state.doorbell_name);
  std::memcpy(block->doorbell_nonce, AsDoorbell(doorbell)->nonce, kNonceBytes);
  block->layout_version = kLayoutVersion;
  block->magic = kControlMagic;  // last: a producer checks it first

  // (Room first: a consumer destroyed here, under mu, would take mu in its destructor.)
  state.consumers.reserve(state.consumers.size() + 1);
  auto consumer = std::make_shared<ConsumerImpl>(std::move(control), std::move(handle),
                                                 std::move(doorbell));
  state.consumers.push_back(consumer);
  return consumer;
}

void StopFileKind(std::chrono::steady_clock::time_point deadline) noexcept {
  ProcessState& state = *process_state;
  std::vector<std::shared_ptr<ConsumerImpl>> consumers;
  {
    std::unique_lock<std::mutex> lock(state.mu);
    state.stopping = true;
    if (state.doorbell) Ring(AsDoorbell(state.doorbell));
    state.wake.fetch_add(1);
    shm::FutexWakeAll(&state.wake);
    state.watcher_exited.wait_until(lock, deadline, [&] { return !state.watcher_running; });
    consumers = LiveConsumersLocked(state);
    state.retired_mappings.clear();  // (unmapped: the watcher has stopped, or is stuck)
    for (auto& orphan : state.orphans) {
      DiscardPayloadOfDeadProducer(static_cast<FileControlBlock*>(orphan.control->data()));
    }
    state.orphans.clear();
    ReleaseDoorbellLocked(state);
  }
  for (auto& consumer : consumers) consumer->StopAtExit();
  MarkFileProducersExited();
  // A producer's exit: what it made for consumers that died is not left in /dev/shm.
  if (payload::Kept().produced > 0) ReleaseWhatDeadConsumersLeft(std::nullopt);
  // Leaked: a pending future may still be destroyed later in the exit, by another thread.
  new std::vector<std::shared_ptr<ConsumerImpl>>(std::move(consumers));
}

void MarkFileProducersExited() noexcept {
  ProcessState& state = *process_state;
  std::vector<std::shared_ptr<ProducerAttachment>> attachments;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    for (auto& [name, weak] : state.attachments) {
      if (auto attachment = weak.lock()) attachments.push_back(std::move(attachment));
    }
  }
  for (auto& attachment : attachments) attachment->Leave(kExited);
}

void ReleaseIdleFileSegments() noexcept {
  ProcessState& state = *process_state;
  std::vector<std::shared_ptr<ConsumerImpl>> consumers;  // released outside mu
  std::lock_guard<std::mutex> lock(state.mu);
  consumers = LiveConsumersLocked(state);
  const bool pending = std::any_of(consumers.begin(), consumers.end(),
                                   [](const auto& consumer) { return consumer->Pending(); });
  if (!pending && state.orphans.empty()) ReleaseDoorbellLocked(state);
}

void PrepareForkFileKind() noexcept {
  process_state->mu.lock();
  payload::PrepareFork();
}

void AfterForkFileKindInParent() noexcept {
  ++forks_in_parent;
  payload::AfterForkInParent();
  process_state->mu.unlock();
}

void AfterForkFileKindInChild() noexcept {
  // The parent's state (its watcher, its doorbell, its consumers, its payload segments) stays
  // the parent's.
  payload::AfterForkInChild();
  try {
    released_consumers.store(new ReleasedConsumers());  // (the parent's leaked)
  } catch (...) {
  }
  ProcessState* parents = process_state;
  process_state = new ProcessState();
  // Unmapped here: nothing in the child uses them. (The old state is leaked: its mutex is held,
  // by PrepareFork.)
  parents->doorbell.reset();
  parents->orphans.clear();
  parents->doorbells.clear();
  parents->retired_mappings.clear();
}

int FileWatcherThreads() {
  std::lock_guard<std::mutex> lock(process_state->mu);
  return process_state->watcher_running ? 1 : 0;
}

size_t PendingFilePairs() {
  std::lock_guard<std::mutex> lock(process_state->mu);
  size_t count = 0;
  for (const auto& weak : process_state->consumers) count += weak.expired() ? 0 : 1;
  return count;
}

std::string FileDoorbellSegment() {
  std::lock_guard<std::mutex> lock(process_state->mu);
  return process_state->doorbell ? process_state->doorbell_name : std::string();
}

void HoldFilePromiseLockForTesting(const FileHandle& handle) {
  // (Received as a deserialized promise is: a holder, its deserialization counted.)
  bool counted = false;
  auto channel = RegisterFileHolder(handle, MapFileControlSegment(handle), &counted);
  if (!channel) throw std::runtime_error("the pair is gone, or this process cannot hold it");
  auto control = shm::Segment::Open(handle.segment, kSegmentBytes);
  auto* block = static_cast<FileControlBlock*>(control->data());
  block->producers_mu.lock();
  for (;;) pause();
}

namespace {
// What killed processes left behind goes when the library loads.
const bool reaped_at_load = (shm::ReapSegmentsOfDeadProcesses(), true);
}  // namespace

}  // namespace dtorch::core
