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
#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include "../core/future_error.h"
#include "../core/shared_state.h"
#include "../ops/errors.h"
#include "../ops/internal_api.h"
#include "python_callbacks.h"
#include "python_pair_groups.h"
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
                           "; pass None (or nothing) to wait without a limit");
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

// A timeout in seconds from Python (timeout=, as concurrent.futures takes it): a number >= 0, in
// milliseconds rounded up; values past core::kMaxTimeoutMs mean no limit.
int64_t TimeoutSecondsAsMs(py::handle timeout, const char* method) {
  PyObject* obj = timeout.ptr();
  if (PyBool_Check(obj) || (!PyFloat_Check(obj) && !PyIndex_Check(obj))) {
    throw py::type_error(std::string("dtorch: ") + method + ": timeout must be a number of "
                         "seconds (int or float), got " + Py_TYPE(obj)->tp_name);
  }
  const double seconds = PyFloat_AsDouble(obj);  // (an int converts; a huge one is inf)
  if (seconds == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(std::string("dtorch: ") + method + ": timeout is out of range");
  }
  if (std::isnan(seconds)) {
    throw py::value_error(std::string("dtorch: ") + method + ": timeout must be a number of "
                          "seconds, got nan");
  }
  if (seconds < 0) {
    throw py::value_error(std::string("dtorch: ") + method + ": timeout must be >= 0, got " +
                          py::repr(timeout).cast<std::string>() +
                          "; pass None to wait without a limit");
  }
  const double ms = std::ceil(seconds * 1000.0);
  if (ms >= static_cast<double>(core::kMaxTimeoutMs)) return core::kMaxTimeoutMs;
  return static_cast<int64_t>(ms);
}

// A wait's timeout from Python's arguments: at most one of timeout_ms (milliseconds: positional
// unless `positional_seconds`, or by keyword) and timeout (seconds: by keyword, or positional for
// result(), as concurrent.futures has it); None or neither: no limit.
struct WaitTimeout {
  std::optional<int64_t> ms;
  std::string shown;  // in milliseconds (for the timeout error)
};

WaitTimeout ParseWaitTimeout(const char* method, const py::args& args, const py::kwargs& kwargs,
                             bool positional_seconds) {
  const char* positional_name = positional_seconds ? "timeout" : "timeout_ms";
  if (args.size() > 1) {
    throw py::type_error(std::string("dtorch: ") + method + "() takes at most one argument, " +
                         positional_name + ", got " + std::to_string(args.size()) +
                         " (a timeout: timeout_ms= in milliseconds or timeout= in seconds)");
  }
  py::object timeout_ms = py::none(), timeout = py::none();
  if (args.size() == 1) (positional_seconds ? timeout : timeout_ms) = args[0];
  for (const auto& [key, value] : kwargs) {
    const std::string name = py::str(key);
    py::object* slot = name == "timeout_ms" ? &timeout_ms : name == "timeout" ? &timeout : nullptr;
    if (slot == nullptr) {
      throw py::type_error(std::string("dtorch: ") + method + "() got an unexpected keyword "
                           "argument '" + name + "'; it takes timeout_ms= (milliseconds) or "
                           "timeout= (seconds)");
    }
    if (!slot->is_none() && args.size() == 1 && name == positional_name) {
      throw py::type_error(std::string("dtorch: ") + method + "() got " + name +
                           " both as an argument and by keyword");
    }
    *slot = py::reinterpret_borrow<py::object>(value);
  }
  if (!timeout_ms.is_none() && !timeout.is_none()) {
    throw py::type_error(std::string("dtorch: ") + method + "() takes one timeout: timeout_ms= "
                         "(milliseconds) or timeout= (seconds), not both");
  }
  // Shown in milliseconds whichever unit the caller wrote: every timeout error of the library
  // (each kind's, each wait's) words its limit the same way.
  if (!timeout_ms.is_none()) {
    return {TimeoutMs(timeout_ms), py::str(timeout_ms).cast<std::string>() + " ms"};
  }
  if (!timeout.is_none()) {
    const int64_t ms = TimeoutSecondsAsMs(timeout, method);
    return {ms, std::to_string(ms) + " ms"};
  }
  return {};
}

