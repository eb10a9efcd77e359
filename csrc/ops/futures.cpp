#include "futures.h"

#include <unistd.h>

#include <chrono>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include <c10/util/Exception.h>

#include "../core/kind_registry.h"
#include "errors.h"
#include "get_tensor.h"
#include "kinds.h"
#include "runtime_hooks.h"

namespace dtorch {

namespace {

// Runs `fn`, turning the core's typed errors into coded c10 errors (ops/errors.h) with the same
// "dtorch: <cause>: <detail>" message, and a bad kind spec into ValueError.
template <typename Fn>
auto TranslateErrors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const core::FutureError& e) {
    ThrowCoded(e);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// Only the library can make a backend; a caller of the public constructor can pass null.
template <typename Backend>
const Backend& NonNull(const std::unique_ptr<Backend>& backend) {
  TORCH_CHECK_VALUE(backend != nullptr, "dtorch: a promise needs a backend, got none");
  return *backend;
}

[[noreturn]] void ThrowTimeout(int64_t timeout_ms) {
  ThrowCoded(TimedOut(std::to_string(timeout_ms) + " ms"));
}

void CheckTimeout(int64_t timeout_ms) {
  TORCH_CHECK(timeout_ms >= 0, "dtorch: timeout_ms must be >= 0, got ", timeout_ms,
              "; call Wait() to wait without a limit");
}

[[noreturn]] void ThrowConsumedCollect() {
  ThrowCoded(core::FutureError(core::FutureErrc::kNoState,
                               "get() (C++: Get()) was already called on this VoidFutureCollect"));
}

core::Deadline DeadlineIn(int64_t timeout_ms) {
  return std::chrono::steady_clock::now() +
         std::chrono::milliseconds(std::min(timeout_ms, core::kMaxTimeoutMs));
}

}  // namespace

template <typename T>
Future<T>::Future(std::unique_ptr<core::FutureBackend<T>> backend, const char* kind)
    : backend_(std::move(backend)), kind_(kind) {
  TORCH_CHECK_VALUE(backend_ != nullptr, "dtorch: a future needs a backend, got none");
}

template <typename T>
Future<T>::~Future() = default;

template <typename T>
T Future<T>::Get() {
  return TranslateErrors([&] {
    if (!backend_->IsReady()) {
      BeforeReturn before_return;  // runs when the wait is over, also when it throws
      while (!backend_->WaitUntil(DeadlineIn(core::kMaxTimeoutMs))) {
      }
    }
    return backend_->Get();
  });
}

template <typename T>
T Future<T>::Wait(int64_t timeout_ms) {
  CheckTimeout(timeout_ms);
  if (!WaitFor(timeout_ms)) ThrowTimeout(timeout_ms);
  return Value();
}

template <typename T>
T Future<T>::Wait() {
  TranslateErrors([&] {
    if (backend_->IsReady()) return;
    BeforeReturn before_return;
    while (!backend_->WaitUntil(DeadlineIn(core::kMaxTimeoutMs))) {
    }
  });
  return Value();
}

template <typename T>
T Future<T>::Value() {
  return TranslateErrors([&] { return backend_->Value(); });
}

template <typename T>
bool Future<T>::WaitFor(int64_t timeout_ms) const {
  CheckTimeout(timeout_ms);
  return TranslateErrors([&] {
    if (timeout_ms == 0 || backend_->IsReady()) return backend_->WaitUntil(core::Deadline());
    BeforeReturn before_return;
    return backend_->WaitUntil(DeadlineIn(timeout_ms));
  });
}

template <typename T>
bool Future<T>::IsReady() const {
  return TranslateErrors([&] { return backend_->IsReady(); });
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
Promise<T>::Promise(const std::string& kind)
    : Promise(TranslateErrors([&] { return Kinds<T>().Create(kind); })) {}

template <typename T>
Promise<T>::Promise(std::unique_ptr<core::PromiseBackend<T>> backend)
    : backend_(std::move(backend)), kind_(NonNull(backend_).Kind()) {}

template <typename T>
Promise<T>::~Promise() = default;

template <typename T>
c10::intrusive_ptr<Promise<T>> Promise<T>::FromSerialized(const std::string& serialized) {
  return c10::make_intrusive<Promise<T>>(
      TranslateErrors([&] { return Kinds<T>().Deserialize(serialized); }));
}

template <typename T>
void Promise<T>::CheckValue(const T& value, const char* caller) {
  try {
    TranslateErrors([&] { backend_->CheckValue(value); });
  } catch (const c10::Error& e) {
    // The kind's own refusal (no code: a coded error is about reaching the pair, which an
    // altered handle must not fail).
    if (CodeOf(e) == nullptr) RefuseValue(caller, NestedMessage(e));
    throw;
  }
}

template <typename T>
void Promise<T>::RefuseValue(const char* caller, const std::string& why) noexcept {
  try {
    backend_->Set(core::Result<T>::Error(core::FutureErrc::kProducerError,
                                         std::string(caller) + " in the producer (pid " +
                                             std::to_string(getpid()) +
                                             ") refused the value: " + why),
                  caller);
  } catch (...) {
    // (Claimed or failed already, or the pair cannot be reached: nothing to tell.)
  }
}

template <typename T>
bool Promise<T>::CopiesValueOut() const {
  return backend_->CopiesValueOut();
}

template <typename T>
bool Promise<T>::CompletesQuietly() const {
  return backend_->CompletesQuietly();
}

template <typename T>
void Promise<T>::Claim(const char* producer) {
  TranslateErrors([&] { backend_->Claim(producer); });
}

template <typename T>
void Promise<T>::SetValue(T value) {
  SetValueFrom(std::move(value), "set_value");
}

template <typename T>
void Promise<T>::SetValueFrom(T value, const char* caller) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    try {
      TORCH_CHECK(value.defined(),
                  "dtorch: set_value needs a defined tensor, got an undefined one");
      if (value.key_set().has(c10::DispatchKey::Python)) {
        if (const auto check = GetRuntimeHooks().check_subclass_value) check(value);
      }
    } catch (const c10::Error& e) {
      RefuseValue(caller, NestedMessage(e));
      throw;
    }
    if (!value.device().is_cpu() && backend_->CopiesValueOut()) {
      // Device work may still be writing it: snapshotted on its stream, completed after that.
      TORCH_CHECK(c10::raw::intrusive_ptr::use_count(this) > 0, "dtorch: a promise given a "
                  "device tensor must be made with c10::make_intrusive (it completes later)");
      kernels::CompleteFromDevice(value, c10::intrusive_ptr<Promise>::reclaim_copy(this), caller);
      return;
    }
  }
  CheckValue(value, caller);
  BeforeReturn before_return;  // the waiter it wakes may take the GIL meanwhile
  TranslateErrors([&] {
    backend_->Claim(caller);
    backend_->Complete(core::Result<T>::Value(std::move(value)));
  });
}

