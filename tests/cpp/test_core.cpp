// Tests of the torch-free core (csrc/core): promise/future semantics, the completion detectors and
// pool, and the library's threads at exit and fork.
// Built and run by tests/test_core_cpp.py; prints "core tests: N passed" or fails with a message.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <dirent.h>
#include <signal.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <fstream>

#include "core/attach_deadline.h"
#include "core/completion_detectors.h"
#include "core/completion_pool.h"
#include "core/kinds/file/file_kind.h"
#include "core/kinds/file/payload_pool.h"
#include "core/base/fork_generation.h"
#include "core/kind_registry.h"
#include "core/lifecycle.h"
#include "core/settings.h"
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

// FutureBackend::WaitUntil, `ms` from now.
template <typename T>
static bool WaitMs(const FutureBackend<T>& future, int64_t ms) {
  return future.WaitUntil(std::chrono::steady_clock::now() + std::chrono::milliseconds(ms));
}

// The FutureError fn() throws (the test fails if it throws none).
template <typename Fn>
static FutureError ErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const FutureError& e) {
    return e;
  }
  std::fprintf(stderr, "expected a FutureError\n");
  std::exit(1);
}

template <typename Fn>
static FutureErrc ErrorCodeOf(Fn&& fn) {
  return ErrorOf(std::forward<Fn>(fn)).code();
}

static void TestValueAndConsume() {
  MemoryPromise<int> promise;
  auto future = promise.GetFuture();
  CHECK(future->Valid() && !future->IsReady());
  CHECK(!WaitMs(*future, 10));  // timeout: not consumed, still valid
  CHECK(future->Valid());
  promise.SetValue(7);
  CHECK(future->IsReady() && WaitMs(*future, 0));
  CHECK(future->Get() == 7);
  CHECK(!future->Valid() && future->IsReady());  // consumed, and still complete
  CHECK(ErrorCodeOf([&] { future->Get(); }) == FutureErrc::kNoState);
  CHECK(WaitMs(*future, 0) && future->Value() == 7);  // waits never consume, nor refuse
  ++g_passed;
}

static void TestSetTwiceKeepsFirst() {
  MemoryPromise<std::string> promise;
  auto future = promise.GetFuture();
  promise.SetValue("first");
  CHECK(ErrorCodeOf([&] { promise.SetValue("second"); }) == FutureErrc::kPromiseAlreadySatisfied);
  CHECK(ErrorCodeOf([&] { promise.SetError(FutureErrc::kProducerError, "late"); }) ==
        FutureErrc::kPromiseAlreadySatisfied);
  CHECK(future->Get() == "first");
  CHECK(ErrorCodeOf([&] { promise.GetFuture(); }) == FutureErrc::kFutureAlreadyRetrieved);
  ++g_passed;
}

