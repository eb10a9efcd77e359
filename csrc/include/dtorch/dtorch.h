// <dtorch/dtorch.h>: the C++ (libtorch) API of dtorch_ops. Include this one header.
//
// Find it with CMake: find_package(dtorch_ops) (CMAKE_PREFIX_PATH: dtorch_ops.cmake_prefix_path())
// and link the imported target dtorch_ops::dtorch_ops, which carries this include directory and
// libdtorch_ops.so, linked so that it stays loaded: its static initialisers register the ops and
// classes (torch.ops.dtorch.*, torch.classes.dtorch.*) that TorchScript modules using them need
// at torch::jit::load. The library depends on libtorch only (no Python). See examples/cpp/.
//
// Values. GetTensorAsync(t) returns at once a future that yields t itself (no copy; t.detach()
// where t requires grad, so that the future never holds t's autograd graph) once the work queued so
// far on t's device's current stream has finished: at once on CPU; on a device, when an
// event recorded on that stream has completed (a library thread watches it; other streams are not
// waited for, and the device is not synchronised). A "file" promise carries a tensor to another
// process of the same host (its consumer receives a copy in shared memory, or a device copy); a
// "network" promise to another host, through a torch.distributed store.
//
// Handles. Promises and futures are c10::intrusive_ptr handles to the TorchScript classes
// torch.classes.dtorch.*: the same objects a scripted module passes around, shareable between
// threads, destroyed with their last reference. Every method of every class here is thread-safe.
//
// Errors. A promise's or future's failure (broken promise, timeout, producer error, ...) is a
// c10::Error with a "dtorch: <cause>: <detail>" message and a code: CodeOf(error)->code(), a
// FutureErrc (dtorch/types.h), so that no caller parses messages (a serialized promise that is
// malformed is also a c10::ValueError, a promise that cannot leave its process a c10::TypeError).
// A bad argument (a negative timeout, a null handle, an unknown kind, an undefined tensor) is a
// c10::Error or c10::ValueError without a code: CodeOf gives nullptr.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>

#include "export.h"
#include "types.h"

namespace dtorch {

namespace core {  // the library's backends: not part of this API
template <typename T>
class FutureBackend;
template <typename T>
class PromiseBackend;
class NativeError;
struct ErrorInfo;
}  // namespace core

namespace detail {
template <typename T>
struct PairNames;
template <>
struct PairNames<at::Tensor> {
  static constexpr const char* kFuture = "TensorFuture";
  static constexpr const char* kPromise = "TensorPromise";
};
template <>
struct PairNames<Unit> {
  static constexpr const char* kFuture = "VoidFuture";
  static constexpr const char* kPromise = "VoidPromise";
};
template <>
struct PairNames<std::vector<at::Tensor>> {
  static constexpr const char* kFuture = "TensorListFuture";
  static constexpr const char* kPromise = "TensorListPromise";  // (not a class: made by ops only)
};
template <typename T>
class ProducerAccess;  // the library's kernels' access to Promise's claim (not for users)
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Errors

// What every error of this library carries besides its c10::Error base.
class DTORCH_API CodedErrorBase {
 public:
  explicit CodedErrorBase(FutureErrc code) : code_(code) {}
  virtual ~CodedErrorBase();
  FutureErrc code() const noexcept { return code_; }
  // A producer error set from an exception (Python's set_exception(exc)): the exception type's
  // name in the producer ("ValueError"; empty when a message was set), its message, and the
  // producer's traceback text (may be empty; cut to a few KB, its end kept).
  const std::string& exception_type() const noexcept { return exception_type_; }
  const std::string& exception_message() const noexcept { return exception_message_; }
  const std::string& producer_traceback() const noexcept { return producer_traceback_; }
  // The exception object itself, when it was set in this process (for the binding that set it).
  const std::shared_ptr<const core::NativeError>& native_exception() const noexcept {
    return native_exception_;
  }
  void SetOrigin(std::string exception_type, std::string exception_message,
                 std::string producer_traceback,
                 std::shared_ptr<const core::NativeError> native_exception) {
    exception_type_ = std::move(exception_type);
    exception_message_ = std::move(exception_message);
    producer_traceback_ = std::move(producer_traceback);
    native_exception_ = std::move(native_exception);
  }