template <typename T>
void Promise<T>::RegisterHolder() noexcept {
  backend_->RegisterHolder();
}

template <typename T>
void Promise<T>::SetError(const core::ErrorInfo& error, const char* caller) {
  BeforeReturn before_return;
  TranslateErrors([&] { backend_->Set(core::Result<T>::Error(error), caller); });
}

template <typename T>
void Promise<T>::SetException(const std::string& message) {
  const auto nul = message.find('\0');
  TORCH_CHECK_VALUE(nul == std::string::npos, "dtorch: set_exception: the message has a NUL "
                    "character at index ", nul, " (it would cut the message short); pass text "
                    "without NUL characters");
  BeforeReturn before_return;
  TranslateErrors([&] {
    backend_->Set(core::Result<T>::Error(core::FutureErrc::kProducerError, message),
                  "set_exception");
  });
}

template <typename T>
void Promise<T>::SetException(const std::string& message, const std::string& exception_type,
                              const std::string& traceback) {
  TORCH_CHECK_VALUE(message.find('\0') == std::string::npos,
                    "dtorch: set_exception: the message has a NUL character; pass text without "
                    "NUL characters");
  TORCH_CHECK_VALUE(core::ValidExceptionType(exception_type),
                    "dtorch: set_exception: an exception type name is at most ",
                    core::kMaxExceptionTypeBytes, " of [A-Za-z0-9_.], got '",
                    exception_type.substr(0, 64), "'");
  core::ErrorInfo error{core::FutureErrc::kProducerError, message};
  error.origin.exception_type = exception_type;
  error.origin.traceback = traceback;
  SetError(error, "set_exception");
}

