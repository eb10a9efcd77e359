// Typed errors of the promise/future core (torch-free).
//
// Modelled on std::future_errc and folly's BrokenPromise / PromiseAlreadySatisfied /
// FutureAlreadyRetrieved: every failure a caller can see has a code, so the torch glue and
// the Python layer can map it (a timeout becomes Python's TimeoutError, for instance) without
// parsing messages.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include <dtorch/types.h>

namespace dtorch::core {

// The codes are public (dtorch/types.h): C++ users read them from a c10::Error.
using ::dtorch::FutureErrc;
inline constexpr FutureErrc kLastFutureErrc = FutureErrc::kNotReady;

// Short, stable name of a code ("broken promise", ...); used as the message prefix.
inline const char* FutureErrcName(FutureErrc code) {
  switch (code) {
    case FutureErrc::kBrokenPromise: return "broken promise";
    case FutureErrc::kPromiseAlreadySatisfied: return "promise already satisfied";
    case FutureErrc::kFutureAlreadyRetrieved: return "future already retrieved";
    case FutureErrc::kNoState: return "no value: the future was already consumed";
    case FutureErrc::kTimeout: return "timed out";
    case FutureErrc::kProducerError: return "producer error";
    case FutureErrc::kDeviceError: return "device error";
    case FutureErrc::kDroppedAtExit: return "dropped at interpreter exit";
    case FutureErrc::kDroppedAtFork: return "dropped at fork";
    case FutureErrc::kCannotLeaveProcess: return "cannot leave the process";
    case FutureErrc::kInvalidHandle: return "invalid serialized promise";
    case FutureErrc::kSharedMemory: return "shared memory";
    case FutureErrc::kNotReady: return "not ready";
  }
  return "unknown future error";
}

// Stable identifier of a code ("broken_promise", ...): how the Python layer picks the exception
// class (dtorch_ops.errors) without reading messages.
inline const char* FutureErrcId(FutureErrc code) {
  switch (code) {
    case FutureErrc::kBrokenPromise: return "broken_promise";
    case FutureErrc::kPromiseAlreadySatisfied: return "promise_already_satisfied";
    case FutureErrc::kFutureAlreadyRetrieved: return "future_already_retrieved";
    case FutureErrc::kNoState: return "no_state";
    case FutureErrc::kTimeout: return "timeout";
    case FutureErrc::kProducerError: return "producer_error";
    case FutureErrc::kDeviceError: return "device_error";
    case FutureErrc::kDroppedAtExit: return "dropped_at_exit";
    case FutureErrc::kDroppedAtFork: return "dropped_at_fork";
    case FutureErrc::kCannotLeaveProcess: return "cannot_leave_process";
    case FutureErrc::kInvalidHandle: return "invalid_handle";
    case FutureErrc::kSharedMemory: return "shared_memory";
    case FutureErrc::kNotReady: return "not_ready";
  }
  return "unknown";
}

// An exception object of the language binding that set it (Python's set_exception(exc)), opaque
// to the core: a consumer in the same process raises that very object. It never leaves the
// process. The binding derives from it; its destructor may run on any thread.
class NativeError {
 public:
  virtual ~NativeError() = default;
};

// What a producer's exception says beyond its code and detail (kProducerError, set from an
// exception): its type's name in the producer's language ("ValueError", "torch.OutOfMemoryError";
// [A-Za-z0-9_.], at most kMaxExceptionTypeBytes), the producer's traceback text (may be empty,
// cut to the kinds' limits), and, in the process that set it, the object itself. Types and
// tracebacks travel between processes; the object does not.
struct ErrorOrigin {
  std::string exception_type;
  std::string traceback;
  std::shared_ptr<const NativeError> native;

  bool empty() const noexcept { return exception_type.empty() && traceback.empty() && !native; }
};

inline constexpr size_t kMaxExceptionTypeBytes = 127;

// Whether `name` may be an ErrorOrigin::exception_type (what another process sent is checked).
inline bool ValidExceptionType(const std::string& name) {
  if (name.size() > kMaxExceptionTypeBytes) return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.';
    if (!ok) return false;
  }
  return true;
}

class FutureError : public std::runtime_error {
 public:
  FutureError(FutureErrc code, const std::string& detail, ErrorOrigin origin = {})
      : std::runtime_error(std::string("dtorch: ") + FutureErrcName(code) + ": " + detail),
        code_(code),
        detail_(detail),
        origin_(std::move(origin)) {}

  FutureErrc code() const noexcept { return code_; }
  // The message without the "dtorch: <code>: " prefix (for a producer error: the producer's text).
  const std::string& detail() const noexcept { return detail_; }
  // For a producer error set from an exception (empty otherwise).
  const ErrorOrigin& origin() const noexcept { return origin_; }

 private:
  FutureErrc code_;
  std::string detail_;
  ErrorOrigin origin_;
};

// The details of kNoState and kFutureAlreadyRetrieved for a second get() / get_future(), and of
// kNotReady, for every kind. Python and TorchScript name the methods in snake_case, C++ in
// CamelCase: each message gives both where they differ.
inline constexpr const char* kConsumedDetail =
    "get() (C++: Get()) was already called on this future; a future yields its value once";
inline constexpr const char* kFutureRetrievedDetail =
    "get_future() (C++: GetFuture()) was already called on this promise; it has one future";
inline constexpr const char* kNotReadyDetail =
    "value() (C++: Value()) reads a completed future; wait for it first (wait(), await, or a "
    "done callback; C++: Wait(), IsReady()), or use get() (C++: Get()), which blocks";

}  // namespace dtorch::core
