// The event-gated get_tensor kernel, shared by every event-capable backend.
#include <optional>
#include <string>

#include <ATen/core/grad_mode.h>

#include "../core/completion_pool.h"
#include "device_completion.h"
#include "get_tensor.h"

namespace dtorch::kernels {
namespace {
using Producer = detail::ProducerAccess<at::Tensor>;
}  // namespace

void CompleteFromDevice(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise,
                        const char* caller) {
  Producer::CheckValue(*promise, input, caller);
  CheckNotCapturing(input.device(), caller);  // before the snapshot copy is queued (captured)
  Producer::Claim(*promise, caller);
  at::Tensor snapshot;
  try {
    // A library-owned block on the same device, written by a copy queued on the current stream:
    // later work queued there cannot change it. Dense, whatever the input's layout in memory.
    at::NoGradGuard no_grad;
    snapshot = input.detach().clone(c10::MemoryFormat::Preserve);
  } catch (...) {
    Producer::FailClaimed(*promise, std::string(caller) + " could not copy the value on " +
                                        input.device().str() + ": " + CurrentExceptionMessage());
    throw;
  }
  try {
    AfterCurrentStreamWork(
        input.device(), [snapshot, promise](const std::optional<core::FutureError>& error) {
          if (error) {
            // (A copy that never ran, or a device that failed: nothing reads the snapshot.)
            Producer::FailClaimed(*promise, error->code(), error->detail());
            return;
          }
          // Exporting or staging the value (a device-to-host copy, an IPC handle) is long or
          // may block: on the pool, not on the detector.
          try {
            core::CompletionPool::Instance().Post(
                [snapshot, promise] { Producer::CompleteClaimed(*promise, snapshot); });
          } catch (const std::exception& e) {
            Producer::FailClaimed(*promise,
                                  std::string("the value could not be published: ") + e.what());
          }
        });
  } catch (...) {
    // Nothing will complete the claimed promise: fail it, so its waiter does not hang either.
    // The snapshot's copy may still be queued: its memory is kept (abandoned), not reused.
    new at::Tensor(snapshot);
    Producer::FailClaimed(*promise, std::string(caller) + " could not wait for " +
                                        input.device().str() + ": " + CurrentExceptionMessage());
    throw;
  }
}

void get_tensor_device(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise) {
  TORCH_CHECK(promise, "dtorch: get_tensor needs a TensorPromise, got None");
  if (Producer::CopiesValueOut(*promise)) {
    CompleteFromDevice(input, promise, "get_tensor");
    return;
  }
  // A kind that cannot carry a device tensor refuses it here.
  Producer::CheckValue(*promise, input, "get_tensor");
  CheckNotCapturing(input.device(), "get_tensor");  // refused before anything is claimed
  // Claimed now: a used promise raises here, as on CPU, and any later completion raises too.
  Producer::Claim(*promise, "get_tensor");
  try {
    // The callback owns the tensor until the event fired: its memory outlives the device work.
    AfterCurrentStreamWork(input.device(), [value = DetachedValue(input), promise](
                                               const std::optional<core::FutureError>& error) {
      if (error) {
        Producer::FailClaimed(*promise, error->code(), error->detail());
      } else {
        Producer::CompleteClaimed(*promise, value);
      }
    });
  } catch (...) {
    // Nothing will complete the claimed promise (no event, or no thread to watch it: a
    // std::system_error): fail it, so its waiter does not hang either.
    Producer::FailClaimed(*promise, "get_tensor could not wait for " + input.device().str() +
                                       ": " + CurrentExceptionMessage());
    throw;
  }
}

}  // namespace dtorch::kernels
