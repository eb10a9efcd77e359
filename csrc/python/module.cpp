// dtorch_ops._C: the direct binding of the Python API (pybind11, the one that ships with torch).
//
// Its classes are handles to the very C++ objects that the TorchScript classes
// (torch.classes.dtorch.*) hold: script() gives the TorchScript object of the same state and
// from_script() the handle of a TorchScript object, so a value set through one end is seen
// through the other. Each Python API call is one call here; the ops are still dispatched (through
// typed operator handles, from C++), so per-device kernels, autocast, the profiler and user
// overrides apply as for torch.ops.dtorch.*.
//
// Blocking waits release the GIL and follow python_waits.h (signals on the main thread, parking
// at exit). Importing the module loads libdtorch_ops.so, which registers the ops and classes.
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/stl.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include "../core/future_error.h"
#include "../core/shared_state.h"
#include "../ops/errors.h"
#include "../ops/internal_api.h"
#include "python_callbacks.h"
#include "python_waits.h"

namespace py = pybind11;

namespace dtorch::python {
namespace {

constexpr const char* kScriptPrefix = "__torch__.torch.classes.dtorch.";

// A timeout in milliseconds from Python: an int of any size or a float (fractions round up:
// a timeout is a lower bound), >= 0; values past core::kMaxTimeoutMs (~34 years) mean no limit.
int64_t TimeoutMs(py::handle timeout) {
  PyObject* obj = timeout.ptr();
  const auto type_name = [&] { return std::string(Py_TYPE(obj)->tp_name); };
  if (PyBool_Check(obj) || (!PyFloat_Check(obj) && !PyIndex_Check(obj))) {
    throw py::type_error("dtorch: timeout_ms must be a number of milliseconds (int or float), "
                         "got " + type_name());
  }
  const auto negative = [&] {
    return py::value_error("dtorch: timeout_ms must be >= 0, got " +
                           py::repr(timeout).cast<std::string>() +
                           "; use get() to wait without a limit");
  };
  if (PyFloat_Check(obj)) {
    const double ms = PyFloat_AsDouble(obj);
    if (std::isnan(ms)) {
      throw py::value_error("dtorch: timeout_ms must be a number of milliseconds, got nan");
    }
    if (ms < 0) throw negative();
    if (ms >= static_cast<double>(core::kMaxTimeoutMs)) return core::kMaxTimeoutMs;
    return static_cast<int64_t>(std::ceil(ms));
  }
  const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long ms = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow < 0 || (overflow == 0 && ms < 0)) throw negative();
  if (overflow > 0 || ms > core::kMaxTimeoutMs) return core::kMaxTimeoutMs;
  return ms;
}

// The exception class of dtorch_ops.errors for `code` (by its stable id, never by message).
PyObject* ExceptionClass(core::FutureErrc code) {
  py::gil_scoped_acquire gil;
  const auto classes = py::module_::import("dtorch_ops.errors").attr("_BY_CODE");
  return classes[py::str(core::FutureErrcId(code))].ptr();  // the module keeps it alive
}

[[noreturn]] void RaiseTimeout(py::handle timeout) {
  PyErr_SetString(ExceptionClass(core::FutureErrc::kTimeout),
                  TimedOut(py::str(timeout).cast<std::string>()).what());
  throw py::error_already_set();
}

// Coded c10 errors (ops/errors.h) from any function of this module become dtorch_ops.errors'
// classes; everything else goes on to torch's and pybind11's translators.
void TranslateCodedErrors(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const CodedErrorBase& coded) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&coded);
    const char* message = c10_error ? c10_error->what_without_backtrace() : "dtorch: error";
    // A producer's message from another process: not trusted to be valid UTF-8.
    const auto text = py::reinterpret_steal<py::object>(
        PyUnicode_DecodeUTF8(message, static_cast<Py_ssize_t>(strlen(message)), "replace"));
    if (!text) return;  // (MemoryError is set)
    PyErr_SetObject(ExceptionClass(coded.code()), text.ptr());
  }
}

// The TorchScript object (torch.ScriptObject) holding the same C++ object as `handle`.
template <typename C>
py::object ToScript(const c10::intrusive_ptr<C>& handle) {
  return py::cast(torch::jit::Object(c10::IValue(handle).toObject()));
}

