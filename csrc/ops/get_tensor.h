// get_tensor / get_tensor_async: the C++ API over the dtorch::get_tensor* ops, and the per-device
// kernels registered in get_tensor_cpu.cpp and get_tensor_device.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include "futures.h"

namespace dtorch {

// Calls dtorch::get_tensor through the dispatcher: fulfils `promise` with `input` once the work
// that produces `input` on its current stream has finished (at once on CPU).
void GetTensor(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise);

// Calls dtorch::get_tensor_async: returns at once a future that yields `input` when it is ready.
c10::intrusive_ptr<TensorFuture> GetTensorAsync(const at::Tensor& input);

// The seed's Tensor::GetTorchTensorAsync() / GetTorchTensor().
inline c10::intrusive_ptr<TensorFuture> ToTorchAsync(const at::Tensor& input) {
  return GetTensorAsync(input);
}
inline at::Tensor ToTorch(const at::Tensor& input) { return GetTensorAsync(input)->Get(); }

namespace kernels {
// CPU: the value is ready; fulfil now.
void get_tensor_cpu(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise);
// Any device with c10::Event support (CUDA, XPU, PrivateUse1, ...): record an event on the
// input's current stream and fulfil from a poller thread once it completes.
void get_tensor_device(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise);
// Composite: make a memory pair and run get_tensor on it.
c10::intrusive_ptr<TensorFuture> get_tensor_async(const at::Tensor& input);
// Inside a torch.func transform: raise, naming the op and what to do instead.
void refuse_in_transform_get_tensor(const at::Tensor& input,
                                    const c10::intrusive_ptr<TensorPromise>& promise);
c10::intrusive_ptr<TensorFuture> refuse_in_transform_get_tensor_async(const at::Tensor& input);
}  // namespace kernels

}  // namespace dtorch
