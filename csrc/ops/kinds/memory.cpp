// The memory kind's registration: the core's in-process pair (core/promise_future.h), for threads
// of one process; it takes no options and cannot be serialized.
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

#include <dtorch/dtorch.h>

#include "../../core/promise_future.h"
#include "../kinds.h"

namespace dtorch {
namespace {

constexpr char kMemory[] = "memory";

template <typename T>
typename core::KindRegistry<T>::Entry MemoryEntry() {
  return {[](std::string_view options) -> std::unique_ptr<core::PromiseBackend<T>> {
            if (!options.empty()) {
              throw std::invalid_argument("dtorch: " +
                                          std::string(detail::PairNames<T>::kPromise) +
                                          " kind '" + kMemory + "' takes no options");
            }
            return std::make_unique<core::MemoryPromise<T>>();
          },
          nullptr, ""};
}

const bool registered = RegisterKind(
    {{kMemory, /*crosses_processes=*/false, /*crosses_hosts=*/false},
     MemoryEntry<at::Tensor>(), MemoryEntry<core::Unit>()});

}  // namespace
}  // namespace dtorch
