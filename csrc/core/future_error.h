// Typed errors of the promise/future core (torch-free).
//
// Modelled on std::future_errc and folly's BrokenPromise / PromiseAlreadySatisfied /
// FutureAlreadyRetrieved: every failure a caller can see has a code, so the torch glue and
// the Python layer can map it (a timeout becomes Python's TimeoutError, for instance) without
// parsing messages.
#pragma once

#include <stdexcept>
#include <string>

namespace dtorch::core {

enum class FutureErrc {
  kBrokenPromise,            // the promise was destroyed without a value or an exception
  kPromiseAlreadySatisfied,  // a second SetValue/SetException on the same promise
  kFutureAlreadyRetrieved,   // GetFuture() called twice on one promise
  kNoState,                  // the value was already taken by Get(); the future is no longer valid
  kTimeout,                  // Wait(timeout) elapsed before the value arrived
  kProducerError,            // the producer called SetException(message)
  kDeviceError,              // the device reported an error for the work that produces the value
  kDroppedAtExit,            // the value was still pending when the library stopped at exit
  kDroppedAtFork,            // the value was pending in the parent when this process was forked
};

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
  }
  return "unknown future error";
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

}  // namespace dtorch::core