// The handle of a TorchScript object of class C; TypeError for anything else.
template <typename C>
c10::intrusive_ptr<C> FromScript(py::handle obj) {
  const std::string expected = std::string(kScriptPrefix) + C::kClassName;
  std::string got = Py_TYPE(obj.ptr())->tp_name;
  if (py::isinstance<torch::jit::Object>(obj)) {
    const auto object = obj.cast<torch::jit::Object>();
    const auto name = object.type()->name();
    got = name ? name->qualifiedName() : "an unnamed script object";
    if (got == expected) return c10::IValue(object._ivalue()).toCustomClass<C>();
  }
  const std::string short_got =
      got.rfind(kScriptPrefix, 0) == 0 ? "torch.classes.dtorch." + got.substr(strlen(kScriptPrefix))
                                       : got;
  throw py::type_error(std::string("dtorch: expected a torch.classes.dtorch.") + C::kClassName +
                       ", got " + short_got);
}

// A future's value as Python sees it: the tensor, None for a VoidFuture, a list of tensors for a
// TensorListFuture.
py::object ToPython(at::Tensor value) { return py::cast(std::move(value)); }
py::object ToPython(Unit) { return py::none(); }
py::object ToPython(std::vector<at::Tensor> values) { return py::cast(std::move(values)); }

// The value of a future whose wait is over (ready, failed, or taken by another thread meanwhile).
// Receiving a value of a kind that crosses processes may copy it (a device value onto this
// process's device): with the GIL released. (A memory future's value is at hand.)
template <typename T, typename Receive>
py::object Received(const c10::intrusive_ptr<Future<T>>& future, Receive receive) {
  if (future->Kind() == "memory") return ToPython(receive());
  T value;
  {
    ReleasedGil released;
    value = receive();
  }
  return ToPython(std::move(value));
}

template <typename T>
py::object TakeValue(const c10::intrusive_ptr<Future<T>>& future) {
  return Received(future, [&] { return future->Get(); });
}

py::object TakeValue(const c10::intrusive_ptr<VoidFutureCollect>& collect) {
  collect->Get();
  return py::none();
}

// The value of a completed future, not consumed (Future::Value).
template <typename T>
py::object PeekValue(const c10::intrusive_ptr<Future<T>>& future) {
  return Received(future, [&] { return future->Value(); });
}

py::object PeekValue(const c10::intrusive_ptr<VoidFutureCollect>& collect) {
  collect->Value();
  return py::none();
}

template <typename W>
py::object Get(const c10::intrusive_ptr<W>& self) {
  WaitReady(*self, std::nullopt);
  return TakeValue(self);
}

template <typename W>
py::object Wait(const c10::intrusive_ptr<W>& self, py::handle timeout) {
  if (!WaitReady(*self, TimeoutMs(timeout))) RaiseTimeout(timeout);
  return TakeValue(self);
}

// The handle a Python wrapper (dtorch_ops' future classes) holds in its `_h` slot.
template <typename W>
c10::intrusive_ptr<W> HandleOf(py::handle wrapper) {
  static PyObject* const name = PyUnicode_InternFromString("_h");
  const auto handle = py::reinterpret_steal<py::object>(PyObject_GetAttr(wrapper.ptr(), name));
  if (!handle) throw py::error_already_set();
  return c10::intrusive_ptr<W>::reclaim_copy(&handle.cast<W&>());
}

