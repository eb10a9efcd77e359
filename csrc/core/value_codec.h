// ValueCodec<T>: how the kinds that cross processes write a value out (into shared memory, or
// bytes for the network) and make a value of what they read back (torch-free interface; the tensor codec is torch glue,
// ops/tensor_codec.h), so that the transport itself never needs to know what a value is.
//
// A value travels as a header (at most kMaxValueHeaderBytes: a tensor's dtype, sizes, strides)
// and a payload (its bytes, possibly none). What a reader gets came from another process: Read
// checks everything before it builds a value.
//
// Thread-safety: codecs are stateless; every method may be called from any thread.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include <dtorch/types.h>  // Unit

#include "future_error.h"

namespace dtorch::core {

using ::dtorch::Unit;

inline constexpr size_t kMaxValueHeaderBytes = 1088;

template <typename T>
class ValueCodec {
 public:
  virtual ~ValueCodec() = default;
  // Names the value type in serialized promises ("tensor", "void").
  virtual std::string_view TypeName() const = 0;
  // Throws (saying what to do instead) for a value this codec cannot carry.
  virtual void CheckValue(const T& value) const = 0;
  // The header of `value`, and (in *payload_bytes) the size of its payload.
  virtual std::string Header(const T& value, size_t* payload_bytes) const = 0;
  // Writes the payload of `value` (payload_bytes of them, as Header said) to `payload`.
  virtual void WritePayload(const T& value, void* payload, size_t payload_bytes) const = 0;
  // The payload of `value` where its own memory holds exactly it (payload_bytes of them, in the
  // payload's order; a CPU tensor that is dense): sent from there, not copied. Null otherwise.
  virtual const void* PayloadInPlace(const T& /*value*/, size_t /*payload_bytes*/) const {
    return nullptr;
  }
  // What the producer must keep alive until the consumer has released the value's payload (or
  // died): a device block the payload only names, which the consumer maps. Null when the payload
  // holds the value itself.
  virtual std::shared_ptr<void> KeepUntilReleased(const T& /*value*/) const { return nullptr; }
  // The payload size `header` implies (untrusted: another process wrote it), so that a reader can
  // check what it is told of a payload's size before it receives the bytes. Throws
  // FutureError(kInvalidHandle) for a header Read would refuse.
  virtual size_t PayloadBytes(std::string_view header) const = 0;
  // The value of a header and payload another process wrote (untrusted). `payload` (null when
  // there are no bytes) is kept alive by `keep_alive` for as long as the value needs it. Throws
  // FutureError(kInvalidHandle) for anything out of bounds.
  virtual T Read(std::string_view header, void* payload, size_t payload_bytes,
                 std::shared_ptr<void> keep_alive) const = 0;
};

// The codec of completion-only pairs (VoidPromise), for every kind: no header, no payload.
class UnitCodec final : public ValueCodec<Unit> {
 public:
  std::string_view TypeName() const override { return "void"; }
  void CheckValue(const Unit&) const override {}
  std::string Header(const Unit&, size_t* payload_bytes) const override {
    *payload_bytes = 0;
    return {};
  }
  void WritePayload(const Unit&, void*, size_t) const override {}
  size_t PayloadBytes(std::string_view header) const override {
    if (!header.empty()) throw FutureError(FutureErrc::kInvalidHandle, "a void value with a header");
    return 0;
  }
  Unit Read(std::string_view header, void*, size_t payload_bytes,
            std::shared_ptr<void>) const override {
    if (!header.empty() || payload_bytes != 0) {
      throw FutureError(FutureErrc::kInvalidHandle, "a void value with a header or payload");
    }
    return {};
  }
};

}  // namespace dtorch::core
