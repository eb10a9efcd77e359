// The core's typed errors (core::FutureError) as c10 errors that keep their code.
//
// TorchScript and torch.ops see a c10::Error (RuntimeError; TypeError for a promise that cannot
// leave its process, ValueError for a malformed serialized promise); C++ users read the code with
// dtorch::CodeOf (<dtorch/dtorch.h>); dtorch_ops._C maps it to one of dtorch_ops.errors' exception
// classes (all subclasses of those), never reading the message.
#pragma once

#include <string>

#include <dtorch/dtorch.h>

#include "../core/future_error.h"

namespace dtorch {

template <typename Base>
class CodedError final : public Base, public CodedErrorBase {
 public:
  CodedError(core::FutureErrc code, const std::string& message)
      : Base(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message),
        CodedErrorBase(code) {}
};

// Throws `message` as the c10 error of `code` ("dtorch: <cause>: <detail>" is FutureError's);
// a producer's exception keeps its `origin` (and `detail`, its message) on the coded error.
[[noreturn]] void ThrowCoded(core::FutureErrc code, const std::string& message,
                             const core::ErrorOrigin& origin = {}, const std::string& detail = {});
[[noreturn]] inline void ThrowCoded(const core::FutureError& error) {
  ThrowCoded(error.code(), error.what(), error.origin(), error.detail());
}

// A wait of `timeout` (as the caller wrote it, with its unit: "5000 ms", "1.5 s") that ended
// before the value arrived.
inline core::FutureError TimedOut(const std::string& timeout) {
  return core::FutureError(core::FutureErrc::kTimeout,
                           "the value was not ready within " + timeout +
                               "; the future is still valid, wait again");
}

}  // namespace dtorch