// Installs get / wait / value / is_ready / done / valid / add_done_callback on a Python wrapper
// class (dtorch_ops' futures) as C++ methods reading its `_h` slot: one C++ call each, with no
// Python frame in between. with_values=false leaves out those that return the value (get, wait,
// value), for a wrapper that keeps its value itself (dtorch_ops.ObjectFuture).
template <typename W>
void InstallWaitMethods(py::object cls, bool with_values) {
  const auto install = [&](const char* name, auto fn, const char* doc, auto... args) {
    cls.attr(name) =
        py::cpp_function(fn, py::name(name), py::is_method(cls), py::doc(doc), args...);
  };
  const auto is_ready = [](py::handle self) { return HandleOf<W>(self)->IsReady(); };
  install("is_ready", is_ready,
          "True when get() would not block (a value or an error is there). Never blocks.");
  install("done", is_ready, "is_ready() under torch.futures.Future's name.");
  install("valid", [](py::handle self) { return HandleOf<W>(self)->Valid(); },
          "False once get() or wait() has taken the value.");
  install(
      "add_done_callback",
      [](py::handle self, py::handle callback) {
        const auto handle = HandleOf<W>(self);
        AddDoneCallback([&](std::function<void()> fire) { handle->OnReady(std::move(fire)); },
                        callback, self);
      },
      "Calls callback(future) once the future is complete (a value or an error), at once if it\n"
      "is. The callback reads the value with future.value(), which does not consume it, so\n"
      "several callbacks can read one value.\n\n"
      "It runs on the thread that completes the future when that is a Python thread, else on\n"
      "the library's pool thread, with the GIL; never under a lock of the library. Keep it short.\n"
      "An exception it raises is reported through sys.unraisablehook.",
      py::arg("callback"));
  if (!with_values) return;
  install("value", [](py::handle self) { return PeekValue(HandleOf<W>(self)); },
          "The value of a completed future, without consuming it (torch.futures.Future.value()):\n"
          "the same object each time, or the future's error raised, also after get().\n\n"
          "Raises FutureNotReadyError before completion (never blocks): call it after wait(),\n"
          "await, or in a done callback.");
  install("get", [](py::handle self) { return Get(HandleOf<W>(self)); },
          "Blocks until the value is ready and returns it; consumes the future.\n\n"
          "The GIL is released while waiting. On the main thread Ctrl-C interrupts the wait\n"
          "(KeyboardInterrupt) and leaves the future valid.");
  install("wait",
          [](py::handle self, py::handle timeout) { return Wait(HandleOf<W>(self), timeout); },
          "Returns the value like get() if it is ready within timeout_ms (an int or a float;\n"
          "fractions of a millisecond round up).\n\n"
          "Raises TimeoutError otherwise; the future stays valid and can be waited on again.",
          py::arg("timeout_ms"));
}

template <typename T>
void BindFuture(py::module_& m) {
  using F = Future<T>;
  py::class_<F, c10::intrusive_ptr<F>>(m, F::kClassName)
      .def("get", &Get<F>)
      .def("wait", &Wait<F>, py::arg("timeout_ms"))
      .def("value", &PeekValue<T>)
      .def("is_ready", &F::IsReady)
      .def("valid", &F::Valid)
      .def("kind", [](const c10::intrusive_ptr<F>& self) { return self->Kind(); })
      .def("notify_when_ready", &NotifyWhenReady<F>)
      .def("script", &ToScript<F>)
      .def_static("from_script", &FromScript<F>);
}

template <typename T>
void BindPromise(py::module_& m) {
  using P = Promise<T>;
  // Completions run with the GIL released (ReleasedGil: parked at exit, as waits are), so that
  // the waiter they wake can take it at once (measured: a Python waiter woken by a completion
  // that held the GIL resumed ~1.5x later).
  auto cls = py::class_<P, c10::intrusive_ptr<P>>(m, P::kClassName)
                 .def(py::init(
                     [](const std::string& kind) { return c10::make_intrusive<P>(kind); }))
                 .def("set_exception",
                      [](const c10::intrusive_ptr<P>& self, const std::string& message) {
                        ReleasedGil unlocked;
                        self->SetException(message);
                      })
                 .def("get_future", &P::GetFuture)
                 .def("kind", [](const c10::intrusive_ptr<P>& self) { return self->Kind(); })
                 .def("serialize", &P::Serialize)
                 .def_static("from_serialized", &P::FromSerialized)
                 .def("script", &ToScript<P>)
                 .def_static("from_script", &FromScript<P>);
  if constexpr (std::is_same_v<T, at::Tensor>) {
    cls.def("set_value", [](const c10::intrusive_ptr<P>& self, at::Tensor value) {
      if (value.key_set().has(c10::DispatchKey::Python)) {
        self->SetValue(std::move(value));  // with the GIL: the subclass check needs Python
        return;
      }
      ReleasedGil unlocked;
      self->SetValue(std::move(value));
    });
  } else {
    cls.def("set_value", [](const c10::intrusive_ptr<P>& self) {
      ReleasedGil unlocked;
      self->SetValue({});
    });
  }
}

// Our ops on a tensor subclass run above the subclass's __torch_dispatch__, so an in-process
// future yields the subclass itself rather than whatever its dispatch passes on (one inner tensor).
struct AboveSubclassDispatch {
  c10::impl::ExcludeDispatchKeyGuard guard{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot})};
};

