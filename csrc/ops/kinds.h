// The kinds promises are made of, as the torch glue sees them: each kind's glue file
// (ops/kinds/<name>.cpp) registers it once, with what the kind is (core::KindInfo) and how to make
// and deserialize its TensorPromise and VoidPromise backends with their codecs. Nothing outside
// those files names a kind.
//
// Lifetime: kinds register from static initializers of the library (RegisterKind returns true,
// for `const bool registered = RegisterKind(...)`), before any promise is made.
//
// Thread-safety: filled while the library loads, read-only after: every function may be called
// from any thread.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <ATen/core/Tensor.h>

#include "../core/future_error.h"
#include "../core/kind_registry.h"
#include "../core/remote_promise.h"
#include "../core/value_codec.h"

namespace dtorch {

struct KindGlue {
  core::KindInfo info;
  core::KindRegistry<at::Tensor>::Entry tensor;
  core::KindRegistry<core::Unit>::Entry unit;
};

bool RegisterKind(KindGlue glue);

// The registry of promises of T (at::Tensor or core::Unit).
template <typename T>
const core::KindRegistry<T>& Kinds();

// What the kind named `name` is; null for a name no kind has.
const core::KindInfo* FindKind(std::string_view name);

// The kind a pair gets when its promise must (or need not) reach other processes of this host:
// the registered kind that crosses processes (or not) and not hosts.
std::string KindWithin(bool crosses_processes);

// The codecs of VoidPromises of kind `Derived::kKind` (every kind's void values are the same: no
// header, no payload, no options), from the options of a kind spec or of a serialized promise.
// `Derived::kNoOptions` says what the kind takes instead of options.
template <typename Derived>
struct VoidCodecs {
  static std::shared_ptr<const core::UnitCodec> ForNewPair(std::string_view options) {
    if (!options.empty()) {
      throw std::invalid_argument(std::string("dtorch: VoidPromise kind '") + Derived::kKind +
                                  "' " + Derived::kNoOptions);
    }
    static const auto codec = std::make_shared<const core::UnitCodec>();
    return codec;
  }
  static std::shared_ptr<const core::UnitCodec> ForSerialized(std::string_view value_options) {
    if (!value_options.empty()) {
      throw core::FutureError(core::FutureErrc::kInvalidHandle,
                              std::string("a serialized ") + Derived::kKind +
                                  " VoidPromise with value options");
    }
    return ForNewPair("");
  }
  static std::string_view OptionsOf(const core::UnitCodec&) { return {}; }
};

// The registry entry of a kind whose pairs cross processes: its promises are
// core::RemotePromise<T, K> over the kind's traits K, with codecs from `Codecs` (ForNewPair,
// ForSerialized, OptionsOf). `create` makes a new pair from a kind spec's options (with New); a
// serialized promise is a K::Handle (K::Handle::Parse, given the type name of the value it must
// carry), its codec made of the handle's value options.
template <typename T, typename K, typename Codecs>
struct RemoteKindEntry {
  // A new pair: RemotePromise<T, K>(codec, where..., the codec's options, which its serialized
  // promises carry), `where` what the kind needs besides (a store's address; nothing).
  template <typename Codec, typename... Where>
  static std::unique_ptr<core::PromiseBackend<T>> New(const std::shared_ptr<const Codec>& codec,
                                                      const Where&... where) {
    return std::make_unique<core::RemotePromise<T, K>>(codec, where..., Codecs::OptionsOf(*codec));
  }
  static std::unique_ptr<core::PromiseBackend<T>> Deserialize(std::string_view rest) {
    auto handle = K::Handle::Parse(rest, Codecs::ForSerialized("")->TypeName());
    auto codec = Codecs::ForSerialized(handle.value_options);
    return std::make_unique<core::RemotePromise<T, K>>(std::move(handle), std::move(codec));
  }
  static typename core::KindRegistry<T>::Entry Make(
      typename core::KindRegistry<T>::Factory create) {
    return {std::move(create), &Deserialize, ""};
  }
};

}  // namespace dtorch
