#include "completion_poller.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

namespace dtorch::core {

CompletionPoller& CompletionPoller::Instance() {
  // Leaked on purpose: detached poller threads may outlive static destruction.
  static CompletionPoller* poller = [] {
    std::atexit(&CompletionPoller::OnExit);
    return new CompletionPoller();
  }();
  return *poller;
}

void CompletionPoller::OnExit() {
  CompletionPoller& poller = Instance();
  std::lock_guard<std::mutex> lock(poller.mu_);
  poller.exiting_ = true;
  for (auto& entry : poller.queues_) {
    for (auto& item : entry.second.items) (void)item.release();  // leaked: see the header
  }
  poller.work_cv_.notify_all();
}

void CompletionPoller::Submit(const std::string& key,
                              std::unique_ptr<PendingCompletion> completion) {
  bool start_thread = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Queue& queue = queues_[key];
    queue.items.push_back(std::move(completion));
    ++pending_;
    if (!queue.has_thread) {
      queue.has_thread = true;
      ++threads_;
      start_thread = true;
    }
  }
  if (!start_thread) {
    work_cv_.notify_all();
    return;
  }
  try {
    std::thread([this, key] { Run(key); }).detach();
  } catch (...) {
    // No thread: take the completion back, so the caller's error is the only outcome (a queued
    // item without a thread would keep its promise alive, unfulfilled, forever). A queue without
    // a thread holds nothing else: its thread only exits once it is empty.
    std::unique_ptr<PendingCompletion> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dropped = std::move(queues_[key].items.back());
      queues_.erase(key);
      --threads_;
      --pending_;
    }
    throw;
  }
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
      if (exiting_) return;  // OnExit leaked what was queued
      head = std::move(queue.items.front());
      queue.items.pop_front();
    }
    // Only this thread takes items of this key, so the head stays the oldest while it is polled.
    std::exception_ptr error;
    microseconds backoff = kMinBackoff;
    for (;;) {
      try {
        if (head->Poll()) break;
      } catch (...) {
        error = std::current_exception();
        break;
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, kMaxBackoff);
      if (exiting_) {
        (void)head.release();  // see OnExit
        return;
      }
    }
    head->Complete(error);
    head.reset();  // release the tensor/event before counting the completion as done
    {
      std::lock_guard<std::mutex> lock(mu_);
      --pending_;
    }
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
