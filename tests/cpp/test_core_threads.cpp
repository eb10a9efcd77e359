// Tests of the core's threads: the completion detectors and pool, fork, the ready notifier.
// Part of test_core (core_test.h).
#include "core_test.h"

void TestDetectorsOnePerKeyInOrder() {
  auto& detectors = CompletionDetectors::Instance();
  detectors.SetIdleExitMs(200);
  constexpr int kKeys = 4;
  constexpr int kPerKey = 2500;  // 10k pending in all
  FakeDevice device;
  std::vector<Outcomes> outcomes(kKeys);
  for (int i = 0; i < kPerKey; ++i) {
    for (int k = 0; k < kKeys; ++k) {
      detectors.Submit("stream" + std::to_string(k),
                       std::make_unique<TicketCompletion>(&device, i + 1, &outcomes[k],
                                                          /*fail=*/i == 7 && k == 0));
    }
  }
  CHECK(detectors.ThreadCount() == kKeys);  // one per key, not per pending value
  CHECK(ThreadsNamed(CompletionDetectors::kThreadName) == kKeys);
  device.Advance(kPerKey);  // the "device" finishes everything
  CHECK(WaitUntil([&] { return detectors.PendingCount() == 0; }));
  CHECK(outcomes[0].device_errors == 1);  // the device error reached its completion
  for (int k = 0; k < kKeys; ++k) {
    std::lock_guard<std::mutex> lock(outcomes[k].mu);
    CHECK(outcomes[k].completed.size() == kPerKey);
    for (int i = 0; i < kPerKey; ++i) CHECK(outcomes[k].completed[i] == i + 1);  // key order
  }
  // (A detector drops its key just after its last completion: the count may drop first.)
  CHECK(WaitUntil([&] { return detectors.ActiveKeys() == 0; }));
  // Idle detectors exit.
  CHECK(WaitUntil([&] { return detectors.ThreadCount() == 0; }));
  CHECK(WaitUntil([&] { return ThreadsNamed(CompletionDetectors::kThreadName) == 0; }));
  ++g_passed;
}

