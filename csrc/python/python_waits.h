// Blocking waits from Python, and what happens to them when the interpreter exits.
//
// Waiting: a thread that waits releases the GIL and sleeps in C++ until the value arrives. Only
// the main thread receives Ctrl-C, so only a wait on the main thread wakes every
// kSignalCheckMs to run Python's signal handlers (no exception is raised and caught for it); an
// interrupted wait raises KeyboardInterrupt and consumes nothing, so the future stays valid.
//
// Exit: once finalization has begun, CPython ends any thread that re-takes the GIL with a forced
// unwind, which aborts the process in a noexcept frame. dtorch_ops' atexit handler therefore
// closes the exit gate (CloseExitGate): from then on a thread other than the main one that
// finishes a wait parks instead of re-taking the GIL. A thread already on its way back to the GIL
// when the gate closes is let through first (CloseExitGate releases the GIL until it has it).
//
// Thread-safety: every function may be called from any thread; those that take the GIL say so.
#pragma once

#include <Python.h>

#include <chrono>
#include <cstdint>
#include <optional>

#include "../core/shared_state.h"

namespace dtorch::python {

inline constexpr int64_t kSignalCheckMs = 100;
// How long the exit handler lets other threads take the GIL after closing the gate.
inline constexpr int64_t kExitGraceMs = 10;

// Records the interpreter's main thread. Call once, at module import (GIL held).
void InitMainThread();
bool IsMainThread();

// From dtorch_ops' atexit handler (GIL held): closes the gate (see above), then waits for the
// Python callbacks running on library threads to return (GilUnlessExiting).
void CloseExitGate();
// The library's before_call hook (a blocking wait or a completion begins; torch may have released
// the GIL for it): a callback's thread is not running Python meanwhile.
void BeforeLibraryCall() noexcept;
// The library's before_return hook: parks a Python thread that released the GIL (in torch's own
// method and op call path) once the gate is closed.
void ParkIfExiting() noexcept;
// Whether the gate is closed (the exit handler has run).
bool ExitGateClosed();
// After fork(), in the child (os.register_at_fork): the forking thread is the child's main
// thread, and no thread is on its way back to the GIL.
void AfterForkInChild();

// Wake-ups of waits that returned without the value (main-thread signal checks), for tests.
uint64_t WaitWakeups();
void CountWakeup();

// Releases the GIL for its scope; on leaving it re-takes the GIL, or parks for good if the exit
// gate is closed and this is not the main thread.
class ReleasedGil {
 public:
  ReleasedGil();
  ~ReleasedGil();
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;

 private:
  PyThreadState* state_;
};

// Takes the GIL for its scope on any thread, a library thread included (PyGILState_Ensure),
// unless the exit gate is closed and this is not the main thread: then it takes nothing, and
// the caller must not touch Python (finalization may have begun).
class GilUnlessExiting {
 public:
  GilUnlessExiting();
  ~GilUnlessExiting();
  GilUnlessExiting(const GilUnlessExiting&) = delete;
  GilUnlessExiting& operator=(const GilUnlessExiting&) = delete;
  explicit operator bool() const { return taken_; }

 private:
  bool taken_ = false;
  PyGILState_STATE state_{};
};

// Raises Python's pending signal exception (KeyboardInterrupt) as py::error_already_set.
void RaiseIfSignalled();

// Waits until waitable.IsReady()-or-error (its WaitFor returns true) or until timeout_ms has
// passed (nullopt: no limit). Returns whether it is ready. Called and returns with the GIL held;
// never consumes. Waitable: Future<T> or VoidFutureCollect.
template <typename Waitable>
bool WaitReady(const Waitable& waitable, std::optional<int64_t> timeout_ms) {
  if (waitable.WaitFor(0)) return true;  // ready (or consumed: WaitFor throws then)
  if (timeout_ms && *timeout_ms == 0) return false;
  using Clock = std::chrono::steady_clock;
  const bool main = IsMainThread();
  const auto deadline = timeout_ms ? Clock::now() + std::chrono::milliseconds(*timeout_ms)
                                   : Clock::time_point::max();
  for (;;) {
    int64_t slice = core::kMaxTimeoutMs;
    if (timeout_ms) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
      slice = std::max<int64_t>(left.count(), 0);
    }
    if (main) slice = std::min(slice, kSignalCheckMs);
    bool ready;
    {
      ReleasedGil unlocked;
      ready = waitable.WaitFor(slice);
    }
    if (ready) return true;
    if (timeout_ms && Clock::now() >= deadline) return false;
    CountWakeup();
    if (main) RaiseIfSignalled();
  }
}

}  // namespace dtorch::python
