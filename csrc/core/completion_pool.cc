#include "completion_pool.h"

#include <cxxabi.h>
#include <pthread.h>

#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "boost_config.h"
#include "base/fork_generation.h"
#include "lifecycle.h"
#include "settings.h"

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>

namespace dtorch::core {

struct CompletionPool::State {
  std::mutex mu;
  std::condition_variable idle;  // outstanding reached 0
  // Everything below is guarded by mu.
  boost::asio::thread_pool* pool = nullptr;  // leaked, never destroyed: see Stop
  int64_t threads = kDefaultThreads;
  size_t running = 0;      // pool threads attached now
  size_t outstanding = 0;  // posted, not yet finished
  bool stopped = false;

  void ThrowIfStoppedLocked() const {
    if (stopped) throw std::runtime_error("dtorch: the completion pool has stopped (process exit)");
  }

  // Counts `work` as outstanding (Stop() waits for it) and wraps it so that the pool knows when it
  // is done. Throws after Stop().
  Work CountedLocked(Work work) {
    ThrowIfStoppedLocked();
    ++outstanding;
    return [this, work = std::move(work)] {
      try {
        work();
      } catch (const abi::__forced_unwind&) {
        throw;  // the thread is being ended (pthread_exit: CPython at finalization): let it end
      } catch (...) {
        // Completion work reports its errors through the values it completes.
      }
      std::lock_guard<std::mutex> lock(mu);
      if (--outstanding == 0) idle.notify_all();
    };
  }
};

struct CompletionPool::Strand::Impl {
  State* state;
  uint64_t fork_generation;  // a strand of the parent's pool does not exist in a fork child
  boost::asio::strand<boost::asio::thread_pool::executor_type> strand;
};

CompletionPool::CompletionPool() : state_(new State()) {}

CompletionPool& CompletionPool::Instance() {
  // Leaked on purpose: pool threads may outlive static destruction.
  static CompletionPool* pool = new CompletionPool();
  return *pool;
}

CompletionPool::State& CompletionPool::StartedLocked() {
  State& st = *state_;
  st.ThrowIfStoppedLocked();
  if (st.pool != nullptr) return st;
  // No threads of Asio's own: the library's named threads attach themselves.
  auto* pool = new boost::asio::thread_pool(0);
  for (int64_t i = 0; i < st.threads; ++i) {
    try {
      std::thread thread([&st, pool] {
        pool->attach();  // runs posted work until the pool is stopped
        std::lock_guard<std::mutex> lock(st.mu);
        --st.running;
      });
      pthread_setname_np(thread.native_handle(), kThreadName);  // counted by name at once
      thread.detach();
      ++st.running;
    } catch (const std::system_error&) {
      if (st.running > 0) break;  // fewer threads, but the work runs
      pool->stop();               // nothing attached: no thread touches it
      delete pool;
      throw;
    }
  }
  st.pool = pool;
  return st;
}

void CompletionPool::Post(Work work) {
  std::unique_lock<std::mutex> lock(state_->mu);
  State& st = StartedLocked();
  Work counted = st.CountedLocked(std::move(work));
  lock.unlock();
  boost::asio::post(*st.pool, std::move(counted));
}

CompletionPool::Work CompletionPool::PostAt(std::chrono::steady_clock::time_point when,
                                            Work work) {
  std::unique_lock<std::mutex> lock(state_->mu);
  State& st = StartedLocked();
  lock.unlock();
  // On a strand of its own: its expiry and a cancel never run at once (an Asio timer is not
  // thread-safe).
  auto strand = boost::asio::make_strand(st.pool->get_executor());
  auto timer = std::make_shared<boost::asio::steady_timer>(strand, when);
  timer->async_wait([&st, timer, work = std::move(work)](const boost::system::error_code& error) {
    if (error) return;  // (cancelled)
    Work counted;
    {
      std::lock_guard<std::mutex> lock(st.mu);
      if (st.stopped) return;
      counted = st.CountedLocked(work);
    }
    counted();
  });
  const uint64_t generation = ForkGeneration();
  return [weak = std::weak_ptr<boost::asio::steady_timer>(timer), strand, generation] {
    if (generation != ForkGeneration()) return;  // (a parent's timer: not this process's pool)
    if (weak.expired()) return;
    try {
      boost::asio::post(strand, [weak] {
        if (const auto timer = weak.lock()) timer->cancel();
      });
    } catch (...) {  // (the pool stopped: the timer is abandoned with it)
    }
  };
}

CompletionPool::Strand CompletionPool::MakeStrand() {
  std::lock_guard<std::mutex> lock(state_->mu);
  State& st = StartedLocked();
  // A strand of the parent's pool is leaked in a fork child: destroying it would lock the parent's
  // Asio service, whose mutex a parent pool thread may have held at fork.
  return Strand(std::shared_ptr<Strand::Impl>(
      new Strand::Impl{&st, ForkGeneration(), boost::asio::make_strand(st.pool->get_executor())},
      [](Strand::Impl* impl) {
        if (impl->fork_generation == ForkGeneration()) delete impl;
      }));
}

void CompletionPool::Strand::Post(Work work) const {
  if (impl_->fork_generation != ForkGeneration()) {
    throw std::logic_error("dtorch: this strand belongs to the parent process's completion pool; "
                           "make a new one after fork");
  }
  State& st = *impl_->state;
  std::unique_lock<std::mutex> lock(st.mu);
  Work counted = st.CountedLocked(std::move(work));
  lock.unlock();
  boost::asio::post(impl_->strand, std::move(counted));
}

void CompletionPool::SetThreads(int64_t count) {
  if (count < 1) throw std::invalid_argument("the completion pool needs at least 1 thread");
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->pool != nullptr && state_->threads != count) {
    throw std::logic_error("the completion pool has already started with " +
                           std::to_string(state_->threads) +
                           " threads; set its size before the first use");
  }
  state_->threads = count;
}