// The exception class of dtorch_ops.errors for `code` (by its stable id, never by message).
PyObject* ExceptionClass(core::FutureErrc code) {
  py::gil_scoped_acquire gil;
  const auto classes = py::module_::import("dtorch_ops.errors").attr("_BY_CODE");
  return classes[py::str(core::FutureErrcId(code))].ptr();  // the module keeps it alive
}

[[noreturn]] void RaiseTimeout(const std::string& shown) {
  PyErr_SetString(ExceptionClass(core::FutureErrc::kTimeout), TimedOut(shown).what());
  throw py::error_already_set();
}

// A Python exception object set on a promise (set_exception(exc)): a consumer in this process
// raises it as it is. Released with the GIL, or leaked once Python's exit has begun.
class PyNativeError final : public core::NativeError {
 public:
  explicit PyNativeError(py::object exception) : exception_(std::move(exception)) {}
  ~PyNativeError() override {
    GilUnlessExiting gil;
    if (!gil) {
      exception_.release();  // (finalizing: not ours to touch)
      return;
    }
    exception_ = py::object();
  }
  const py::object& exception() const { return exception_; }

 private:
  py::object exception_;
};

// Text from another process, not trusted to be valid UTF-8.
py::object TextOf(const std::string& bytes) {
  auto text = py::reinterpret_steal<py::object>(
      PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace"));
  if (!text) throw py::error_already_set();
  return text;
}

// Coded c10 errors (ops/errors.h) from any function of this module become dtorch_ops.errors'
// classes; everything else goes on to torch's and pybind11's translators. A producer's exception
// is raised as it was set: the very object in this process, else its built-in type (or a
// ProducerError naming it) with its message and the producer's traceback as a note.
void TranslateCodedErrors(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const CodedErrorBase& coded) {
    if (const auto* native = dynamic_cast<const PyNativeError*>(coded.native_exception().get())) {
      PyObject* exception = native->exception().ptr();
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception)), exception);
      return;
    }
    const auto* c10_error = dynamic_cast<const c10::Error*>(&coded);
    const std::string message = c10_error ? c10_error->what_without_backtrace() : "dtorch: error";
    try {
      const py::object text = TextOf(message);
      if (coded.code() == core::FutureErrc::kProducerError && !coded.exception_type().empty()) {
        const py::object exception =
            py::module_::import("dtorch_ops.errors")
                .attr("_producer_exception")(coded.exception_type(),
                                             TextOf(coded.exception_message()),
                                             TextOf(coded.producer_traceback()));
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
        return;
      }
      PyErr_SetObject(ExceptionClass(coded.code()), text.ptr());
    } catch (py::error_already_set& e) {
      e.restore();  // (MemoryError, say)
    }
  }
}

// Completions of several futures in the order they come (wait_any, as_completed): each watched
// future posts its index once complete, through one OnReady callback (no thread per future).
class CompletionQueue {
 public:
  void Push(int64_t index) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.push_back(index);
    }
    cv_.notify_all();
  }
  // Whether an index is there within timeout_ms (WaitReady's Waitable).
  bool WaitFor(int64_t timeout_ms) const {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock,
                          std::chrono::steady_clock::now() +
                              std::chrono::milliseconds(std::min(timeout_ms, core::kMaxTimeoutMs)),
                          [&] { return !ready_.empty(); });
  }
  std::optional<int64_t> PopNow() {
    std::lock_guard<std::mutex> lock(mu_);
    if (ready_.empty()) return std::nullopt;
    const int64_t index = ready_.front();
    ready_.pop_front();
    return index;
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<int64_t> ready_;  // guarded by mu_
};

