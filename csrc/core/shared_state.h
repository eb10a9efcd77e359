// SharedState<T>: the one-shot rendezvous between a promise and its future (torch-free).
//
// Semantics follow std::promise/std::future:
//   - exactly one completion (a value or an error); a second one throws
//     FutureError(kPromiseAlreadySatisfied) *before* anything changes, so the first value is kept;
//   - Take() blocks until completion and consumes: afterwards Valid() is false and another Take()
//     throws FutureError(kNoState). An error is consumed the same way (it is thrown once);
//   - WaitUntil(deadline) never consumes and leaves the state valid when it times out; after
//     Take() it returns true at once (the state is complete, as torch.futures' wait() is after
//     a value was read);
//   - IsReady() reports completion: true once a value or an error is there, also after Take()
//     (torch.futures.Future.done()); Valid() is the one that reports consumption;
//   - Peek() reads a completed state, before or after Take() (torch.futures.Future.value()): a
//     copy of the value, or the error thrown. So the state keeps its result until it is destroyed
//     (a tensor's storage stays referenced while the future lives, as in torch.futures), and a
//     completion callback can read it whoever took it.
//
// Completion callbacks (OnReady) let a waiter be woken without a thread per future: each runs
// exactly once, after completion, outside the lock, on the completing thread (or at once on the
// registering thread when the state is already complete). A callback that throws is ignored so
// it cannot break the producer.
//
// Thread-safety: every method may be called from any thread.
//
// Fork: a child process inherits the state but not the threads that waited on it. glibc's
// pthread_cond_broadcast waits for the waiters it wakes to leave their wait, so completing a state
// in the child would hang on a waiter that only existed in the parent: the condition variable of a
// state that had waiters in an earlier fork generation is re-initialised before its next use. Its
// mutex, if a thread of the parent held it at fork, is re-initialised by the library's fork child
// handler when that fails the state (LockSurvivingFork).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>

#include "base/fork_generation.h"
#include "future_error.h"
#include "result.h"

namespace dtorch::core {

// The longest wait: timeouts beyond 2^40 ms (~34 years) are clamped, since larger ones overflow
// the clock arithmetic of std::condition_variable.
inline constexpr int64_t kMaxTimeoutMs = int64_t{1} << 40;

template <typename T>
class SharedState {
 public:
  using Callback = std::function<void()>;

  SharedState() = default;
  SharedState(const SharedState&) = delete;
  SharedState& operator=(const SharedState&) = delete;

  // Completes with `result` (a value or an error). Throws kPromiseAlreadySatisfied, changing
  // nothing, if already complete.
  void Complete(Result<T> result) {
    if (!TryComplete(std::move(result))) {
      throw FutureError(FutureErrc::kPromiseAlreadySatisfied,
                        "the promise already holds a value or an exception");
    }
  }

  // Completes with `result` unless already complete; returns whether it did. Used to break a
  // promise on destruction, which must never throw.
  bool TryComplete(Result<T> result) noexcept {
    CallbackNode* callbacks;
    bool wake;
    {
      auto lock = LockSurvivingFork(mu_);
      if (CompleteLocked()) return false;
      if (consumer_gone_) {
        retrieved_ = true;  // complete, keeping nothing: `result` goes when this returns
      } else {
        result_.emplace(std::move(result));
      }
      callbacks = TakeCallbacksLocked();
      wake = HasWaitersLocked();
    }
    if (wake) cv_.notify_all();
    RunCallbacks(callbacks);
    return true;
  }

  // Blocks until complete, then consumes the value (or throws the stored error, consuming it).
  // Of several threads blocked here, one gets the value and the others kNoState.
  T Take() {
    auto lock = LockSurvivingFork(mu_);
    ThrowIfRetrievedLocked();
    WaitingLocked waiting(*this);
    cv_.wait(lock, [this] { return CompleteLocked(); });
    ThrowIfRetrievedLocked();  // another waiter may have taken it while this one slept
    return TakeLocked();
  }

  // Blocks until `deadline` at the latest (a deadline in the past: a poll); returns whether the
  // state is complete. Never consumes.
  bool WaitUntil(std::chrono::steady_clock::time_point deadline) const {
    auto lock = LockSurvivingFork(mu_);
    if (CompleteLocked() || deadline <= std::chrono::steady_clock::now()) {
      return CompleteLocked();  // a poll: no timed wait (a syscall) at all
    }
    WaitingLocked waiting(*this);
    return cv_.wait_until(lock, deadline, [this] { return CompleteLocked(); });
  }

  // The value of a complete state, copied, or its error thrown; consumes nothing. Throws
  // kNotReady before completion.
  T Peek() const {
    auto lock = LockSurvivingFork(mu_);
    if (!result_) {
      throw FutureError(FutureErrc::kNotReady, kNotReadyDetail);
    }
    return result_->CopyOrThrow();
  }

