// CompletionPoller: completes promises when asynchronous device work finishes, without a
// blocked thread per pending value (torch-free).
//
// Work submitted on one device stream completes in submission order, so pending completions
// are queued per stream key and one library thread per *active* stream polls only the oldest;
// when it is done the ones behind it are usually done too and are drained without sleeping.
// A queue's thread polls with an exponential back-off (20 us .. 1 ms) instead of a blocking
// device synchronize, which on CUDA would spin a core; it exits after kIdleExitMs without work.
// Thousands of pending values on a few streams therefore cost a few threads.
//
// Lifetime: the poller is a process-wide singleton that is never destroyed; a completion keeps
// whatever it needs (the tensor, the event, the promise) alive until Complete() has run.
// Shutdown() (called at process exit: by dtorch_ops' Python atexit handler, before the
// interpreter is torn down, and by std::atexit) stops the threads from touching completions:
// those still pending are leaked rather than completed or destroyed while the runtime below them
// (Python, a device driver, the allocator) is being torn down.
//
// Thread-safety: Submit() and the counters may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace dtorch::core {

class PendingCompletion {
 public:
  virtual ~PendingCompletion() = default;
  // Non-blocking: true once the awaited work has finished. May throw (a device error).
  virtual bool Poll() = 0;
  // Called exactly once, on a poller thread: with nullptr when Poll() returned true, or with the
  // exception Poll() threw. Must not throw.
  virtual void Complete(std::exception_ptr error) noexcept = 0;
};

class CompletionPoller {
 public:
  static constexpr int64_t kIdleExitMs = 2000;
  static constexpr const char* kThreadName = "dtorch-poller";  // at most 15 characters

  static CompletionPoller& Instance();

  // Queues `completion` behind the earlier ones with the same key (one key per device stream).
  // Throws (and queues nothing) if no poller thread can be started.
  void Submit(const std::string& key, std::unique_ptr<PendingCompletion> completion);

  // Live poller threads and completions not yet completed (for tests and diagnostics).
  size_t ThreadCount() const;
  size_t PendingCount() const;

  // Tests: the next `count` thread starts fail as if the system had no thread to spare.
  void FailThreadStartsForTesting(int count) { fail_thread_starts_for_testing_ = count; }

  // Stops all completion work for good: queued completions are leaked, and this waits (up to
  // `timeout_ms`) for the ones being completed right now. Later Submit()s are leaked too.
  // Idempotent; thread-safe.
  void Shutdown(int64_t timeout_ms);

 private:
  struct Queue {
    std::deque<std::unique_ptr<PendingCompletion>> items;
    bool has_thread = false;
  };

  CompletionPoller() = default;
  void Run(const std::string& key);

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::map<std::string, Queue> queues_;  // guarded by mu_
  size_t threads_ = 0;                   // guarded by mu_
  size_t pending_ = 0;                   // guarded by mu_
  size_t in_flight_ = 0;                 // guarded by mu_: taken by a thread, not yet released
  std::condition_variable idle_cv_;      // in_flight_ dropped
  std::atomic<bool> exiting_{false};     // set once, by Shutdown (also read without mu_)
  std::atomic<int> fail_thread_starts_for_testing_{0};
};

}  // namespace dtorch::core
