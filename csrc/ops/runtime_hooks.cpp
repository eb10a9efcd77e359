#include "runtime_hooks.h"

#include "internal_api.h"

namespace dtorch {
namespace {
RuntimeHooks& Hooks() {
  static RuntimeHooks hooks;
  return hooks;
}
}  // namespace

void SetRuntimeHooks(const RuntimeHooks& hooks) { Hooks() = hooks; }
const RuntimeHooks& GetRuntimeHooks() { return Hooks(); }

}  // namespace dtorch
