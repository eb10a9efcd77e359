// Result<T>: one completion of a promise, a value or an error with a typed code (torch-free).
//
// As folly's Try<T>: what a producer hands to PromiseBackend::Complete and what a future yields,
// so every kind carries errors the same way (a code the Python layer maps to an exception type,
// and a detail for the message) and nobody recognises an error by its text.
#pragma once

#include <string>
#include <utility>
#include <variant>

#include "future_error.h"

namespace dtorch::core {

struct ErrorInfo {
  FutureErrc code;
  std::string detail;
  ErrorOrigin origin = {};  // a producer's exception: its type, traceback, object

  FutureError ToException() const { return FutureError(code, detail, origin); }
};

template <typename T>
class Result {
 public:
  static Result Value(T value) { return Result(std::in_place_index<0>, std::move(value)); }
  static Result Error(FutureErrc code, std::string detail) {
    return Result(std::in_place_index<1>, ErrorInfo{code, std::move(detail)});
  }
  static Result Error(ErrorInfo error) { return Result(std::in_place_index<1>, std::move(error)); }

  bool ok() const noexcept { return state_.index() == 0; }
  // Preconditions: ok() for value(), !ok() for error().
  T& value() { return std::get<0>(state_); }
  const T& value() const { return std::get<0>(state_); }
  const ErrorInfo& error() const { return std::get<1>(state_); }

  // The value, moved out; or throws the error as a FutureError.
  T TakeOrThrow() {
    if (!ok()) throw error().ToException();
    return std::move(value());
  }
  // A copy of the value; or throws the error as a FutureError. Changes nothing.
  T CopyOrThrow() const {
    if (!ok()) throw error().ToException();
    return value();
  }

 private:
  template <size_t I, typename V>
  Result(std::in_place_index_t<I> index, V&& v) : state_(index, std::forward<V>(v)) {}

  std::variant<T, ErrorInfo> state_;
};

}  // namespace dtorch::core
