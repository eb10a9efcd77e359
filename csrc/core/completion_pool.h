// CompletionPool: the library's one process-wide thread pool for completion work that is long or
// must not run on a detector (copying a device value into shared memory, publishing it to
// another process). A Boost.Asio thread_pool (torch-free) whose threads are the library's own,
// named dtorch-pool, started on the first Post (2 by default, SetThreads before that).
//
// Order: work posted to the pool runs in any order on any of its threads; work posted through one
// Strand runs one at a time, in posting order.
//
// Exit (Stop, within the library's exit deadline): work already posted is finished if it can be
// by the deadline (it may hand a value to another process); then the pool stops, work not started
// is abandoned (never run, never destroyed) and Post throws. Fork: the child inherits no pool
// thread; the parent's queued work is abandoned there, and the first Post starts a new pool.
//
// Work must not throw (an exception escaping it is caught and ignored). Work that takes the GIL
// (the _C module's Python callbacks) must not take it once Python's exit has begun
// (python/python_waits.h: GilUnlessExiting).
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

namespace dtorch::core {

class CompletionPool {
 public:
  static constexpr const char* kThreadName = "dtorch-pool";  // at most 15 characters
  static constexpr int64_t kDefaultThreads = 2;

  using Work = std::function<void()>;

  // Runs work in order, one at a time, on the pool's threads. Cheap to copy; all copies are one
  // strand. Post throws std::logic_error in a fork child (make a new strand there) and
  // std::runtime_error after Stop.
  class Strand {
   public:
    void Post(Work work) const;

   private:
    friend class CompletionPool;
    struct Impl;
    explicit Strand(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
    std::shared_ptr<Impl> impl_;
  };

  static CompletionPool& Instance();

  // Starts the pool if needed. Throws std::runtime_error after Stop, std::system_error when no
  // pool thread can be started.
  void Post(Work work);
  // Runs `work` on the pool once `when` has come (an Asio timer: no thread waits for it), unless
  // the returned function (callable from any thread, any number of times) cancelled it first:
  // a cancelled timer and its work are released at once. Not counted as posted until it fires:
  // Stop does not wait for it, and a timer still pending at Stop or in a fork child never runs.
  // Throws as Post.
  Work PostAt(std::chrono::steady_clock::time_point when, Work work);
  Strand MakeStrand();

  // Threads the pool starts with. Throws std::invalid_argument when < 1, std::logic_error once the
  // pool has started (the count of a running Asio pool is fixed).
  void SetThreads(int64_t count);
  int64_t Threads() const;
  // Pool threads running now (0 before the first Post).
  size_t ThreadCount() const;

  // Waits until the posted work is done or `deadline`, then stops the pool. Idempotent.
  void Stop(std::chrono::steady_clock::time_point deadline);

  // pthread_atfork handlers (the library's lifecycle, core/lifecycle.h, calls them).
  void PrepareFork();
  void AfterForkInParent();
  void AfterForkInChild();

 private:
  struct State;
  CompletionPool();
  State& StartedLocked();
  State* state_;  // replaced (the old one leaked) in a fork child
};

}  // namespace dtorch::core
