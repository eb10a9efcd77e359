// Promise/future pairs as TorchScript custom classes (torch.classes.dtorch.*) and as the C++ API:
//   TensorPromise / TensorFuture   carry a tensor (get_tensor fulfils the promise);
//   VoidPromise / VoidFuture       carry only completion (sync fulfils them);
//   VoidFutureCollect              several VoidFutures, one per device, awaited as one;
//   ReadyNotifier                  an event loop's wake-up channel (asyncio `await`).
//
// A promise is the producer's end; get_future() hands out its single consumer end. Both are thin,
// thread-safe handles over a core backend of one kind ("memory": same process; "file": processes
// of one host, core/file_kind.h). Both are held by intrusive_ptr, so a kernel that still has to
// fulfil a promise keeps it alive; when the last reference to an unfulfilled promise goes, its
// future fails with "broken promise".
//
// Values: a memory TensorFuture yields the tensor the producer set, not a copy (it aliases the
// input of get_tensor); a file TensorFuture yields a view of a shared copy (ops/tensor_codec.h).
//
// Errors surface as c10 errors that keep the core's code (ops/errors.h): RuntimeError in
// TorchScript, dtorch_ops.errors' classes in Python.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/custom_class.h>

#include "../core/fork_generation.h"
#include "../core/promise_future.h"
#include "../core/ready_notifier.h"

namespace dtorch {

// torch.classes.dtorch.ReadyNotifier: an event loop's wake-up channel (see core/ready_notifier.h).
// One per asyncio loop, created by dtorch_ops; futures post tokens to it when they complete.
class ReadyNotifier : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = "ReadyNotifier";
  ReadyNotifier() : core_(std::make_shared<core::ReadyNotifier>()) {}
  const char* Kind() const { return "eventfd"; }
  int64_t FileNo() const { return core_->fd(); }
  std::vector<int64_t> Drain() { return core_->Drain(); }
  // Pending completion callbacks hold it weakly (NotifyWhenReady): this object owns the eventfd.
  const std::shared_ptr<core::ReadyNotifier>& core() const { return core_; }

 private:
  const std::shared_ptr<core::ReadyNotifier> core_;
};

template <typename T>
struct PairNames;
template <>
struct PairNames<at::Tensor> {
  static constexpr const char* kFuture = "TensorFuture";
  static constexpr const char* kPromise = "TensorPromise";
};
template <>
struct PairNames<core::Unit> {
  static constexpr const char* kFuture = "VoidFuture";
  static constexpr const char* kPromise = "VoidPromise";
};

template <typename T>
class Future : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = PairNames<T>::kFuture;
  // kind: the backend's kind name (a string with static storage).
  Future(std::unique_ptr<core::FutureBackend<T>> backend, const char* kind);

  // Blocks until the value is ready and returns it; consumes the future (Valid() is false after).
  T Get();
  // Like Get() if the value arrives within timeout_ms; otherwise throws ("dtorch: timed out")
  // and the future stays valid.
  T Wait(int64_t timeout_ms);
  // The value of a completed future without consuming it, as torch.futures.Future.value(): the
  // same tensor each time (no copy), or the completion's error raised, also after Get() took it
  // (the future keeps it while it lives). Raises "not ready" before completion; never blocks.
  T Value();
  // Blocks up to timeout_ms; true once ready (value or error). Never consumes.
  bool WaitFor(int64_t timeout_ms) const;
  bool IsReady() const;
  bool Valid() const;
  std::string Kind() const { return kind_; }
  // Runs callback once when the value (or an error) is ready, on the completing thread, or at once
  // if it already is. For event-loop integration; callback must be cheap and must not block.
  void OnReady(std::function<void()> callback);

 private:
  const std::unique_ptr<core::FutureBackend<T>> backend_;
  const char* const kind_;  // static storage: the kind registry's name
};

template <typename T>
class Promise : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = PairNames<T>::kPromise;
  // kind: a kind spec (core/kind_registry.h): "memory" (same process) or "file" (processes of
  // one host). Unknown or unavailable kinds raise ValueError.
  explicit Promise(const std::string& kind);
  explicit Promise(std::unique_ptr<core::PromiseBackend<T>> backend);
  // The promise another process serialized (Serialize()); untrusted input, validated before
  // anything is opened. It attaches to the pair on first use, not here.
  static c10::intrusive_ptr<Promise> FromSerialized(const std::string& serialized);

  // Fulfils the promise; a second completion throws and the first value is kept. `caller` names
  // the call in that error (a string literal: the get_tensor kernel on CPU passes its own name).
  void SetValue(T value, const char* caller = "set_value");
  void SetException(const std::string& message);
  // Refuses a value this promise's kind cannot carry (a device tensor in a file promise), before
  // anything is claimed.
  void CheckValue(const T& value) const;
  // For asynchronous producers (the device get_tensor kernel, sync_into): Claim() reserves the
  // promise at once, so that any other completion (or claim) raises now, as on CPU, rather than
  // being dropped later; the producer then completes it with CompleteClaimed / FailClaimed,
  // which never throw. `producer` names the call (a string literal: it is kept) so that a second
  // one can be told which call fulfils the promise.
  void Claim(const char* producer);
  void CompleteClaimed(T value) noexcept;
  // Fails with a producer error (`message`), or with an error of `code` (a device error, a value
  // dropped at exit or fork).
  void FailClaimed(const std::string& message) noexcept;
  void FailClaimed(core::FutureErrc code, const std::string& detail) noexcept;
  // The consumer's end; callable once.
  c10::intrusive_ptr<Future<T>> GetFuture();
  std::string Kind() const { return kind_; }
  // A string another process can turn back into this promise (FromSerialized). Memory promises
  // cannot leave the process and raise TypeError.
  std::string Serialize() const;

 private:
  const std::unique_ptr<core::PromiseBackend<T>> backend_;
  const char* const kind_;  // static storage: the kind registry's name
};

