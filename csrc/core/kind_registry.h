// The promise kinds and how to make them (torch-free): a registry mapping each kind's name to its
// factory and deserializer, filled by the kinds themselves (ops/kinds.h), and the format of a
// serialized promise.
//
// A kind spec is the kind's name, optionally followed by "://" and its options (the one string
// TorchScript and C++ pass: "memory", "file", "network://host:port"); Python passes the same
// options as keyword arguments. A serialized promise is "dtorch-promise:<version>:<kind>:<rest>",
// where <rest> belongs to the kind's deserializer.
//
// Thread-safety: a registry is filled once, before first use, and read-only after.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "future_error.h"
#include "promise_future.h"

namespace dtorch::core {

// What a kind is, for the code that chooses or describes kinds (how it works is the kind's own).
struct KindInfo {
  std::string name;  // in kind specs and serialized promises: lower-case letters
  bool crosses_processes = false;  // its promise may be set in another process of the host
  bool crosses_hosts = false;      // ... or on another host
};

inline constexpr std::string_view kSerializedMagic = "dtorch-promise";
inline constexpr std::string_view kSerializedVersion = "1";
// Serialized promises longer than this are refused before they are parsed.
inline constexpr size_t kMaxSerializedBytes = 512;

// "dtorch-promise:1:<kind>:" — what every serialized promise starts with.
inline std::string SerializedPrefix(std::string_view kind) {
  return std::string(kSerializedMagic) + ":" + std::string(kSerializedVersion) + ":" +
         std::string(kind) + ":";
}

template <typename T>
class KindRegistry {
 public:
  // Makes a promise of the kind from its options (the part after "://"; empty without).
  using Factory = std::function<std::unique_ptr<PromiseBackend<T>>(std::string_view options)>;
  // Rebuilds a promise from what follows "dtorch-promise:1:<kind>:" (untrusted input: validate
  // it all, throw FutureError(kInvalidHandle)). Null for kinds that cannot leave the process.
  using Deserializer = std::function<std::unique_ptr<PromiseBackend<T>>(std::string_view rest)>;
  struct Entry {
    Factory create;  // throws std::invalid_argument for options it does not take
    Deserializer deserialize;
    // Set instead of the functions for a kind this build does not have yet: why, and what to do.
    std::string unavailable;
  };

  // `type_name` names the pair in errors ("TensorPromise").
  explicit KindRegistry(std::string type_name) : type_name_(std::move(type_name)) {}

  void Register(std::string_view kind, Entry entry) {
    entries_.emplace(std::string(kind), std::move(entry));
  }

  std::unique_ptr<PromiseBackend<T>> Create(std::string_view spec) const {
    const auto separator = spec.find("://");
    const std::string_view name = spec.substr(0, separator);
    const std::string_view options =
        separator == std::string_view::npos ? std::string_view() : spec.substr(separator + 3);
    return Find(name, spec).create(options);
  }

  std::unique_ptr<PromiseBackend<T>> Deserialize(std::string_view serialized) const {
    if (serialized.size() > kMaxSerializedBytes) {
      throw FutureError(FutureErrc::kInvalidHandle,
                        "a serialized " + type_name_ + " is at most " +
                            std::to_string(kMaxSerializedBytes) + " bytes, got " +
                            std::to_string(serialized.size()));
    }
    const std::string head = std::string(kSerializedMagic) + ":";
    if (serialized.substr(0, head.size()) != head) {
      throw FutureError(FutureErrc::kInvalidHandle,
                        "not a serialized " + type_name_ + " (it does not start with '" + head +
                            "'); pass the string from serialize()");
    }
    std::string_view rest = serialized.substr(head.size());
    const auto version_end = rest.find(':');
    if (rest.substr(0, version_end) != kSerializedVersion) {
      throw FutureError(FutureErrc::kInvalidHandle,
                        "a serialized " + type_name_ + " of another format version (this "
                        "build reads version " + std::string(kSerializedVersion) +
                            "): serialize and deserialize with the same dtorch_ops");
    }
    rest = version_end == std::string_view::npos ? std::string_view() : rest.substr(version_end + 1);
    const auto kind_end = rest.find(':');
    if (kind_end == std::string_view::npos) {
      throw FutureError(FutureErrc::kInvalidHandle,
                        "a serialized " + type_name_ + " without a kind");
    }
    const std::string_view kind = rest.substr(0, kind_end);
    auto it = entries_.find(std::string(kind));
    if (it == entries_.end() || !it->second.deserialize) {
      throw FutureError(FutureErrc::kInvalidHandle,
                        "a serialized " + type_name_ + " of kind '" + Printable(kind) +
                            "', which cannot be deserialized (" + KnownKinds() + ")");
    }
    return it->second.deserialize(rest.substr(kind_end + 1));
  }

 private:
  const Entry& Find(std::string_view name, std::string_view spec) const {
    auto it = entries_.find(std::string(name));
    if (it == entries_.end()) {
      throw std::invalid_argument("dtorch: unknown " + type_name_ + " kind '" + Printable(spec) +
                                  "'; expected " + KnownKinds());
    }
    if (!it->second.unavailable.empty()) {
      throw std::invalid_argument("dtorch: " + type_name_ + " kind '" + std::string(name) + "' " +
                                  it->second.unavailable);
    }
    return it->second;
  }

  std::string KnownKinds() const {
    std::string known;
    for (const auto& [name, entry] : entries_) {
      known += (known.empty() ? "\"" : ", \"") + name + "\"";
    }
    return known;
  }

  // At most 64 characters of untrusted text, with control characters escaped.
  static std::string Printable(std::string_view text) {
    std::string out;
    for (const char c : text.substr(0, 64)) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        out += "\\x";
        out += "0123456789abcdef"[(c >> 4) & 0xf];
        out += "0123456789abcdef"[c & 0xf];
      } else {
        out += c;
      }
    }
    return text.size() > 64 ? out + "..." : out;
  }

  const std::string type_name_;
  std::map<std::string, Entry> entries_;
};

}  // namespace dtorch::core
