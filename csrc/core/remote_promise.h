// RemotePromise<T, K>: the promise backend of every kind that crosses processes (torch-free).
// The kinds differ in how a process reaches a pair (the kind's attachment: a shared-memory
// channel, a session on a store); what a promise handle does with its attachment is the same, and
// lives here once:
//
// - One attachment per handle and process: made on first use (or when the handle is received),
//   made anew in a forked child (compared by fork generation: a value copied from an ancestor
//   never equals the child's own), and made outside the handle's lock (attaching may block; a fork
//   meanwhile must not leave the lock held in the child).
// - A deserialization is counted once per process: by the registration when the handle is
//   received, else by the first attach (K::Attach is told so).
// - Claim: the attachment decides, across processes; ClaimOutcome says how, and a second set
//   raises kPromiseAlreadySatisfied, one after the consumer failed the pair kBrokenPromise, one on
//   a pair its consumer dropped is a no-op (Complete delivers nothing).
// - Complete delivers only what this process claimed (a forked child of the claimer does not).
//
// K, the kind's traits (FileKind, NetworkKind), provides (all static):
//   kName, Handle, Consumer (a RemoteConsumer with handle()), Attachment (a RemoteAttachment),
//   Prepared (what a received handle keeps until its first attach: e.g. a mapping made ahead),
//   kTooLate (why a set comes too late);
//   kHolderAttachesAnew    whether RegisterHolder attaches even where this process is attached;
//   CreateConsumer(codec, args...)                  the creator's pair;
//   Received(handle, &prepared, &counted) noexcept  registers a received handle as a holder;
//   Attach(consumer, handle, prepared, uncounted, holder)   this process's attachment (null: the
//       pair is gone); `uncounted`: the deserialization here is not counted yet; `holder`: for
//       RegisterHolder (a handle held without deserializing: a forked child's arguments);
//   CountedOnAttach(attachment)                     counts that deserialization, if Attach did not;
//   CountSerialized(consumer, handle, attachment, prepared, attach)   a handle serialized in this
//       process (attachment: this process's, or null; attach(): attaches);
//   CreatorDropped(consumer, claimed_here)          the creator's handle goes;
//   Deliver(consumer, attachment, codec, result)    publishes a claimed result (consumer: null
//       unless this handle created the pair).
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "base/fork_generation.h"
#include "future_error.h"
#include "promise_future.h"
#include "received_future.h"
#include "value_codec.h"

namespace dtorch::core {

// How a handle's claim of a pair went.
enum class ClaimOutcome {
  kClaimed,
  kClaimedByAnother,  // another handle (of any process) claimed it first
  kFailedByConsumer,  // failed already: its producers gone, none attached in time, ...
  kPairGone,          // its consumer dropped it: nobody will read a value
};

// A process's way to complete a pair (the creator's own, or a producer process's attachment:
// one per process and pair, shared by its handles).
class RemoteAttachment {
 public:
  virtual ~RemoteAttachment() = default;
  // Claims the completion, unless the pair was claimed (or failed, or dropped) already.
  virtual ClaimOutcome TryClaim() = 0;
};

// The consumer's end of a pair, in the process that created it.
class RemoteConsumer : public ReceivedSource {
 public:
  // Whether this is the process that created the pair (not a forked child of it).
  virtual bool InCreatorProcess() const = 0;
  // The promise may reach other processes (it was serialized here): counts the serialization.
  virtual void MarkLeftProcess() = 0;
  // Marks the single future handed out; false if it was already.
  virtual bool RetrieveFuture() = 0;
};

template <typename T, typename K>
class RemotePromise final : public PromiseBackend<T> {
  using Handle = typename K::Handle;
  using Consumer = typename K::Consumer;
  using Attachment = typename K::Attachment;
  using Prepared = typename K::Prepared;

 public:
  // The creator's promise: makes the pair (K::CreateConsumer(*codec, args...)).
  template <typename... Args>
  explicit RemotePromise(std::shared_ptr<const ValueCodec<T>> codec, Args&&... args)
      : codec_(std::move(codec)),
        consumer_(K::CreateConsumer(codec_, std::forward<Args>(args)...)),
        handle_(consumer_->handle()) {}
  // A promise another process serialized: this process holds it from now on.
  RemotePromise(Handle handle, std::shared_ptr<const ValueCodec<T>> codec)
      : codec_(std::move(codec)), handle_(std::move(handle)) {
    bool counted = false;
    if (auto attachment = K::Received(handle_, &prepared_, &counted)) {
      attachment_ = std::move(attachment);
      attached_in_ = ForkGeneration();
      prepared_ = Prepared();  // (the attachment holds what it needs)
    }
    if (!counted) uncounted_in_ = ForkGeneration() + 1;  // (counted when it attaches)
  }

