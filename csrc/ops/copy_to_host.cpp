// The host copy (dtorch::copy_to_host_async, copy_list_to_host_async): one kernel for every
// device, over torch's own non-blocking copy and the device-generic completion after stream work.
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "device_completion.h"
#include "get_tensor.h"

namespace dtorch {
namespace kernels {
namespace {

// Tensors whose memory a copy may still be reading, or that belong to a runtime being torn down
// (exit) or to the parent process (fork): kept for good rather than freed (freeing them could
// hand a block to new work while a copy still reads it, or run the allocator of a dead runtime).
// As the detectors leak a dropped completion (core/completion_detectors.h).
void Abandon(std::vector<at::Tensor> tensors) {
  if (!tensors.empty()) new std::vector<at::Tensor>(std::move(tensors));
}

bool Dropped(core::FutureErrc code) {
  return code == core::FutureErrc::kDroppedAtExit || code == core::FutureErrc::kDroppedAtFork;
}

// What the copies of one call need until the event of the last device has fired: the sources
// (alive while their copies may still read them), the copies and the promise.
template <typename T>
struct PendingCopies {
  std::vector<at::Tensor> sources;
  std::vector<at::Tensor> copies;
  core::MemoryPromise<T> promise;
  std::atomic<size_t> devices_left{0};
  std::mutex mu;
  std::optional<core::FutureError> first_error;  // guarded by mu
  bool abandon = false;                          // guarded by mu: see Abandon

