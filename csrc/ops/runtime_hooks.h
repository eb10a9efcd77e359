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
  // Runs on a thread that blocked in a library wait (Get, Wait, WaitFor of the futures), once the
  // wait is over and before the thread returns to its caller. Python's hook parks a thread that
  // would otherwise re-take the GIL after interpreter finalization began (CPython then ends the
  // thread with a forced unwind, which aborts the process in any noexcept frame).
  void (*after_blocking_wait)() = nullptr;
  // Called by TensorPromise::SetValue with a value that has the Python dispatch key (a tensor
  // subclass); throws c10::TypeError for values that a promise cannot carry (a DTensor).
  void (*check_subclass_value)(const at::Tensor& value) = nullptr;
};

void SetRuntimeHooks(const RuntimeHooks& hooks);
const RuntimeHooks& GetRuntimeHooks();

// Runs hooks.after_blocking_wait (if set) when destroyed: put one in scope before blocking.
class AfterBlockingWait {
 public:
  AfterBlockingWait() = default;
  AfterBlockingWait(const AfterBlockingWait&) = delete;
  AfterBlockingWait& operator=(const AfterBlockingWait&) = delete;
  ~AfterBlockingWait() {
    if (const auto hook = GetRuntimeHooks().after_blocking_wait) hook();
  }
};

}  // namespace dtorch
