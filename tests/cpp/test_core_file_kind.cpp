// Tests of the file kind (a codec of ints; the same process plays both ends, or a forked
// child). Part of test_core (core_test.h).
#include "core_test.h"

static std::unique_ptr<FilePromise<int64_t>> Deserialized(const std::string& serialized,
                                                          std::shared_ptr<IntCodec> codec) {
  const std::string prefix = SerializedPrefix("file");
  CHECK(serialized.rfind(prefix, 0) == 0);
  return std::make_unique<FilePromise<int64_t>>(
      FileHandle::Parse(serialized.substr(prefix.size()), "int"), codec);
}

void TestFileKindInProcess() {
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

void TestFileKindProducerProcesses() {
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

void TestFilePayloadReuse() {
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
