#include "tensor_promise_future.h"

#include <utility>

#include <c10/util/Exception.h>

namespace dtorch {
namespace {

// Runs `fn`, turning the core's typed errors into c10::Error (RuntimeError in Python/TorchScript)
// with the same "dtorch: <cause>: <detail>" message.
template <typename Fn>
auto TranslateErrors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const core::FutureError& e) {
    TORCH_CHECK(false, e.what());
  }
}

std::unique_ptr<TensorPromiseBackend> MakePromiseBackend(const std::string& kind) {
  if (kind == "memory") {
    return std::make_unique<core::MemoryPromise<at::Tensor>>();
  }
  TORCH_CHECK(kind != "file" && kind != "network", "dtorch: TensorPromise kind '", kind,
              "' is not available in this build yet; use kind=\"memory\" (same process)");
  TORCH_CHECK(false, "dtorch: unknown TensorPromise kind '", kind,
              "'; expected \"memory\", \"file\" or \"network\"");
}

}  // namespace

TensorFuture::TensorFuture(std::unique_ptr<TensorFutureBackend> backend, std::string kind)
    : backend_(std::move(backend)), kind_(std::move(kind)) {
  TORCH_INTERNAL_ASSERT(backend_ != nullptr);
}

at::Tensor TensorFuture::Get() {
  return TranslateErrors([&] { return backend_->Get(); });
}

at::Tensor TensorFuture::Wait(int64_t timeout_ms) {
  TORCH_CHECK(timeout_ms >= 0, "dtorch: wait(timeout_ms) needs timeout_ms >= 0, got ", timeout_ms,
              "; use get() to wait without a limit");
  if (!WaitFor(timeout_ms)) {
    TORCH_CHECK(false, core::FutureError(core::FutureErrc::kTimeout,
                                         "the value was not ready within " +
                                             std::to_string(timeout_ms) +
                                             " ms; the future is still valid, wait again")
                           .what());
  }
  return Get();
}

bool TensorFuture::WaitFor(int64_t timeout_ms) const {
  TORCH_CHECK(timeout_ms >= 0, "dtorch: timeout_ms must be >= 0, got ", timeout_ms);
  return TranslateErrors([&] { return backend_->WaitFor(timeout_ms); });
}

bool TensorFuture::IsReady() const { return backend_->IsReady(); }

bool TensorFuture::Valid() const { return backend_->Valid(); }

void TensorFuture::OnReady(std::function<void()> callback) {
  backend_->OnReady(std::move(callback));
}

void TensorFuture::NotifyWhenReady(const c10::intrusive_ptr<ReadyNotifier>& notifier,
                                   int64_t token) {
  TORCH_CHECK(notifier, "dtorch: notify_when_ready needs a ReadyNotifier, got None");
  backend_->OnReady([core = notifier->core(), token] { core->Post(token); });
}

TensorPromise::TensorPromise(const std::string& kind)
    : kind_(kind), backend_(MakePromiseBackend(kind)) {}

void TensorPromise::SetValue(const at::Tensor& value) {
  TORCH_CHECK(value.defined(), "dtorch: set_value needs a defined tensor, got an undefined one");
  TranslateErrors([&] { backend_->SetValue(value); });
}

void TensorPromise::SetException(const std::string& message) {
  TranslateErrors([&] { backend_->SetException(message); });
}

c10::intrusive_ptr<TensorFuture> TensorPromise::GetFuture() {
  return TranslateErrors(
      [&] { return c10::make_intrusive<TensorFuture>(backend_->GetFuture(), kind_); });
}

std::string TensorPromise::Serialize() const {
  TORCH_CHECK(kind_ != "memory",
              "dtorch: memory promises cannot leave the process (pickle, serialize(), "
              "torch.jit.save of a module holding one); create the pair with a kind that crosses "
              "processes (dtorch_ops.TensorPromise.for_tensor or kind=\"file\")");
  TORCH_INTERNAL_ASSERT(false, "dtorch: Serialize() for kind '", kind_, "' is not implemented");
}

std::string PromiseKindFor(const at::Tensor& tensor, bool per_device_per_process) {
  TORCH_CHECK(tensor.defined(), "dtorch: promise_kind_for needs a defined tensor");
  if (tensor.device().is_cpu()) return "memory";
  return per_device_per_process ? "file" : "memory";
}

}  // namespace dtorch