  ~RemotePromise() override {
    if (consumer_ && consumer_->InCreatorProcess()) {
      K::CreatorDropped(*consumer_, claimed_ && claimed_in_ == ForkGeneration());
    }
  }

  void CheckValue(const T& value) const override {
    Attach();  // (a handle this process inherited, not deserialized, registers here)
    codec_->CheckValue(value);
  }
  bool CopiesValueOut() const override { return true; }

  void Complete(Result<T> result) override {
    // Claimed by the parent of this forked child (whose fork handler fails what the parent had
    // pending): the completion is the parent's to publish.
    if (!claimed_ || claimed_in_ != ForkGeneration()) return;
    const auto attachment = Attach();
    if (!attachment) return;
    K::Deliver(consumer_.get(), *attachment, *codec_, std::move(result));
  }

  std::unique_ptr<FutureBackend<T>> GetFuture() override {
    return FutureOfPair<T>(consumer_, codec_, K::kName);
  }

  std::string Serialize() override {
    if (consumer_ && consumer_->InCreatorProcess()) {
      consumer_->MarkLeftProcess();
    } else {
      std::shared_ptr<Attachment> attachment;
      Prepared prepared;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (attached_in_ == ForkGeneration()) attachment = attachment_;
        prepared = prepared_;
      }
      K::CountSerialized(consumer_.get(), handle_, attachment.get(), std::move(prepared),
                            [this] { return Attach(); });
    }
    return handle_.Serialize();
  }
  const char* Kind() const override { return K::kName; }

  void RegisterHolder() noexcept override {
    if (consumer_ && consumer_->InCreatorProcess()) return;  // (its copies are no holders)
    try {
      Attach(/*holder=*/true);
    } catch (...) {  // (its first use says why)
    }
  }

 protected:
  void ClaimShared(const char* producer) override {
    const auto attachment = Attach();
    switch (attachment ? attachment->TryClaim() : ClaimOutcome::kPairGone) {
      case ClaimOutcome::kClaimed:
        claimed_in_ = ForkGeneration();
        claimed_ = true;
        return;
      case ClaimOutcome::kClaimedByAnother:
        throw FutureError(FutureErrc::kPromiseAlreadySatisfied,
                          std::string("this ") + producer + " came second: another handle of "
                          "the promise (in this or another process) claimed it first. A promise "
                          "is fulfilled once: use a new one per value");
      case ClaimOutcome::kFailedByConsumer:
        throw FutureError(FutureErrc::kBrokenPromise,
                          std::string(producer) + " came too late: " + K::kTooLate);
      case ClaimOutcome::kPairGone:
        return;  // its consumer dropped the pair: nothing to deliver (Complete does nothing)
    }
  }

 private:
  // This handle's attachment in this process (made on first use; anew in a forked child). Null
  // when the pair is gone.
  std::shared_ptr<Attachment> Attach(bool holder = false) const {
    const uint64_t generation = ForkGeneration();
    Prepared prepared;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (attached_in_ == generation && !(holder && K::kHolderAttachesAnew)) return attachment_;
      prepared = std::move(prepared_);
    }
    const bool uncounted = uncounted_in_.load() == generation + 1;
    auto attachment =
        K::Attach(consumer_.get(), handle_, std::move(prepared), uncounted, holder);
    std::lock_guard<std::mutex> lock(mu_);
    // (Else another thread attached meanwhile: the same attachment, the process's one.)
    if (attached_in_ != generation || (holder && K::kHolderAttachesAnew)) {
      attachment_ = std::move(attachment);
      attached_in_ = generation;
      if (uncounted && uncounted_in_.exchange(0) == generation + 1 && attachment_) {
        K::CountedOnAttach(*attachment_);
      }
    }
    return attachment_;
  }

  const std::shared_ptr<const ValueCodec<T>> codec_;
  const std::shared_ptr<Consumer> consumer_;  // null unless this handle created the pair
  const Handle handle_;
  std::atomic<bool> claimed_{false};     // this handle's claim reached a pair that is there
  std::atomic<uint64_t> claimed_in_{0};  // the fork generation that claimed
  // The fork generation + 1 whose deserialization is not counted yet (0: none).
  mutable std::atomic<uint64_t> uncounted_in_{0};
  mutable std::mutex mu_;
  mutable std::shared_ptr<Attachment> attachment_;  // guarded by mu_
  // guarded by mu_: attachment_'s fork generation; none yet: UINT64_MAX
  mutable uint64_t attached_in_ = UINT64_MAX;
  mutable Prepared prepared_;  // guarded by mu_: until the first attach
};

}  // namespace dtorch::core