static void TestExceptionAndBrokenPromise() {
  {
    MemoryPromise<int> promise;
    auto future = promise.GetFuture();
    promise.SetError(FutureErrc::kProducerError, "disk on fire");
    const auto e = ErrorOf([&] { future->Get(); });
    CHECK(e.code() == FutureErrc::kProducerError && e.detail() == "disk on fire");
    CHECK(std::string(e.what()) == "dtorch: producer error: disk on fire");
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

// A completion that is done once the shared "device" counter reaches its ticket. With `blocking`,
// it can wait for that (on the device's condition variable) instead of being polled.
struct FakeDevice {
  std::mutex mu;
  std::condition_variable cv;
  int counter = 0;  // guarded by mu
  std::atomic<int> polls{0};
  std::atomic<int> blocking_waits{0};
  void Advance(int to) {
    {
      std::lock_guard<std::mutex> lock(mu);
      counter = to;
    }
    cv.notify_all();
  }
  bool Reached(int ticket) {
    std::lock_guard<std::mutex> lock(mu);
    return counter >= ticket;
  }
};

struct Outcomes {
  std::mutex mu;
  std::vector<int> completed;                        // guarded by mu: tickets, in completion order
  std::vector<std::pair<int, FutureErrc>> failures;  // guarded by mu
  std::atomic<int> device_errors{0};
};

class TicketCompletion final : public PendingCompletion {
 public:
  TicketCompletion(FakeDevice* device, int ticket, Outcomes* out, bool fail = false,
                   bool blocking = false)
      : device_(device), ticket_(ticket), out_(out), fail_(fail), blocking_(blocking) {}
  bool Poll() override {
    ++device_->polls;
    return Check(device_->Reached(ticket_));
  }
  bool CanBlock() const override { return blocking_; }
  bool WaitFor(std::chrono::microseconds timeout) override {
    ++device_->blocking_waits;
    std::unique_lock<std::mutex> lock(device_->mu);
    const bool done =
        device_->cv.wait_for(lock, timeout, [&] { return device_->counter >= ticket_; });
    lock.unlock();
    return Check(done);
  }
  void Complete(std::exception_ptr error) noexcept override {
    std::lock_guard<std::mutex> lock(out_->mu);
    if (!error) {
      out_->completed.push_back(ticket_);
      return;
    }
    try {
      std::rethrow_exception(error);
    } catch (const FutureError& e) {
      out_->failures.emplace_back(ticket_, e.code());
    } catch (...) {
      ++out_->device_errors;
      out_->completed.push_back(ticket_);
    }
  }

 private:
  bool Check(bool done) const {
    if (done && fail_) throw std::runtime_error("device fault");
    return done;
  }
  FakeDevice* device_;
  int ticket_;
  Outcomes* out_;
  bool fail_;
  bool blocking_;
};

template <typename Pred>
static bool WaitUntil(Pred pred, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  return pred();
}

static int ThreadsNamed(const std::string& name) {
  int count = 0;
  DIR* dir = ::opendir("/proc/self/task");
  CHECK(dir != nullptr);
  while (dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream comm(std::string("/proc/self/task/") + entry->d_name + "/comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++count;
  }
  ::closedir(dir);
  return count;
}

static void TestDetectorsOnePerKeyInOrder() {
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

static void TestDetectorsCapSharesThreads() {
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

static void TestSubmissionWakesOnlyItsDetector() {
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

static void TestFailedThreadStartQueuesNothing() {
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
static void TestFork() {
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
static void TestForkWhileAWaiterHoldsTheLock() {
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

static void TestPool() {
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

// ---- the file kind (a codec of ints; the same process plays both ends, or a forked child) ----

class IntCodec final : public ValueCodec<int64_t> {
 public:
  std::string_view TypeName() const override { return "int"; }
  void CheckValue(const int64_t& value) const override {
    if (value < 0) throw std::invalid_argument("negative");
  }
  std::string Header(const int64_t&, size_t* payload_bytes) const override {
    *payload_bytes = sizeof(int64_t);
    return "i";
  }
  void WritePayload(const int64_t& value, void* payload, size_t) const override {
    std::memcpy(payload, &value, sizeof(value));
  }
  size_t PayloadBytes(std::string_view header) const override {
    if (header != "i") throw FutureError(FutureErrc::kInvalidHandle, "bad int");
    return sizeof(int64_t);
  }
  int64_t Read(std::string_view header, void* payload, size_t bytes,
               std::shared_ptr<void> keep_alive) const override {
    if (header != "i" || bytes != sizeof(int64_t) || !keep_alive) {
      throw FutureError(FutureErrc::kInvalidHandle, "bad int");
    }
    int64_t value;
    std::memcpy(&value, payload, sizeof(value));
    return value;
  }
};

static std::vector<std::string> OurSegments() {
  std::vector<std::string> names;
  const std::string mine = "dtorch_" + std::to_string(getpid()) + "-";
  if (DIR* dir = opendir("/dev/shm")) {
    while (const dirent* entry = readdir(dir)) {
      if (std::string(entry->d_name).rfind(mine, 0) == 0) names.push_back(entry->d_name);
    }
    closedir(dir);
  }
  return names;
}

static std::unique_ptr<FilePromise<int64_t>> Deserialized(const std::string& serialized,
                                                          std::shared_ptr<IntCodec> codec) {
  const std::string prefix = SerializedPrefix("file");
  CHECK(serialized.rfind(prefix, 0) == 0);
  return std::make_unique<FilePromise<int64_t>>(
      FileHandle::Parse(serialized.substr(prefix.size()), "int"), codec);
}

static void TestFileKindInProcess() {
  auto codec = std::make_shared<IntCodec>();
  const size_t segments_before = OurSegments().size();  // this process's doorbell, once made
  {
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    const std::string serialized = creator.Serialize();
    auto producer = Deserialized(serialized, codec);
    CHECK(!WaitMs(*future, 10));
    producer->SetValue(42);
    CHECK(WaitMs(*future, 5000) && future->IsReady());
    // Fulfil once, across handles: the creator's own handle is refused now.
    CHECK(ErrorCodeOf([&] { creator.SetValue(1); }) == FutureErrc::kPromiseAlreadySatisfied);
    CHECK(future->Get() == 42);
    CHECK(!future->Valid());
    CHECK(ErrorCodeOf([&] { future->Get(); }) == FutureErrc::kNoState);
    CHECK(ErrorCodeOf([&] { creator.GetFuture(); }) == FutureErrc::kFutureAlreadyRetrieved);
    CHECK(ErrorCodeOf([&] { producer->GetFuture(); }) == FutureErrc::kFutureAlreadyRetrieved);
  }
  {  // an error travels with its code
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    creator.SetError(FutureErrc::kDeviceError, "it broke");
    const auto e = ErrorOf([&] { future->Get(); });
    CHECK(e.code() == FutureErrc::kDeviceError && e.detail() == "it broke");
  }
  {  // a promise that never left the process breaks when the creator drops it
    auto creator = std::make_unique<FilePromise<int64_t>>(codec);
    auto future = creator->GetFuture();
    std::atomic<bool> called{false};
    future->OnReady([&] { called = true; });
    creator.reset();
    CHECK(ErrorCodeOf([&] { future->Get(); }) == FutureErrc::kBrokenPromise);
    CHECK(called);
  }
  {  // a callback runs on the doorbell watcher when a producer completes the pair
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    auto producer = Deserialized(creator.Serialize(), codec);
    std::atomic<bool> called{false};
    future->OnReady([&] { called = true; });
    CHECK(!called);
    std::thread([&] { producer->SetValue(7); }).join();
    CHECK(WaitUntil([&] { return called.load(); }));
    CHECK(FileWatcherThreads() == 1);
    CHECK(future->Get() == 7);
  }
  {  // a pair that is gone: a producer's set is a no-op, not an error
    FilePromise<int64_t> creator(codec);
    const std::string serialized = creator.Serialize();
    { auto future = creator.GetFuture(); }
    auto producer = Deserialized(serialized, codec);
    producer->SetValue(3);  // the creator's handle still lives: the segment does too; fine
  }
  // Malformed handles never reach shared memory.
  const auto parse = [](const std::string& rest) {
    return ErrorCodeOf([&] { FileHandle::Parse(rest, "int"); });
  };
  CHECK(parse("int:dtorch_1-2_00:00") == FutureErrc::kInvalidHandle);
  CHECK(parse("int:../etc/passwd:00112233445566778899aabbccddeeff") == FutureErrc::kInvalidHandle);
  CHECK(parse("void:dtorch_1-2_00112233445566778899aabbccddeeff:00112233445566778899aabbccddeeff") ==
        FutureErrc::kInvalidHandle);
  CHECK(parse("int:dtorch_1-2_00112233445566778899aabbccddeeff:00112233445566778899aabbccddeefg") ==
        FutureErrc::kInvalidHandle);
  // Everything of the pairs is unlinked once they are gone (the doorbell stays while we live).
  CHECK(OurSegments().size() <= std::max<size_t>(segments_before, 1));
  ++g_passed;
}

static void TestFileKindProducerProcesses() {
  auto codec = std::make_shared<IntCodec>();
  {  // a forked child fulfils the promise it inherited (it attaches on first use there)
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    const pid_t child = fork();
    if (child == 0) {
      creator.SetValue(99);
      _exit(0);
    }
    CHECK(WaitMs(*future, 10'000));
    CHECK(future->Get() == 99);
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  {  // a producer killed after attaching: "producer died (pid N)", within about a second
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    const std::string serialized = creator.Serialize();
    const pid_t child = fork();
    if (child == 0) {
      auto producer = Deserialized(serialized, codec);
      try {
        producer->SetValue(-1);  // refused by the codec: the process attached nonetheless
      } catch (const std::invalid_argument&) {
      }
      for (;;) pause();
    }
    std::this_thread::sleep_for(300ms);
    kill(child, SIGKILL);
    const auto start = std::chrono::steady_clock::now();
    CHECK(WaitMs(*future, 10'000));
    CHECK(std::chrono::steady_clock::now() - start < 3s);
    const auto e = ErrorOf([&] { future->Get(); });
    CHECK(e.code() == FutureErrc::kBrokenPromise);
    CHECK(e.detail().find("producer died (pid " + std::to_string(child) + ")") !=
          std::string::npos);
    waitpid(child, nullptr, 0);
  }
  {  // a process that only deserialized the promise holds it: killed before any use, it "died"
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    const std::string serialized = creator.Serialize();
    int ready[2];
    CHECK(pipe(ready) == 0);
    const pid_t child = fork();
    if (child == 0) {
      auto holder = Deserialized(serialized, codec);  // registered here, nothing used
      const char byte = 1;
      if (write(ready[1], &byte, 1) != 1) _exit(2);
      for (;;) pause();
    }
    char byte = 0;
    CHECK(read(ready[0], &byte, 1) == 1);
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    const auto start = std::chrono::steady_clock::now();
    const auto e = ErrorOf([&] { future->Get(); });  // (the creator keeps its own handle)
    CHECK(std::chrono::steady_clock::now() - start < 2s);
    CHECK(e.code() == FutureErrc::kBrokenPromise &&
          e.detail().find("producer died (pid " + std::to_string(child) + ")") !=
              std::string::npos);
    close(ready[0]);
    close(ready[1]);
  }
  {  // a holder that passes the handle on and ends: no break while it is in flight; the process
     // that deserializes it later sets the value
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    const std::string serialized = creator.Serialize();
    int forwarded[2];
    CHECK(pipe(forwarded) == 0);
    const pid_t holder = fork();
    if (holder == 0) {
      const std::string passed_on = Deserialized(serialized, codec)->Serialize();
      if (write(forwarded[1], passed_on.data(), passed_on.size()) !=
          static_cast<ssize_t>(passed_on.size())) {
        _exit(2);
      }
      _exit(0);  // (no exit handler: "died", but a handle of it is in flight)
    }
    waitpid(holder, nullptr, 0);
    std::this_thread::sleep_for(1500ms);  // (a break takes under a second)
    CHECK(!future->IsReady());
    const pid_t receiver = fork();
    if (receiver == 0) {
      std::string text(serialized.size(), '\0');
      if (read(forwarded[0], text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
        _exit(2);
      }
      Deserialized(text, codec)->SetValue(5);
      _exit(0);
    }
    CHECK(WaitMs(*future, 10'000) && future->Get() == 5);
    waitpid(receiver, nullptr, 0);
    close(forwarded[0]);
    close(forwarded[1]);
  }
  {  // ... and a handle in flight that never arrives breaks at the attach deadline
    const int64_t saved = AttachTimeoutMs();
    SetAttachTimeoutMs(500);
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    const std::string serialized = creator.Serialize();
    const pid_t holder = fork();
    if (holder == 0) {
      Deserialized(serialized, codec)->Serialize();  // (to nobody)
      _exit(0);
    }
    waitpid(holder, nullptr, 0);
    const auto e = ErrorOf([&] { future->Get(); });
    CHECK(e.code() == FutureErrc::kBrokenPromise &&
          e.detail().find("never deserialized") != std::string::npos);
    SetAttachTimeoutMs(saved);
  }
  ++g_passed;
}

static void TestFilePayloadReuse() {
  // Size classes: at least 64 KiB, then 4, 5, 6, 7 x a power of two (at most 25 % unused).
  CHECK(payload::ClassCapacity(1) == 64 * 1024);
  CHECK(payload::ClassCapacity(64 * 1024) == 64 * 1024);
  CHECK(payload::ClassCapacity(64 * 1024 + 1) == 80 * 1024);
  CHECK(payload::ClassCapacity(1 << 20) == 1 << 20);
  CHECK(payload::ClassCapacity((1 << 20) + 1) == 1280 * 1024);
  CHECK(payload::ClassCapacity(uint64_t{7} << 30) == uint64_t{7} << 30);
  for (uint64_t bytes = 1; bytes < (uint64_t{1} << 40); bytes = bytes * 3 + 7) {
    const uint64_t capacity = payload::ClassCapacity(bytes);
    CHECK(capacity >= bytes && (capacity <= 64 * 1024 || capacity - capacity / 5 <= bytes));
  }
  // Values one after another (each dropped before the next: IntCodec copies it out) reuse one
  // segment, mapped once by the producer's side and once by the consumer's (one process here).
  auto codec = std::make_shared<IntCodec>();
  const auto before = payload::Kept();
  for (int64_t i = 0; i < 5; ++i) {
    FilePromise<int64_t> creator(codec);
    auto future = creator.GetFuture();
    Deserialized(creator.Serialize(), codec)->SetValue(i);
    CHECK(future->Get() == i);
  }
  const auto after = payload::Kept();
  CHECK(after.produced == before.produced + (before.produced == 0 ? 1 : 0));
  CHECK(after.received == before.received + (before.received == 0 ? 1 : 0));
  CHECK(after.produced_bytes >= 64 * 1024 && after.received_bytes >= 64 * 1024);
  ++g_passed;
}

static void TestKindRegistry() {
  KindRegistry<int64_t> kinds("IntPromise");
  kinds.Register("memory", {[](std::string_view) {
                                 return std::make_unique<MemoryPromise<int64_t>>();
                               },
                               nullptr, ""});
  kinds.Register("network", {nullptr, nullptr, "is not available in this build yet"});
  CHECK(std::string(kinds.Create("memory")->Kind()) == "memory");
  bool refused = false;
  try {
    kinds.Create("network://host:1");
  } catch (const std::invalid_argument& e) {
    refused = std::string(e.what()).find("not available") != std::string::npos;
  }
  CHECK(refused);
  CHECK(ErrorCodeOf([&] { kinds.Deserialize("dtorch-promise:1:memory:x"); }) ==
        FutureErrc::kInvalidHandle);
  CHECK(ErrorCodeOf([&] { kinds.Deserialize("dtorch-promise:2:file:x"); }) ==
        FutureErrc::kInvalidHandle);
  CHECK(ErrorCodeOf([&] { kinds.Deserialize(std::string(600, 'a')); }) ==
        FutureErrc::kInvalidHandle);
  CHECK(ErrorCodeOf([&] { MemoryPromise<int64_t>().Serialize(); }) ==
        FutureErrc::kCannotLeaveProcess);
  // Result<T>: one value or one coded error.
  auto ok = Result<int64_t>::Value(5);
  CHECK(ok.ok() && ok.TakeOrThrow() == 5);
  auto failed = Result<int64_t>::Error(FutureErrc::kProducerError, "no");
  CHECK(!failed.ok() && ErrorCodeOf([&] { failed.TakeOrThrow(); }) == FutureErrc::kProducerError);
  ++g_passed;
}

// Last: the library's threads cannot be used afterwards.
static void TestStopAtExit() {
  // A file pair still pending at exit fails like a device value, and leaves nothing behind.
  FilePromise<int64_t> file_creator(std::make_shared<IntCodec>());
  auto file_future = file_creator.GetFuture();
  auto& detectors = CompletionDetectors::Instance();
  auto& pool = CompletionPool::Instance();
  FakeDevice device;
  Outcomes out;
  for (int i = 0; i < 100; ++i) {  // never finish: dropped
    detectors.Submit("stuck", std::make_unique<TicketCompletion>(&device, 1, &out));
  }
  for (int i = 0; i < 3; ++i) {  // a blocking key whose work is done: completed, not dropped
    detectors.Submit("done", std::make_unique<TicketCompletion>(&device, 0, &out, false, true));
  }
  std::atomic<bool> pool_work_done{false};
  pool.Post([&] {
    std::this_thread::sleep_for(200ms);  // posted work (a hand-over to another process) finishes
    pool_work_done = true;
  });
  CHECK(WaitUntil([&] { return detectors.PendingCount() == 100; }));
  SetExitTimeoutMs(1000);
  const auto start = std::chrono::steady_clock::now();
  StopLibraryThreads();
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(took < 1500ms);
  CHECK(pool_work_done);
  CHECK(detectors.PendingCount() == 0 && detectors.ThreadCount() == 0);
  {
    std::lock_guard<std::mutex> lock(out.mu);
    CHECK(out.completed.size() == 3);
    CHECK(out.failures.size() == 100);
    for (const auto& failure : out.failures) CHECK(failure.second == FutureErrc::kDroppedAtExit);
  }
  // Later submissions fail at once; the pool refuses work.
  detectors.Submit("late", std::make_unique<TicketCompletion>(&device, 0, &out));
  {
    std::lock_guard<std::mutex> lock(out.mu);
    CHECK(out.failures.size() == 101 && out.failures.back().second == FutureErrc::kDroppedAtExit);
  }
  bool refused = false;
  try {
    pool.Post([] {});
  } catch (const std::runtime_error&) {
    refused = true;
  }
  CHECK(refused);
  CHECK(WaitUntil([&] { return pool.ThreadCount() == 0; }));
  CHECK(ErrorCodeOf([&] { file_future->Get(); }) == FutureErrc::kDroppedAtExit);
  CHECK(OurSegments().empty());
  StopLibraryThreads();  // idempotent
  ++g_passed;
}

// The settings table: every entry's documented minimum is its setter's (one below is refused,
// the minimum taken), names are unique, and each participant of the lifecycle is counted.
void TestSettingsTable() {
  const auto settings = AllSettings();
  CHECK(settings.size() >= 8);
  std::set<std::string> names;
  for (const auto& setting : settings) {
    CHECK(names.insert(setting.name).second);
    CHECK(!setting.doc.empty() && setting.get && setting.set);
    CHECK(setting.minimum <= setting.default_value && setting.default_value <= setting.maximum);
    const int64_t saved = GetSetting(setting.name);
    CHECK(saved == setting.default_value);
    bool refused = false;
    try {
      SetSetting(setting.name, setting.minimum - 1);
    } catch (const std::invalid_argument&) {
      refused = true;
    }
    CHECK(refused);
    SetSetting(setting.name, setting.minimum);
    CHECK(GetSetting(setting.name) == setting.minimum);
    SetSetting(setting.name, saved);
  }
  bool unknown = false;
  try {
    GetSetting("no_such_setting");
  } catch (const std::out_of_range&) {
    unknown = true;
  }
  CHECK(unknown);
  const auto threads = CountLibraryThreads();
  for (const char* name : {"detectors", "pool", "doorbell", "network"}) {
    CHECK(threads.count(name) == 1);
  }
  ++g_passed;
}

int main() {
  TestSettingsTable();
  TestReadyNotifier();
  TestValueAndConsume();
  TestSetTwiceKeepsFirst();
  TestExceptionAndBrokenPromise();
  TestBlockedWaiterWokenFromAnotherThread();
  TestCallbacks();
  TestDetectorsOnePerKeyInOrder();
  TestDetectorsCapSharesThreads();
  TestSubmissionWakesOnlyItsDetector();
  TestFailedThreadStartQueuesNothing();
  TestFork();
  TestForkWhileAWaiterHoldsTheLock();
  TestPool();
  TestKindRegistry();
  TestFileKindInProcess();
  TestFileKindProducerProcesses();
  TestFilePayloadReuse();
  TestStopAtExit();
  std::printf("core tests: %d passed\n", g_passed);
  return 0;
}
