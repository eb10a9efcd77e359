// ReadyNotifier: wakes an event loop (asyncio) when futures complete, without taking the GIL on
// the completing thread and without a thread per waiter (torch-free, Linux).
//
// The loop watches fd() (an eventfd) for readability. A completion callback calls Post(token):
// the token is queued and the eventfd is written. The loop then calls Drain() and resolves the
// waiters of the returned tokens. Post never blocks and never throws, so it can run on any
// completing thread (a producer, a device poller). Tokens posted while a Drain() runs are
// returned by that Drain() or by the next one, which the eventfd write then triggers: no wake-up
// is lost.
//
// Lifetime: the eventfd is closed when the notifier is destroyed. Pending callbacks hold it
// through a weak_ptr and post only while it lives, so a late completion never writes to a closed
// (or reused) fd, and an abandoned event loop's fd is not kept open by its pending futures.
//
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

namespace dtorch::core {

class ReadyNotifier {
 public:
  ReadyNotifier();  // throws std::system_error if no eventfd can be created
  ~ReadyNotifier();
  ReadyNotifier(const ReadyNotifier&) = delete;
  ReadyNotifier& operator=(const ReadyNotifier&) = delete;

  // The eventfd to watch for readability (non-blocking, close-on-exec).
  int fd() const { return fd_; }
  // Queues `token` and makes fd() readable.
  void Post(int64_t token) noexcept;
  // Resets fd()'s readability and returns the tokens posted since the last Drain().
  std::vector<int64_t> Drain();

 private:
  const int fd_;
  std::mutex mu_;
  std::vector<int64_t> tokens_;  // guarded by mu_
};

}  // namespace dtorch::core
