// A serialized file promise: "dtorch-promise:1:file:<type>:<segment>:<nonce>[:<options>]",
// written and parsed (untrusted input: every field bounded and checked).
#include "../../boost_config.h"  // first: checks the Boost version

#include "control_block.h"
#include "../../kind_registry.h"

namespace dtorch::core {
using namespace file_internal;

std::string FileHandle::Serialize() const {
  std::string serialized = SerializedPrefix(FileKind::kName) + type_name + ":" + segment + ":" + nonce_hex;
  if (!value_options.empty()) serialized += ":" + value_options;
  return serialized;
}

FileHandle FileHandle::Parse(std::string_view rest, std::string_view expected_type) {
  const auto bad = [](const std::string& why) {
    return FutureError(FutureErrc::kInvalidHandle,
                       "a serialized file promise " + why + "; pass the string from serialize()");
  };
  FileHandle handle;
  const auto first = rest.find(':');
  const auto second = first == std::string_view::npos ? first : rest.find(':', first + 1);
  const auto third = second == std::string_view::npos ? second : rest.find(':', second + 1);
  if (second == std::string_view::npos ||
      (third != std::string_view::npos && rest.find(':', third + 1) != std::string_view::npos)) {
    throw bad("has the wrong number of fields (expected <type>:<segment>:<nonce>[:<options>])");
  }
  handle.type_name = std::string(rest.substr(0, first));
  handle.segment = std::string(rest.substr(first + 1, second - first - 1));
  handle.nonce_hex = std::string(rest.substr(second + 1, third - second - 1));
  if (third != std::string_view::npos) {
    handle.value_options = std::string(rest.substr(third + 1));
    if (handle.value_options.empty() || !ValidValueOptions(handle.value_options)) {
      throw bad("has malformed value options");
    }
  }
  if (handle.type_name != expected_type) {
    throw bad("carries another value type than this promise's '" + std::string(expected_type) +
              "', not a " + std::string(expected_type) + " one (TensorPromise and VoidPromise "
              "are not interchangeable)");
  }
  if (!shm::ParseSegmentName(handle.segment)) throw bad("names no segment of dtorch's form");
  unsigned char nonce[kNonceBytes];
  if (!ParseHex(handle.nonce_hex, nonce, kNonceBytes)) throw bad("has a malformed nonce");
  return handle;
}

}  // namespace dtorch::core
