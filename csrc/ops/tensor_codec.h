// The tensor codec: how a file promise writes a tensor into shared memory and how its consumer
// makes a tensor of it (core/value_codec.h), so that the transport stays torch-free.
//
// What travels: CPU tensors with the strided layout, every dtype of a closed set (no quantized
// ones), any shape and strides. The values are copied once, when the producer sets the promise;
// a tensor whose elements are dense in memory (contiguous, channels-last, any permutation) keeps
// its strides, any other (a slice with gaps, an expanded view) arrives contiguous. The consumer's
// tensor is a view of the shared payload, which stays mapped for as long as the tensor lives.
#pragma once

#include <ATen/core/Tensor.h>

#include "../core/value_codec.h"

namespace dtorch {

class TensorCodec final : public core::ValueCodec<at::Tensor> {
 public:
  std::string_view TypeName() const override { return "tensor"; }
  void CheckValue(const at::Tensor& value) const override;
  std::string Header(const at::Tensor& value, size_t* payload_bytes) const override;
  void WritePayload(const at::Tensor& value, void* payload, size_t payload_bytes) const override;
  at::Tensor Read(std::string_view header, void* payload, size_t payload_bytes,
                  std::shared_ptr<void> keep_alive) const override;
};

}  // namespace dtorch
