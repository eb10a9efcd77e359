// The file kind's consumer: the creator's end of a pair (file_kind.h's FileConsumer): waiting on
// the state word, callbacks through the watcher, the producers' liveness, taking the value, and
// what it unlinks when the pair goes. Private to the kind.
#pragma once

#include "../../attach_deadline.h"
#include "channels.h"
#include "watcher.h"

namespace dtorch::core::file_internal {

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
      throw FutureError(FutureErrc::kNoState, kConsumedDetail);
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

}  // namespace dtorch::core::file_internal
