// The tensor codec of every kind that crosses processes: how a producer writes a tensor out (into
// a file pair's shared memory, or a network pair's bytes) and how its consumer makes a tensor of
// it (core/value_codec.h), so that the transports stay torch-free.
//
// What travels: strided tensors of every dtype of a closed set (no quantized ones), any shape and
// strides, on the CPU or on a device. The values are copied once, when the producer completes the
// promise; a tensor whose elements are dense in memory (contiguous, channels-last, any
// permutation) keeps its strides, any other (a slice with gaps, an expanded view) arrives
// contiguous.
//
// How a value travels, and what the consumer receives (the consumer's delivery, chosen when it
// creates the pair and carried in the serialized promise):
// - CPU tensors: the bytes, in the payload; the consumer's tensor is a view of the shared
//   payload, which stays mapped for as long as the tensor lives.
// - Device tensors (the producer passes a snapshot whose device work has finished):
//   - to a consumer that can open the device's IPC memory (DeviceIpc, CUDA), by default: the
//     payload names the snapshot's device memory; the consumer copies it into its own device
//     memory and releases it (kIpc), or keeps the IPC view itself (kZeroCopy: the producer must
//     outlive it, as with torch.multiprocessing). The producer keeps the snapshot until then
//     (KeepUntilReleased).
//   - otherwise (a device without IPC, like the simulated device, or a consumer without it):
//     staged through the payload (a copy to host memory on a stream of the library's); the
//     consumer copies it onto the same device if it has it, else it receives the CPU tensor.
//   - kCpu ("device=cpu"): always a CPU tensor (staged through the payload).
#pragma once

#include <ATen/core/Tensor.h>

#include "../core/value_codec.h"

namespace dtorch {

class TensorCodec final : public core::ValueCodec<at::Tensor> {
 public:
  // What the consumer receives of a device tensor (see above).
  enum class Delivery {
    kStaged,    // "": through host memory; onto the same device if the consumer has it
    kIpc,       // "ipc": the device's IPC, copied into the consumer's own device memory
    kZeroCopy,  // "zero_copy": the IPC view itself
    kCpu,       // "device=cpu": a CPU tensor
  };

  // The codec of a pair created with the options of a kind spec ("file://device=cpu",
  // "file://zero_copy"; none: kIpc when this process can open a device's IPC memory, else
  // kStaged). Throws std::invalid_argument for unknown options or zero_copy without IPC.
  static std::shared_ptr<const TensorCodec> ForNewPair(std::string_view options);
  // The codec a serialized promise names (its value options; untrusted): throws
  // FutureError(kInvalidHandle) for unknown ones.
  static std::shared_ptr<const TensorCodec> ForSerialized(std::string_view value_options);

  explicit TensorCodec(Delivery delivery) : delivery_(delivery) {}
  Delivery delivery() const { return delivery_; }
  // The value options that name this codec's delivery in a serialized promise.
  std::string_view Options() const;

  std::string_view TypeName() const override { return "tensor"; }
  void CheckValue(const at::Tensor& value) const override;
  std::string Header(const at::Tensor& value, size_t* payload_bytes) const override;
  void WritePayload(const at::Tensor& value, void* payload, size_t payload_bytes) const override;
  const void* PayloadInPlace(const at::Tensor& value, size_t payload_bytes) const override;
  std::shared_ptr<void> KeepUntilReleased(const at::Tensor& value) const override;
  size_t PayloadBytes(std::string_view header) const override;
  at::Tensor Read(std::string_view header, void* payload, size_t payload_bytes,
                  std::shared_ptr<void> keep_alive) const override;

 private:
  // Whether `value` travels by its device's IPC (else its bytes travel in the payload).
  bool TravelsByIpc(const at::Tensor& value) const;

  const Delivery delivery_;
};

}  // namespace dtorch