  // `in_flight`: copies may still be running (no event will say when they are done).
  void Fail(core::FutureError error, bool in_flight) {
    std::lock_guard<std::mutex> lock(mu);
    abandon = abandon || in_flight || Dropped(error.code());
    if (!first_error) first_error = std::move(error);
  }
  // One device's copies have landed (or failed); the last one completes the promise.
  void DeviceDone(T (*pack)(std::vector<at::Tensor>)) noexcept {
    if (devices_left.fetch_sub(1) != 1) return;
    std::optional<core::FutureError> error;
    {
      std::lock_guard<std::mutex> lock(mu);
      error = first_error;
      if (abandon) {
        Abandon(std::move(sources));
        Abandon(std::move(copies));
      }
    }
    sources.clear();
    try {
      promise.Complete(error ? core::Result<T>::Error(error->code(), error->detail())
                             : core::Result<T>::Value(pack(std::move(copies))));
    } catch (...) {
      // A memory promise does not throw; nothing else could be told.
    }
  }
};

// Queues a non-blocking copy of each device input (pending.sources: the detached inputs) and
// records its device in `devices`; pending.copies gets one CPU tensor per input.
template <typename T>
void QueueCopies(const char* op, const std::vector<at::Tensor>& inputs, PendingCopies<T>& pending,
                 std::vector<c10::Device>& devices) {
  pending.copies.reserve(inputs.size());
  for (const auto& input : inputs) {
    TORCH_CHECK_TYPE(input.defined(), "dtorch: ", op, " needs tensors, got an undefined one");
    // Detached: the copy is a value to log, not part of the autograd graph.
    at::Tensor value = input.detach();
    if (value.device().is_cpu()) {
      pending.copies.push_back(std::move(value));  // host memory already: no copy
      continue;
    }
    // Refused before anything is queued on a stream under graph capture: the capture would
    // record the copy, not run it.
    CheckNotCapturing(input.device(), op);
    // Non-blocking from an accelerator: torch pins the destination (CUDA's caching host
    // allocator, a PrivateUse1 backend's pinned allocator) and queues the copy on the current
    // stream of the input's device.
    pending.copies.push_back(value.to(c10::Device(c10::kCPU), value.scalar_type(),
                                      /*non_blocking=*/true, /*copy=*/false));
    pending.sources.push_back(std::move(value));
    if (std::find(devices.begin(), devices.end(), input.device()) == devices.end()) {
      devices.push_back(input.device());
    }
  }
}

template <typename T>
c10::intrusive_ptr<Future<T>> CopyToHost(const char* op, const std::vector<at::Tensor>& inputs,
                                         T (*pack)(std::vector<at::Tensor>)) {
  auto pending = std::make_shared<PendingCopies<T>>();
  auto future = c10::make_intrusive<Future<T>>(pending->promise.GetFuture(),
                                               pending->promise.Kind());
  std::vector<c10::Device> devices;  // of the device inputs, each once, in order
  try {
    QueueCopies(op, inputs, *pending, devices);
  } catch (...) {
    // The copies queued so far may still read their sources and write their destinations.
    Abandon(std::move(pending->sources));
    Abandon(std::move(pending->copies));
    throw;
  }
  pending->devices_left = devices.size() + 1;  // + 1: this call, until every event is recorded
  for (size_t i = 0; i < devices.size(); ++i) {
    try {
      AfterCurrentStreamWork(devices[i], [pending, pack](
                                             const std::optional<core::FutureError>& error) {
        if (error) pending->Fail(*error, /*in_flight=*/false);
        pending->DeviceDone(pack);
      });
    } catch (...) {
      // Nothing will report for this device or the ones after it (no event, or no thread to
      // watch it): fail the value, so that no waiter hangs, and raise.
      pending->Fail(core::FutureError(core::FutureErrc::kProducerError,
                                      std::string(op) + " could not wait for " +
                                          devices[i].str() + ": " + CurrentExceptionMessage()),
                    /*in_flight=*/true);
      for (size_t j = i; j <= devices.size(); ++j) pending->DeviceDone(pack);
      throw;
    }
  }
  pending->DeviceDone(pack);
  return future;
}

at::Tensor First(std::vector<at::Tensor> copies) { return std::move(copies.front()); }
std::vector<at::Tensor> All(std::vector<at::Tensor> copies) { return copies; }

}  // namespace

c10::intrusive_ptr<TensorFuture> copy_to_host_async(const at::Tensor& input) {
  TORCH_CHECK_TYPE(input.defined(), "dtorch: copy_to_host_async(input) needs a tensor, got None");
  return CopyToHost<at::Tensor>("copy_to_host_async", {input}, &First);
}

c10::intrusive_ptr<TensorListFuture> copy_list_to_host_async(at::TensorList inputs) {
  return CopyToHost<std::vector<at::Tensor>>("copy_list_to_host_async", inputs.vec(), &All);
}

c10::intrusive_ptr<TensorFuture> refuse_in_transform_copy_to_host_async(const at::Tensor&) {
  RefuseInTransform("copy_to_host_async (to_torch_async(t, device=\"cpu\"))");
}

c10::intrusive_ptr<TensorListFuture> refuse_in_transform_copy_list_to_host_async(
    at::TensorList) {
  RefuseInTransform("copy_list_to_host_async (to_torch_async([...], device=\"cpu\"))");
}

}  // namespace kernels

namespace {
void CheckHost(c10::Device device) {
  TORCH_CHECK_VALUE(device.is_cpu(), "dtorch: GetTensorAsync(input, device) copies to the host: "
                    "device must be the CPU, got ", device);
}
}  // namespace

c10::intrusive_ptr<TensorFuture> GetTensorAsync(const at::Tensor& input, c10::Device device) {
  CheckHost(device);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dtorch::copy_to_host_async", "")
                             .typed<c10::intrusive_ptr<TensorFuture>(const at::Tensor&)>();
  return op.call(input);
}

c10::intrusive_ptr<TensorListFuture> GetTensorAsync(const std::vector<at::Tensor>& inputs,
                                                    c10::Device device) {
  CheckHost(device);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dtorch::copy_list_to_host_async", "")
                             .typed<c10::intrusive_ptr<TensorListFuture>(at::TensorList)>();
  return op.call(inputs);
}

}  // namespace dtorch
