// Promise/future backends (torch-free): the pair of interfaces every kind implements, and the
// in-process "memory" kind. Kinds that cross processes live in core/kinds/<name>/; kind_registry.h
// maps kind names to their factories and deserializers (filled by ops/kinds/<name>.cpp).
//
// A PromiseBackend<T> is the producer's end, a FutureBackend<T> the consumer's. T is the value
// carried (at::Tensor in the torch glue; Unit for completion-only signals). A completion is one
// Result<T>: a value, or an error with a typed code.
//
// Fulfil once: Claim() reserves the promise's single completion for one producer, at call time,
// so that a second set raises in the caller (also when the first producer completes later, as the
// device kernels do); Complete() then delivers the result. The claim and Serialize() belong to
// the backend, so a kind that crosses processes claims across processes.
//
// Lifetime: a promise destroyed before it was satisfied breaks its future: the waiter gets
// FutureError(kBrokenPromise) instead of hanging (kinds that cross processes: also when every
// process that held it is gone; see each kind's header).
//
// Thread-safety: all methods of both interfaces may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "base/fork_generation.h"
#include "future_error.h"
#include "result.h"
#include "shared_state.h"

namespace dtorch::core {

// The value of a completion-only pair (VoidPromise / VoidFuture): dtorch/types.h.
using ::dtorch::Unit;

using Deadline = std::chrono::steady_clock::time_point;

template <typename T>
class FutureBackend {
 public:
  virtual ~FutureBackend() = default;
  // Blocks until the value is ready and takes it (throws the completion's error instead, if any).
  // Consumes: afterwards Valid() is false and Get() throws kNoState.
  virtual T Get() = 0;
  // The value of a complete future without consuming it (a copy: a tensor shares its storage),
  // or its error thrown, as often as asked, also after Get(): the future keeps its completion.
  // Throws kNotReady before completion.
  virtual T Value() = 0;
  // Blocks until `deadline` at the latest (a past deadline polls); true once complete (also
  // after Get()). Never consumes.
  virtual bool WaitUntil(Deadline deadline) const = 0;
  // Whether the future is complete (a value or an error is there; also after Get() took it).
  virtual bool IsReady() const = 0;
  // False once Get() has taken the value.
  virtual bool Valid() const = 0;
  // Runs callback once, when the value (or an error) is ready; see SharedState::OnReady.
  virtual void OnReady(std::function<void()> callback) = 0;
};

template <typename T>
class PromiseBackend {
 public:
  virtual ~PromiseBackend() = default;

  // Refuses, before any claim, a value this kind cannot carry (throws with what to do instead).
  virtual void CheckValue(const T& /*value*/) const {}
  // Whether the value is copied out of this process when the promise is completed (file,
  // network), rather than handed over as it is (memory): a value still being written by queued
  // device work must then be snapshotted before it is completed.
  virtual bool CopiesValueOut() const { return false; }
  // Whether Complete would run in this thread and wake nobody (the memory kind with no waiter and
  // no callback): no I/O, no other thread to hand the GIL to. A hint, as SharedState::HasNoWaiters.
  virtual bool CompletesQuietly() const { return false; }

  // Reserves the single completion for `producer` (a string literal: it is kept, to name the
  // first producer when a second one is refused). Throws FutureError(kPromiseAlreadySatisfied),
  // changing nothing, if this promise (here, or in another process for the kinds that cross
  // processes) is claimed already; any other error (the kind could not reach its pair) leaves
  // the promise unclaimed.
  void Claim(const char* producer) {
    const char* first = nullptr;
    if (!claimed_by_.compare_exchange_strong(first, producer)) {
      throw FutureError(FutureErrc::kPromiseAlreadySatisfied,
                        std::string("the promise already holds a value or an exception, or "
                                    "will: ") + first + " was called on it first and this " +
                            producer + " came second. A promise is fulfilled once: use a new "
                            "one per value");
    }
    try {
      ClaimShared(producer);
    } catch (const FutureError& e) {
      // Only a claim taken elsewhere sticks; any other failure changes nothing.
      claimed_by_ = e.code() == FutureErrc::kPromiseAlreadySatisfied
                        ? "a producer elsewhere" : nullptr;
      throw;
    } catch (...) {
      claimed_by_ = nullptr;
      throw;
    }
  }

  // Completes a claimed promise with `result`. Throws FutureError only when the kind could not
  // deliver the value (shared memory full); the future then fails with that same error.
  virtual void Complete(Result<T> result) = 0;