using TensorFuture = Future<at::Tensor>;
using TensorPromise = Promise<at::Tensor>;
using VoidFuture = Future<core::Unit>;
using VoidPromise = Promise<core::Unit>;

extern template class Future<at::Tensor>;
extern template class Future<core::Unit>;
extern template class Promise<at::Tensor>;
extern template class Promise<core::Unit>;

// The VoidFutures of one sync, one per device, awaited as one: ready when all are; Get() raises
// the error of the first device (in `devices` order) that failed, naming it. Thread-safe.
class VoidFutureCollect : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = "VoidFutureCollect";
  VoidFutureCollect(std::vector<c10::Device> devices,
                    std::vector<c10::intrusive_ptr<VoidFuture>> futures);

  // Blocks until every device is done; consumes. Throws "dtorch: sync on <device> failed: ...".
  void Get();
  // Like Get() within timeout_ms (for all devices together); otherwise throws ("timed out") and
  // stays valid.
  void Wait(int64_t timeout_ms);
  // Get()'s outcome without consuming, once every device is done, also after Get() (see
  // Future::Value); raises "not ready" before.
  void Value() const;
  bool WaitFor(int64_t timeout_ms) const;
  bool IsReady() const;
  bool Valid() const;
  const char* Kind() const { return "memory"; }
  const std::vector<c10::Device>& Devices() const { return devices_; }
  // Runs callback once every device is done (or failed); see Future::OnReady.
  void OnReady(std::function<void()> callback);

 private:
  // Reads each device's future with `read` (Get or Value); throws the first error, naming its
  // device.
  template <typename Read>
  void ThrowFirstDeviceError(Read read) const;

  const std::vector<c10::Device> devices_;
  const std::vector<c10::intrusive_ptr<VoidFuture>> futures_;
  std::atomic<bool> consumed_{false};
};

// Posts `token` to `notifier` once `waitable` (a Future or a VoidFutureCollect) is ready, at once
// if it is: how an event loop awaits it (dtorch_ops' __await__). Never consumes. The pending
// callback holds the notifier weakly: a notifier dropped with its event loop closes its eventfd
// at once, however many futures it was waiting for, and a late completion posts nothing.
template <typename Waitable>
void NotifyWhenReady(const c10::intrusive_ptr<Waitable>& waitable,
                     const c10::intrusive_ptr<ReadyNotifier>& notifier, int64_t token) {
  TORCH_CHECK(notifier, "dtorch: notify_when_ready needs a ReadyNotifier, got None");
  // An event loop belongs to the process that registered it: a value failed in a fork child does
  // not post to the parent's loop (the eventfd is shared between them).
  waitable->OnReady([weak = std::weak_ptr<core::ReadyNotifier>(notifier->core()), token,
                     generation = core::ForkGeneration()] {
    if (generation != core::ForkGeneration()) return;
    if (const auto core = weak.lock()) core->Post(token);
  });
}

// A c10::Error's message without its leading "dtorch: ", for nesting it in another message.
std::string NestedMessage(const c10::Error& error);
// The message of the exception being handled (call inside a catch block): NestedMessage for a
// c10::Error, what() for other std::exceptions.
std::string CurrentExceptionMessage();

// The promise kind for a pair whose promise a worker will fulfil with `tensor`: CPU -> "memory";
// a device tensor with per_device_per_process -> "file" (one worker process per device);
// otherwise "memory".
std::string PromiseKindFor(const at::Tensor& tensor, bool per_device_per_process);
// A promise of the kind PromiseKindFor advises (TensorPromise.for_tensor in Python).
c10::intrusive_ptr<TensorPromise> TensorPromiseFor(const at::Tensor& tensor,
                                                   bool per_device_per_process);
// The seed's CreateTensorPromiseFromSerialized(): TensorPromise::FromSerialized.
inline c10::intrusive_ptr<TensorPromise> CreateTensorPromiseFromSerialized(
    const std::string& serialized) {
  return TensorPromise::FromSerialized(serialized);
}

}  // namespace dtorch