void TestDetectorsCapSharesThreads() {
  auto& detectors = CompletionDetectors::Instance();
  detectors.SetIdleExitMs(60'000);
  {  // five idle detectors, then the cap is lowered below them
    FakeDevice idle_device;
    Outcomes idle_out;
    for (int k = 0; k < 5; ++k) {
      detectors.Submit("before" + std::to_string(k),
                       std::make_unique<TicketCompletion>(&idle_device, 1, &idle_out));
    }
    CHECK(detectors.ThreadCount() == 5);
    idle_device.Advance(1);
    CHECK(WaitUntil([&] { return detectors.ActiveKeys() == 0; }));
  }
  detectors.SetMaxThreads(3);
  constexpr int kKeys = 20;
  FakeDevice device;
  std::vector<Outcomes> outcomes(kKeys);
  for (int i = 0; i < 50; ++i) {
    for (int k = 0; k < kKeys; ++k) {
      detectors.Submit("shared" + std::to_string(k),
                       std::make_unique<TicketCompletion>(&device, i + 1, &outcomes[k]));
    }
  }
  CHECK(detectors.ActiveKeys() == kKeys);
  CHECK(WaitUntil([&] { return detectors.ThreadCount() <= 3; }));  // the idle ones beyond it exit
  CHECK(detectors.ThreadCount() >= 1);
  for (int step = 1; step <= 50; step += 7) device.Advance(step);  // in several steps
  device.Advance(50);
  CHECK(WaitUntil([&] { return detectors.PendingCount() == 0; }));
  CHECK(detectors.ThreadCount() <= 3);
  for (auto& out : outcomes) {
    std::lock_guard<std::mutex> lock(out.mu);
    CHECK(out.completed.size() == 50);
    for (int i = 0; i < 50; ++i) CHECK(out.completed[i] == i + 1);
  }
  detectors.SetMaxThreads(CompletionDetectors::kDefaultMaxThreads);
  detectors.SetIdleExitMs(200);
  CHECK(WaitUntil([&] { return detectors.ThreadCount() == 0; }));
  ++g_passed;
}

void TestSubmissionWakesOnlyItsDetector() {
  auto& detectors = CompletionDetectors::Instance();
  detectors.SetIdleExitMs(60'000);  // four idle detectors stay
  FakeDevice device;
  Outcomes out;
  for (int k = 0; k < 4; ++k) {  // all four pending at once: four detectors
    detectors.Submit("idle" + std::to_string(k), std::make_unique<TicketCompletion>(&device, 1, &out));
  }
  CHECK(detectors.ThreadCount() == 4);
  device.Advance(1);
  CHECK(WaitUntil([&] { return detectors.ActiveKeys() == 0; }));
  CHECK(detectors.ThreadCount() == 4);
  std::this_thread::sleep_for(20ms);  // all four are in their idle wait
  const uint64_t before = detectors.NotifiedWakeups();
  detectors.Submit("busy", std::make_unique<TicketCompletion>(&device, 2, &out, false, true));
  CHECK(WaitUntil([&] { return device.blocking_waits > 0; }));
  CHECK(detectors.NotifiedWakeups() == before + 1);  // one idle detector took the key
  for (int i = 0; i < 100; ++i) {  // an active key: nobody is woken
    detectors.Submit("busy", std::make_unique<TicketCompletion>(&device, 2, &out, false, true));
  }
  std::this_thread::sleep_for(20ms);
  CHECK(detectors.NotifiedWakeups() == before + 1);
  CHECK(detectors.ThreadCount() == 4);
  // The detector sleeps in the blocking wait (a slice at a time), it does not poll.
  const int polls = device.polls;
  std::this_thread::sleep_for(200ms);
  CHECK(device.polls - polls <= 2);
  CHECK(device.blocking_waits >= 1 &&
        device.blocking_waits <= 200 / CompletionDetectors::kBlockingSliceMs + 10);
  device.Advance(2);
  CHECK(WaitUntil([&] { return detectors.PendingCount() == 0; }));
  {
    std::lock_guard<std::mutex> lock(out.mu);
    CHECK(out.completed.size() == 105 && out.failures.empty());
  }
  detectors.SetIdleExitMs(CompletionDetectors::kDefaultIdleExitMs);
  ++g_passed;
}

void TestFailedThreadStartQueuesNothing() {
  auto& detectors = CompletionDetectors::Instance();
  CHECK(WaitUntil([&] { return detectors.ThreadCount() == 0; }));
  FakeDevice device;
  Outcomes out;
  detectors.FailThreadStartsForTesting(1);
  bool threw = false;
  try {
    detectors.Submit("nothread", std::make_unique<TicketCompletion>(&device, 0, &out));
  } catch (const std::system_error&) {
    threw = true;
  }
  CHECK(threw && detectors.PendingCount() == 0 && detectors.ActiveKeys() == 0);
  detectors.Submit("nothread", std::make_unique<TicketCompletion>(&device, 0, &out));
  CHECK(WaitUntil([&] { return detectors.PendingCount() == 0; }));
  ++g_passed;
}

// Completes `promise` with 1 once the device reaches 1, or with the error it is given.
// As the device kernels do: claimed when submitted, completed once the fake device reached 1.
struct PromiseCompletion final : PendingCompletion {
  PromiseCompletion(FakeDevice* d, MemoryPromise<int>* p) : device(d), promise(p) {
    promise->Claim("PromiseCompletion");
  }
  bool Poll() override { return device->Reached(1); }
  void Complete(std::exception_ptr error) noexcept override {
    if (!error) return promise->Complete(Result<int>::Value(1));
    try {
      std::rethrow_exception(error);
    } catch (const FutureError& e) {
      promise->Complete(Result<int>::Error(e.code(), e.detail()));
    }
  }
  FakeDevice* device;
  MemoryPromise<int>* promise;
};

// A forked child: the parent's pending values fail there (also one a parent thread was blocked on),
// and the detectors work there for new values.
void TestFork() {
  auto& detectors = CompletionDetectors::Instance();
  FakeDevice device;
  MemoryPromise<int> promise;
  auto future = promise.GetFuture();
  detectors.Submit("parent", std::make_unique<PromiseCompletion>(&device, &promise));
  std::thread waiter([&] { CHECK(WaitMs(*future, 10'000)); });  // blocked across the fork
  std::this_thread::sleep_for(50ms);
  const uint64_t generation = ForkGeneration();
  const pid_t pid = ::fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    // The child: no detector, the parent's value failed, a new value completes.
    int failures = 0;
    failures += ForkGeneration() != generation + 1;
    failures += detectors.ThreadCount() != 0 || detectors.PendingCount() != 0;
    try {
      future->Get();
      ++failures;
    } catch (const FutureError& e) {
      failures += e.code() != FutureErrc::kDroppedAtFork;
    }
    FakeDevice child_device;
    Outcomes out;
    detectors.Submit("child", std::make_unique<TicketCompletion>(&child_device, 1, &out));
    failures += detectors.ThreadCount() != 1;
    child_device.Advance(1);
    failures += !WaitUntil([&] { return detectors.PendingCount() == 0; });
    std::_Exit(failures == 0 ? 0 : 10 + failures);
  }
  int status = 0;
  CHECK(::waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // The parent is unaffected.
  CHECK(ForkGeneration() == generation && detectors.PendingCount() == 1);
  device.Advance(1);
  waiter.join();
  CHECK(future->Get() == 1);
  ++g_passed;
}

// A parent thread keeps taking the lock of a pending value while the process forks: a child must
// never hang failing that value (its lock may be held by a thread that does not exist there).
void TestForkWhileAWaiterHoldsTheLock() {
  auto& detectors = CompletionDetectors::Instance();
  FakeDevice device;
  MemoryPromise<int> promise;
  auto future = promise.GetFuture();
  detectors.Submit("locked", std::make_unique<PromiseCompletion>(&device, &promise));
  std::atomic<bool> stop{false};
  std::thread poller([&] {
    while (!stop) WaitMs(*future, 0);
  });
  int hung = 0;
  for (int i = 0; i < 50; ++i) {
    const pid_t pid = ::fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      bool dropped = false;
      try {
        future->Get();
      } catch (const FutureError& e) {
        dropped = e.code() == FutureErrc::kDroppedAtFork;
      }
      std::_Exit(dropped ? 0 : 1);
    }
    int status = 0;
    bool exited = false;  // (the predicate runs again after it held: reap once)
    WaitUntil([&] { return exited || (exited = ::waitpid(pid, &status, WNOHANG) == pid); }, 5s);
    if (!exited) {
      ++hung;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    } else {
      CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
  }
  stop = true;
  poller.join();
  CHECK(hung == 0);
  device.Advance(1);  // the parent's value completes as usual
  CHECK(future->Get() == 1);
  CHECK(WaitUntil([&] { return detectors.PendingCount() == 0; }));
  ++g_passed;
}

void TestPool() {
  auto& pool = CompletionPool::Instance();
  CHECK(pool.ThreadCount() == 0 && ThreadsNamed(CompletionPool::kThreadName) == 0);  // lazy
  pool.SetThreads(2);
  std::atomic<int> ran{0};
  for (int i = 0; i < 100; ++i) pool.Post([&] { ++ran; });
  CHECK(WaitUntil([&] { return ran == 100; }));
  CHECK(pool.ThreadCount() == 2 && ThreadsNamed(CompletionPool::kThreadName) == 2);
  bool refused = false;
  try {
    pool.SetThreads(3);
  } catch (const std::logic_error&) {
    refused = true;
  }
  CHECK(refused && pool.Threads() == 2);
  // A strand runs its work one at a time, in posting order, from several posting threads.
  auto strand = pool.MakeStrand();
  std::mutex mu;
  std::vector<int> order[2];
  std::atomic<int> inside{0};
  std::atomic<bool> overlapped{false};
  std::vector<std::thread> posters;
  for (int t = 0; t < 2; ++t) {
    posters.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        strand.Post([&, t, i] {
          if (inside.fetch_add(1) != 0) overlapped = true;
          {
            std::lock_guard<std::mutex> lock(mu);
            order[t].push_back(i);
          }
          --inside;
        });
      }
    });
  }
  for (auto& p : posters) p.join();
  CHECK(WaitUntil([&] {
    std::lock_guard<std::mutex> lock(mu);
    return order[0].size() == 500 && order[1].size() == 500;
  }));
  CHECK(!overlapped);
  for (int t = 0; t < 2; ++t) {
    for (int i = 0; i < 500; ++i) CHECK(order[t][i] == i);
  }
  pool.Post([] { throw std::runtime_error("ignored"); });  // does not take a pool thread down
  std::atomic<bool> after{false};
  pool.Post([&] { after = true; });
  CHECK(WaitUntil([&] { return after.load(); }));
  CHECK(pool.ThreadCount() == 2);
  ++g_passed;
}
static bool Readable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, timeout_ms) == 1 && (p.revents & POLLIN);
}

void TestReadyNotifier() {
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