// One future's completion, fanned out to the CompletionQueues waiting for it now: a future
// registers one OnReady callback however many waits (a wait_any in a polling loop) watch it.
// Each future wrapper keeps its fanout; a subscription holds its queue weakly (a queue that is
// gone is forgotten at the next subscription).
class CompletionFanout {
 public:
  // The fanout of `waitable`, fired by its completion (at once if it is complete).
  template <typename W>
  static std::shared_ptr<CompletionFanout> Of(const c10::intrusive_ptr<W>& waitable) {
    auto fanout = std::make_shared<CompletionFanout>();
    waitable->OnReady([weak = std::weak_ptr<CompletionFanout>(fanout)] {
      if (const auto fanout = weak.lock()) fanout->Fire();
    });
    return fanout;
  }
  void Fire() {
    std::vector<Subscription> subscribers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fired_ = true;
      subscribers.swap(subscribers_);
    }
    for (const auto& [weak, index] : subscribers) {
      if (const auto queue = weak.lock()) queue->Push(index);
    }
  }
  // Posts `index` to `queue` once the future is complete (at once if it is).
  void Subscribe(const std::shared_ptr<CompletionQueue>& queue, int64_t index) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!fired_) {
        subscribers_.erase(std::remove_if(subscribers_.begin(), subscribers_.end(),
                                          [](const Subscription& s) { return s.first.expired(); }),
                           subscribers_.end());
        subscribers_.emplace_back(queue, index);
        return;
      }
    }
    queue->Push(index);
  }

 private:
  using Subscription = std::pair<std::weak_ptr<CompletionQueue>, int64_t>;
  std::mutex mu_;
  bool fired_ = false;                     // guarded by mu_
  std::vector<Subscription> subscribers_;  // guarded by mu_
};

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
  if (!internal::KindCrossesProcesses(future->Kind())) return ToPython(receive());
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

// wait() and result(): the value once ready, not consumed (torch.futures' wait(),
// concurrent.futures' result()).
template <typename W>
py::object Wait(const c10::intrusive_ptr<W>& self, const WaitTimeout& timeout) {
  if (!WaitReady(*self, timeout.ms)) RaiseTimeout(timeout.shown);
  return PeekValue(self);
}

template <typename W>
py::object WaitFromArgs(const c10::intrusive_ptr<W>& self, const char* method,
                        const py::args& args, const py::kwargs& kwargs, bool positional_seconds) {
  return Wait(self, ParseWaitTimeout(method, args, kwargs, positional_seconds));
}


// What a Python wrapper (dtorch_ops' future classes) holds in its `_h` slot.
py::object HandleObjectOf(py::handle wrapper) {
  static PyObject* const name = PyUnicode_InternFromString("_h");
  auto handle = py::reinterpret_steal<py::object>(PyObject_GetAttr(wrapper.ptr(), name));
  if (!handle) throw py::error_already_set();
  return handle;
}

// The handle of class W a Python wrapper holds.
template <typename W>
c10::intrusive_ptr<W> HandleOf(py::handle wrapper) {
  return c10::intrusive_ptr<W>::reclaim_copy(&HandleObjectOf(wrapper).cast<W&>());
}

// Calls fn with the wrapper's handle. An ObjectFuture's (W = VoidFuture) may be a TensorFuture's:
// the future then() returns adopts its callback's tensor result (dtorch_ops/_settle.py), its
// handle swapped just before its class, so a method of the class it had (or one bound before)
// may meet the new handle; the methods that reach here need only what both have.
template <typename W, typename Fn>
auto WithHandleOf(py::handle wrapper, Fn&& fn) {
  if constexpr (std::is_same_v<W, VoidFuture>) {
    const py::object handle = HandleObjectOf(wrapper);
    if (py::isinstance<TensorFuture>(handle)) {
      return fn(c10::intrusive_ptr<TensorFuture>::reclaim_copy(&handle.cast<TensorFuture&>()));
    }
    return fn(c10::intrusive_ptr<VoidFuture>::reclaim_copy(&handle.cast<VoidFuture&>()));
  } else {
    return fn(HandleOf<W>(wrapper));
  }
}

// Runs a method's body for CPython (a method descriptor below): its result, or nullptr with the
// Python error set, translated as the rest of this module's errors are (ours by code, torch's
// c10 errors as torch does).
template <typename Body>
PyObject* Guarded(Body&& body) {
  try {
    return body().release().ptr();
  } catch (abi::__forced_unwind&) {
    throw;  // (the thread is being ended, as CPython ends one at finalization: let it end)
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    try {
      TranslateCodedErrors(error);  // (throws what is not ours)
    } catch (...) {
    }
    if (!PyErr_Occurred()) {
      try {
        torch::translate_exception_to_python(error);
      } catch (...) {
      }
    }
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "dtorch: an unknown C++ error");
  }
  return nullptr;
}

