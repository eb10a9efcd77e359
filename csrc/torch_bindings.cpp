// Every schema and custom class of the dtorch library, declared in one place, and every kernel
// registration.
//
// Zero-output ops and ops that keep a reference to their input use CONSERVATIVE alias analysis:
// with the default (FROM_SCHEMA) TorchScript would treat them as pure and delete them.
#include <optional>

#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops/futures.h"
#include "ops/get_tensor.h"
#include "ops/internal_api.h"
#include "ops/sync.h"

namespace {

using dtorch::Future;
using dtorch::Promise;
using dtorch::ReadyNotifier;
using dtorch::VoidFutureCollect;

// Handles compare equal when they refer to the same object (tracing and opcheck compare inputs);
// anything else (None, another class) compares unequal rather than raising.
template <typename C>
bool SameObject(const c10::intrusive_ptr<C>& self, const c10::IValue& other) {
  if (!other.isObject()) return false;
  const auto& object = other.toObjectRef();
  if (object.slots().size() != 1 || !object.getSlot(0).isCapsule()) return false;
  return object.getSlot(0).toCapsule().get() == static_cast<torch::CustomClassHolder*>(self.get());
}

template <typename C>
bool NotSameObject(const c10::intrusive_ptr<C>& self, const c10::IValue& other) {
  return !SameObject(self, other);
}

// `len(obj)` must raise TypeError, as for any Python object without a length: without a __len__
// method torch raises NotImplementedError, which breaks torch.library.opcheck's schema check.
template <typename C>
int64_t NoLength(const c10::intrusive_ptr<C>&) {
  TORCH_CHECK_TYPE(false, "dtorch: a ", C::kClassName, " has no len()");
}

// __obj_flatten__ for torch.compile/export: constant per kind, so compiled code guards on the kind
// only and does not recompile for each new promise or future.
template <typename C>
std::tuple<std::tuple<std::string, std::string>> FlattenKind(const c10::intrusive_ptr<C>& self) {
  return std::make_tuple(std::make_tuple(std::string("kind"), std::string(self->Kind())));
}

// The methods every handle class has: flatten, identity, no len(), and pickling that refuses
// (handles to one consumer's value, or to one event loop, cannot be copied).
template <typename C>
torch::class_<C>& HandleBasics(torch::class_<C>& cls) {
  return cls.def("__obj_flatten__", &FlattenKind<C>)
      .def("__eq__", &SameObject<C>)
      .def("__ne__", &NotSameObject<C>)
      .def("__len__", &NoLength<C>);
}

template <typename C>
torch::class_<C>& NotPicklable(torch::class_<C>& cls) {
  return cls.def_pickle(
      [](const c10::intrusive_ptr<C>&) -> std::string {
        TORCH_CHECK_TYPE(false, "dtorch: a ", C::kClassName, " cannot be pickled or copied; "
                         "it belongs to the one consumer (or event loop) that holds it");
      },
      [](std::string) -> c10::intrusive_ptr<C> {
        TORCH_CHECK(false, "dtorch: a ", C::kClassName, " cannot be unpickled");
      });
}

// TensorFuture / VoidFuture / TensorListFuture. get() and wait() return the tensor, None for a
// VoidFuture, the list of tensors for a TensorListFuture.
template <typename T>
void DefineFuture(torch::Library& m) {
  using F = Future<T>;
  auto cls = m.class_<F>(F::kClassName);
  // wait(timeout_ms=None): the value once ready, without consuming it (as torch.futures'
  // wait()); past timeout_ms raises ("dtorch: timed out") and the future stays valid.
  const auto wait = [](const c10::intrusive_ptr<F>& self, std::optional<int64_t> timeout_ms) {
    return timeout_ms ? self->Wait(*timeout_ms) : self->Wait();
  };
  if constexpr (std::is_same_v<T, dtorch::core::Unit>) {
    // Blocks until ready and consumes the future.
    cls.def("get", [](const c10::intrusive_ptr<F>& self) { self->Get(); });
    cls.def(
        "wait",
        [wait](const c10::intrusive_ptr<F>& self, std::optional<int64_t> timeout_ms) {
          wait(self, timeout_ms);
        },
        "", {torch::arg("timeout_ms") = torch::arg::none()});
    // The completed future's value (None) or error, without consuming it; raises if not ready.
    cls.def("value", [](const c10::intrusive_ptr<F>& self) { self->Value(); });
  } else {
    cls.def("get", &F::Get);
    cls.def("wait", wait, "", {torch::arg("timeout_ms") = torch::arg::none()});
    cls.def("value", &F::Value);
  }
  // Blocks up to timeout_ms; True once ready. Does not consume.
  cls.def("wait_for", &F::WaitFor)
      .def("is_ready", &F::IsReady)
      // torch.futures.Future's name for is_ready().
      .def("done", &F::IsReady)
      .def("valid", &F::Valid)
      .def("kind", [](const c10::intrusive_ptr<F>& self) { return self->Kind(); })
      // Posts `token` to the notifier once ready (how asyncio awaits it). Does not consume.
      .def("notify_when_ready", &dtorch::NotifyWhenReady<F>);
  NotPicklable(HandleBasics(cls));
}

// TensorPromise / VoidPromise, constructed with their kind spec ("memory", "file"). set_value takes
// the tensor (nothing for a VoidPromise). Pickling (torch.jit.save, pickle) goes through
// serialize(): memory promises refuse; a process that unpickles a file or network promise holds
// its pair from then on.
template <typename T>
void DefinePromise(torch::Library& m) {
  using P = Promise<T>;
  auto cls = m.class_<P>(P::kClassName);
  cls.def(torch::init<std::string>());
  if constexpr (std::is_same_v<T, dtorch::core::Unit>) {
    cls.def("set_value", [](const c10::intrusive_ptr<P>& self) { self->SetValue({}); });
  } else {
    cls.def("set_value", [](const c10::intrusive_ptr<P>& self, at::Tensor value) {
      self->SetValue(std::move(value));
    });
  }
  cls.def("set_exception",
          [](const c10::intrusive_ptr<P>& self, const std::string& message) {
            self->SetException(message);
          })
      .def("get_future", &P::GetFuture)
      .def("kind", [](const c10::intrusive_ptr<P>& self) { return self->Kind(); })
      .def("serialize", &P::Serialize)
      // The promise another process serialized; this process holds its pair from now on.
      .def_static("from_serialized", &P::FromSerialized)
      .def_pickle([](const c10::intrusive_ptr<P>& self) { return self->Serialize(); },
                  [](std::string state) { return P::FromSerialized(state); });
  HandleBasics(cls);
}

}  // namespace