  bool IsReady() const {
    auto lock = LockSurvivingFork(mu_);
    return CompleteLocked();  // (also once taken: complete)
  }

  // Whether completing now would wake nobody: no thread blocked in Take / WaitUntil and no
  // OnReady callback. Only a hint (a waiter may come just after): a binding uses it to complete
  // without first releasing the GIL, which only a woken waiter needs.
  bool HasNoWaiters() const {
    auto lock = LockSurvivingFork(mu_);
    return !HasWaitersLocked() && callbacks_head_ == nullptr;
  }

  // The consumer's end is gone: drops the kept result, which nobody can read any more (a promise
  // that outlives its future must not keep the value alive). The state stays complete.
  void DropResult() {
    std::optional<Result<T>> dropped;  // (destroyed after the lock is released)
    auto lock = LockSurvivingFork(mu_);
    consumer_gone_ = true;  // (a later completion keeps nothing either)
    if (!result_) return;
    retrieved_ = true;
    dropped.swap(result_);
  }

  bool Valid() const {
    auto lock = LockSurvivingFork(mu_);
    return !retrieved_;
  }

  // Runs `callback` once the state is complete (at once, here, if it already is).
  void OnReady(Callback callback) {
    auto node = std::make_unique<CallbackNode>(CallbackNode{std::move(callback), nullptr});
    {
      auto lock = LockSurvivingFork(mu_);
      if (!CompleteLocked()) {
        *callbacks_tail_ = node.get();
        callbacks_tail_ = &node.release()->next;
        return;
      }
    }
    RunCallbacks(node.release());
  }

  ~SharedState() { RunCallbacks(TakeCallbacksLocked(), /*run=*/false); }

 private:
  // A result was set (it stays, also once taken, until DropResult).
  bool CompleteLocked() const { return result_.has_value() || retrieved_; }

  void ThrowIfRetrievedLocked() const {
    if (retrieved_) {
      throw FutureError(FutureErrc::kNoState, kConsumedDetail);
    }
  }

  // Counts a waiter on cv_ for its scope (construct and destroy with mu_ held).
  class WaitingLocked {
   public:
    explicit WaitingLocked(const SharedState& state) : state_(state) {
      state_.ForgetOtherGenerationsLocked();
      ++state_.waiters_;
    }
    ~WaitingLocked() { --state_.waiters_; }

   private:
    const SharedState& state_;
  };

  // Waiters counted in an earlier fork generation exist only in the parent: cv_ is re-initialised
  // (not destroyed: its waiters are gone, not woken) so that no notify waits for them.
  void ForgetOtherGenerationsLocked() const {
    const uint64_t generation = ForkGeneration();
    if (cv_generation_ == generation) return;
    if (waiters_ > 0) {
      new (&cv_) std::condition_variable();
      waiters_ = 0;
    }
    cv_generation_ = generation;
  }

  bool HasWaitersLocked() const {
    ForgetOtherGenerationsLocked();
    return waiters_ > 0;
  }

  T TakeLocked() {
    retrieved_ = true;
    return result_->CopyOrThrow();  // (kept, for Peek)
  }

  // The callbacks are a list whose nodes are allocated before mu_ is taken: the locked part of
  // OnReady is two pointer writes, so a fork child handler that re-initialises mu_ (held by a
  // thread of the parent) never finds the list half-changed, as it could a growing vector.
  struct CallbackNode {
    Callback callback;
    CallbackNode* next;
  };

  CallbackNode* TakeCallbacksLocked() {
    CallbackNode* list = callbacks_head_;
    callbacks_head_ = nullptr;
    callbacks_tail_ = &callbacks_head_;
    return list;
  }

  // Runs (unless !run) and frees the callbacks of `list`, in registration order.
  static void RunCallbacks(CallbackNode* list, bool run = true) noexcept {
    while (list != nullptr) {
      std::unique_ptr<CallbackNode> node(list);
      list = node->next;
      if (!run) continue;
      try {
        node->callback();
      } catch (...) {
        // A waiter's callback must not break the producer; the state is already complete.
      }
    }
  }

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;    // re-initialised after fork: ForgetOtherGenerationsLocked
  mutable int waiters_ = 0;                // guarded by mu_: threads waiting on cv_
  mutable uint64_t cv_generation_ = ForkGeneration();  // guarded by mu_: waiters_' generation
  bool retrieved_ = false;                 // guarded by mu_
  bool consumer_gone_ = false;             // guarded by mu_: DropResult was called
  std::optional<Result<T>> result_;        // guarded by mu_: set once, kept
  CallbackNode* callbacks_head_ = nullptr;              // guarded by mu_
  CallbackNode** callbacks_tail_ = &callbacks_head_;   // guarded by mu_
};

}  // namespace dtorch::core