// The arguments of a METH_FASTCALL | METH_KEYWORDS call, as pybind11's args and kwargs.
std::pair<py::args, py::kwargs> CallArguments(PyObject* const* args, Py_ssize_t nargs,
                                              PyObject* kwnames) {
  py::tuple positional(nargs);
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    positional[i] = py::reinterpret_borrow<py::object>(args[i]);
  }
  py::kwargs keywords;
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t i = 0; i < nkw; ++i) {
    keywords[PyTuple_GET_ITEM(kwnames, i)] = py::reinterpret_borrow<py::object>(args[nargs + i]);
  }
  return {py::reinterpret_steal<py::args>(positional.release()), std::move(keywords)};
}

// A call with arguments a method does not take: CPython's own message for it.
bool CheckNoArguments(const char* method, Py_ssize_t nargs, PyObject* kwnames) {
  if (nargs == 1 && (kwnames == nullptr || PyTuple_GET_SIZE(kwnames) == 0)) return true;
  PyErr_Format(PyExc_TypeError, "%s() takes no arguments (%zd given)", method,
               nargs - 1 + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0));
  return false;
}

// The methods of a Python wrapper class of W's handles: C functions reading the wrapper's `_h`.
// Each is a plain builtin function made a method by an instancemethod (as pybind11 makes its
// methods), so its first argument is the wrapper: Dynamo treats such a method as the C call it
// is (a graph break), where a method descriptor of an opaque class would be put in the graph.
template <typename W>
struct WrapperMethods {
  using Call = PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*);

  template <typename Body>
  static PyObject* NoArguments(const char* method, PyObject* const* args, Py_ssize_t nargs,
                               PyObject* kwnames, Body&& body) {
    if (nargs < 1 || !CheckNoArguments(method, nargs, kwnames)) {
      if (nargs < 1) PyErr_Format(PyExc_TypeError, "%s() needs its future", method);
      return nullptr;
    }
    return Guarded([&] { return body(py::handle(args[0])); });
  }
  static PyObject* IsReady(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kw) {
    return NoArguments("is_ready", args, nargs, kw, [](py::handle self) {
      return py::bool_(WithHandleOf<W>(self, [](const auto& h) { return h->IsReady(); }));
    });
  }
  static PyObject* Done(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kw) {
    return NoArguments("done", args, nargs, kw, [](py::handle self) {
      return py::bool_(WithHandleOf<W>(self, [](const auto& h) { return h->IsReady(); }));
    });
  }
  static PyObject* Valid(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kw) {
    return NoArguments("valid", args, nargs, kw, [](py::handle self) {
      return py::bool_(WithHandleOf<W>(self, [](const auto& h) { return h->Valid(); }));
    });
  }
  static PyObject* Value(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kw) {
    return NoArguments("value", args, nargs, kw,
                       [](py::handle self) { return PeekValue(HandleOf<W>(self)); });
  }
  static PyObject* GetValue(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kw) {
    return NoArguments("get", args, nargs, kw,
                       [](py::handle self) { return Get(HandleOf<W>(self)); });
  }
  static PyObject* AddDoneCallback(PyObject*, PyObject* const* args, Py_ssize_t nargs,
                                   PyObject* kwnames) {
    if (nargs != 2 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
      PyErr_Format(PyExc_TypeError,
                   "add_done_callback() takes exactly one argument, a callable (%zd given)",
                   std::max<Py_ssize_t>(nargs - 1, 0) + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0));
      return nullptr;
    }
    return Guarded([&] {
      const py::handle self(args[0]);
      WithHandleOf<W>(self, [&](const auto& handle) {
        python::AddDoneCallback(
            [&](std::function<void()> fire) { handle->OnReady(std::move(fire)); }, args[1], self);
      });
      return py::object(py::none());
    });
  }
  template <bool kResult>
  static PyObject* WaitValue(PyObject*, PyObject* const* args, Py_ssize_t nargs,
                             PyObject* kwnames) {
    if (nargs < 1) {
      PyErr_SetString(PyExc_TypeError, "wait() needs its future");
      return nullptr;
    }
    return Guarded([&] {
      const auto [positional, keywords] = CallArguments(args + 1, nargs - 1, kwnames);
      return WaitFromArgs(HandleOf<W>(py::handle(args[0])), kResult ? "result" : "wait",
                          positional, keywords, kResult);
    });
  }
};

