// The internal exports (internal_api.h) over the core.
#include "internal_api.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "../core/completion_detectors.h"
#include "../core/completion_pool.h"
#include "../core/base/fork_generation.h"
#include "../core/promise_future.h"
#include "../core/ready_notifier.h"
#include "errors.h"
#include "futures.h"
#include "kinds.h"
#include "tensor_codec.h"

namespace dtorch {

ReadyNotifier::ReadyNotifier() : core_(std::make_shared<core::ReadyNotifier>()) {}
ReadyNotifier::~ReadyNotifier() = default;
int64_t ReadyNotifier::FileNo() const { return core_->fd(); }
std::vector<int64_t> ReadyNotifier::Drain() { return core_->Drain(); }

std::function<void()> ReadyPoster(const c10::intrusive_ptr<ReadyNotifier>& notifier,
                                  int64_t token) {
  TORCH_CHECK(notifier, "dtorch: notify_when_ready needs a ReadyNotifier, got None");
  // An event loop belongs to the process that registered it: a value failed in a fork child does
  // not post to the parent's loop (the eventfd is shared between them).
  return [weak = std::weak_ptr<core::ReadyNotifier>(notifier->core()), token,
          generation = core::ForkGeneration()] {
    if (generation != core::ForkGeneration()) return;
    if (const auto core = weak.lock()) core->Post(token);
  };
}

namespace internal {
namespace {

template <typename T>
void SetExceptionOf(const c10::intrusive_ptr<Promise<T>>& promise, const std::string& message,
                    const std::string& exception_type, const std::string& traceback,
                    std::shared_ptr<const core::NativeError> native) {
  TORCH_CHECK(promise, "dtorch: set_exception needs a promise, got None");
  TORCH_CHECK_VALUE(core::ValidExceptionType(exception_type),
                    "dtorch: set_exception: an exception type name is at most ",
                    core::kMaxExceptionTypeBytes, " of [A-Za-z0-9_.]");
  core::ErrorInfo error{core::FutureErrc::kProducerError, message};
  error.origin = {exception_type, traceback, std::move(native)};
  detail::ProducerAccess<T>::SetError(*promise, error, "set_exception");
}

}  // namespace

void SetExceptionObject(const c10::intrusive_ptr<TensorPromise>& promise,
                        const std::string& message, const std::string& exception_type,
                        const std::string& traceback,
                        std::shared_ptr<const core::NativeError> native) {
  SetExceptionOf(promise, message, exception_type, traceback, std::move(native));
}

void SetExceptionObject(const c10::intrusive_ptr<VoidPromise>& promise, const std::string& message,
                        const std::string& exception_type, const std::string& traceback,
                        std::shared_ptr<const core::NativeError> native) {
  SetExceptionOf(promise, message, exception_type, traceback, std::move(native));
}

void RegisterHolder(const c10::intrusive_ptr<TensorPromise>& promise) {
  if (promise) detail::ProducerAccess<at::Tensor>::RegisterHolder(*promise);
}

void RegisterHolder(const c10::intrusive_ptr<VoidPromise>& promise) {
  if (promise) detail::ProducerAccess<Unit>::RegisterHolder(*promise);
}

bool CompletesQuietly(const c10::intrusive_ptr<TensorPromise>& promise) {
  return promise && detail::ProducerAccess<at::Tensor>::CompletesQuietly(*promise);
}

bool CompletesQuietly(const c10::intrusive_ptr<VoidPromise>& promise) {
  return promise && detail::ProducerAccess<Unit>::CompletesQuietly(*promise);
}

std::function<void()> FailAfter(const c10::intrusive_ptr<VoidPromise>& promise,
                                int64_t timeout_ms, std::string detail) {
  TORCH_CHECK(promise, "dtorch: a timeout needs a promise, got None");
  TORCH_CHECK(timeout_ms >= 0, "dtorch: a timeout must be >= 0 ms, got ", timeout_ms);
  const auto when = std::chrono::steady_clock::now() +
                    std::chrono::milliseconds(std::min(timeout_ms, core::kMaxTimeoutMs));
  return core::CompletionPool::Instance().PostAt(
      when, [weak = c10::weak_intrusive_ptr<VoidPromise>(promise), detail = std::move(detail)] {
        const auto promise = weak.lock();
        if (!promise) return;
        try {
          detail::ProducerAccess<Unit>::SetError(
              *promise, core::ErrorInfo{core::FutureErrc::kTimeout, detail}, "the timeout");
        } catch (...) {
          // (Completed before the timeout: the value stays.)
        }
      });
}

c10::intrusive_ptr<TensorListFuture> FailedTensorListFuture(const std::string& message) {
  core::MemoryPromise<std::vector<at::Tensor>> promise;
  auto future = c10::make_intrusive<TensorListFuture>(promise.GetFuture(), promise.Kind());
  promise.SetError(core::FutureErrc::kProducerError, message);
  return future;
}

uint64_t ForkGeneration() { return core::ForkGeneration(); }

void PostInOrder(std::function<void()> work) {
  struct GenerationStrand {
    uint64_t generation;
    core::CompletionPool::Strand strand;
  };
  // One strand per fork generation (a parent's cannot be used in a child), replaced through
  // std::atomic_* on a shared_ptr rather than under a mutex. Leaked, like the pool: library
  // threads may still post after static destruction began.
  static auto* const current = new std::shared_ptr<const GenerationStrand>();
  auto strand = std::atomic_load(current);
  if (!strand || strand->generation != core::ForkGeneration()) {
    auto made = std::make_shared<const GenerationStrand>(
        GenerationStrand{core::ForkGeneration(), core::CompletionPool::Instance().MakeStrand()});
    if (std::atomic_compare_exchange_strong(current, &strand, made)) strand = made;
  }
  strand->strand.Post(std::move(work));
}

void StopLibraryThreads() { core::StopLibraryThreads(); }
std::map<std::string, size_t> CountLibraryThreads() { return core::CountLibraryThreads(); }
std::map<std::string, core::Diagnostics> LibraryDiagnostics() { return core::LibraryDiagnostics(); }


void FailDetectorThreadStartsForTesting(int count) {
  core::CompletionDetectors::Instance().FailThreadStartsForTesting(count);
}


void AtChildExit() {
  core::EndingWithoutExitHandler();
}


std::pair<std::string, std::string> EncodeTensorForTesting(const at::Tensor& value) {
  const auto codec = TensorCodec::ForSerialized("");
  codec->CheckValue(value);
  size_t payload_bytes = 0;
  std::string header = codec->Header(value, &payload_bytes);
  std::string payload(payload_bytes, '\0');
  codec->WritePayload(value, payload.data(), payload_bytes);
  return {std::move(header), std::move(payload)};
}

at::Tensor DecodeTensorForTesting(const std::string& header, const std::string& payload,
                                  const std::string& value_options) {
  try {
    auto bytes = std::make_shared<std::string>(payload);  // viewed by the tensor: kept alive
    return TensorCodec::ForSerialized(value_options)
        ->Read(header, bytes->empty() ? nullptr : bytes->data(), bytes->size(), bytes);
  } catch (const core::FutureError& e) {
    ThrowCoded(e);
  }
}

bool KindCrossesProcesses(std::string_view kind) {
  const core::KindInfo* info = FindKind(kind);
  return info != nullptr && info->crosses_processes;
}

std::vector<core::Setting> AllSettings() { return core::AllSettings(); }
int64_t GetSetting(const std::string& name) { return core::GetSetting(name); }
void SetSetting(const std::string& name, int64_t value) { core::SetSetting(name, value); }

}  // namespace internal
}  // namespace dtorch
