// The file kind's registration (core/kinds/file/): processes of one host, over shared memory; a
// TensorPromise takes the tensor codec's options ("file://device=cpu", "file://zero_copy").
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <c10/util/Exception.h>

#include "../../core/kinds/file/file_kind.h"
#include "../internal_api.h"
#include "../kinds.h"
#include "../tensor_codec.h"

namespace dtorch {
namespace {

// The codecs of file pairs of T, from the options of a kind spec (a new pair) or of a serialized
// promise (core/kind_registry.h).
template <typename T>
struct FileCodecs;
template <>
struct FileCodecs<at::Tensor> {
  static std::shared_ptr<const TensorCodec> ForNewPair(std::string_view options) {
    return TensorCodec::ForNewPair(options);
  }
  static std::shared_ptr<const TensorCodec> ForSerialized(std::string_view value_options) {
    return TensorCodec::ForSerialized(value_options);
  }
  static std::string_view OptionsOf(const TensorCodec& codec) { return codec.Options(); }
};
template <>
struct FileCodecs<core::Unit> : VoidCodecs<FileCodecs<core::Unit>> {
  static constexpr char kKind[] = "file";
  static constexpr char kNoOptions[] = "takes no options";
};

template <typename T>
typename core::KindRegistry<T>::Entry FileEntry() {
  using Entry = RemoteKindEntry<T, core::FileKind, FileCodecs<T>>;
  return Entry::Make(
      [](std::string_view options) { return Entry::New(FileCodecs<T>::ForNewPair(options)); });
}

const bool registered = RegisterKind(
    {{"file", /*crosses_processes=*/true, /*crosses_hosts=*/false}, FileEntry<at::Tensor>(),
     FileEntry<core::Unit>()});

}  // namespace

namespace internal {
void HoldFilePromiseLockForTesting(const std::string& serialized) {
  const std::string prefix = core::SerializedPrefix("file");
  TORCH_CHECK(serialized.rfind(prefix, 0) == 0, "not a serialized file promise");
  core::HoldFilePromiseLockForTesting(
      core::FileHandle::Parse(std::string_view(serialized).substr(prefix.size()), "tensor"));
}
}  // namespace internal

}  // namespace dtorch
