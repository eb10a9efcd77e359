// dtorch_ops.h: the public C++ (libtorch) API of dtorch_ops. Include this one header
// (`#include <dtorch_ops.h>`, with dtorch_ops.include_path() on the include path); it offers:
//
//   dtorch::GetTensorAsync(t)   -> c10::intrusive_ptr<TensorFuture>, returns at once; the future
//                                  yields t (no copy) once the work producing it has finished
//   dtorch::GetTensor(t, promise)  fulfils `promise` with t the same way
//   dtorch::ToTorchAsync(t), dtorch::ToTorch(t)   aliases: GetTensorAsync(t), GetTensorAsync(t)->Get()
//   dtorch::TensorPromise(kind)    producer end ("memory": same process; "file": processes of
//                                  one host): SetValue, SetException, GetFuture (once), Serialize
//   dtorch::CreateTensorPromiseFromSerialized(s)  a file promise another process serialized
//                                  (attaches to its pair on first use)
//   dtorch::TensorPromiseFor(t, per_device_per_process)  a promise of PromiseKindFor's kind
//   dtorch::TensorFuture           consumer end: Get() (consumes), Wait(timeout_ms) (throws
//                                  c10::Error on timeout, stays valid), WaitFor(timeout_ms),
//                                  IsReady(), Valid()
//   dtorch::PromiseKindFor(t, per_device_per_process)  the promise kind to use for t
//   dtorch::Sync(devices), dtorch::SyncAsync(devices) -> VoidFutureCollect,
//   dtorch::SyncInto(devices, void_promise)   wait for the work queued so far on each device's
//                                  current stream (std::nullopt: the devices this process used)
//   dtorch::VoidPromise / VoidFuture           a completion signal without a value
//
// Errors are c10::Error with "dtorch: <cause>: <detail>" messages (e.g. "broken promise" when a
// promise is dropped without a value); dtorch::CodeOf(error) gives the cause's code
// (ops/errors.h).
//
// Link libdtorch_ops.so (dtorch_ops.library_path()) with -Wl,--no-as-needed: its static
// initialisers register the torch ops and classes (torch.ops.dtorch.*, torch.classes.dtorch.*),
// which TorchScript modules that use them need at torch::jit::load. It depends on libtorch only
// (no Python). See examples/cpp/.
#pragma once

#include "ops/errors.h"
#include "ops/get_tensor.h"  // brings in ops/futures.h
#include "ops/sync.h"
