// Torch-free types of the public API, shared with the library's core.
#pragma once

namespace dtorch {

// The value of a completion-only pair (VoidPromise / VoidFuture): there is none.
struct Unit {};

// Why a promise or future failed (dtorch::CodeOf(error)->code() in C++; in Python, the class of
// dtorch_ops.errors raised). Modelled on std::future_errc and folly's BrokenPromise /
// PromiseAlreadySatisfied / FutureAlreadyRetrieved: every failure a caller can see has one, so
// that no caller parses messages. Append only: the file kind carries codes between processes.
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
  kCannotLeaveProcess,       // a promise of a same-process kind was serialized (pickle, jit.save)
  kInvalidHandle,            // a serialized promise is malformed, tampered with or of another type
  kSharedMemory,             // the shared-memory transport failed (/dev/shm full, a segment gone)
  kNotReady,                 // Value() on a future not complete yet (never crosses processes)
};

}  // namespace dtorch