int64_t CompletionPool::Threads() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->threads;
}

size_t CompletionPool::ThreadCount() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->running;
}

void CompletionPool::Stop(std::chrono::steady_clock::time_point deadline) {
  State& st = *state_;
  std::unique_lock<std::mutex> lock(st.mu);
  if (st.stopped) return;
  // Posting stays open meanwhile: work in progress may post the next step of a strand.
  st.idle.wait_until(lock, deadline, [&] { return st.outstanding == 0; });
  st.stopped = true;
  // Threads leave after their current work; work not started is abandoned. The pool is not
  // destroyed: its destructor joins threads that may still be inside a piece of work.
  if (st.pool != nullptr) st.pool->stop();
}

void CompletionPool::PrepareFork() { state_->mu.lock(); }

void CompletionPool::AfterForkInParent() { state_->mu.unlock(); }

void CompletionPool::AfterForkInChild() {
  // The parent's pool (and its locked mutex) are leaked: none of its threads exist here.
  auto* fresh = new State();
  fresh->threads = state_->threads;
  state_ = fresh;
}

namespace {

const bool pool_setting_registered = RegisterSetting(
    {"pool_threads", Setting::Unit::kCount, CompletionPool::kDefaultThreads, 1, INT64_MAX,
     "Threads of the completion pool (named dtorch-pool), started on its first use; set it before "
     "then.",
     [] { return CompletionPool::Instance().Threads(); },
     [](int64_t n) { CompletionPool::Instance().SetThreads(n); }, 20});

// After the detectors (which may post to it), before the kinds.
const bool pool_participates = RegisterParticipant({
    "pool", 10, [] { return CompletionPool::Instance().ThreadCount(); },
    [](std::chrono::steady_clock::time_point deadline) { CompletionPool::Instance().Stop(deadline); },
    [] { CompletionPool::Instance().PrepareFork(); },
    [] { CompletionPool::Instance().AfterForkInParent(); },
    [] { CompletionPool::Instance().AfterForkInChild(); }, nullptr});

}  // namespace

}  // namespace dtorch::core