// Installs get / wait / result / value / is_ready / done / valid / add_done_callback on a Python
// wrapper class (dtorch_ops' futures) as C functions: one C call each (no Python frame, no
// pybind11 dispatch), TypeErrors that say what each takes, and help() / inspect.signature show
// each signature (the docstrings' first line). with_values=false leaves out those that return
// the value (get, wait, result, value), for a wrapper that keeps its value itself
// (dtorch_ops.ObjectFuture).
template <typename W>
void InstallWaitMethods(py::object cls, bool with_values) {
  using M = WrapperMethods<W>;
  constexpr int kFlags = METH_FASTCALL | METH_KEYWORDS;
  const auto fn = [](typename M::Call call) {
    return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call));
  };
  // (Static: a function keeps a pointer to its definition.)
  static PyMethodDef definitions[] = {
      {"is_ready", fn(&M::IsReady), kFlags,
       "is_ready($self, /)\n--\n\n"
       "True once the future is complete (a value or an error is there), also after get() took\n"
       "the value. Never blocks."},
      {"done", fn(&M::Done), kFlags,
       "done($self, /)\n--\n\n"
       "is_ready() under torch.futures.Future's name: True once complete, also after get()."},
      {"valid", fn(&M::Valid), kFlags,
       "valid($self, /)\n--\n\n"
       "False once get() has taken the value (wait(), result() and value() do not take it)."},
      {"add_done_callback", fn(&M::AddDoneCallback), kFlags,
       "add_done_callback($self, callback, /)\n--\n\n"
       "Calls callback(future) once the future is complete (a value or an error), at once if it\n"
       "is. The callback reads the value with future.value(), which does not consume it, so\n"
       "several callbacks can read one value.\n\n"
       "It runs on the thread that completes the future when that is a Python thread, else on\n"
       "the library's pool thread, with the GIL; never under a lock of the library. Keep it\n"
       "short. An exception it raises is reported through sys.unraisablehook."},
      {"value", fn(&M::Value), kFlags,
       "value($self, /)\n--\n\n"
       "The value of a completed future, without consuming it (torch.futures.Future.value()):\n"
       "the same object each time, or the future's error raised, also after get().\n\n"
       "Raises FutureNotReadyError before completion (never blocks): call it after wait(),\n"
       "await, or in a done callback."},
      {"get", fn(&M::GetValue), kFlags,
       "get($self, /)\n--\n\n"
       "Blocks until the value is ready and returns it; consumes the future (valid() is then\n"
       "False and a second get() raises FutureConsumedError), as std::future::get().\n\n"
       "The GIL is released while waiting. On the main thread Ctrl-C interrupts the wait\n"
       "(KeyboardInterrupt) and leaves the future valid."},
      {"wait", fn(&M::template WaitValue<false>), kFlags,
       "wait($self, /, timeout_ms=None, *, timeout=None)\n--\n\n"
       "Blocks until the value is ready and returns it, without consuming it (as\n"
       "torch.futures.Future.wait(): it can be repeated, and get() still returns the value).\n\n"
       "timeout_ms (milliseconds; an int or a float, fractions round up) or timeout= (seconds)\n"
       "bound the wait: past it, raises FutureTimeoutError (a TimeoutError) and the future\n"
       "stays as it was. None: no limit. The GIL is released while waiting; on the main thread\n"
       "Ctrl-C interrupts it."},
      {"result", fn(&M::template WaitValue<true>), kFlags,
       "result($self, /, timeout=None, *, timeout_ms=None)\n--\n\n"
       "concurrent.futures.Future.result(): wait() with the timeout in seconds. Returns the\n"
       "value without consuming it, or raises the future's error; past the timeout raises\n"
       "FutureTimeoutError (a TimeoutError)."},
  };
  constexpr size_t kWithoutValues = 4;  // (the first four)
  const auto module = cls.attr("__module__");
  const size_t count = with_values ? std::size(definitions) : kWithoutValues;
  for (size_t i = 0; i < count; ++i) {
    const auto function = py::reinterpret_steal<py::object>(
        PyCFunction_NewEx(&definitions[i], nullptr, module.ptr()));
    if (!function) throw py::error_already_set();
    const auto method = py::reinterpret_steal<py::object>(PyInstanceMethod_New(function.ptr()));
    if (!method) throw py::error_already_set();
    cls.attr(definitions[i].ml_name) = method;
  }
}

