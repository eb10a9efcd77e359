#include "python_waits.h"

#include <pythread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include <pybind11/pybind11.h>

#include "../ops/internal_api.h"

namespace dtorch::python {
namespace {

std::atomic<unsigned long> main_thread_ident{0};
std::atomic<uint64_t> wakeups{0};

// The gate and the count of threads on their way back to the GIL are plain atomics (no lock on
// the wait's hot path): a thread counts itself, then reads the gate; the exit handler closes the
// gate, then reads the count. Sequentially consistent, so either the thread sees the gate closed
// (and parks) or the handler sees it counted (and lets it take the GIL first).
std::atomic<bool> exit_gate_closed{false};
std::atomic<int64_t> reacquiring{0};
// Threads running a Python callback (inside a GilUnlessExiting) and not blocked in a library wait
// (which parks rather than returns to Python once the gate is closed): CloseExitGate waits for
// them, since CPython would end them at finalization with a forced unwind, which C++ frames do
// not survive. Each thread counts once (its flag), however deep its callbacks nest.
std::atomic<int64_t> running_callbacks{0};
thread_local int64_t callback_depth = 0;  // GilUnlessExiting scopes this thread is in
thread_local bool counted = false;        // this thread is in running_callbacks

void SetCounted(bool running) noexcept {
  if (running == counted) return;
  counted = running;
  running ? ++running_callbacks : --running_callbacks;
}

[[noreturn]] void ParkForever() noexcept {
  SetCounted(false);  // (it never returns to Python)
  for (;;) ::pause();
}

}  // namespace

void InitMainThread() {
  const auto threading = pybind11::module_::import("threading");
  main_thread_ident = threading.attr("main_thread")().attr("ident").cast<unsigned long>();
}

void AfterForkInChild() {
  main_thread_ident = PyThread_get_thread_ident();
  reacquiring = 0;  // the parent's threads do not exist here
  running_callbacks = counted ? 1 : 0;
}

bool ExitGateClosed() { return exit_gate_closed.load(); }

bool IsMainThread() { return PyThread_get_thread_ident() == main_thread_ident.load(); }

uint64_t WaitWakeups() { return wakeups.load(); }
void CountWakeup() { ++wakeups; }

void CloseExitGate() {
  exit_gate_closed = true;
  // Threads past the gate wait for the GIL, which this (main) thread holds: let them have it.
  // Ours are counted; a thread returning through torch's own GIL guard (a raw TorchScript method
  // or op that passed the library's hook just before the gate closed) is not, so the GIL is
  // released for a short grace period too.
  pybind11::gil_scoped_release release;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (reacquiring.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(kExitGraceMs));
  // A Python callback still running is waited for, as Python waits for its non-daemon threads:
  // finalizing under it would abort the process. (Also one still on its way to the GIL: counted
  // in reacquiring until it is in running_callbacks; it gets the GIL, which this thread released,
  // so this wait has no bound of its own.)
  const auto warn_at =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(internal::GetSetting("exit_timeout_s"));
  bool warned = false;
  while (running_callbacks.load() > 0 || reacquiring.load() > 0) {
    if (!warned && std::chrono::steady_clock::now() >= warn_at) {
      warned = true;
      std::fprintf(stderr, "dtorch: waiting at exit for a done callback that is still running "
                           "(add_done_callback / then); the process exits once it returns\n");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void BeforeLibraryCall() noexcept {
  // Only a thread that released the GIL (torch's call path, ReleasedGil) passes the gate on its
  // way back to Python; one that holds it goes straight back, so it still counts.
  if (counted && !PyGILState_Check()) SetCounted(false);
}

void ParkIfExiting() noexcept {
  SetCounted(callback_depth > 0);  // (before reading the gate, as ~ReleasedGil)
  if (!exit_gate_closed.load() || IsMainThread()) return;
  // Only a Python thread that released the GIL would re-take it; a C++ thread, or one that holds
  // the GIL, returns as usual.
  if (PyGILState_GetThisThreadState() == nullptr || PyGILState_Check()) return;
  ParkForever();
}

ReleasedGil::ReleasedGil() : state_(PyEval_SaveThread()) { SetCounted(false); }

ReleasedGil::~ReleasedGil() {
  ++reacquiring;
  if (exit_gate_closed.load() && !IsMainThread()) {
    // Finalization may have begun: re-taking the GIL would end this thread with a forced unwind
    // (an abort here). The process is exiting; this thread stays asleep until it does.
    --reacquiring;
    ParkForever();
  }
  PyEval_RestoreThread(state_);
  SetCounted(callback_depth > 0);  // (before leaving reacquiring: CloseExitGate sees one)
  --reacquiring;
}

GilUnlessExiting::GilUnlessExiting() {
  ++reacquiring;  // (counted, as ~ReleasedGil, so that CloseExitGate lets us through first)
  if (exit_gate_closed.load() && !IsMainThread()) {
    --reacquiring;
    return;
  }
  state_ = PyGILState_Ensure();
  ++callback_depth;
  SetCounted(true);  // (before leaving reacquiring: CloseExitGate sees one or the other)
  --reacquiring;
  taken_ = true;
}

GilUnlessExiting::~GilUnlessExiting() {
  if (!taken_) return;
  const bool nested = --callback_depth > 0;
  PyGILState_Release(state_);  // (may run Python: clearing a thread state made for this scope)
  SetCounted(nested);
}

void RaiseIfSignalled() {
  if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
}

}  // namespace dtorch::python