 private:
  FutureErrc code_;
  std::string exception_type_;
  std::string exception_message_;
  std::string producer_traceback_;
  std::shared_ptr<const core::NativeError> native_exception_;
};

// The code of a promise's or future's failure, or nullptr for another error (see "Errors").
inline const CodedErrorBase* CodeOf(const c10::Error& error) {
  return dynamic_cast<const CodedErrorBase*>(&error);
}

// ---------------------------------------------------------------------------------------------
// Futures: the consumer's end (torch.classes.dtorch.TensorFuture / VoidFuture / TensorListFuture)

// Created by Promise::GetFuture() or GetTensorAsync(); one consumer end per promise. Only Get()
// consumes (it may succeed once); every other method may be called any number of times,
// concurrently, before and after it. A future keeps its completion while it lives: Value() and
// Wait() return it also after Get(), and IsReady() stays true.
template <typename T>
class DTORCH_API Future : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = detail::PairNames<T>::kFuture;
  // Made by the library (its backend type is internal; null: c10::ValueError).
  Future(std::unique_ptr<core::FutureBackend<T>> backend, const char* kind);
  ~Future() override;

  // Blocks until the value is ready and returns it; consumes (Valid() is false after, and a second
  // Get() throws FutureErrc::kNoState). Throws the completion's error instead, if it failed.
  T Get();
  // Blocks until the value is ready and returns it (as Value()) without consuming it, as
  // torch.futures.Future.wait() (std::future::wait_for does not consume either): the future
  // stays valid. Throws the completion's error instead, if it failed.
  T Wait();
  // The same, waiting at most timeout_ms (>= 0); past it throws FutureErrc::kTimeout (the future
  // stays valid).
  T Wait(int64_t timeout_ms);
  // The value of a completed future without consuming it, as torch.futures.Future.value(): the
  // same tensor each time (no copy), or the completion's error thrown. Throws FutureErrc::kNotReady
  // before completion; never blocks.
  T Value();
  // Blocks up to timeout_ms; true once ready (value or error). Never consumes.
  bool WaitFor(int64_t timeout_ms) const;
  // Whether the future is complete (a value or an error is there), as
  // torch.futures.Future.done(): also true after Get() took the value. Never blocks.
  bool IsReady() const;
  // False once Get() took the value.
  bool Valid() const;
  // The kind of the pair: "memory", "file" or "network".
  std::string Kind() const { return kind_; }
  // Runs `callback` once when the value (or an error) is ready: on the completing thread (a library
  // thread for device values), or at once on this thread if it already is. It must be cheap, must
  // not block and must not throw; hold what it needs by value.
  void OnReady(std::function<void()> callback);

 private:
  const std::unique_ptr<core::FutureBackend<T>> backend_;
  const char* const kind_;  // static storage: the kind registry's name
};

// ---------------------------------------------------------------------------------------------
// Promises: the producer's end (torch.classes.dtorch.TensorPromise / VoidPromise)

// Fulfilled once, by SetValue/SetException or by an op (GetTensor, SyncInto). When the last
// reference to an unfulfilled promise goes (or, for a file or network promise, its process dies), its future
// fails with FutureErrc::kBrokenPromise instead of waiting forever.
template <typename T>
class DTORCH_API Promise : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = detail::PairNames<T>::kPromise;
  // kind: "memory" (same process), "file" (processes of one host, through shared memory) or
  // "network://host:port" (hosts, through the TCPStore at that address).
  // Throws c10::ValueError for an unknown kind. Make promises with c10::make_intrusive (as
  // every handle here is): a promise completed later (a device value) keeps a reference to itself.
  explicit Promise(const std::string& kind);
  // Made by the library (its backend type is internal; null: c10::ValueError).
  explicit Promise(std::unique_ptr<core::PromiseBackend<T>> backend);
  ~Promise() override;
  // The promise that another process serialized with Serialize(): untrusted input, validated
  // before anything is opened (c10::ValueError, FutureErrc::kInvalidHandle, if malformed). This
  // process holds the pair from now on (its death or exit without setting breaks the future);
  // a handle that does not match its pair, or a pair it cannot reach, raises at first use.
  static c10::intrusive_ptr<Promise> FromSerialized(const std::string& serialized);

