// What the core's C++ tests share (tests/cpp/test_core*.cpp, one executable: test_core.cpp
// has main): CHECK, the pass count, waits, an int codec for the file kind, and the tests.
#pragma once

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

// (The tests' own header: the core's names and the chrono literals unqualified in each.)
using namespace dtorch::core;
using namespace std::chrono_literals;

inline int g_passed = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

// FutureBackend::WaitUntil, `ms` from now.
template <typename T>
inline bool WaitMs(const FutureBackend<T>& future, int64_t ms) {
  return future.WaitUntil(std::chrono::steady_clock::now() + std::chrono::milliseconds(ms));
}

// The FutureError fn() throws (the test fails if it throws none).
template <typename Fn>
inline FutureError ErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const FutureError& e) {
    return e;
  }
  std::fprintf(stderr, "expected a FutureError\n");
  std::exit(1);
}

template <typename Fn>
inline FutureErrc ErrorCodeOf(Fn&& fn) {
  return ErrorOf(std::forward<Fn>(fn)).code();
}

template <typename Pred>
inline bool WaitUntil(Pred pred, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  return pred();
}

inline int ThreadsNamed(const std::string& name) {
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

inline std::vector<std::string> OurSegments() {
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

// The tests (each adds one to g_passed), by file:
// test_core.cpp
void TestValueAndConsume();
void TestSetTwiceKeepsFirst();
void TestExceptionAndBrokenPromise();
void TestBlockedWaiterWokenFromAnotherThread();
void TestCallbacks();
void TestKindRegistry();
void TestStopAtExit();
void TestSettingsTable();
// test_core_threads.cpp
void TestDetectorsOnePerKeyInOrder();
void TestDetectorsCapSharesThreads();
void TestSubmissionWakesOnlyItsDetector();
void TestFailedThreadStartQueuesNothing();
void TestFork();
void TestForkWhileAWaiterHoldsTheLock();
void TestPool();
void TestReadyNotifier();
// test_core_file_kind.cpp
void TestFileKindInProcess();
void TestFileKindProducerProcesses();
void TestFilePayloadReuse();
