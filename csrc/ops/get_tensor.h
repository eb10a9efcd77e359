// The per-device kernels of the dtorch::get_tensor* ops (get_tensor_cpu.cpp,
// get_tensor_device.cpp, get_tensor_async.cpp); the C++ API over them (GetTensor, GetTensorAsync)
// is declared in <dtorch/dtorch.h>.
#pragma once

#include <ATen/core/Tensor.h>

#include "futures.h"

namespace dtorch::kernels {
// CPU: the value is ready; fulfil now.
void get_tensor_cpu(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise);
// Any device with c10::Event support (CUDA, XPU, PrivateUse1, ...): record an event on the
// input's current stream and fulfil from a detector thread once it completes.
void get_tensor_device(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise);
// Composite: make a memory pair and run get_tensor on it.
c10::intrusive_ptr<TensorFuture> get_tensor_async(const at::Tensor& input);
// Inside a torch.func transform: raise, naming the op and what to do instead.
void refuse_in_transform_get_tensor(const at::Tensor& input,
                                    const c10::intrusive_ptr<TensorPromise>& promise);
c10::intrusive_ptr<TensorFuture> refuse_in_transform_get_tensor_async(const at::Tensor& input);
}  // namespace dtorch::kernels