  // Fulfils the promise with `value` (a memory future yields this very tensor; a file or network future a
  // copy: of a CPU tensor made now, of a device tensor a snapshot queued now on its current
  // stream and published once done). A second completion throws
  // FutureErrc::kPromiseAlreadySatisfied and the first value is kept.
  void SetValue(T value);
  // Fails the future with FutureErrc::kProducerError and `message`.
  void SetException(const std::string& message);
  // The same, for an exception: its type's name ("ValueError": a Python consumer raises that
  // type where it is a built-in one, else a ProducerError naming it) and the producer's
  // traceback text (may be empty).
  void SetException(const std::string& message, const std::string& exception_type,
                    const std::string& traceback);
  // The consumer's end; callable once (then FutureErrc::kFutureAlreadyRetrieved). For a file or
  // network promise, only in the process that created the pair.
  c10::intrusive_ptr<Future<T>> GetFuture();
  std::string Kind() const { return kind_; }
  // A string another process turns back into this promise (FromSerialized). A memory promise
  // cannot leave its process: c10::TypeError (FutureErrc::kCannotLeaveProcess).
  std::string Serialize() const;

 private:
  friend class detail::ProducerAccess<T>;
  // SetValue, naming the op that fulfils the promise (a string literal: the claim keeps it).
  void SetValueFrom(T value, const char* caller);
  // Fails the promise with `error` (set_exception of the bindings), naming `caller`.
  void SetError(const core::ErrorInfo& error, const char* caller);
  // This process holds the promise (a binding received it without deserializing it).
  void RegisterHolder() noexcept;
  // For producers that complete later (the device get_tensor kernel, sync_into): Claim() reserves
  // the promise at call time, so that any other completion raises now; the producer then completes
  // with CompleteClaimed / FailClaimed, which never throw.
  // CheckValue refuses a value this kind cannot carry, and then fails the promise with that
  // refusal too (RefuseValue), so that a consumer elsewhere learns why no value comes.
  void CheckValue(const T& value, const char* caller);
  void RefuseValue(const char* caller, const std::string& why) noexcept;
  // Whether the kind copies the value out of this process (file, network): a device value must then be
  // snapshotted on its stream before it is completed.
  bool CopiesValueOut() const;
  // Whether setting a CPU value now would wake nobody and copy nothing (core::PromiseBackend).
  bool CompletesQuietly() const;
  void Claim(const char* producer);
  void CompleteClaimed(T value) noexcept;
  void FailClaimed(const std::string& message) noexcept;
  void FailClaimed(FutureErrc code, const std::string& detail) noexcept;

  const std::unique_ptr<core::PromiseBackend<T>> backend_;
  const char* const kind_;  // static storage: the kind registry's name
};

using TensorFuture = Future<at::Tensor>;
using TensorPromise = Promise<at::Tensor>;
using VoidFuture = Future<Unit>;
using VoidPromise = Promise<Unit>;
// Several tensors that arrive together: the host copies of GetTensorAsync(inputs, kCPU).
using TensorListFuture = Future<std::vector<at::Tensor>>;

extern template class DTORCH_API Future<at::Tensor>;
extern template class DTORCH_API Future<Unit>;
extern template class DTORCH_API Future<std::vector<at::Tensor>>;
extern template class DTORCH_API Promise<at::Tensor>;
extern template class DTORCH_API Promise<Unit>;

// The VoidFutures of one sync, one per device, awaited as one (torch.classes.dtorch.
// VoidFutureCollect): ready when all are. Get() throws the error of the first device (in Devices()
// order) that failed, naming it; the others' errors are dropped.
class DTORCH_API VoidFutureCollect : public torch::CustomClassHolder {
 public:
  static constexpr const char* kClassName = "VoidFutureCollect";
  VoidFutureCollect(std::vector<c10::Device> devices,
                    std::vector<c10::intrusive_ptr<VoidFuture>> futures);