TORCH_LIBRARY(dtorch, m) {
  // Python fake classes and fake kernels (torch.compile / export) live in this module.
  m.set_python_module("dtorch_ops.compile.fakes");

  // An event loop's wake-up channel: the loop watches fileno() and drain()s posted tokens.
  auto notifier = m.class_<ReadyNotifier>("ReadyNotifier");
  notifier.def(torch::init<>())
      .def("fileno", &ReadyNotifier::FileNo)
      .def("drain", &ReadyNotifier::Drain);
  NotPicklable(HandleBasics(notifier));

  DefineFuture<at::Tensor>(m);
  DefinePromise<at::Tensor>(m);
  DefineFuture<dtorch::Unit>(m);
  DefinePromise<dtorch::Unit>(m);
  DefineFuture<std::vector<at::Tensor>>(m);

  // One VoidFuture per device of a sync, awaited as one.
  auto collect = m.class_<VoidFutureCollect>("VoidFutureCollect");
  collect.def("get", &VoidFutureCollect::Get)
      .def(
          "wait",
          [](const c10::intrusive_ptr<VoidFutureCollect>& self, std::optional<int64_t> timeout_ms) {
            timeout_ms ? self->Wait(*timeout_ms) : self->Wait();
          },
          "", {torch::arg("timeout_ms") = torch::arg::none()})
      .def("wait_for", &VoidFutureCollect::WaitFor)
      .def("value", &VoidFutureCollect::Value)
      .def("is_ready", &VoidFutureCollect::IsReady)
      .def("done", &VoidFutureCollect::IsReady)
      .def("valid", &VoidFutureCollect::Valid)
      .def("devices",
           [](const c10::intrusive_ptr<VoidFutureCollect>& self) { return self->Devices(); })
      .def("notify_when_ready", &dtorch::NotifyWhenReady<VoidFutureCollect>);
  NotPicklable(HandleBasics(collect));

  // Fulfils `promise` with `input` once the work producing `input` on its current stream is done
  // (at once on CPU). One kernel per device; never waits for other streams.
  m.def(torch::schema(
      "get_tensor(Tensor input, __torch__.torch.classes.dtorch.TensorPromise promise) -> ()",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // Returns at once a future that yields `input` (aliased, no copy) when it is ready.
  m.def(torch::schema(
      "get_tensor_async(Tensor input) -> __torch__.torch.classes.dtorch.TensorFuture",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // The host copy: returns at once a future of a CPU copy of `input` (detached; a CPU input as it
  // is), made by a non-blocking copy into pinned memory on input's current stream, and ready once
  // an event recorded after the copy has fired.
  m.def(torch::schema(
      "copy_to_host_async(Tensor input) -> __torch__.torch.classes.dtorch.TensorFuture",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // The same for several tensors: one event per device, one future yielding the list.
  m.def(torch::schema(
      "copy_list_to_host_async(Tensor[] inputs) -> "
      "__torch__.torch.classes.dtorch.TensorListFuture",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // Returns at once a collect of one VoidFuture per device, each ready when the work queued so
  // far on that device's current stream is done. None: the devices this process has used.
  m.def(torch::schema(
      "sync(Device[]? devices=None) -> __torch__.torch.classes.dtorch.VoidFutureCollect",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // Like sync, completing `promise` (which may belong to another process) when all are done.
  m.def(torch::schema(
      "sync_into(Device[]? devices, __torch__.torch.classes.dtorch.VoidPromise promise) -> ()",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // The blocking sync: returns when the work queued so far on the devices is done.
  m.def(torch::schema("sync_wait(Device[]? devices=None) -> ()",
                      c10::AliasAnalysisKind::CONSERVATIVE));
}

// Kernels. They are registered here, after TORCH_LIBRARY in the same translation unit, because
// an impl whose signature names a custom class needs that class registered first, and static
// initialisation order across translation units is unspecified.

// Host memory: the value is ready now (dense, sparse, quantized, mkldnn and strided nested
// layouts alike).
TORCH_LIBRARY_IMPL(dtorch, CPU, m) { m.impl("get_tensor", &dtorch::kernels::get_tensor_cpu); }
TORCH_LIBRARY_IMPL(dtorch, MkldnnCPU, m) { m.impl("get_tensor", &dtorch::kernels::get_tensor_cpu); }
// Nested tensors are outside CompositeExplicitAutograd's backends: get_tensor_async too.
TORCH_LIBRARY_IMPL(dtorch, NestedTensorCPU, m) {
  m.impl("get_tensor", &dtorch::kernels::get_tensor_cpu);
  m.impl("get_tensor_async", &dtorch::kernels::get_tensor_async);
}
TORCH_LIBRARY_IMPL(dtorch, NestedTensorCUDA, m) {
  m.impl("get_tensor", &dtorch::kernels::get_tensor_device);
  m.impl("get_tensor_async", &dtorch::kernels::get_tensor_async);
}
TORCH_LIBRARY_IMPL(dtorch, SparseCPU, m) { m.impl("get_tensor", &dtorch::kernels::get_tensor_cpu); }
TORCH_LIBRARY_IMPL(dtorch, SparseCsrCPU, m) {
  m.impl("get_tensor", &dtorch::kernels::get_tensor_cpu);
}
TORCH_LIBRARY_IMPL(dtorch, QuantizedCPU, m) {
  m.impl("get_tensor", &dtorch::kernels::get_tensor_cpu);
}
// Every event-capable backend shares the device-generic kernel.
TORCH_LIBRARY_IMPL(dtorch, CUDA, m) { m.impl("get_tensor", &dtorch::kernels::get_tensor_device); }
TORCH_LIBRARY_IMPL(dtorch, SparseCUDA, m) {
  m.impl("get_tensor", &dtorch::kernels::get_tensor_device);
}
TORCH_LIBRARY_IMPL(dtorch, SparseCsrCUDA, m) {
  m.impl("get_tensor", &dtorch::kernels::get_tensor_device);
}
TORCH_LIBRARY_IMPL(dtorch, XPU, m) { m.impl("get_tensor", &dtorch::kernels::get_tensor_device); }
TORCH_LIBRARY_IMPL(dtorch, MPS, m) { m.impl("get_tensor", &dtorch::kernels::get_tensor_device); }
TORCH_LIBRARY_IMPL(dtorch, PrivateUse1, m) {
  m.impl("get_tensor", &dtorch::kernels::get_tensor_device);
}
// Explicit, not CompositeImplicitAutograd: each op stays one node in traced graphs. The sync ops
// have no tensor argument to dispatch on; their kernels pick the per-device sync kernels.
TORCH_LIBRARY_IMPL(dtorch, CompositeExplicitAutograd, m) {
  m.impl("get_tensor_async", &dtorch::kernels::get_tensor_async);
  // One kernel for every device: torch's non-blocking copy and the device-generic event.
  m.impl("copy_to_host_async", &dtorch::kernels::copy_to_host_async);
  m.impl("copy_list_to_host_async", &dtorch::kernels::copy_list_to_host_async);
  m.impl("sync", &dtorch::kernels::sync);
  m.impl("sync_into", &dtorch::kernels::sync_into);
  m.impl("sync_wait", &dtorch::kernels::sync_wait);
}

// The ops compute nothing to differentiate: nested tensors' autograd key (which, unlike the
// dense ones, has no autograd fallback) passes them through to the backend kernels.
TORCH_LIBRARY_IMPL(dtorch, AutogradNestedTensor, m) {
  m.impl("get_tensor", torch::CppFunction::makeFallthrough());
  m.impl("get_tensor_async", torch::CppFunction::makeFallthrough());
}

// The same for the dense autograd keys: without a kernel there, each call took autograd's boxed
// fallback (which copies the op's schema per call), twice for get_tensor_async (its kernel calls
// get_tensor): ~40 % of a raw get_tensor_async call. What the kernels do to a tensor is detached
// or under NoGradGuard already.
TORCH_LIBRARY_IMPL(dtorch, Autograd, m) {
  m.impl("get_tensor", torch::CppFunction::makeFallthrough());
  m.impl("get_tensor_async", torch::CppFunction::makeFallthrough());
}

// torch.func transforms (grad, vjp, jacrev, jvp, vmap, functionalize) would hand the op their
// internal, unwrapped tensor: a future of it carries no gradient (grad of t * to_torch(t) came
// out as t, not 2t). Refuse inside a transform, as vmap refuses ops without a batching rule.
TORCH_LIBRARY_IMPL(dtorch, FuncTorchDynamicLayerFrontMode, m) {
  m.impl("get_tensor", &dtorch::kernels::refuse_in_transform_get_tensor);
  m.impl("get_tensor_async", &dtorch::kernels::refuse_in_transform_get_tensor_async);
  m.impl("copy_to_host_async", &dtorch::kernels::refuse_in_transform_copy_to_host_async);
  m.impl("copy_list_to_host_async",
         &dtorch::kernels::refuse_in_transform_copy_list_to_host_async);
}

// Autocast keys are not fallthrough for ops with custom-class arguments (pytorch#158414), and
// autocast's keys come from thread-local state even for ops without tensors: these ops compute
// nothing, so autocast passes them through unchanged.
#define DTORCH_AUTOCAST_FALLTHROUGH(key)                                      \
  TORCH_LIBRARY_IMPL(dtorch, key, m) {                                        \
    m.impl("get_tensor", torch::CppFunction::makeFallthrough());              \
    m.impl("get_tensor_async", torch::CppFunction::makeFallthrough());        \
    m.impl("copy_to_host_async", torch::CppFunction::makeFallthrough());      \
    m.impl("copy_list_to_host_async", torch::CppFunction::makeFallthrough()); \
    m.impl("sync", torch::CppFunction::makeFallthrough());                    \
    m.impl("sync_into", torch::CppFunction::makeFallthrough());               \
    m.impl("sync_wait", torch::CppFunction::makeFallthrough());               \
  }
DTORCH_AUTOCAST_FALLTHROUGH(AutocastCPU)
DTORCH_AUTOCAST_FALLTHROUGH(AutocastCUDA)
DTORCH_AUTOCAST_FALLTHROUGH(AutocastXPU)
DTORCH_AUTOCAST_FALLTHROUGH(AutocastPrivateUse1)
#undef DTORCH_AUTOCAST_FALLTHROUGH
