// dtorch_ops from C++: futures, promises across threads and processes, and a TorchScript module
// (saved by Python) whose forward calls torch.ops.dtorch.get_tensor_async. Usage:
//   dtorch_cpp_example [scripted_module.pt]
// Prints "cpp example: OK" and returns 0, or reports the first failure and returns 1.
#include <dtorch/dtorch.h>

#include <torch/script.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kWaitMs = 10'000;  // every blocking wait is bounded

void Check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

// Runs fn, expecting a c10::Error of dtorch_ops with the code `expected` (dtorch::CodeOf: no
// message is parsed).
template <typename Fn>
void ExpectError(Fn&& fn, dtorch::FutureErrc expected, const std::string& what) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const auto* coded = dtorch::CodeOf(e);
    Check(coded != nullptr && coded->code() == expected,
          what + ": unexpected error \"" + e.what_without_backtrace() + "\"");
    return;
  }
  throw std::runtime_error("check failed: " + what + ": no c10::Error thrown");
}

// (a) GetTensorAsync(t)->Get() yields t itself (no copy).
void FutureAliasesInput() {
  at::Tensor t = torch::arange(6, torch::kFloat32);
  auto future = dtorch::GetTensorAsync(t);
  Check(future->Valid(), "a fresh future is valid");
  at::Tensor value = future->Get();
  Check(value.is_same(t) && value.data_ptr() == t.data_ptr(), "the value aliases the input");
  Check(!future->Valid(), "Get() consumes the future");
  Check(dtorch::ToTorch(t).is_same(t), "ToTorch(t) aliases t");
  Check(dtorch::PromiseKindFor(t, false) == "memory", "a CPU tensor gets a memory promise");
}

// (b) A memory promise fulfilled from another thread; the consumer waits with a timeout.
void PromiseFromThread() {
  auto promise = c10::make_intrusive<dtorch::TensorPromise>("memory");
  auto future = promise->GetFuture();
  at::Tensor t = torch::ones({2, 3});
  std::thread producer([promise, t] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    promise->SetValue(t);
  });
  at::Tensor value;
  try {
    value = future->Wait(kWaitMs);
  } catch (...) {
    producer.join();
    throw;
  }
  producer.join();
  Check(value.is_same(t), "the value set on the producer thread arrives");
}

// (c) A timed-out Wait throws c10::Error and leaves the future valid.
void TimeoutKeepsFutureValid() {
  auto promise = c10::make_intrusive<dtorch::TensorPromise>("memory");
  auto future = promise->GetFuture();
  ExpectError([&] { future->Wait(20); }, dtorch::FutureErrc::kTimeout, "Wait on an unset promise");
  Check(future->Valid(), "the future stays valid after a timeout");
  Check(!future->IsReady(), "not ready before the value is set");
  at::Tensor t = torch::zeros({1});
  promise->SetValue(t);
  Check(future->WaitFor(kWaitMs) && future->IsReady(), "ready once set");
  Check(future->Wait(kWaitMs).is_same(t), "waiting again yields the value");
  Check(future->Wait().is_same(t) && future->Valid(), "Wait() leaves the future valid");
  Check(future->Get().is_same(t) && !future->Valid() && future->IsReady(),
        "only Get() consumes; the future stays complete");
}

// (c2) The host copy: a CPU copy of each tensor, ready once it has landed (a CPU tensor, as
// here, is yielded as it is; a device one is copied without blocking, on its current stream).
void HostCopy() {
  at::Tensor loss = torch::full({}, 0.25);
  auto copies = dtorch::GetTensorAsync(std::vector<at::Tensor>{loss, loss * 2}, c10::kCPU);
  const std::vector<at::Tensor> values = copies->Wait(kWaitMs);
  Check(values.size() == 2 && values[1].item<float>() == 0.5f, "the host copies' values");
  Check(dtorch::ToTorchAsync(loss, c10::kCPU)->Get().data_ptr() == loss.data_ptr(),
        "a CPU tensor's host copy is the tensor itself (detached)");
}

// (d) A promise dropped without a value breaks its future.
void DroppedPromiseBreaks() {
  auto promise = c10::make_intrusive<dtorch::TensorPromise>("memory");
  auto future = promise->GetFuture();
  promise.reset();
  ExpectError([&] { future->Wait(kWaitMs); }, dtorch::FutureErrc::kBrokenPromise,
              "Wait after the promise died");
}

// (f) Sync: blocking, as a collect of per-device futures, and into a VoidPromise.
void SyncDevices() {
  dtorch::Sync();  // the devices this process has used (CPU here)
  auto collect = dtorch::SyncAsync(std::vector<c10::Device>{c10::Device(c10::kCPU)});
  Check(collect->Devices().size() == 1 && collect->IsReady(), "a CPU sync is ready at once");
  collect->Wait(kWaitMs);
  Check(collect->Valid(), "Wait() does not consume the collect");
  collect->Get();
  Check(!collect->Valid() && collect->IsReady(), "Get() consumes it; it stays complete");
  auto promise = c10::make_intrusive<dtorch::VoidPromise>("memory");
  auto done = promise->GetFuture();
  dtorch::SyncInto(std::nullopt, promise);
  done->Wait(kWaitMs);
}

// (g) A file promise crosses processes: serialized, rebuilt in a forked child (any process of
// this host could: a Python worker, another C++ program), which copies its value into shared
// memory; the parent's future yields a view of that copy.
void FilePromiseAcrossProcesses() {
  auto promise = c10::make_intrusive<dtorch::TensorPromise>("file");
  auto future = promise->GetFuture();
  const std::string serialized = promise->Serialize();
  const pid_t child = fork();
  if (child == 0) {
    int code = 0;
    try {
      dtorch::CreateTensorPromiseFromSerialized(serialized)->SetValue(torch::arange(5) * 10);
    } catch (...) {
      code = 1;
    }
    _exit(code);
  }
  Check(child > 0, "fork");
  at::Tensor value = future->Wait(kWaitMs);
  int status = 0;
  waitpid(child, &status, 0);
  Check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the producer process succeeded");
  Check(value.equal(torch::arange(5) * 10), "the value set in the other process arrives");
  ExpectError([] { dtorch::CreateTensorPromiseFromSerialized("dtorch-promise:1:file:x"); },
              dtorch::FutureErrc::kInvalidHandle, "a malformed serialized promise");
  Check(dtorch::TensorPromiseFor(torch::ones(1), true)->Kind() == "memory",
        "a CPU tensor's pair is a memory one");
}

// (e) A TorchScript module saved by Python that calls torch.ops.dtorch.* loads and runs.
void RunScriptedModule(const std::string& path) {
  torch::jit::Module module = torch::jit::load(path);
  at::Tensor x = torch::arange(4, torch::kFloat32);
  at::Tensor y = module.forward({x}).toTensor();
  std::cout << "scripted module " << path << ": forward(" << x << ") =\n" << y << "\n";
  Check(y.equal(x * 2), "the scripted module returns x * 2");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    FutureAliasesInput();
    PromiseFromThread();
    TimeoutKeepsFutureValid();
    HostCopy();
    DroppedPromiseBreaks();
    SyncDevices();
    FilePromiseAcrossProcesses();
    if (argc > 1) RunScriptedModule(argv[1]);
  } catch (const c10::Error& e) {
    std::cerr << "cpp example: FAILED: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "cpp example: FAILED: " << e.what() << "\n";
    return 1;
  }
  std::cout << "cpp example: OK\n";
  return 0;
}
