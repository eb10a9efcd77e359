// Tests of the torch-free core (csrc/core): promise/future semantics and the completion poller.
// Built and run by tests/test_core_cpp.py; prints "core tests: N passed" or fails with a message.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <poll.h>

#include "core/completion_poller.h"
#include "core/promise_future.h"
#include "core/ready_notifier.h"

using namespace dtorch::core;
using namespace std::chrono_literals;

static int g_passed = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

template <typename Fn>
static FutureErrc ErrorCodeOf(Fn&& fn) {
  try {
    fn();
  } catch (const FutureError& e) {
    return e.code();
  }
  std::fprintf(stderr, "expected a FutureError\n");
  std::exit(1);
}

static void TestValueAndConsume() {
  MemoryPromise<int> promise;
  auto future = promise.GetFuture();
  CHECK(future->Valid() && !future->IsReady());
  CHECK(!future->WaitFor(10));  // timeout: not consumed, still valid
  CHECK(future->Valid());
  promise.SetValue(7);
  CHECK(future->IsReady() && future->WaitFor(0));
  CHECK(future->Get() == 7);
  CHECK(!future->Valid() && !future->IsReady());
  CHECK(ErrorCodeOf([&] { future->Get(); }) == FutureErrc::kNoState);
  CHECK(ErrorCodeOf([&] { future->WaitFor(0); }) == FutureErrc::kNoState);
  ++g_passed;
}

static void TestSetTwiceKeepsFirst() {
  MemoryPromise<std::string> promise;
  auto future = promise.GetFuture();
  promise.SetValue("first");
  CHECK(ErrorCodeOf([&] { promise.SetValue("second"); }) == FutureErrc::kPromiseAlreadySatisfied);
  CHECK(ErrorCodeOf([&] { promise.SetException("late"); }) ==
        FutureErrc::kPromiseAlreadySatisfied);
  CHECK(future->Get() == "first");
  CHECK(ErrorCodeOf([&] { promise.GetFuture(); }) == FutureErrc::kFutureAlreadyRetrieved);
  ++g_passed;
}

static void TestExceptionAndBrokenPromise() {
  {
    MemoryPromise<int> promise;
    auto future = promise.GetFuture();
    promise.SetException("disk on fire");
    try {
      future->Get();
      CHECK(false);
    } catch (const FutureError& e) {
      CHECK(e.code() == FutureErrc::kProducerError && e.detail() == "disk on fire");
      CHECK(std::string(e.what()) == "dtorch: producer error: disk on fire");
    }
    CHECK(!future->Valid());
  }
  std::unique_ptr<FutureBackend<int>> orphan;
  {
    MemoryPromise<int> promise;
    orphan = promise.GetFuture();
  }
  CHECK(orphan->IsReady());
  CHECK(ErrorCodeOf([&] { orphan->Get(); }) == FutureErrc::kBrokenPromise);
  ++g_passed;
}

static void TestBlockedWaiterWokenFromAnotherThread() {
  auto promise = std::make_unique<MemoryPromise<int>>();
  auto future = promise->GetFuture();
  std::thread producer([&] {
    std::this_thread::sleep_for(20ms);
    promise->SetValue(42);
  });
  CHECK(future->Get() == 42);
  producer.join();
  // A waiter blocked when the promise is destroyed gets "broken promise", not a hang.
  auto promise2 = std::make_unique<MemoryPromise<int>>();
  auto future2 = promise2->GetFuture();
  std::thread dropper([&] {
    std::this_thread::sleep_for(20ms);
    promise2.reset();
  });
  CHECK(ErrorCodeOf([&] { future2->Get(); }) == FutureErrc::kBrokenPromise);
  dropper.join();
  ++g_passed;
}

static void TestCallbacks() {
  MemoryPromise<int> promise;
  auto future = promise.GetFuture();
  std::atomic<int> calls{0};
  std::thread::id ran_on;
  future->OnReady([&] {
    ++calls;
    ran_on = std::this_thread::get_id();
    CHECK(future->IsReady());  // the state is complete (and unlocked) when callbacks run
  });
  future->OnReady([] { throw std::runtime_error("a bad callback must not break the producer"); });
  CHECK(calls == 0);
  std::thread producer([&] { promise.SetValue(1); });
  producer.join();
  CHECK(calls == 1 && ran_on != std::this_thread::get_id());
  future->OnReady([&] { ++calls; });  // already ready: runs at once, here
  CHECK(calls == 2);
  CHECK(future->Get() == 1);
  // A broken promise runs callbacks too.
  std::atomic<bool> broken_seen{false};
  {
    MemoryPromise<int> dropped;
    auto f = dropped.GetFuture();
    f->OnReady([&] { broken_seen = true; });
  }
  CHECK(broken_seen);
  ++g_passed;
}

// A completion that is done once the shared "device" counter reaches its ticket.
class TicketCompletion final : public PendingCompletion {
 public:
  TicketCompletion(const std::atomic<int>* device, int ticket, bool fail,
                   std::vector<int>* completed, std::mutex* mu, std::atomic<int>* errors)
      : device_(device), ticket_(ticket), fail_(fail), completed_(completed), mu_(mu),
        errors_(errors) {}
  bool Poll() override {
    if (device_->load() < ticket_) return false;
    if (fail_) throw std::runtime_error("device fault");
    return true;
  }
  void Complete(std::exception_ptr error) noexcept override {
    if (error) ++*errors_;
    std::lock_guard<std::mutex> lock(*mu_);
    completed_->push_back(ticket_);
  }

