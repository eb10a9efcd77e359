// Promise/future pairs as TorchScript custom classes (torch.classes.dtorch.*): the classes are
// declared in the public header (<dtorch/dtorch.h>, which states their semantics); this header
// adds what the library's own kernels and bindings use with them.
//
// A promise is the producer's end; GetFuture() hands out its single consumer end. Both are thin,
// thread-safe handles over a core backend of one kind (ops/kinds.h: "memory", the same process;
// "file", processes of one host; "network", hosts). Values: a memory TensorFuture yields the
// tensor the producer set, not a copy; the kinds that cross processes yield a copy (or a view of
// a shared one: ops/tensor_codec.h).
#pragma once

#include <string>

#include <dtorch/dtorch.h>

#include "../core/promise_future.h"

namespace dtorch {

namespace detail {
// The kernels that complete a promise later (the device get_tensor kernel, sync_into) reach its
// claim through this (Promise's private section says how a claim works).
template <typename T>
class ProducerAccess {
 public:
  // Refuses a value this promise's kind cannot carry (a device tensor in a file promise), before
  // anything is claimed by `caller`, and fails the promise with that refusal.
  static void CheckValue(Promise<T>& promise, const T& value, const char* caller) {
    promise.CheckValue(value, caller);
  }
  // Fails the promise with `error`, naming `caller` (a string literal) as its producer; throws as
  // SetValue does (a promise set already).
  static void SetError(Promise<T>& promise, const core::ErrorInfo& error, const char* caller) {
    promise.SetError(error, caller);
  }
  static void RegisterHolder(Promise<T>& promise) noexcept { promise.RegisterHolder(); }
  static bool CopiesValueOut(const Promise<T>& promise) { return promise.CopiesValueOut(); }
  static bool CompletesQuietly(const Promise<T>& promise) { return promise.CompletesQuietly(); }
  // SetValue, naming the op that fulfils the promise in a second completion's error (a string
  // literal: the claim keeps the pointer).
  static void SetValue(Promise<T>& promise, T value, const char* caller) {
    promise.SetValueFrom(std::move(value), caller);
  }
  // `producer` names the call (a string literal: it is kept).
  static void Claim(Promise<T>& promise, const char* producer) { promise.Claim(producer); }
  static void CompleteClaimed(Promise<T>& promise, T value) noexcept {
    promise.CompleteClaimed(std::move(value));
  }
  // Fails with a producer error (`message`), or with an error of `code` (a device error, a value
  // dropped at exit or fork).
  static void FailClaimed(Promise<T>& promise, const std::string& message) noexcept {
    promise.FailClaimed(message);
  }
  static void FailClaimed(Promise<T>& promise, FutureErrc code,
                          const std::string& detail) noexcept {
    promise.FailClaimed(code, detail);
  }
};
}  // namespace detail

// A c10::Error's message without its leading "dtorch: ", for nesting it in another message.
std::string NestedMessage(const c10::Error& error);
// The message of the exception being handled (call inside a catch block): NestedMessage for a
// c10::Error, what() for other std::exceptions.
std::string CurrentExceptionMessage();

}  // namespace dtorch
