#include "kinds.h"

#include <vector>

#include <c10/util/Exception.h>

#include <dtorch/dtorch.h>  // detail::PairNames

namespace dtorch {
namespace {

template <typename T>
core::KindRegistry<T>& MutableKinds() {
  static auto* registry = new core::KindRegistry<T>(detail::PairNames<T>::kPromise);  // leaked
  return *registry;
}

std::vector<core::KindInfo>& Infos() {
  static auto* infos = new std::vector<core::KindInfo>();  // leaked: read until the end
  return *infos;
}

}  // namespace

bool RegisterKind(KindGlue glue) {
  MutableKinds<at::Tensor>().Register(glue.info.name, std::move(glue.tensor));
  MutableKinds<core::Unit>().Register(glue.info.name, std::move(glue.unit));
  Infos().push_back(std::move(glue.info));
  return true;
}

template <typename T>
const core::KindRegistry<T>& Kinds() {
  return MutableKinds<T>();
}
template const core::KindRegistry<at::Tensor>& Kinds<at::Tensor>();
template const core::KindRegistry<core::Unit>& Kinds<core::Unit>();

const core::KindInfo* FindKind(std::string_view name) {
  for (const auto& info : Infos()) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

std::string KindWithin(bool crosses_processes) {
  for (const auto& info : Infos()) {
    if (info.crosses_processes == crosses_processes && !info.crosses_hosts) return info.name;
  }
  TORCH_INTERNAL_ASSERT(false, "no kind registered that crosses processes: ", crosses_processes);
}

}  // namespace dtorch
