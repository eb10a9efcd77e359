// The network kind's registration (core/kinds/network/): hosts, over a torch.distributed store
// ("network://host:port[?device=cpu]"); the store itself is reached through c10d
// (network_store.cpp).
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <dtorch/dtorch.h>

#include "../../core/kinds/network/network_kind.h"
#include "../kinds.h"
#include "../tensor_codec.h"

namespace dtorch {
namespace {

// The codecs of network pairs of T: a value crosses hosts as bytes (no device IPC), arriving on
// the producer's device type when the consumer has it (kStaged), or on the CPU ("device=cpu").
template <typename T>
struct NetworkCodecs;
template <>
struct NetworkCodecs<at::Tensor> {
  static std::shared_ptr<const TensorCodec> ForNewPair(std::string_view options) {
    if (options.empty()) return std::make_shared<const TensorCodec>(TensorCodec::Delivery::kStaged);
    if (options == "device=cpu") {
      return std::make_shared<const TensorCodec>(TensorCodec::Delivery::kCpu);
    }
    throw std::invalid_argument("dtorch: TensorPromise kind 'network' takes the option "
                                "device=cpu after the store's address (\"network://host:port"
                                "?device=cpu\"), got '" + std::string(options.substr(0, 64)) + "'");
  }
  static std::shared_ptr<const TensorCodec> ForSerialized(std::string_view value_options) {
    try {
      return ForNewPair(value_options);
    } catch (const std::invalid_argument&) {
      throw core::FutureError(core::FutureErrc::kInvalidHandle,
                              "a serialized network TensorPromise with unknown value options");
    }
  }
  static std::string_view OptionsOf(const TensorCodec& codec) { return codec.Options(); }
};
template <>
struct NetworkCodecs<core::Unit> : VoidCodecs<NetworkCodecs<core::Unit>> {
  static constexpr char kKind[] = "network";
  static constexpr char kNoOptions[] =
      "takes only the store's address (\"network://host:port\")";
};

// "network://host:port[?<value options>]"
template <typename T>
typename core::KindRegistry<T>::Entry NetworkEntry() {
  using Entry = RemoteKindEntry<T, core::NetworkKind, NetworkCodecs<T>>;
  return Entry::Make([](std::string_view options) {
    if (options.empty()) {
      throw std::invalid_argument(
          "dtorch: " + std::string(detail::PairNames<T>::kPromise) +
          " kind 'network' needs its store's address: \"network://host:port\" "
          "(Python: kind=\"network\", store=a TCPStore or \"host:port\")");
    }
    const auto query = options.find('?');
    const auto store = core::StoreAddress::Parse(options.substr(0, query));
    return Entry::New(NetworkCodecs<T>::ForNewPair(
                          query == std::string_view::npos ? std::string_view()
                                                          : options.substr(query + 1)),
                      store);
  });
}

const bool registered = RegisterKind(
    {{"network", /*crosses_processes=*/true, /*crosses_hosts=*/true}, NetworkEntry<at::Tensor>(),
     NetworkEntry<core::Unit>()});

}  // namespace
}  // namespace dtorch
