#include "python_waits.h"

#include <pythread.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <pybind11/pybind11.h>

namespace dtorch::python {
namespace {

std::atomic<unsigned long> main_thread_ident{0};
std::atomic<uint64_t> wakeups{0};

// Pointers, leaked: a fork child replaces them (the parent's lock may have been held at the fork
// by a thread that does not exist in the child).
std::mutex* exit_mu = new std::mutex();
std::condition_variable* exit_cv = new std::condition_variable();
std::atomic<bool> exit_gate_closed{false};  // written under *exit_mu
int64_t reacquiring = 0;                    // guarded by *exit_mu: threads on their way to the GIL

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
  exit_mu = new std::mutex();
  exit_cv = new std::condition_variable();
  reacquiring = 0;
}

bool ExitGateClosed() { return exit_gate_closed.load(); }

bool IsMainThread() { return PyThread_get_thread_ident() == main_thread_ident.load(); }

uint64_t WaitWakeups() { return wakeups.load(); }
void CountWakeup() { ++wakeups; }

void CloseExitGate() {
  {
    std::lock_guard<std::mutex> lock(*exit_mu);
    exit_gate_closed = true;
  }
  // Threads past the gate wait for the GIL, which this (main) thread holds: let them have it.
  // Ours are counted; a thread returning through torch's own GIL guard (a raw TorchScript method
  // or op that passed the library's hook just before the gate closed) is not, so the GIL is
  // released for a short grace period too.
  pybind11::gil_scoped_release release;
  std::unique_lock<std::mutex> lock(*exit_mu);
  exit_cv->wait_for(lock, std::chrono::seconds(1), [] { return reacquiring == 0; });
  lock.unlock();
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
  {
    std::unique_lock<std::mutex> lock(*exit_mu);
    if (exit_gate_closed && !IsMainThread()) {
      // Finalization may have begun: re-taking the GIL would end this thread with a forced
      // unwind (an abort here). The process is exiting; this thread stays asleep until it does.
      lock.unlock();
      ParkForever();
    }
    ++reacquiring;
  }
  PyEval_RestoreThread(state_);
  {
    std::lock_guard<std::mutex> lock(*exit_mu);
    --reacquiring;
  }
  exit_cv->notify_all();
}

void RaiseIfSignalled() {
  if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
}

}  // namespace dtorch::python
