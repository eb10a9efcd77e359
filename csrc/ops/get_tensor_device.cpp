// The event-gated get_tensor kernel, shared by every event-capable backend.
#include <optional>
#include <string>

#include "device_completion.h"
#include "get_tensor.h"

namespace dtorch::kernels {
namespace {
using Producer = detail::ProducerAccess<at::Tensor>;
}  // namespace

void get_tensor_device(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise) {
  TORCH_CHECK(promise, "dtorch: get_tensor needs a TensorPromise, got None");
  Producer::CheckValue(*promise, input);  // a kind that cannot carry a device tensor refuses it here
  // Claimed now: a used promise raises here, as on CPU, and any later completion raises too.
  Producer::Claim(*promise, "get_tensor");
  try {
    // The callback owns the tensor until the event fired: its memory outlives the device work.
    AfterCurrentStreamWork(input.device(),
                           [input, promise](const std::optional<core::FutureError>& error) {
                             if (error) {
                               Producer::FailClaimed(*promise, error->code(), error->detail());
                             } else {
                               Producer::CompleteClaimed(*promise, input);
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
