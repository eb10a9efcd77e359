// CompletionDetectors: complete values when asynchronous work finishes, with a bounded number of
// library threads (torch-free). One model for every source of completions ("Threads and
// completions" in the design): device streams today, other kinds later.
//
// A source's completions are queued under its key (one key per device stream). Work of one key
// finishes in order, so only the oldest pending completion of each key is watched; when it is done
// the ones behind it are usually done too and are drained without sleeping, in order.
//
// Threads ("detectors", named dtorch-detect): at most one per active key, up to a cap per process
// (SetMaxThreads; 32 by default), beyond which keys share detectors (a new key goes to the
// detector serving the fewest, not blocked if possible). A key is active while it has completions
// queued or being completed; a submission to an active key wakes nobody, one to an inactive key
// wakes only the detector it is given to. A detector serving one key whose oldest completion can
// block (PendingCompletion::CanBlock: the device type records its own events) sleeps in that wait,
// in slices of kBlockingSliceMs (at the cap, a key given to a blocked detector, the one whose slice
// ends first, waits for that); otherwise it polls its keys' oldest completions with an
// exponential back-off (20 us .. 1 ms). A detector with no key exits after the idle time
// (SetIdleExitMs).
//
// Untimed waits (PendingCompletion::WaitIsTimed false: CUDA's cudaEventSynchronize has no
// timeout): the detector sleeps until that completion's work has finished or failed, and sees
// nothing else meanwhile. So a new key goes to a detector in an untimed wait only as the last
// choice, at the cap when every detector is in one (then the fewest keys): that key waits until
// the wait ends, i.e. behind another stream's work. Below the cap a new key starts a detector.
//
// Exit (Stop, called by the library's exit handler within one deadline): detectors complete what
// is already done and exit; every completion still pending then gets FutureError
// kDroppedAtExit, and so does each later submission. A detector in an untimed wait cannot be
// woken: Stop does not wait for one serving a single key (that key's oldest completion was
// pending when last looked at, as a polling detector's final round finds it: dropped) and
// abandons it at once, as it abandons any detector still busy at the deadline; its wait then
// returns whenever the device is done, and it touches nothing of what Stop dropped. So exit never
// waits for device work. Fork: the child inherits no detector; the completions pending in the
// parent get kDroppedAtFork in the child (AfterForkInChild), and new submissions there start new
// detectors. A detector in a wait (timed or not) holds no lock and is not inside Complete(), so
// PrepareFork does not wait for it either.
//
// Lifetime: a process-wide singleton, never destroyed. A completion keeps what it needs alive until
// Complete() has run. One dropped (exit, fork) is completed with the error and then leaked, not
// destroyed: what it holds (a device event, a tensor) may belong to a runtime being torn down, or
// to the parent's device context.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

namespace dtorch::core {

class PendingCompletion {
 public:
  virtual ~PendingCompletion() = default;
  // Non-blocking: true once the awaited work has finished. May throw (a device error).
  virtual bool Poll() = 0;
  // Whether WaitFor blocks in the backend without spinning until the work is done.
  virtual bool CanBlock() const { return false; }
  // Whether WaitFor returns once `timeout` has passed. An untimed one returns only when the work
  // has finished or failed (see "Untimed waits" above). Asked only when CanBlock().
  virtual bool WaitIsTimed() const { return true; }
  // Blocks until the work has finished or (WaitIsTimed) `timeout` has passed; returns whether it
  // finished. Called only when CanBlock(). May throw (a device error).
  virtual bool WaitFor(std::chrono::microseconds timeout) { return Poll(); }
  // Called exactly once: with nullptr when the work finished, with the exception Poll()/WaitFor()
  // threw, or with a FutureError (kDroppedAtExit, kDroppedAtFork) when the value will never be
  // detected. Runs on a detector, or on the thread that stops the library or forked. Must not
  // throw, block, or take the GIL.
  virtual void Complete(std::exception_ptr error) noexcept = 0;
};

class CompletionDetectors {
 public:
  static constexpr const char* kThreadName = "dtorch-detect";  // at most 15 characters
  static constexpr size_t kDefaultMaxThreads = 32;
  static constexpr int64_t kDefaultIdleExitMs = 2000;
  // A blocking wait's slice: how long a key given to a detector in such a wait (at the cap; the
  // one whose slice ends first) may wait for it to notice, and how often a blocked detector wakes
  // (40/s: 0.2-0.3 % of a core here, against 0.13 % at 50 ms and 0.65 % at 10 ms).
  static constexpr int64_t kBlockingSliceMs = 25;

  static CompletionDetectors& Instance();

  // Queues `completion` behind the earlier ones of `key`. Throws std::system_error (and queues
  // nothing) if a detector is needed and no thread can be started. After Stop(), completes it at
  // once, here, with kDroppedAtExit.
  void Submit(const std::string& key, std::unique_ptr<PendingCompletion> completion);

  // Settings, applied at once (idle detectors beyond a lowered cap exit; busy ones finish their
  // keys). Throw std::invalid_argument when < 1.
  void SetMaxThreads(int64_t count);
  int64_t MaxThreads() const;
  void SetIdleExitMs(int64_t ms);
  int64_t IdleExitMs() const;

  // For tests and diagnostics.
  size_t ThreadCount() const;   // live detectors
  size_t PendingCount() const;  // completions not yet completed
  size_t ActiveKeys() const;    // keys with completions queued or being completed
  // How many times a detector was woken by a notification (a key given to it, Stop), not by a
  // timeout: a submission wakes at most one detector.
  uint64_t NotifiedWakeups() const;
  // The next `count` thread starts fail as if the system had no thread to spare.
  void FailThreadStartsForTesting(int count);

  // Exit: detectors complete what is done and exit; at `deadline` (or once every detector left is
  // in an untimed wait on its only key) whatever is still pending is completed with kDroppedAtExit
  // (here, on the calling thread). A detector still busy then is abandoned: it completes only what
  // it had already taken off its keys, polls nothing more and destroys nothing. Idempotent.
  void Stop(std::chrono::steady_clock::time_point deadline);

  // pthread_atfork handlers (the library's lifecycle, core/lifecycle.h, calls them).
  // PrepareFork waits until no detector is inside Complete() and keeps the detectors' state locked
  // across fork(); the parent unlocks it, the child resets it and drops what was pending.
  void PrepareFork();
  void AfterForkInParent();
  void AfterForkInChild();

 private:
  struct State;
  struct Detector;
  struct Key;

  CompletionDetectors();
  void Run(Detector* self);
  void AssignLocked(Key& key);
  void StartDetectorLocked(Key& key);
  void WakeIdleLocked();

  // Replaced (the old one leaked) in a fork child: its mutex and condition variables may be in any
  // state there.
  State* state_;
};

}  // namespace dtorch::core