  // CheckValue + Claim + Complete: what a synchronous producer calls.
  void Set(Result<T> result, const char* producer) {
    if (result.ok()) CheckValue(result.value());
    Claim(producer);
    Complete(std::move(result));
  }
  void SetValue(T value) { Set(Result<T>::Value(std::move(value)), "SetValue"); }
  void SetError(FutureErrc code, const std::string& detail) {
    Set(Result<T>::Error(code, detail), "SetError");
  }

  // The consumer's end; throws FutureError(kFutureAlreadyRetrieved) when called twice, or where
  // the kind keeps the future in another process.
  virtual std::unique_ptr<FutureBackend<T>> GetFuture() = 0;
  // A string the kind's deserializer (kind_registry.h) turns back into this promise in another
  // process. Throws FutureError(kCannotLeaveProcess) for kinds that stay in one process.
  virtual std::string Serialize() = 0;
  // The kind's name, with static storage (handles keep the pointer).
  virtual const char* Kind() const = 0;
  // This process received the promise without deserializing it (a forked child's arguments):
  // for the kinds that cross processes, it registers as a holder (see each kind), as deserializing
  // does. Never throws; a no-op for the others.
  virtual void RegisterHolder() noexcept {}

 protected:
  // The part of Claim() that is shared with other handles of the same promise (other processes):
  // throws FutureError(kPromiseAlreadySatisfied) when one of them claimed it first.
  virtual void ClaimShared(const char* producer) {}

 private:
  std::atomic<const char*> claimed_by_{nullptr};
};

// ---- memory kind: both ends in one process, a SharedState between them. ----

template <typename T>
class MemoryFuture final : public FutureBackend<T> {
 public:
  explicit MemoryFuture(std::shared_ptr<SharedState<T>> state) : state_(std::move(state)) {}
  ~MemoryFuture() override { state_->DropResult(); }
  T Get() override { return state_->Take(); }
  T Value() override { return state_->Peek(); }
  bool WaitUntil(Deadline deadline) const override { return state_->WaitUntil(deadline); }
  bool IsReady() const override { return state_->IsReady(); }
  bool Valid() const override { return state_->Valid(); }
  void OnReady(std::function<void()> callback) override { state_->OnReady(std::move(callback)); }

 private:
  const std::shared_ptr<SharedState<T>> state_;
};

template <typename T>
class MemoryPromise final : public PromiseBackend<T> {
 public:
  MemoryPromise() : state_(std::make_shared<SharedState<T>>()) {}
  MemoryPromise(const MemoryPromise&) = delete;
  MemoryPromise& operator=(const MemoryPromise&) = delete;

  ~MemoryPromise() override {
    state_->TryComplete(Result<T>::Error(
        FutureErrc::kBrokenPromise,
        "the promise was destroyed before a value or an exception was set"));
  }

  void Complete(Result<T> result) override { state_->Complete(std::move(result)); }
  // (Not in a forked child: its claim fails anyway, and the pair's mutex may have been held by a
  // thread of the parent.)
  bool CompletesQuietly() const override {
    return ForkGeneration() == created_in_ && state_->HasNoWaiters();
  }
  std::unique_ptr<FutureBackend<T>> GetFuture() override {
    if (future_retrieved_.exchange(true)) {
      throw FutureError(FutureErrc::kFutureAlreadyRetrieved, kFutureRetrievedDetail);
    }
    return std::make_unique<MemoryFuture<T>>(state_);
  }
  std::string Serialize() override {
    throw FutureError(FutureErrc::kCannotLeaveProcess,
                      "memory promises cannot leave the process (pickle, serialize(), "
                      "torch.jit.save of a module holding one); create the pair with a kind that "
                      "crosses processes (kind='file', or dtorch_ops.TensorPromise.for_tensor)");
  }
  const char* Kind() const override { return "memory"; }

 protected:
  // Its future lives in the process that created it: a forked child cannot reach it.
  void ClaimShared(const char* producer) override {
    if (ForkGeneration() != created_in_) {
      throw FutureError(FutureErrc::kCannotLeaveProcess,
                        std::string(producer) + " on a memory promise in a forked child: its "
                        "future is in the parent process, which this process cannot reach. "
                        "Create the pair with kind='file' to fulfil it from a child process");
    }
  }

 private:
  const std::shared_ptr<SharedState<T>> state_;
  std::atomic<bool> future_retrieved_{false};
  const uint64_t created_in_ = ForkGeneration();
};

}  // namespace dtorch::core
