// Hooks through which the runtime that embeds the library (the Python module dtorch_ops._C)
// adapts the Python-free library to itself. Unset hooks do nothing: a plain libtorch C++ program
// needs none.
//
// Thread-safety: SetRuntimeHooks is called once, when the embedding module loads, before any
// promise or future is used from it; the hooks themselves may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtorch {

struct RuntimeHooks {
  // Runs on a thread about to return from a library call that its caller may have entered with
  // the GIL released (torch does so for TorchScript methods and ops called from Python): after a
  // blocking wait (Get, Wait, WaitFor of the futures) and after a completion (SetValue,
  // SetException). Python's hook parks a thread that would otherwise re-take the GIL after
  // interpreter finalization began (CPython then ends the thread with a forced unwind, which
  // aborts the process in any noexcept frame).
  void (*before_return)() = nullptr;
  // Runs where such a call begins (the same places): Python's hook stops counting the thread as
  // running Python, so that exit does not wait for a callback blocked in a library wait.
  void (*before_call)() = nullptr;
  // Called by TensorPromise::SetValue with a value that has the Python dispatch key (a tensor
  // subclass); throws c10::TypeError for values that a promise cannot carry (a DTensor).
  void (*check_subclass_value)(const at::Tensor& value) = nullptr;
};

// SetRuntimeHooks: internal_api.h (exported to _C).
const RuntimeHooks& GetRuntimeHooks();

// Runs hooks.before_call (if set) when made and hooks.before_return when destroyed: put one in
// scope before blocking or completing.
class BeforeReturn {
 public:
  BeforeReturn() {
    if (const auto hook = GetRuntimeHooks().before_call) hook();
  }
  BeforeReturn(const BeforeReturn&) = delete;
  BeforeReturn& operator=(const BeforeReturn&) = delete;
  ~BeforeReturn() {
    if (const auto hook = GetRuntimeHooks().before_return) hook();
  }
};

}  // namespace dtorch
