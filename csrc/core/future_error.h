// Typed errors of the promise/future core (torch-free).
//
// Modelled on std::future_errc and folly's BrokenPromise / PromiseAlreadySatisfied /
// FutureAlreadyRetrieved: every failure a caller can see has a code, so the torch glue and
// the Python layer can map it (a timeout becomes Python's TimeoutError, for instance) without
// parsing messages.
#pragma once

#include <stdexcept>
#include <string>

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

class FutureError : public std::runtime_error {
 public:
  FutureError(FutureErrc code, const std::string& detail)
      : std::runtime_error(std::string("dtorch: ") + FutureErrcName(code) + ": " + detail),
        code_(code),
        detail_(detail) {}

  FutureErrc code() const noexcept { return code_; }
  // The message without the "dtorch: <code>: " prefix (for a producer error: the producer's text).
  const std::string& detail() const noexcept { return detail_; }

 private:
  FutureErrc code_;
  std::string detail_;
};

// The detail of kNotReady, for every kind.
inline constexpr const char* kNotReadyDetail =
    "value() reads a completed future; wait for it first (wait(), await, or a done callback), "
    "or use get(), which blocks";

}  // namespace dtorch::core
