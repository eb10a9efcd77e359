// The per-device kernels of the dtorch::get_tensor* ops (get_tensor_cpu.cpp,
// get_tensor_device.cpp, get_tensor_async.cpp) and of the host copy (copy_to_host.cpp); the C++
// API over them (GetTensor, GetTensorAsync) is declared in <dtorch/dtorch.h>.
#pragma once

#include <ATen/core/Tensor.h>

#include "futures.h"

namespace dtorch::kernels {
// The value a future of the ops yields for `input`: `input` itself, detached when it requires
// grad, so that a future holds the tensor's memory but never its autograd graph, eagerly as in
// a compiled graph (dtorch_ops/compile/graph_ops.py detaches there). A tensor subclass with
// Python dispatch is left as it is: here, below its dispatch (AboveSubclassDispatch), detach()
// would make a plain tensor of the wrapper's empty storage; dtorch_ops detaches it in Python
// first (functions.py), which keeps the subclass.
inline at::Tensor DetachedValue(const at::Tensor& input) {
  if (!input.requires_grad() || input.unsafeGetTensorImpl()->is_python_dispatch()) return input;
  return input.detach();
}

// CPU: the value is ready; fulfil now.
void get_tensor_cpu(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise);
// Any device with c10::Event support (CUDA, XPU, PrivateUse1, ...): record an event on the
// input's current stream and fulfil from a detector thread once it completes.
void get_tensor_device(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise);
// A device tensor for a promise whose kind copies the value out of this process (file): claims
// the promise for `caller` (a string literal), queues a snapshot copy of `input` on its device's
// current stream (so that later work there, an in-place optimizer step, cannot change the value)
// and returns; once an event after the copy has fired, the library's pool completes the promise
// with the snapshot (exports or stages it: TensorCodec).
void CompleteFromDevice(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise,
                        const char* caller);
// Composite: make a memory pair and run get_tensor on it.
c10::intrusive_ptr<TensorFuture> get_tensor_async(const at::Tensor& input);
// Inside a torch.func transform: raise, naming the op and what to do instead.
void refuse_in_transform_get_tensor(const at::Tensor& input,
                                    const c10::intrusive_ptr<TensorPromise>& promise);
c10::intrusive_ptr<TensorFuture> refuse_in_transform_get_tensor_async(const at::Tensor& input);

// Every device: a non-blocking copy of each input into pinned host memory on its device's current
// stream, a future ready once an event after the copies has fired (CPU inputs: as they are).
c10::intrusive_ptr<TensorFuture> copy_to_host_async(const at::Tensor& input);
c10::intrusive_ptr<TensorListFuture> copy_list_to_host_async(at::TensorList inputs);
c10::intrusive_ptr<TensorFuture> refuse_in_transform_copy_to_host_async(const at::Tensor& input);
c10::intrusive_ptr<TensorListFuture> refuse_in_transform_copy_list_to_host_async(
    at::TensorList inputs);

// Raises, inside a torch.func transform, naming `op` and what to do instead.
[[noreturn]] void RefuseInTransform(const char* op);
}  // namespace dtorch::kernels
