// The public header on its own: of dtorch_ops, this file includes only <dtorch/dtorch.h> (and of
// torch, the factory functions it makes its tensors with) and uses every public name, and is built with no include path into csrc/ (the root CMakeLists.txt links it to
// dtorch_ops::dtorch_ops of an installed package). Linking it proves each is exported; running it
// that each does what its declaration says, in brief (examples/cpp and the Python tests go
// further). Prints the path of the libdtorch_ops.so it loaded ("loaded: <path>") and "public
// header check: OK".
#include <dtorch/dtorch.h>

#if __has_include("core/promise_future.h") || __has_include("ops/futures.h") || \
    __has_include(<core/promise_future.h>) || __has_include(<ops/futures.h>)
#error "the library's internal headers are reachable: the public header check must not see them"
#endif

#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int64_t kWaitMs = 10'000;

void Check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("check failed: ") + what);
}

template <typename Fn>
void ExpectCode(Fn&& fn, dtorch::FutureErrc expected, const char* what) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const dtorch::CodedErrorBase* coded = dtorch::CodeOf(e);
    Check(coded != nullptr && coded->code() == expected, what);
    return;
  }
  Check(false, what);
}

void Futures() {
  const at::Tensor t = at::ones({3});
  c10::intrusive_ptr<dtorch::TensorFuture> future = dtorch::GetTensorAsync(t);
  Check(future->WaitFor(kWaitMs) && future->IsReady() && future->Valid(), "ready and valid");
  Check(future->Kind() == "memory", "GetTensorAsync makes a memory pair");
  Check(future->Value().is_same(t), "Value() is the input");
  std::atomic<bool> called{false};
  future->OnReady([&called] { called = true; });
  Check(called, "OnReady on a ready future runs at once");
  Check(future->Wait().is_same(t) && future->Wait(kWaitMs).is_same(t) && future->Valid(),
        "Wait() returns the value, not consumed");
  Check(future->Get().is_same(t) && !future->Valid(), "Get() consumes");
  Check(future->IsReady() && future->Value().is_same(t), "complete, and Value(), after Get()");
  Check(dtorch::ToTorchAsync(t)->Wait(kWaitMs).is_same(t), "ToTorchAsync");
  Check(dtorch::ToTorch(t).is_same(t), "ToTorch");

  // The host copy: a CPU input is yielded as it is (detached); a device one would be copied.
  const at::Tensor x = at::full({2}, 3.0);
  Check(dtorch::GetTensorAsync(x, c10::kCPU)->Wait(kWaitMs).data_ptr() == x.data_ptr(),
        "GetTensorAsync(t, kCPU) of a CPU tensor");
  Check(dtorch::ToTorchAsync(x, c10::kCPU)->Get().equal(x), "ToTorchAsync(t, kCPU)");
  c10::intrusive_ptr<dtorch::TensorListFuture> copies =
      dtorch::GetTensorAsync(std::vector<at::Tensor>{x, t}, c10::kCPU);
  const std::vector<at::Tensor> values = copies->Wait(kWaitMs);
  Check(values.size() == 2 && values[1].equal(t), "GetTensorAsync(tensors, kCPU)");
  bool refused = false;
  try {
    dtorch::GetTensorAsync(x, c10::Device(c10::kMeta));
  } catch (const c10::ValueError&) {
    refused = true;
  }
  Check(refused, "a host copy to another device is refused");
}

void Promises() {
  auto promise = c10::make_intrusive<dtorch::TensorPromise>("memory");
  Check(promise->Kind() == "memory", "kind");
  auto future = promise->GetFuture();
  ExpectCode([&] { promise->GetFuture(); }, dtorch::FutureErrc::kFutureAlreadyRetrieved,
             "a second GetFuture");
  ExpectCode([&] { future->Value(); }, dtorch::FutureErrc::kNotReady, "Value() before completion");
  ExpectCode([&] { future->Wait(1); }, dtorch::FutureErrc::kTimeout, "a timed-out Wait");
  dtorch::GetTensor(at::zeros({2}), promise);
  Check(future->Wait(kWaitMs).equal(at::zeros({2})), "GetTensor fulfils the promise");
  ExpectCode([&] { promise->SetValue(at::ones({1})); },
             dtorch::FutureErrc::kPromiseAlreadySatisfied, "a second SetValue");

  auto failing = c10::make_intrusive<dtorch::TensorPromise>("memory");
  auto failed = failing->GetFuture();
  failing->SetException("no value");
  ExpectCode([&] { failed->Get(); }, dtorch::FutureErrc::kProducerError, "SetException");
  ExpectCode([&] { failing->Serialize(); }, dtorch::FutureErrc::kCannotLeaveProcess,
             "a memory promise cannot leave its process");

  auto file_promise = dtorch::TensorPromiseFor(at::ones({1}), /*per_device_per_process=*/true);
  Check(dtorch::PromiseKindFor(at::ones({1}), true) == file_promise->Kind(), "PromiseKindFor");
  auto file = c10::make_intrusive<dtorch::TensorPromise>("file");
  auto file_future = file->GetFuture();
  dtorch::CreateTensorPromiseFromSerialized(file->Serialize())->SetValue(at::full({2}, 7.0));
  Check(file_future->Wait(kWaitMs).equal(at::full({2}, 7.0)), "a file promise, serialized");
  ExpectCode([] { dtorch::TensorPromise::FromSerialized("not a promise"); },
             dtorch::FutureErrc::kInvalidHandle, "a malformed serialized promise");
}

void Sync() {
  dtorch::Sync();
  const dtorch::DeviceList cpu = std::vector<c10::Device>{c10::Device(c10::kCPU)};
  c10::intrusive_ptr<dtorch::VoidFutureCollect> collect = dtorch::SyncAsync(cpu);
  Check(collect->WaitFor(kWaitMs) && collect->IsReady() && collect->Valid(), "SyncAsync");
  Check(collect->Devices().size() == 1 && collect->Kind() == "memory", "its devices");
  collect->Value();
  collect->OnReady([] {});
  collect->Wait();
  collect->Wait(kWaitMs);
  Check(collect->Valid(), "Wait() does not consume");
  collect->Get();
  Check(!collect->Valid() && collect->IsReady(), "Get() consumes; the collect stays complete");
  collect->Wait(kWaitMs);  // (complete: returns at once)

  auto promise = c10::make_intrusive<dtorch::VoidPromise>("memory");
  c10::intrusive_ptr<dtorch::VoidFuture> future = promise->GetFuture();
  dtorch::SyncInto(cpu, promise);
  dtorch::Unit done = future->Wait(kWaitMs);
  (void)done;
  auto set = c10::make_intrusive<dtorch::VoidPromise>("memory");
  auto set_future = set->GetFuture();
  set->SetValue(dtorch::Unit{});
  set_future->Get();
}

// The libdtorch_ops.so this process mapped (from /proc/self/maps): the tests check that it is the
// installed package's.
std::string LoadedLibrary() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash != std::string::npos && line.size() >= 16 &&
        line.compare(line.size() - 16, 16, "libdtorch_ops.so") == 0) {
      return line.substr(slash);
    }
  }
  return "(not mapped)";
}

}  // namespace

int main() {
  try {
    Futures();
    Promises();
    Sync();
  } catch (const std::exception& e) {
    std::cerr << "public header check: FAILED: " << e.what() << "\n";
    return 1;
  }
  std::cout << "loaded: " << LoadedLibrary() << "\n";
  std::cout << "public header check: OK\n";
  return 0;
}
