// TensorPromise / TensorFuture: the tensor-carrying promise/future pair, as TorchScript custom
// classes (torch.classes.dtorch.*) and as the C++ API.
//
// A TensorPromise is the producer's end (get_tensor kernels fulfil it); get_future() hands out the
// single consumer end. Both are thin, thread-safe handles over a core backend of one kind
// ("memory": same process). Both hold intrusive_ptr references, so a kernel that still has to
// fulfil a promise keeps it alive; when the last reference to an unfulfilled promise goes, its
// future fails with "broken promise".
//
// Values: the future yields the tensor the producer set, not a copy (it aliases the input of
// get_tensor).
//
// Errors surface as c10::Error ("dtorch: <cause>: <detail>"): RuntimeError in Python and
// TorchScript. dtorch_ops.TensorFuture.wait maps a timeout to Python's TimeoutError.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include "../core/promise_future.h"
#include "../core/ready_notifier.h"

namespace dtorch {

using TensorFutureBackend = core::FutureBackend<at::Tensor>;
using TensorPromiseBackend = core::PromiseBackend<at::Tensor>;

// torch.classes.dtorch.ReadyNotifier: an event loop's wake-up channel (see core/ready_notifier.h).
// One per asyncio loop, created by dtorch_ops; futures post tokens to it when they complete.
class ReadyNotifier : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = "ReadyNotifier";
  ReadyNotifier() : core_(std::make_shared<core::ReadyNotifier>()) {}
  int64_t FileNo() const { return core_->fd(); }
  std::vector<int64_t> Drain() { return core_->Drain(); }
  // Shared with pending completion callbacks, which keep the eventfd open.
  const std::shared_ptr<core::ReadyNotifier>& core() const { return core_; }

 private:
  const std::shared_ptr<core::ReadyNotifier> core_;
};

class TensorFuture : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = "TensorFuture";
  TensorFuture(std::unique_ptr<TensorFutureBackend> backend, std::string kind);

  // Blocks until the value is ready and returns it; consumes the future (Valid() is false after).
  at::Tensor Get();
  // Like Get() if the value arrives within timeout_ms; otherwise throws ("dtorch: timed out")
  // and the future stays valid.
  at::Tensor Wait(int64_t timeout_ms);
  // Blocks up to timeout_ms; true once ready (value or error). Never consumes.
  bool WaitFor(int64_t timeout_ms) const;
  bool IsReady() const;
  bool Valid() const;
  const std::string& Kind() const { return kind_; }
  // Runs callback once when the value (or an error) is ready, on the completing thread, or at once
  // if it already is. For event-loop integration; callback must be cheap and must not block.
  void OnReady(std::function<void()> callback);
  // Posts `token` to `notifier` once this future is ready (at once if it is): how an event loop
  // awaits it (dtorch_ops.TensorFuture.__await__). Never consumes.
  void NotifyWhenReady(const c10::intrusive_ptr<ReadyNotifier>& notifier, int64_t token);

 private:
  const std::unique_ptr<TensorFutureBackend> backend_;
  const std::string kind_;
};

class TensorPromise : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = "TensorPromise";
  // kind: "memory" (same process). Other kinds throw a clear error until they are built.
  explicit TensorPromise(const std::string& kind);

  // Fulfils the promise; a second completion throws and the first value is kept.
  void SetValue(const at::Tensor& value);
  void SetException(const std::string& message);
  // The consumer's end; callable once.
  c10::intrusive_ptr<TensorFuture> GetFuture();
  const std::string& Kind() const { return kind_; }
  // True once a value or an exception was set.
  bool IsSatisfied() const { return backend_->IsSatisfied(); }
  // A string another process can turn back into this promise. Memory promises cannot leave the
  // process and throw.
  std::string Serialize() const;

 private:
  const std::string kind_;
  const std::unique_ptr<TensorPromiseBackend> backend_;
};

// The promise kind for a pair whose promise a worker will fulfil with `tensor`: CPU -> "memory";
// a device tensor with per_device_per_process -> "file" (one worker process per device);
// otherwise "memory".
std::string PromiseKindFor(const at::Tensor& tensor, bool per_device_per_process);

}  // namespace dtorch