  // Blocks until every device is done; consumes (see Future::Get).
  void Get();
  // Blocks until every device is done and throws the first device's error, if any, without
  // consuming (see Future::Wait); with timeout_ms, for all devices together, else throws
  // FutureErrc::kTimeout.
  void Wait();
  void Wait(int64_t timeout_ms);
  // Get()'s outcome without consuming, once every device is done, also after Get(); throws
  // FutureErrc::kNotReady before.
  void Value() const;
  bool WaitFor(int64_t timeout_ms) const;
  bool IsReady() const;
  bool Valid() const;
  std::string Kind() const { return "memory"; }
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

// ---------------------------------------------------------------------------------------------
// Getting a tensor's value (the ops dtorch::get_tensor_async / get_tensor, through the dispatcher)

// Returns at once a memory future that yields `input` (not a copy) once the work producing it on
// its device's current stream has finished; see "Values" above.
DTORCH_API c10::intrusive_ptr<TensorFuture> GetTensorAsync(const at::Tensor& input);
// Fulfils `promise` (possibly another process's: a file promise) with `input` the same way.
// Returns at once; throws now if the promise was already used or cannot carry `input`.
DTORCH_API void GetTensor(const at::Tensor& input,
                          const c10::intrusive_ptr<TensorPromise>& promise);
// The seed's Tensor::GetTorchTensorAsync() / GetTorchTensor(): GetTensorAsync(input), and its
// Get() (blocks until the value is ready).
inline c10::intrusive_ptr<TensorFuture> ToTorchAsync(const at::Tensor& input) {
  return GetTensorAsync(input);
}
inline at::Tensor ToTorch(const at::Tensor& input) { return GetTensorAsync(input)->Get(); }

// The host copy (the ops dtorch::copy_to_host_async / copy_list_to_host_async): what a training
// loop wants of a loss, without the stall of .item(). `device` must be the CPU (c10::kCPU; other
// targets: c10::ValueError). Returns at once a future of a CPU copy of `input`: a non-blocking
// copy into pinned host memory (torch's cached pinned allocator, as t.to("cpu", non_blocking=True)
// makes it) queued on the current stream of input's device, and the future is ready when an event
// recorded after it has completed (no device sync; other streams are not waited for). A CPU input
// is yielded as it is (no copy). The values are detached from autograd.
DTORCH_API c10::intrusive_ptr<TensorFuture> GetTensorAsync(const at::Tensor& input,
                                                           c10::Device device);
// The same for several tensors (a loss, a metric, a learning rate): one event per device after its
// copies, one future yielding the copies in order.
DTORCH_API c10::intrusive_ptr<TensorListFuture> GetTensorAsync(
    const std::vector<at::Tensor>& inputs, c10::Device device);
inline c10::intrusive_ptr<TensorFuture> ToTorchAsync(const at::Tensor& input,
                                                     c10::Device device) {
  return GetTensorAsync(input, device);
}

// The promise kind for a pair whose promise a worker fulfils with `tensor`: "memory" for a CPU
// tensor, or for any tensor unless per_device_per_process; "file" for a device tensor when each
// device has its own worker process: such a worker passes its device tensor to GetTensor (a
// snapshot on its stream, published once done; the consumer receives it on its device, or on
// the CPU with a "file://device=cpu" promise).
DTORCH_API std::string PromiseKindFor(const at::Tensor& tensor, bool per_device_per_process);
// A promise of that kind.
DTORCH_API c10::intrusive_ptr<TensorPromise> TensorPromiseFor(const at::Tensor& tensor,
                                                              bool per_device_per_process);
// The seed's CreateTensorPromiseFromSerialized(): TensorPromise::FromSerialized.
inline c10::intrusive_ptr<TensorPromise> CreateTensorPromiseFromSerialized(
    const std::string& serialized) {
  return TensorPromise::FromSerialized(serialized);
}

// ---------------------------------------------------------------------------------------------
// Device sync (the ops dtorch::sync / sync_wait / sync_into): wait for the work queued so far on
// each device's current stream, without synchronising the devices. std::nullopt: every device
// this process has used (a context exists on it), or the CPU when there is none.

using DeviceList = std::optional<std::vector<c10::Device>>;

// Returns at once; the collect is ready when every device is.
DTORCH_API c10::intrusive_ptr<VoidFutureCollect> SyncAsync(
    const DeviceList& devices = std::nullopt);
// Blocks until every device is done (the seed's Graph::Sync()).
DTORCH_API void Sync(const DeviceList& devices = std::nullopt);
// Completes `promise` (possibly another process's) when every device is done; returns at once.
DTORCH_API void SyncInto(const DeviceList& devices,
                         const c10::intrusive_ptr<VoidPromise>& promise);

}  // namespace dtorch
