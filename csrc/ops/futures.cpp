#include "futures.h"

#include <chrono>
#include <optional>
#include <type_traits>
#include <utility>

#include <c10/util/Exception.h>

#include "runtime_hooks.h"

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

[[noreturn]] void ThrowTimeout(int64_t timeout_ms) {
  TORCH_CHECK(false, core::FutureError(core::FutureErrc::kTimeout,
                                       "the value was not ready within " +
                                           std::to_string(timeout_ms) +
                                           " ms; the future is still valid, wait again")
                         .what());
}

void CheckTimeout(int64_t timeout_ms) {
  TORCH_CHECK(timeout_ms >= 0, "dtorch: timeout_ms must be >= 0, got ", timeout_ms,
              "; use get() to wait without a limit");
}

template <typename T>
std::unique_ptr<core::PromiseBackend<T>> MakePromiseBackend(const std::string& kind) {
  if (kind == "memory") {
    return std::make_unique<core::MemoryPromise<T>>();
  }
  TORCH_CHECK(kind != "file" && kind != "network", "dtorch: ", PairNames<T>::kPromise, " kind '",
              kind, "' is not available in this build yet; use kind=\"memory\" (same process)");
  TORCH_CHECK(false, "dtorch: unknown ", PairNames<T>::kPromise, " kind '", kind,
              "'; expected \"memory\", \"file\" or \"network\"");
}

}  // namespace

template <typename T>
Future<T>::Future(std::unique_ptr<core::FutureBackend<T>> backend, std::string kind)
    : backend_(std::move(backend)), kind_(std::move(kind)) {
  TORCH_INTERNAL_ASSERT(backend_ != nullptr);
}

template <typename T>
T Future<T>::Get() {
  return TranslateErrors([&] {
    if (!backend_->IsReady()) {
      BeforeReturn before_return;  // runs when the wait is over, also when it throws
      while (!backend_->WaitFor(core::kMaxTimeoutMs)) {
      }
    }
    return backend_->Get();
  });
}

template <typename T>
T Future<T>::Wait(int64_t timeout_ms) {
  CheckTimeout(timeout_ms);
  if (!WaitFor(timeout_ms)) ThrowTimeout(timeout_ms);
  return Get();
}

template <typename T>
bool Future<T>::WaitFor(int64_t timeout_ms) const {
  CheckTimeout(timeout_ms);
  return TranslateErrors([&] {
    if (timeout_ms == 0 || backend_->IsReady()) return backend_->WaitFor(0);
    BeforeReturn before_return;
    return backend_->WaitFor(timeout_ms);
  });
}

template <typename T>
bool Future<T>::IsReady() const {
  return backend_->IsReady();
}

template <typename T>
bool Future<T>::Valid() const {
  return backend_->Valid();
}

template <typename T>
void Future<T>::OnReady(std::function<void()> callback) {
  backend_->OnReady(std::move(callback));
}

template <typename T>
Promise<T>::Promise(const std::string& kind) : kind_(kind), backend_(MakePromiseBackend<T>(kind)) {}

template <typename T>
void Promise<T>::Claim(const char* producer) {
  const char* first = nullptr;
  if (claimed_by_.compare_exchange_strong(first, producer)) return;
  TORCH_CHECK(false, "dtorch: promise already satisfied: the promise already holds a value or "
              "an exception, or will: ", first, " was called on it first and this ", producer,
              " came second. A promise is fulfilled once: use a new one per value");
}

template <typename T>
void Promise<T>::SetValue(T value, const char* caller) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    TORCH_CHECK(value.defined(), "dtorch: set_value needs a defined tensor, got an undefined one");
    if (value.key_set().has(c10::DispatchKey::Python)) {
      if (const auto check = GetRuntimeHooks().check_subclass_value) check(value);
    }
  }
  Claim(caller);
  BeforeReturn before_return;  // the waiter it wakes may take the GIL meanwhile
  TranslateErrors([&] { backend_->SetValue(std::move(value)); });
}

template <typename T>
void Promise<T>::SetException(const std::string& message) {
  const auto nul = message.find('\0');
  TORCH_CHECK_VALUE(nul == std::string::npos, "dtorch: set_exception: the message has a NUL "
                    "character at index ", nul, " (it would cut the message short); pass text "
                    "without NUL characters");
  Claim("set_exception");
  BeforeReturn before_return;
  TranslateErrors([&] { backend_->SetException(message); });
}

template <typename T>
void Promise<T>::CompleteClaimed(T value) noexcept {
  TORCH_INTERNAL_ASSERT(claimed_by_ != nullptr);
  try {
    backend_->SetValue(std::move(value));
  } catch (...) {
    // Cannot happen: the claim made this the only completion.
  }
}