template <typename T>
void Promise<T>::CompleteClaimed(T value) noexcept {
  try {
    backend_->Complete(core::Result<T>::Value(std::move(value)));
  } catch (...) {
    // The kind could not deliver it; its future holds that error (PromiseBackend::Complete).
  }
}

template <typename T>
void Promise<T>::FailClaimed(const std::string& message) noexcept {
  FailClaimed(core::FutureErrc::kProducerError, message);
}

template <typename T>
void Promise<T>::FailClaimed(core::FutureErrc code, const std::string& detail) noexcept {
  try {
    backend_->Complete(core::Result<T>::Error(code, detail));
  } catch (...) {
    // As above.
  }
}

template <typename T>
c10::intrusive_ptr<Future<T>> Promise<T>::GetFuture() {
  return TranslateErrors(
      [&] { return c10::make_intrusive<Future<T>>(backend_->GetFuture(), kind_); });
}

template <typename T>
std::string Promise<T>::Serialize() const {
  return TranslateErrors([&] { return backend_->Serialize(); });
}

template class DTORCH_API Future<at::Tensor>;
template class DTORCH_API Future<Unit>;
template class DTORCH_API Future<std::vector<at::Tensor>>;
template class DTORCH_API Promise<at::Tensor>;
template class DTORCH_API Promise<Unit>;

VoidFutureCollect::VoidFutureCollect(std::vector<c10::Device> devices,
                                     std::vector<c10::intrusive_ptr<VoidFuture>> futures)
    : devices_(std::move(devices)), futures_(std::move(futures)) {
  TORCH_INTERNAL_ASSERT(devices_.size() == futures_.size());
}

void VoidFutureCollect::Get() {
  if (consumed_.exchange(true)) ThrowConsumedCollect();
  ThrowFirstDeviceError([](VoidFuture& future) { future.Get(); });
}

void VoidFutureCollect::Value() const {
  ThrowFirstDeviceError([](VoidFuture& future) { future.Value(); });
}

template <typename Read>
void VoidFutureCollect::ThrowFirstDeviceError(Read read) const {
  std::optional<std::string> first_error;
  auto first_code = core::FutureErrc::kProducerError;
  for (size_t i = 0; i < futures_.size(); ++i) {
    try {
      read(*futures_[i]);
    } catch (const c10::Error& e) {
      const auto* coded = CodeOf(e);
      if (coded && coded->code() == core::FutureErrc::kNotReady) throw;  // (not an outcome yet)
      if (!first_error) {
        first_error = "dtorch: sync on " + devices_[i].str() + " failed: " + NestedMessage(e);
        if (const auto* coded = CodeOf(e)) first_code = coded->code();
      }
    }
  }
  if (first_error) ThrowCoded(first_code, *first_error);
}

void VoidFutureCollect::Wait(int64_t timeout_ms) {
  if (!WaitFor(timeout_ms)) ThrowTimeout(timeout_ms);
  Value();
}

void VoidFutureCollect::Wait() {
  while (!WaitFor(core::kMaxTimeoutMs)) {
  }
  Value();
}

bool VoidFutureCollect::WaitFor(int64_t timeout_ms) const {
  CheckTimeout(timeout_ms);
  if (consumed_) return true;  // (complete: its futures were read)
  const auto deadline = DeadlineIn(timeout_ms);
  for (const auto& future : futures_) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (!future->WaitFor(std::max<int64_t>(left.count(), 0))) return false;
  }
  return true;
}

bool VoidFutureCollect::IsReady() const {
  if (consumed_) return true;
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
  return KindWithin(/*crosses_processes=*/!tensor.device().is_cpu() && per_device_per_process);
}

c10::intrusive_ptr<TensorPromise> TensorPromiseFor(const at::Tensor& tensor,
                                                   bool per_device_per_process) {
  return c10::make_intrusive<TensorPromise>(PromiseKindFor(tensor, per_device_per_process));
}

}  // namespace dtorch
