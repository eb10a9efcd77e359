// The file kind's channels: how a handle completes a pair (file_kind.h's FileChannel): the
// creator's own, a copy deserialized in the creator's process, and a producer process's
// attachment (its entry in the producer table). Private to the kind.
#pragma once

#include "control_block.h"
#include "watcher.h"

namespace dtorch::core::file_internal {

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

inline bool IsCreatorProcess(const FileControlBlock* block) {
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

}  // namespace dtorch::core::file_internal
