// Promise/future backends (torch-free): the abstract pair every kind implements, and the
// in-process "memory" kind.
//
// A PromiseBackend<T> is the producer's end, a FutureBackend<T> the consumer's. T is the value
// carried (at::Tensor in the torch glue; an empty struct for completion-only signals). Other
// kinds (shared memory across processes, torch.distributed) implement the same two interfaces.
//
// Lifetime: a promise destroyed before it was satisfied breaks its future: the waiter gets
// FutureError(kBrokenPromise) instead of hanging.
//
// Thread-safety: all methods of both interfaces may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "future_error.h"
#include "shared_state.h"

namespace dtorch::core {

// The value of a completion-only pair (VoidPromise / VoidFuture).
struct Unit {};

template <typename T>
class FutureBackend {
 public:
  virtual ~FutureBackend() = default;
  // Blocks until the value is ready and takes it (throws the producer's error instead, if any).
  virtual T Get() = 0;
  // Blocks up to timeout_ms; true once ready. Does not consume; the future stays valid.
  virtual bool WaitFor(int64_t timeout_ms) const = 0;
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
  // Throws FutureError(kPromiseAlreadySatisfied) on a second completion; the first one stays.
  virtual void SetValue(T value) = 0;
  // Completes with an error of `code` (kProducerError for SetException's message). Throws
  // FutureError(kPromiseAlreadySatisfied) on a second completion.
  virtual void SetError(FutureErrc code, const std::string& detail) = 0;
  void SetException(const std::string& message) { SetError(FutureErrc::kProducerError, message); }
  // The consumer's end; throws FutureError(kFutureAlreadyRetrieved) when called twice.
  virtual std::unique_ptr<FutureBackend<T>> GetFuture() = 0;
  virtual const char* Kind() const = 0;
};

// ---- memory kind: both ends in one process, a SharedState between them. ----

template <typename T>
class MemoryFuture final : public FutureBackend<T> {
 public:
  explicit MemoryFuture(std::shared_ptr<SharedState<T>> state) : state_(std::move(state)) {}
  T Get() override { return state_->Take(); }
  bool WaitFor(int64_t timeout_ms) const override { return state_->WaitFor(timeout_ms); }
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
    state_->TrySetError(FutureErrc::kBrokenPromise,
                        "the promise was destroyed before a value or an exception was set");
  }

  void SetValue(T value) override { state_->SetValue(std::move(value)); }
  void SetError(FutureErrc code, const std::string& detail) override {
    state_->SetError(code, detail);
  }
  std::unique_ptr<FutureBackend<T>> GetFuture() override {
    if (future_retrieved_.exchange(true)) {
      throw FutureError(FutureErrc::kFutureAlreadyRetrieved,
                        "get_future() was already called on this promise; it has one future");
    }
    return std::make_unique<MemoryFuture<T>>(state_);
  }
  const char* Kind() const override { return "memory"; }

 private:
  const std::shared_ptr<SharedState<T>> state_;
  std::atomic<bool> future_retrieved_{false};
};

}  // namespace dtorch::core
