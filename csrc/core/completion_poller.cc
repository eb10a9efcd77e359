#include "completion_poller.h"

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <system_error>
#include <thread>
#include <utility>

namespace dtorch::core {

CompletionPoller& CompletionPoller::Instance() {
  // Leaked on purpose: detached poller threads may outlive static destruction.
  static CompletionPoller* poller = [] {
    std::atexit([] { Instance().Shutdown(/*timeout_ms=*/1000); });
    return new CompletionPoller();
  }();
  return *poller;
}

void CompletionPoller::Shutdown(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  exiting_ = true;
  for (auto& entry : queues_) {
    for (auto& item : entry.second.items) (void)item.release();  // leaked: see the header
    pending_ -= entry.second.items.size();
    entry.second.items.clear();
  }
  work_cv_.notify_all();
  idle_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return in_flight_ == 0; });
}

void CompletionPoller::Submit(const std::string& key,
                              std::unique_ptr<PendingCompletion> completion) {
  std::lock_guard<std::mutex> lock(mu_);
  if (exiting_) {
    (void)completion.release();  // shutting down: see Shutdown
    return;
  }
  Queue& queue = queues_[key];
  queue.items.push_back(std::move(completion));
  ++pending_;
  if (queue.has_thread) {
    work_cv_.notify_all();
    return;
  }
  // Started under the lock: the new thread waits for it, and a failed start can take back
  // exactly this completion (a queued item without a thread would keep its promise alive,
  // unfulfilled, forever) before anyone else queues behind it.
  try {
    if (fail_thread_starts_for_testing_ > 0) {
      --fail_thread_starts_for_testing_;
      throw std::system_error(EAGAIN, std::generic_category(), "dtorch: cannot start a thread");
    }
    std::thread([this, key] { Run(key); }).detach();
  } catch (...) {
    queue.items.pop_back();
    --pending_;
    if (queue.items.empty()) queues_.erase(key);
    throw;
  }
  queue.has_thread = true;
  ++threads_;
}

void CompletionPoller::Run(const std::string& key) {
  pthread_setname_np(pthread_self(), kThreadName);  // visible in /proc, ps, gdb and the tests
  using std::chrono::microseconds;
  constexpr microseconds kMinBackoff{20};
  constexpr microseconds kMaxBackoff{1000};
  for (;;) {
    std::unique_ptr<PendingCompletion> head;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto idle_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kIdleExitMs);
      // Map references stay valid while other keys come and go; only this thread erases `key`.
      Queue& queue = queues_[key];
      while (queue.items.empty() && !exiting_) {
        if (work_cv_.wait_until(lock, idle_deadline) == std::cv_status::timeout &&
            queue.items.empty()) {
          queues_.erase(key);
          --threads_;
          return;
        }
      }
      if (exiting_) return;  // Shutdown leaked what was queued
      head = std::move(queue.items.front());
      queue.items.pop_front();
      ++in_flight_;
    }
    // Only this thread takes items of this key, so the head stays the oldest while it is polled.
    std::exception_ptr error;
    microseconds backoff = kMinBackoff;
    bool done = false;
    while (!done && !exiting_) {
      try {
        done = head->Poll();
      } catch (...) {
        error = std::current_exception();
        done = true;
      }
      if (!done) {
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, kMaxBackoff);
      }
    }
    if (done) {
      head->Complete(error);
      head.reset();  // release the tensor/event before counting the completion as done
    } else {
      (void)head.release();  // shutting down: leaked, see Shutdown
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      --pending_;
      --in_flight_;
    }
    idle_cv_.notify_all();
  }
}

size_t CompletionPoller::ThreadCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  return threads_;
}

size_t CompletionPoller::PendingCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_;
}

}  // namespace dtorch::core
