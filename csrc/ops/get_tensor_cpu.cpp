#include "get_tensor.h"

namespace dtorch::kernels {

void get_tensor_cpu(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise) {
  TORCH_CHECK(promise, "dtorch: get_tensor needs a TensorPromise, got None");
  detail::ProducerAccess<at::Tensor>::SetValue(*promise, DetachedValue(input), "get_tensor");
}

}  // namespace dtorch::kernels