template <typename T>
void BindFuture(py::module_& m) {
  using F = Future<T>;
  py::class_<F, c10::intrusive_ptr<F>>(m, F::kClassName)
      .def("get", &Get<F>)
      .def("wait",
           [](const c10::intrusive_ptr<F>& self, const py::args& args, const py::kwargs& kwargs) {
             return WaitFromArgs(self, "wait", args, kwargs, false);
           })
      .def("result",
           [](const c10::intrusive_ptr<F>& self, const py::args& args, const py::kwargs& kwargs) {
             return WaitFromArgs(self, "result", args, kwargs, true);
           })
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
  // that held the GIL resumed ~1.5x later); set_value keeps it where it would wake nobody.
  auto cls = py::class_<P, c10::intrusive_ptr<P>>(m, P::kClassName)
                 .def(py::init(
                     [](const std::string& kind) { return c10::make_intrusive<P>(kind); }))
                 .def("set_exception",
                      [](const c10::intrusive_ptr<P>& self, const std::string& message) {
                        ReleasedGil unlocked;
                        self->SetException(message);
                      })
                 // set_exception(exc) of dtorch_ops: the exception object, its type's name
                 // ("ValueError", "module.Name"), message and traceback text.
                 .def("set_exception_object",
                      [](const c10::intrusive_ptr<P>& self, py::object exception,
                         const std::string& exception_type, const std::string& message,
                         const std::string& traceback) {
                        auto native = std::make_shared<const PyNativeError>(std::move(exception));
                        ReleasedGil unlocked;
                        internal::SetExceptionObject(self, message, exception_type, traceback,
                                                     std::move(native));
                      })
                 // This process received the promise without deserializing it (a forked
                 // multiprocessing child's arguments): it holds it from now on.
                 .def("register_holder",
                      [](const c10::intrusive_ptr<P>& self) {
                        ReleasedGil unlocked;
                        internal::RegisterHolder(self);
                      })
                 .def("get_future", &P::GetFuture)
                 .def("kind", [](const c10::intrusive_ptr<P>& self) { return self->Kind(); })
                 // Without the GIL: both may reach the pair (a holder's registration, a count:
                 // the interprocess lock, or the network kind's store).
                 .def("serialize",
                      [](const c10::intrusive_ptr<P>& self) {
                        ReleasedGil unlocked;
                        return self->Serialize();
                      })
                 .def_static("from_serialized",
                             [](const std::string& serialized) {
                               ReleasedGil unlocked;
                               return P::FromSerialized(serialized);
                             })
                 .def("script", &ToScript<P>)
                 .def_static("from_script", &FromScript<P>);
  // The GIL is kept where nobody waits (a pair set and read on one thread): releasing it would
  // hand it to another Python thread for nothing (measured: futures resolved per second by 4
  // producer threads went from 0.9x torch.futures' to 2.7x).
  if constexpr (std::is_same_v<T, at::Tensor>) {
    cls.def("set_value", [](const c10::intrusive_ptr<P>& self, at::Tensor value) {
      if (value.key_set().has(c10::DispatchKey::Python) ||
          (value.device().is_cpu() && internal::CompletesQuietly(self))) {
        self->SetValue(std::move(value));  // with the GIL: also the subclass check needs Python
        return;
      }
      ReleasedGil unlocked;
      self->SetValue(std::move(value));
    });
  } else {
    cls.def("set_value", [](const c10::intrusive_ptr<P>& self) {
      if (internal::CompletesQuietly(self)) return self->SetValue({});
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
      .def("wait",
           [](const c10::intrusive_ptr<VoidFutureCollect>& self, const py::args& args,
              const py::kwargs& kwargs) { return WaitFromArgs(self, "wait", args, kwargs, false); })
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

  // wait_any / as_completed (dtorch_ops.waiting): futures post their index here once complete.
  py::class_<CompletionQueue, std::shared_ptr<CompletionQueue>>(m, "CompletionQueue")
      .def(py::init<>())
      // The next index, waiting up to timeout_ms (None: no limit) with the GIL released; None
      // past it.
      .def("pop", [](const std::shared_ptr<CompletionQueue>& self,
                     std::optional<int64_t> timeout_ms) -> std::optional<int64_t> {
        if (auto index = self->PopNow()) return index;
        if (!WaitReady(*self, timeout_ms)) return std::nullopt;
        return self->PopNow();
      }, py::arg("timeout_ms"));
  // A future's completion fanned out to the queues watching it (one callback per future).
  py::class_<CompletionFanout, std::shared_ptr<CompletionFanout>>(m, "CompletionFanout")
      .def(py::init<>())  // (fired by hand: a torch.futures.Future's done callback)
      .def_static("of", &CompletionFanout::Of<TensorFuture>)
      .def_static("of", &CompletionFanout::Of<VoidFuture>)
      .def_static("of", &CompletionFanout::Of<TensorListFuture>)
      .def_static("of", &CompletionFanout::Of<VoidFutureCollect>)
      .def("fire", &CompletionFanout::Fire)
      .def("subscribe", &CompletionFanout::Subscribe);
  // A timeout for the functions over several futures: timeout= (seconds) or timeout_ms=, one of
  // them; None for no limit. Raises the usual TypeError / ValueError naming `method`.
  m.def("timeout_ms_of",
        [](const std::string& method, py::object timeout, py::object timeout_ms)
            -> std::optional<int64_t> {
          py::kwargs kwargs;
          if (!timeout.is_none()) kwargs["timeout"] = timeout;
          if (!timeout_ms.is_none()) kwargs["timeout_ms"] = timeout_ms;
          return ParseWaitTimeout(method.c_str(), py::args(), kwargs, true).ms;
        });
  // Fails a memory VoidPromise with a timeout error after timeout_ms (collect_all's timeout);
  // the returned timer's cancel() releases it once the promise is set.
  struct PendingTimeout {
    std::function<void()> cancel;
  };
  py::class_<PendingTimeout>(m, "PendingTimeout")
      .def("cancel", [](const PendingTimeout& self) { self.cancel(); });
  m.def("fail_after",
        [](const c10::intrusive_ptr<VoidPromise>& promise, int64_t timeout_ms,
           std::string detail) {
          return PendingTimeout{internal::FailAfter(promise, timeout_ms, std::move(detail))};
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
  // The network kind's pair-group maker (dtorch_ops/_pair_groups.py), or None.
  m.def("set_pair_group_maker", &dtorch::python::SetPairGroupMaker);
  m.def("library_threads", [] {
    py::dict threads;
    for (const auto& [name, count] : internal::CountLibraryThreads()) threads[name.c_str()] = count;
    return threads;
  });
  // Each lifecycle participant's diagnostics (core/lifecycle.h), by name: {"detectors": {...},
  // "doorbell": {"pending_pairs": ...}, ...}.
  m.def("diagnostics", [] { return internal::LibraryDiagnostics(); });
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
  // dtorch_ops calls it in a fork-started multiprocessing child before it exits (which skips the
  // library's exit handler): its consumers then read "producer exited", not "died", and its
  // doorbell goes if nothing of it is pending.
  m.def("at_child_exit", &internal::AtChildExit);
  // Test-only: in a producer process, takes `promise`'s interprocess lock and never returns.
  m.def("hold_file_promise_lock_for_testing", [](const std::string& serialized) {
    py::gil_scoped_release unlocked;
    internal::HoldFilePromiseLockForTesting(serialized);
  });

  // Settings: the one table (core/settings.h) dtorch_ops.config is built from; std::invalid_argument
  // and std::logic_error reach Python as ValueError and RuntimeError.
  m.def("settings", [] {
    py::list table;
    for (const auto& setting : internal::AllSettings()) {
      py::dict entry;
      entry["name"] = setting.name;
      entry["unit"] = setting.unit == core::Setting::Unit::kSeconds ? "s" : "count";
      entry["default"] = setting.default_value;
      entry["minimum"] = setting.minimum;
      entry["maximum"] = setting.maximum;
      entry["doc"] = setting.doc;
      table.append(entry);
    }
    return table;
  });
  m.def("get_setting", &internal::GetSetting, py::arg("name"));
  m.def("set_setting", &internal::SetSetting, py::arg("name"), py::arg("value"));
}

}  // namespace dtorch::python
