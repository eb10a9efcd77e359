#include "python_callbacks.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "../ops/internal_api.h"
#include "python_waits.h"

namespace dtorch::python {
namespace {

// Python callbacks need the GIL, so running them on several pool threads at once gains nothing:
// internal::PostInOrder runs them one at a time, in the order their futures completed
// (registration order for one future, as torch.futures).

// One registered callback: owned references to the callable and its argument.
class PendingCall {
 public:
  PendingCall(PyObject* fn, PyObject* arg)
      : fn_(Py_NewRef(fn)), arg_(Py_NewRef(arg)), generation_(internal::ForkGeneration()) {}
  PendingCall(const PendingCall&) = delete;
  PendingCall& operator=(const PendingCall&) = delete;

  ~PendingCall() {
    if (fn_ == nullptr || generation_ != internal::ForkGeneration()) return;  // (a child: left)
    GilUnlessExiting gil;
    if (gil) ReleaseWithGil();  // (else exiting: left to the process's end)
  }

  // On the completing thread: runs here on a Python thread, else posts to the pool.
  static void Fire(const std::shared_ptr<PendingCall>& call) {
    if (call->generation_ != internal::ForkGeneration()) return;
    if (PyGILState_GetThisThreadState() != nullptr) {
      call->Run();
      return;
    }
    try {
      internal::PostInOrder([call] { call->Run(); });
    } catch (...) {
      // The pool has stopped (exit) or cannot start a thread: the callback is not run.
    }
  }

 private:
  void Run() {
    GilUnlessExiting gil;
    if (!gil || fn_ == nullptr) return;
    PyObject* result = PyObject_CallOneArg(fn_, arg_);
    if (result == nullptr) {
      PyErr_WriteUnraisable(fn_);
    } else {
      Py_DECREF(result);
    }
    ReleaseWithGil();  // now, not when the future drops its callback list
  }

  void ReleaseWithGil() {
    Py_CLEAR(fn_);
    Py_CLEAR(arg_);
  }

  PyObject* fn_;
  PyObject* arg_;
  const uint64_t generation_;
};

}  // namespace

void AddDoneCallback(const std::function<void(std::function<void()>)>& on_ready,
                     pybind11::handle fn, pybind11::handle arg) {
  if (!PyCallable_Check(fn.ptr())) {
    throw pybind11::type_error(std::string("dtorch: add_done_callback needs a callable, got ") +
                               Py_TYPE(fn.ptr())->tp_name);
  }
  auto call = std::make_shared<PendingCall>(fn.ptr(), arg.ptr());
  on_ready([call = std::move(call)] { PendingCall::Fire(call); });
}

}  // namespace dtorch::python
