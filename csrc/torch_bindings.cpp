// Every schema and custom class of the dtorch library, declared in one place.
//
// Zero-output ops and ops that keep a reference to their input use CONSERVATIVE alias analysis:
// with the default (FROM_SCHEMA) TorchScript would treat them as pure and delete them.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops/get_tensor.h"
#include "ops/tensor_promise_future.h"

namespace {

using dtorch::ReadyNotifier;
using dtorch::TensorFuture;
using dtorch::TensorPromise;

// Handles compare equal when they refer to the same object (tracing and opcheck compare inputs).
template <typename T>
bool SameObject(const c10::intrusive_ptr<T>& self, const c10::intrusive_ptr<T>& other) {
  return self.get() == other.get();
}

// `len(obj)` must raise TypeError, as for any Python object without a length: without a __len__
// method torch raises NotImplementedError, which breaks torch.library.opcheck's schema check.
template <typename T>
int64_t NoLength(const c10::intrusive_ptr<T>& self) {
  TORCH_CHECK_TYPE(false, "dtorch: a ", T::kClassName, " has no len()");
}

// __obj_flatten__ for torch.compile/export: constant per kind, so compiled code guards on the kind
// only and does not recompile for each new promise or future.
template <typename T>
std::tuple<std::tuple<std::string, std::string>> FlattenKind(const c10::intrusive_ptr<T>& self) {
  return std::make_tuple(std::make_tuple(std::string("kind"), self->Kind()));
}

}  // namespace

TORCH_LIBRARY(dtorch, m) {
  // Python fake classes and fake kernels (torch.compile / export) live in this module.
  m.set_python_module("dtorch_ops._fake");

  // An event loop's wake-up channel: the loop watches fileno() and drain()s posted tokens.
  m.class_<ReadyNotifier>("ReadyNotifier")
      .def(torch::init<>())
      .def("fileno", &ReadyNotifier::FileNo)
      .def("drain", &ReadyNotifier::Drain)
      .def("__obj_flatten__",
           [](const c10::intrusive_ptr<ReadyNotifier>&) {
             return std::make_tuple(std::make_tuple(std::string("kind"), std::string("eventfd")));
           })
      .def("__eq__", &SameObject<ReadyNotifier>)
      .def("__len__", &NoLength<ReadyNotifier>)
      .def_pickle(
          [](const c10::intrusive_ptr<ReadyNotifier>&) -> std::string {
            TORCH_CHECK(false, "dtorch: a ReadyNotifier belongs to one event loop and cannot be "
                               "pickled or copied");
          },
          [](std::string) -> c10::intrusive_ptr<ReadyNotifier> {
            TORCH_CHECK(false, "dtorch: a ReadyNotifier cannot be unpickled");
          });

  m.class_<TensorFuture>("TensorFuture")
      // Blocks until ready; returns the tensor and consumes the future.
      .def("get", &TensorFuture::Get)
      // Like get() within timeout_ms, else raises ("dtorch: timed out") and stays valid.
      .def("wait", &TensorFuture::Wait)
      // Blocks up to timeout_ms; True once ready. Does not consume.
      .def("wait_for", &TensorFuture::WaitFor)
      .def("is_ready", &TensorFuture::IsReady)
      .def("valid", &TensorFuture::Valid)
      .def("kind", [](const c10::intrusive_ptr<TensorFuture>& self) { return self->Kind(); })
      // Posts `token` to the notifier once ready (how asyncio awaits it). Does not consume.
      .def("notify_when_ready", &TensorFuture::NotifyWhenReady)
      .def("__obj_flatten__", &FlattenKind<TensorFuture>)
      .def("__eq__", &SameObject<TensorFuture>)
      .def("__len__", &NoLength<TensorFuture>)
      .def_pickle(
          [](const c10::intrusive_ptr<TensorFuture>& self) -> std::string {
            TORCH_CHECK(false, "dtorch: a TensorFuture cannot be pickled or copied; its value "
                               "belongs to the one consumer that holds it");
          },
          [](std::string) -> c10::intrusive_ptr<TensorFuture> {
            TORCH_CHECK(false, "dtorch: a TensorFuture cannot be unpickled");
          });

  m.class_<TensorPromise>("TensorPromise")
      .def(torch::init<std::string>())
      .def("set_value", &TensorPromise::SetValue)
      .def("set_exception", &TensorPromise::SetException)
      .def("get_future", &TensorPromise::GetFuture)
      .def("kind", [](const c10::intrusive_ptr<TensorPromise>& self) { return self->Kind(); })
      .def("serialize", &TensorPromise::Serialize)
      .def("__obj_flatten__", &FlattenKind<TensorPromise>)
      .def("__eq__", &SameObject<TensorPromise>)
      .def("__len__", &NoLength<TensorPromise>)
      .def_pickle(
          [](const c10::intrusive_ptr<TensorPromise>& self) { return self->Serialize(); },
          [](std::string state) -> c10::intrusive_ptr<TensorPromise> {
            TORCH_CHECK(false, "dtorch: cannot restore a TensorPromise from '", state,
                        "': no promise kind that crosses processes is available in this build");
          });

  // Fulfils `promise` with `input` once the work producing `input` on its current stream is done
  // (at once on CPU). One kernel per device; never waits for other streams.
  m.def(torch::schema(
      "get_tensor(Tensor input, __torch__.torch.classes.dtorch.TensorPromise promise) -> ()",
      c10::AliasAnalysisKind::CONSERVATIVE));
  // Returns at once a future that yields `input` (aliased, no copy) when it is ready.
  m.def(torch::schema(
      "get_tensor_async(Tensor input) -> __torch__.torch.classes.dtorch.TensorFuture",
      c10::AliasAnalysisKind::CONSERVATIVE));
}

// Kernels. They are registered here, after TORCH_LIBRARY in the same translation unit, because
// an impl whose signature names a custom class needs that class registered first, and static
// initialisation order across translation units is unspecified.
// Host memory: the value is ready now (dense, sparse and quantized layouts alike).
TORCH_LIBRARY_IMPL(dtorch, CPU, m) { m.impl("get_tensor", &dtorch::kernels::get_tensor_cpu); }
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
// Explicit, not CompositeImplicitAutograd: the op must stay one node in traced graphs.
TORCH_LIBRARY_IMPL(dtorch, CompositeExplicitAutograd, m) {
  m.impl("get_tensor_async", &dtorch::kernels::get_tensor_async);
}

// Autocast keys are not fallthrough for ops with custom-class arguments (pytorch#158414): these
// ops compute nothing, so autocast passes them through unchanged.
#define DTORCH_AUTOCAST_FALLTHROUGH(key)                                      \
  TORCH_LIBRARY_IMPL(dtorch, key, m) {                                        \
    m.impl("get_tensor", torch::CppFunction::makeFallthrough());              \
    m.impl("get_tensor_async", torch::CppFunction::makeFallthrough());        \
  }
DTORCH_AUTOCAST_FALLTHROUGH(AutocastCPU)
DTORCH_AUTOCAST_FALLTHROUGH(AutocastCUDA)
DTORCH_AUTOCAST_FALLTHROUGH(AutocastXPU)
DTORCH_AUTOCAST_FALLTHROUGH(AutocastPrivateUse1)
#undef DTORCH_AUTOCAST_FALLTHROUGH
