// Tests of the torch-free core (csrc/core): promise/future semantics and callbacks, the kind
// registry, the settings table and the library's threads at exit; main() runs them with those of
// test_core_threads.cpp and test_core_file_kind.cpp (core_test.h).
// Built and run by tests/test_core_cpp.py; prints "core tests: N passed" or fails with a message.
#include "core_test.h"

void TestValueAndConsume() {
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

void TestSetTwiceKeepsFirst() {
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

void TestExceptionAndBrokenPromise() {
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

void TestBlockedWaiterWokenFromAnotherThread() {
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

void TestCallbacks() {
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

void TestKindRegistry() {
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
void TestStopAtExit() {
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
