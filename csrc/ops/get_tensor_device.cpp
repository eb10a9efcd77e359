// The event-gated get_tensor kernel, shared by every event-capable backend.
#include <optional>
#include <string>

#include "device_completion.h"
#include "get_tensor.h"

namespace dtorch::kernels {

void get_tensor_device(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise) {
  TORCH_CHECK(promise, "dtorch: get_tensor needs a TensorPromise, got None");
  // The CPU kernel would raise at once on a used promise; raise here too, not on a poller thread.
  TORCH_CHECK(!promise->IsSatisfied(), "dtorch: get_tensor: the promise already holds a value or "
              "an exception; a promise is fulfilled once, use a new one per value");
  // The callback owns the tensor until the event fired: its memory outlives the device work.
  AfterCurrentStreamWork(input.device(), [input, promise](const std::optional<std::string>& error) {
    // A racing producer may have satisfied the promise meanwhile: the first completion stands.
    if (error) {
      promise->TrySetException(*error + " (while waiting for the tensor)");
    } else {
      promise->TrySetValue(input);
    }
  });
}

}  // namespace dtorch::kernels