// RuntimeHooks::check_subclass_value: a promise cannot carry a DTensor (raw set_value included).
void CheckSubclassValue(const at::Tensor& value) {
  // Once the exit gate is closed, a thread without the GIL must not take it (finalization may
  // have begun): the check is skipped then.
  if (!PyGILState_Check() && ExitGateClosed()) return;
  py::gil_scoped_acquire gil;
  const py::object module =
      py::module_::import("sys").attr("modules").attr("get")("torch.distributed.tensor");
  if (module.is_none()) return;  // no DTensor can exist before its module is imported
  if (py::isinstance(py::cast(value), module.attr("DTensor"))) {
    TORCH_CHECK_TYPE(false, "dtorch: set_value expects a local tensor, got a DTensor: pass "
                     "t.to_local() (or t.full_tensor()) instead");
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dtorch_ops' direct binding (see csrc/python/module.cpp)";
  InitMainThread();
  RuntimeHooks hooks;
  hooks.before_return = &ParkIfExiting;
  hooks.before_call = &BeforeLibraryCall;
  hooks.check_subclass_value = &CheckSubclassValue;
  SetRuntimeHooks(hooks);

  py::register_local_exception_translator(&TranslateCodedErrors);

  py::class_<ReadyNotifier, c10::intrusive_ptr<ReadyNotifier>>(m, "ReadyNotifier")
      .def(py::init([] { return c10::make_intrusive<ReadyNotifier>(); }))
      .def("fileno", &ReadyNotifier::FileNo)
      .def("drain", &ReadyNotifier::Drain);

  BindFuture<at::Tensor>(m);
  BindPromise<at::Tensor>(m);
  BindFuture<Unit>(m);
  BindPromise<Unit>(m);
  BindFuture<std::vector<at::Tensor>>(m);

  py::class_<VoidFutureCollect, c10::intrusive_ptr<VoidFutureCollect>>(m, "VoidFutureCollect")
      .def("get", &Get<VoidFutureCollect>)
      .def("wait", &Wait<VoidFutureCollect>, py::arg("timeout_ms"))
      .def("value",
           [](const c10::intrusive_ptr<VoidFutureCollect>& self) { return PeekValue(self); })
      .def("is_ready", &VoidFutureCollect::IsReady)
      .def("valid", &VoidFutureCollect::Valid)
      .def("devices", &VoidFutureCollect::Devices)
      .def("notify_when_ready", &NotifyWhenReady<VoidFutureCollect>)
      .def("script", &ToScript<VoidFutureCollect>)
      .def_static("from_script", &FromScript<VoidFutureCollect>);

  // The ops, dispatched from C++. above_subclass: see AboveSubclassDispatch.
  m.def(
      "get_tensor_async",
      [](const at::Tensor& input, bool above_subclass) {
        if (!above_subclass) return GetTensorAsync(input);
        AboveSubclassDispatch above;
        return GetTensorAsync(input);
      },
      py::arg("input"), py::arg("above_subclass") = false);
  m.def(
      "get_tensor",
      [](const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise,
         bool above_subclass) {
        if (!above_subclass) {
          // Without the GIL: a file promise copies the value (the dispatcher re-takes the GIL
          // for any Python kernel it calls).
          ReleasedGil unlocked;
          return GetTensor(input, promise);
        }
        AboveSubclassDispatch above;
        GetTensor(input, promise);
      },
      py::arg("input"), py::arg("promise"), py::arg("above_subclass") = false);
  // The host copy (to_torch_async(t, device="cpu")): plain tensors only (dtorch_ops checks).
  m.def("copy_to_host_async",
        [](const at::Tensor& input) { return GetTensorAsync(input, c10::Device(c10::kCPU)); });
  m.def("copy_list_to_host_async", [](const std::vector<at::Tensor>& inputs) {
    return GetTensorAsync(inputs, c10::Device(c10::kCPU));
  });
  m.def("failed_tensor_list_future", &internal::FailedTensorListFuture);  // for fake kernels
  m.def("sync_async", [](const DeviceList& devices) { return SyncAsync(devices); });
  m.def("sync_into", [](const DeviceList& devices, const c10::intrusive_ptr<VoidPromise>& promise) {
    SyncInto(devices, promise);
  });

  // dtorch_ops.futures calls these on its classes once they are defined.
  m.def(
      "install_wait_methods",
      [](py::object cls, py::object handle_cls, bool with_values) {
        if (handle_cls.is(py::type::of<TensorFuture>())) {
          return InstallWaitMethods<TensorFuture>(cls, with_values);
        }
        if (handle_cls.is(py::type::of<VoidFuture>())) {
          return InstallWaitMethods<VoidFuture>(cls, with_values);
        }
        if (handle_cls.is(py::type::of<TensorListFuture>())) {
          return InstallWaitMethods<TensorListFuture>(cls, with_values);
        }
        TORCH_INTERNAL_ASSERT(handle_cls.is(py::type::of<VoidFutureCollect>()));
        InstallWaitMethods<VoidFutureCollect>(cls, with_values);
      },
      py::arg("cls"), py::arg("handle_cls"), py::arg("with_values") = true);

  // Process exit (dtorch_ops' atexit handler) and diagnostics for the tests.
  m.def("close_exit_gate", &CloseExitGate);
  m.def("after_fork_in_child", &AfterForkInChild);
  m.def("wait_wakeups", &WaitWakeups);
  m.def("fail_thread_starts_for_testing", [](int count) {
    internal::FailDetectorThreadStartsForTesting(count);
  });
  // With the GIL released: a detector finishing a completion may need it to drop a tensor.
  m.def("stop_library_threads", &internal::StopLibraryThreads,
        py::call_guard<py::gil_scoped_release>());
  m.def("library_threads", [] {
    const auto counts = internal::CountLibraryThreads();
    py::dict threads;
    threads["detectors"] = counts.detectors;
    threads["pool"] = counts.pool;
    threads["doorbell"] = counts.doorbell;
    threads["network"] = counts.network;
    return threads;
  });
  // Whether this build opens `device_type`'s memory of other processes (CUDA: built with it).
  m.def("has_device_ipc", [](const std::string& device_type) {
    return FindDeviceIpc(c10::Device(device_type).type()) != nullptr;
  });
  m.def("encode_tensor_for_testing", [](const at::Tensor& value) {
    auto [header, payload] = internal::EncodeTensorForTesting(value);
    return py::make_tuple(py::bytes(header), py::bytes(payload));
  });
  m.def("decode_tensor_for_testing",
        [](const py::bytes& header, const py::bytes& payload, const std::string& value_options) {
          return internal::DecodeTensorForTesting(header, payload, value_options);
        });
  m.def("pending_file_pairs", &internal::PendingFilePairs);
  m.def("pending_network_pairs", &internal::PendingNetworkPairs);
  m.def("file_doorbell_segment", &internal::FileDoorbellSegment);
  m.def("kept_file_payloads", [] {
    const auto kept = internal::KeptFilePayloads();
    py::dict counts;
    counts["produced"] = kept.produced;
    counts["received"] = kept.received;
    counts["produced_bytes"] = kept.produced_bytes;
    counts["received_bytes"] = kept.received_bytes;
    return counts;
  });
  // dtorch_ops calls it in a fork-started multiprocessing child before it exits (which skips the
  // library's exit handler): its consumers then read "producer exited", not "died", and its
  // doorbell goes if nothing of it is pending.
  m.def("file_kind_at_child_exit", &internal::FileKindAtChildExit);
  // Test-only: in a producer process, takes `promise`'s interprocess lock and never returns.
  m.def("hold_file_promise_lock_for_testing", [](const std::string& serialized) {
    py::gil_scoped_release unlocked;
    internal::HoldFilePromiseLockForTesting(serialized);
  });
  m.def("detector_stats", [] {
    const auto detectors = internal::GetDetectorStats();
    py::dict stats;
    stats["threads"] = detectors.threads;
    stats["pending"] = detectors.pending;
    stats["active_streams"] = detectors.active_streams;
    stats["notified_wakeups"] = detectors.notified_wakeups;
    return stats;
  });

  // Settings (dtorch_ops.config); std::invalid_argument and std::logic_error reach Python as
  // ValueError and RuntimeError.
  m.def("set_max_detector_threads", &internal::SetMaxDetectorThreads);
  m.def("max_detector_threads", &internal::MaxDetectorThreads);
  m.def("set_detector_idle_exit_ms", &internal::SetDetectorIdleExitMs);
  m.def("detector_idle_exit_ms", &internal::DetectorIdleExitMs);
  m.def("set_pool_threads", &internal::SetPoolThreads);
  m.def("pool_threads", &internal::PoolThreads);
  m.def("set_attach_timeout_ms", &internal::SetAttachTimeoutMs);
  m.def("attach_timeout_ms", &internal::AttachTimeoutMs);
  m.def("set_network_heartbeat_timeout_ms", &internal::SetNetworkHeartbeatTimeoutMs);
  m.def("network_heartbeat_timeout_ms", &internal::NetworkHeartbeatTimeoutMs);
  m.def("set_payload_idle_ms", &internal::SetPayloadIdleMs);
  m.def("payload_idle_ms", &internal::PayloadIdleMs);
  m.def("set_exit_timeout_ms", &internal::SetExitTimeoutMs);
  m.def("exit_timeout_ms", &internal::ExitTimeoutMs);
}

}  // namespace dtorch::python
