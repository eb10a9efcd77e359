#include "python_waits.h"

#include <pythread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <pybind11/pybind11.h>

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

[[noreturn]] void ParkForever() noexcept {
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
}

void ParkIfExiting() noexcept {
  if (!exit_gate_closed.load() || IsMainThread()) return;
  // Only a Python thread that released the GIL would re-take it; a C++ thread, or one that holds
  // the GIL, returns as usual.
  if (PyGILState_GetThisThreadState() == nullptr || PyGILState_Check()) return;
  ParkForever();
}

ReleasedGil::~ReleasedGil() {
  ++reacquiring;
  if (exit_gate_closed.load() && !IsMainThread()) {
    // Finalization may have begun: re-taking the GIL would end this thread with a forced unwind
    // (an abort here). The process is exiting; this thread stays asleep until it does.
    --reacquiring;
    ParkForever();
  }
  PyEval_RestoreThread(state_);
  --reacquiring;
}

GilUnlessExiting::GilUnlessExiting() {
  ++reacquiring;  // (counted, as ~ReleasedGil, so that CloseExitGate lets us through first)
  if (exit_gate_closed.load() && !IsMainThread()) {
    --reacquiring;
    return;
  }
  state_ = PyGILState_Ensure();
  --reacquiring;
  taken_ = true;
}

void RaiseIfSignalled() {
  if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
}

}  // namespace dtorch::python
