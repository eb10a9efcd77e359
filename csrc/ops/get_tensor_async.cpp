#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>

#include "../core/promise_future.h"
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

void RefuseInTransform(const char* op) {
  TORCH_CHECK(false, "dtorch: ", op, " cannot run inside a torch.func transform (grad, vjp, "
              "jacrev, jvp, vmap, functionalize): its future would hold the transform's internal "
              "tensor, which carries no gradient or batch dimension. Take the value outside the "
              "transform, e.g. return it as an auxiliary output "
              "(torch.func.grad(f, has_aux=True))");
}

void refuse_in_transform_get_tensor(const at::Tensor&, const c10::intrusive_ptr<TensorPromise>&) {
  RefuseInTransform("get_tensor");
}

c10::intrusive_ptr<TensorFuture> refuse_in_transform_get_tensor_async(const at::Tensor&) {
  RefuseInTransform("get_tensor_async (to_torch_async, to_torch)");
}

c10::intrusive_ptr<TensorFuture> get_tensor_async(const at::Tensor& input) {
  TORCH_CHECK_TYPE(input.defined(), "dtorch: get_tensor_async(input) needs a tensor, got None");
  // The op runs in the caller's process, so the pair is always the core's in-process one.
  auto promise = c10::make_intrusive<TensorPromise>(
      std::make_unique<core::MemoryPromise<at::Tensor>>());
  auto future = promise->GetFuture();
  GetTensor(input, promise);
  return future;
}

}  // namespace kernels
}  // namespace dtorch
