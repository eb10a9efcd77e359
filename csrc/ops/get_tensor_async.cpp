#include <ATen/core/dispatch/Dispatcher.h>

#include "get_tensor.h"

namespace dtorch {

void GetTensor(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dtorch::get_tensor", "")
          .typed<void(const at::Tensor&, const c10::intrusive_ptr<TensorPromise>&)>();
  op.call(input, promise);
}

c10::intrusive_ptr<TensorFuture> GetTensorAsync(const at::Tensor& input) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dtorch::get_tensor_async", "")
                             .typed<c10::intrusive_ptr<TensorFuture>(const at::Tensor&)>();
  return op.call(input);
}

namespace kernels {

c10::intrusive_ptr<TensorFuture> get_tensor_async(const at::Tensor& input) {
  // The op runs in the caller's process, so the pair is always of the memory kind.
  auto promise = c10::make_intrusive<TensorPromise>("memory");
  auto future = promise->GetFuture();
  GetTensor(input, promise);
  return future;
}

}  // namespace kernels
}  // namespace dtorch