 private:
  const std::atomic<int>* device_;
  int ticket_;
  bool fail_;
  std::vector<int>* completed_;
  std::mutex* mu_;
  std::atomic<int>* errors_;
};

static void TestPollerBoundedThreadsAndOrder() {
  auto& poller = CompletionPoller::Instance();
  constexpr int kStreams = 4;
  constexpr int kPerStream = 2500;  // 10k pending in all
  std::atomic<int> device{0};
  std::atomic<int> errors{0};
  std::mutex mu;
  std::vector<std::vector<int>> completed(kStreams);
  for (int i = 0; i < kPerStream; ++i) {
    for (int s = 0; s < kStreams; ++s) {
      poller.Submit("stream" + std::to_string(s),
                    std::make_unique<TicketCompletion>(&device, i, /*fail=*/i == 7 && s == 0,
                                                       &completed[s], &mu, &errors));
    }
  }
  CHECK(poller.PendingCount() >= static_cast<size_t>(kStreams * kPerStream - kStreams));
  CHECK(poller.ThreadCount() == kStreams);  // one thread per stream, not per pending value
  device = kPerStream;  // the "device" finishes everything
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (poller.PendingCount() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  CHECK(poller.PendingCount() == 0);
  CHECK(errors == 1);  // the device error reached its completion
  for (int s = 0; s < kStreams; ++s) {
    std::lock_guard<std::mutex> lock(mu);
    CHECK(completed[s].size() == kPerStream);
    for (int i = 0; i < kPerStream; ++i) CHECK(completed[s][i] == i);  // stream order
  }
  // Idle threads go away.
  deadline = std::chrono::steady_clock::now() +
             std::chrono::milliseconds(CompletionPoller::kIdleExitMs) + 5s;
  while (poller.ThreadCount() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(poller.ThreadCount() == 0);
  ++g_passed;
}

static bool Readable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, timeout_ms) == 1 && (p.revents & POLLIN);
}

static void TestReadyNotifier() {
  auto notifier = std::make_shared<ReadyNotifier>();
  CHECK(!Readable(notifier->fd(), 0));
  CHECK(notifier->Drain().empty());  // nothing posted: returns at once
  MemoryPromise<int> promise;
  auto future = promise.GetFuture();
  future->OnReady([notifier] { notifier->Post(7); });
  std::thread producer([&] { promise.SetValue(1); });
  CHECK(Readable(notifier->fd(), 5000));
  producer.join();
  CHECK(notifier->Drain() == std::vector<int64_t>{7});
  CHECK(!Readable(notifier->fd(), 0));  // drained: not readable until the next post
  // Many posters: every token arrives exactly once.
  std::vector<std::thread> posters;
  for (int t = 0; t < 4; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) notifier->Post(t * 1000 + i);
    });
  }
  std::vector<int64_t> seen;
  while (seen.size() < 4000) {
    CHECK(Readable(notifier->fd(), 5000));
    for (int64_t token : notifier->Drain()) seen.push_back(token);
  }
  for (auto& p : posters) p.join();
  for (int64_t token : notifier->Drain()) seen.push_back(token);
  std::sort(seen.begin(), seen.end());
  CHECK(seen.size() == 4000);
  for (int i = 0; i < 4000; ++i) CHECK(seen[i] == i);
  ++g_passed;
}

// Last: the poller cannot be used afterwards.
static void TestPollerShutdown() {
  auto& poller = CompletionPoller::Instance();
  std::atomic<int> device{0};  // never advances: these never complete
  std::atomic<int> errors{0};
  std::mutex mu;
  std::vector<int> completed;
  for (int i = 0; i < 100; ++i) {
    poller.Submit("stuck", std::make_unique<TicketCompletion>(&device, 1, false, &completed, &mu,
                                                             &errors));
  }
  CHECK(poller.PendingCount() == 100);
  const auto start = std::chrono::steady_clock::now();
  poller.Shutdown(5000);
  CHECK(std::chrono::steady_clock::now() - start < 3s);  // the stuck head was abandoned
  CHECK(poller.PendingCount() == 0 && completed.empty());
  poller.Submit("late", std::make_unique<TicketCompletion>(&device, 0, false, &completed, &mu,
                                                          &errors));
  std::this_thread::sleep_for(50ms);
  CHECK(completed.empty());  // after shutdown nothing completes
  poller.Shutdown(1000);     // idempotent
  ++g_passed;
}

int main() {
  TestReadyNotifier();
  TestValueAndConsume();
  TestSetTwiceKeepsFirst();
  TestExceptionAndBrokenPromise();
  TestBlockedWaiterWokenFromAnotherThread();
  TestCallbacks();
  TestPollerBoundedThreadsAndOrder();
  TestPollerShutdown();
  std::printf("core tests: %d passed\n", g_passed);
  return 0;
}
