#include "errors.h"

#include <c10/util/Exception.h>

namespace dtorch {

CodedErrorBase::~CodedErrorBase() = default;

void ThrowCoded(core::FutureErrc code, const std::string& message,
                const core::ErrorOrigin& origin, const std::string& detail) {
  switch (code) {
    case core::FutureErrc::kCannotLeaveProcess:
      // TypeError, as Python's own unpicklable objects raise (pickle's callers catch that one).
      throw CodedError<c10::TypeError>(code, message);
    case core::FutureErrc::kInvalidHandle:
      throw CodedError<c10::ValueError>(code, message);
    default: {
      CodedError<c10::Error> error(code, message);
      if (!origin.empty()) {
        error.SetOrigin(origin.exception_type, detail, origin.traceback, origin.native);
      }
      throw error;
    }
  }
}

}  // namespace dtorch