template <typename T>
void Promise<T>::FailClaimed(const std::string& message) noexcept {
  FailClaimed(core::FutureErrc::kProducerError, message);
}

template <typename T>
void Promise<T>::FailClaimed(core::FutureErrc code, const std::string& detail) noexcept {
  TORCH_INTERNAL_ASSERT(claimed_by_ != nullptr);
  try {
    backend_->SetError(code, detail);
  } catch (...) {
    // Cannot happen: the claim made this the only completion.
  }
}

template <typename T>
c10::intrusive_ptr<Future<T>> Promise<T>::GetFuture() {
  return TranslateErrors(
      [&] { return c10::make_intrusive<Future<T>>(backend_->GetFuture(), kind_); });
}

template <typename T>
std::string Promise<T>::Serialize() const {
  // TypeError, as Python's own unpicklable objects raise (pickle's callers catch that one), and
  // no double quote: torch 2.11's inductor pastes this message into a "..." literal.
  TORCH_CHECK_TYPE(kind_ != "memory",
                   "dtorch: memory promises cannot leave the process (pickle, serialize(), "
                   "torch.jit.save of a module holding one); create the pair with a kind that "
                   "crosses processes (dtorch_ops.TensorPromise.for_tensor or kind='file')");
  TORCH_INTERNAL_ASSERT(false, "dtorch: Serialize() for kind '", kind_, "' is not implemented");
}

template class Future<at::Tensor>;
template class Future<core::Unit>;
template class Promise<at::Tensor>;
template class Promise<core::Unit>;

VoidFutureCollect::VoidFutureCollect(std::vector<c10::Device> devices,
                                     std::vector<c10::intrusive_ptr<VoidFuture>> futures)
    : devices_(std::move(devices)), futures_(std::move(futures)) {
  TORCH_INTERNAL_ASSERT(devices_.size() == futures_.size());
}

void VoidFutureCollect::Get() {
  TORCH_CHECK(!consumed_.exchange(true),
              "dtorch: no value: get() was already called on this VoidFutureCollect");
  std::optional<std::string> first_error;
  for (size_t i = 0; i < futures_.size(); ++i) {
    try {
      futures_[i]->Get();
    } catch (const c10::Error& e) {
      if (!first_error) {
        first_error = "dtorch: sync on " + devices_[i].str() + " failed: " + NestedMessage(e);
      }
    }
  }
  TORCH_CHECK(!first_error, *first_error);
}

void VoidFutureCollect::Wait(int64_t timeout_ms) {
  if (!WaitFor(timeout_ms)) ThrowTimeout(timeout_ms);
  Get();
}

bool VoidFutureCollect::WaitFor(int64_t timeout_ms) const {
  CheckTimeout(timeout_ms);
  TORCH_CHECK(!consumed_, "dtorch: no value: get() was already called on this VoidFutureCollect");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(
      std::min<int64_t>(timeout_ms, core::kMaxTimeoutMs));
  for (const auto& future : futures_) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (!future->WaitFor(std::max<int64_t>(left.count(), 0))) return false;
  }
  return true;
}

bool VoidFutureCollect::IsReady() const {
  if (consumed_) return false;
  for (const auto& future : futures_) {
    if (!future->IsReady()) return false;
  }
  return true;
}

bool VoidFutureCollect::Valid() const { return !consumed_; }

void VoidFutureCollect::OnReady(std::function<void()> callback) {
  if (futures_.empty()) {
    callback();
    return;
  }
  auto remaining = std::make_shared<std::atomic<size_t>>(futures_.size());
  auto shared_callback = std::make_shared<std::function<void()>>(std::move(callback));
  for (const auto& future : futures_) {
    future->OnReady([remaining, shared_callback] {
      if (remaining->fetch_sub(1) == 1) (*shared_callback)();
    });
  }
}

std::string NestedMessage(const c10::Error& error) {
  static const std::string kPrefix = "dtorch: ";
  std::string message = error.what_without_backtrace();
  if (message.compare(0, kPrefix.size(), kPrefix) == 0) message.erase(0, kPrefix.size());
  return message;
}

std::string CurrentExceptionMessage() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return NestedMessage(e);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

std::string PromiseKindFor(const at::Tensor& tensor, bool per_device_per_process) {
  TORCH_CHECK(tensor.defined(), "dtorch: promise_kind_for needs a defined tensor");
  if (tensor.device().is_cpu()) return "memory";
  return per_device_per_process ? "file" : "memory";
}

}  // namespace dtorch
