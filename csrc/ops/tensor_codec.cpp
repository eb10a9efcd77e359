#include "tensor_codec.h"

#include <cstring>
#include <limits>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include "../core/future_error.h"
#include "internal_api.h"

namespace dtorch {
namespace {

// The dtypes a file promise carries; the index is the code on the wire (append only).
constexpr c10::ScalarType kWireDtypes[] = {
    c10::kBool,          c10::kByte,          c10::kChar,           c10::kShort,
    c10::kInt,           c10::kLong,          c10::kHalf,           c10::kBFloat16,
    c10::kFloat,         c10::kDouble,        c10::kComplexHalf,    c10::kComplexFloat,
    c10::kComplexDouble, c10::kUInt16,        c10::kUInt32,         c10::kUInt64,
    c10::ScalarType::Float8_e4m3fn,   c10::ScalarType::Float8_e5m2,
    c10::ScalarType::Float8_e4m3fnuz, c10::ScalarType::Float8_e5m2fnuz,
    c10::ScalarType::Float8_e8m0fnu,  c10::ScalarType::Float4_e2m1fn_x2,
};
constexpr uint32_t kWireDtypeCount = sizeof(kWireDtypes) / sizeof(kWireDtypes[0]);
constexpr int64_t kMaxDims = 64;

// header: u32 dtype code, u32 ndim, i32 device type, i32 device index (of the producer's tensor;
// CPU: 0, -1), u32 transport, u32 0, i64 sizes[ndim], i64 strides[ndim] (native byte order: both
// ends are on one host).
constexpr size_t kFixedHeaderBytes = 24;
constexpr size_t HeaderBytes(size_t ndim) { return kFixedHeaderBytes + 16 * ndim; }
static_assert(HeaderBytes(kMaxDims) <= core::kMaxValueHeaderBytes);

// How the value's bytes travel.
enum Transport : uint32_t {
  kBytesInPayload = 0,  // the payload holds the elements
  kDeviceIpc = 1,       // the payload holds a DeviceIpc record: u32 length, then the record
};
constexpr size_t kMaxIpcRecordBytes = 256;
constexpr size_t kIpcPayloadBytes = 4 + kMaxIpcRecordBytes;

constexpr std::string_view kIpcOption = "ipc";
constexpr std::string_view kZeroCopyOption = "zero_copy";
constexpr std::string_view kCpuOption = "device=cpu";

// The accelerator types whose IPC this process may open.
constexpr c10::DeviceType kIpcCandidates[] = {c10::kCUDA, c10::kHIP, c10::kXPU, c10::kMTIA,
                                              c10::kPrivateUse1};

bool HasDevice(c10::DeviceType type, c10::DeviceIndex index) {
  if (!c10::impl::hasDeviceGuardImpl(type)) return false;
  try {
    return index >= 0 && index < c10::impl::VirtualGuardImpl(type).deviceCount();
  } catch (const c10::Error&) {
    return false;
  }
}

// A copy of `source` in new memory on `to` (the value the consumer keeps), finished when this
// returns. Made on a stream of the library's on `stream_device`, not on the current stream, which
// may be queued with the consumer's unrelated work; the memory is allocated on the current stream,
// which then uses it (the side stream's copy is over before anything else can touch it).
// A stream of the library's on `device` for its copies (a backend without a stream pool: the
// current one).
c10::Stream LibraryStream(c10::Device device) {
  const c10::impl::VirtualGuardImpl guard(device.type());
  try {
    return guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  } catch (const c10::Error&) {
    return guard.getStream(device);
  }
}

at::Tensor CopyOnSideStream(const at::Tensor& source, c10::Device to, c10::Device stream_device) {
  at::Tensor copy = at::empty_strided(source.sizes(), source.strides(),
                                      source.options().device(to));
  const c10::impl::VirtualGuardImpl guard(stream_device.type());
  const c10::StreamGuard on_side_stream(LibraryStream(stream_device));  // (and its device)
  copy.copy_(source);
  // A device-to-device copy is queued even when not non_blocking: wait for it.
  c10::Event copied(stream_device.type());
  copied.record(guard.getStream(stream_device));
  copied.synchronize();
  return copy;
}

// Whether this process may open some device's IPC memory: its library was built with it (CUDA).
// Whether it sees such a device is not asked: that would initialize CUDA (cudaGetDeviceCount),
// after which a fork-started worker could not use CUDA; a consumer that cannot open the value
// says so when it receives it.
bool CanOpenDeviceIpc() {
  for (const auto type : kIpcCandidates) {
    if (FindDeviceIpc(type) != nullptr) return true;
  }
  return false;
}

int64_t WireCode(c10::ScalarType dtype) {
  for (uint32_t i = 0; i < kWireDtypeCount; ++i) {
    if (kWireDtypes[i] == dtype) return i;
  }
  return -1;
}

// The strides the payload keeps: the tensor's own when its elements are dense, else contiguous.
c10::DimVector PayloadStrides(const at::Tensor& value) {
  if (value.is_non_overlapping_and_dense()) return c10::DimVector(value.strides());
  return c10::contiguous_strides(value.sizes());
}

[[noreturn]] void Corrupt(const std::string& why) {
  throw core::FutureError(core::FutureErrc::kInvalidHandle, "the published tensor " + why);
}

std::shared_ptr<const TensorCodec> CodecOf(TensorCodec::Delivery delivery) {
  using D = TensorCodec::Delivery;
  static const auto staged = std::make_shared<const TensorCodec>(D::kStaged);
  static const auto ipc = std::make_shared<const TensorCodec>(D::kIpc);
  static const auto zero_copy = std::make_shared<const TensorCodec>(D::kZeroCopy);
  static const auto cpu = std::make_shared<const TensorCodec>(D::kCpu);
  switch (delivery) {
    case D::kStaged: return staged;
    case D::kIpc: return ipc;
    case D::kZeroCopy: return zero_copy;
    case D::kCpu: return cpu;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown delivery");
}

}  // namespace

std::shared_ptr<const TensorCodec> TensorCodec::ForNewPair(std::string_view options) {
  if (options.empty()) return CodecOf(CanOpenDeviceIpc() ? Delivery::kIpc : Delivery::kStaged);
  if (options == kCpuOption) return CodecOf(Delivery::kCpu);
  if (options == kZeroCopyOption) {
    if (!CanOpenDeviceIpc()) {
      throw std::invalid_argument(
          "dtorch: TensorPromise(kind='file', zero_copy=True) shares device memory through the "
          "device's IPC (CUDA), which this dtorch_ops cannot open (it was built without CUDA); "
          "drop zero_copy (the value is then copied)");
    }
    return CodecOf(Delivery::kZeroCopy);
  }
  throw std::invalid_argument("dtorch: a file TensorPromise takes the options device='cpu' "
                              "('file://device=cpu') or zero_copy=True ('file://zero_copy'), "
                              "got '" + std::string(options.substr(0, 64)) + "'");
}

std::shared_ptr<const TensorCodec> TensorCodec::ForSerialized(std::string_view value_options) {
  if (value_options.empty()) return CodecOf(Delivery::kStaged);
  if (value_options == kIpcOption) return CodecOf(Delivery::kIpc);
  if (value_options == kZeroCopyOption) return CodecOf(Delivery::kZeroCopy);
  if (value_options == kCpuOption) return CodecOf(Delivery::kCpu);
  throw core::FutureError(core::FutureErrc::kInvalidHandle,
                          "a serialized file promise has value options this build does not "
                          "know; serialize and deserialize with the same dtorch_ops");
}

std::string_view TensorCodec::Options() const {
  switch (delivery_) {
    case Delivery::kStaged: return "";
    case Delivery::kIpc: return kIpcOption;
    case Delivery::kZeroCopy: return kZeroCopyOption;
    case Delivery::kCpu: return kCpuOption;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown delivery");
}

void TensorCodec::CheckValue(const at::Tensor& value) const {
  // (One codec for the file and the network kinds: the messages name neither.)
  TORCH_CHECK_VALUE(value.defined(), "dtorch: a cross-process promise needs a defined tensor");
  const auto device = value.device();
  TORCH_CHECK(!device.is_meta(), "dtorch: a cross-process promise carries values, and a meta "
              "tensor has none: pass a tensor on the CPU or a device");
  TORCH_CHECK(device.is_cpu() || c10::impl::hasDeviceGuardImpl(device.type()), "dtorch: a "
              "cross-process promise cannot copy a tensor on ", device, " (its backend has no "
              "device guard with streams and events): pass t.cpu()");
  TORCH_CHECK(value.layout() == c10::kStrided && !value.is_nested(), "dtorch: a cross-process "
              "promise carries strided (dense) tensors; got layout ", value.layout(),
              value.is_nested() ? " (nested)" : "", ": convert it first (e.g. t.to_dense())");
  TORCH_CHECK(WireCode(value.scalar_type()) >= 0, "dtorch: a cross-process promise cannot carry "
              "dtype ", value.scalar_type(), " (quantized and bit-packed dtypes are not "
              "supported): convert it first (e.g. t.dequantize())");
  TORCH_CHECK(value.dim() <= kMaxDims, "dtorch: a cross-process promise carries tensors of at "
              "most ", kMaxDims, " dimensions, got ", value.dim());
  TORCH_CHECK_TYPE(!value.key_set().has(c10::DispatchKey::Python), "dtorch: a cross-process "
                   "promise carries plain tensors; got a tensor subclass with its own "
                   "__torch_dispatch__: pass the plain tensor(s) it holds");
  TORCH_CHECK(delivery_ != Delivery::kZeroCopy || device.is_cpu() ||
                  FindDeviceIpc(device.type()) != nullptr,
              "dtorch: this file promise was created with zero_copy=True, which shares device "
              "memory through the device's IPC, and ", device.type(), " has none: create the "
              "promise without zero_copy (the value is then copied)");
}

bool TensorCodec::TravelsByIpc(const at::Tensor& value) const {
  return !value.device().is_cpu() &&
         (delivery_ == Delivery::kIpc || delivery_ == Delivery::kZeroCopy) &&
         FindDeviceIpc(value.device().type()) != nullptr;
}

std::string TensorCodec::Header(const at::Tensor& value, size_t* payload_bytes) const {
  const auto strides = PayloadStrides(value);
  const auto ndim = static_cast<uint32_t>(value.dim());
  std::string header(HeaderBytes(ndim), '\0');
  const auto code = static_cast<uint32_t>(WireCode(value.scalar_type()));
  const auto device_type = static_cast<int32_t>(value.device().type());
  const int32_t device_index = value.device().is_cpu() ? -1 : value.device().index();
  const uint32_t transport = TravelsByIpc(value) ? kDeviceIpc : kBytesInPayload;
  std::memcpy(&header[0], &code, 4);
  std::memcpy(&header[4], &ndim, 4);
  std::memcpy(&header[8], &device_type, 4);
  std::memcpy(&header[12], &device_index, 4);
  std::memcpy(&header[16], &transport, 4);
  std::memcpy(&header[kFixedHeaderBytes], value.sizes().data(), 8 * ndim);
  std::memcpy(&header[kFixedHeaderBytes + 8 * ndim], strides.data(), 8 * ndim);
  *payload_bytes = transport == kDeviceIpc ? kIpcPayloadBytes : value.numel() * value.element_size();
  return header;
}

namespace {
// Its elements fill [data, data + nbytes) in the payload's order (strides >= 0), and no lazy
// conjugation or negation is pending (nor is it a ZeroTensor, which has no data).
bool PayloadIsItsMemory(const at::Tensor& value) {
  return value.device().is_cpu() && value.is_non_overlapping_and_dense() && !value.is_conj() &&
         !value.is_neg() && !value._is_zerotensor();
}
}  // namespace

const void* TensorCodec::PayloadInPlace(const at::Tensor& value, size_t payload_bytes) const {
  if (TravelsByIpc(value) || !PayloadIsItsMemory(value) ||
      payload_bytes != static_cast<size_t>(value.nbytes())) {
    return nullptr;
  }
  return payload_bytes == 0 ? "" : value.const_data_ptr();
}

void TensorCodec::WritePayload(const at::Tensor& value, void* payload,
                               size_t payload_bytes) const {
  if (TravelsByIpc(value)) {
    // The producer's device work on `value` has finished (a snapshot completed after its event):
    // no event travels with the record.
    const std::string record = FindDeviceIpc(value.device().type())->Export(value);
    TORCH_INTERNAL_ASSERT(record.size() <= kMaxIpcRecordBytes && payload_bytes == kIpcPayloadBytes,
                          "a DeviceIpc record of ", record.size(), " bytes");
    const auto length = static_cast<uint32_t>(record.size());
    std::memcpy(payload, &length, 4);
    std::memcpy(static_cast<char*>(payload) + 4, record.data(), record.size());
    return;
  }
  if (PayloadIsItsMemory(value)) {
    // One memcpy, at memory bandwidth, instead of an element-wise copy.
    TORCH_INTERNAL_ASSERT(payload_bytes == static_cast<size_t>(value.nbytes()));
    std::memcpy(payload, value.const_data_ptr(), payload_bytes);
    return;
  }
  at::NoGradGuard no_grad;
  at::Tensor staged = at::from_blob(payload, value.sizes(), PayloadStrides(value),
                                    at::TensorOptions().dtype(value.scalar_type()));
  if (value.device().is_cpu()) {
    staged.copy_(value);
    return;
  }
  // A device value (whose device work has finished): copied to the host on a stream of the
  // library's, not the device's default one, which may be queued behind the user's later work.
  const c10::StreamGuard on_side_stream(LibraryStream(value.device()));
  staged.copy_(value);  // blocking: done when it returns
}

std::shared_ptr<void> TensorCodec::KeepUntilReleased(const at::Tensor& value) const {
  if (!TravelsByIpc(value)) return nullptr;
  return std::make_shared<at::Tensor>(value);  // the device block the consumer maps
}

namespace {

// A header as Read and PayloadBytes check it (untrusted).
struct ParsedHeader {
  c10::ScalarType dtype;
  c10::DeviceType origin_type;
  int32_t device_index;
  uint32_t transport;
  std::vector<int64_t> sizes, strides;
  int64_t numel;
  size_t needed;  // the bytes its elements span
};

ParsedHeader ParseHeader(std::string_view header) {
  if (header.size() < kFixedHeaderBytes) Corrupt("header is truncated");
  uint32_t code = 0, ndim = 0, transport = 0;
  int32_t device_type = 0, device_index = 0;
  std::memcpy(&code, header.data(), 4);
  std::memcpy(&ndim, header.data() + 4, 4);
  std::memcpy(&device_type, header.data() + 8, 4);
  std::memcpy(&device_index, header.data() + 12, 4);
  std::memcpy(&transport, header.data() + 16, 4);
  uint32_t reserved = 0;
  std::memcpy(&reserved, header.data() + 20, 4);
  if (reserved != 0) Corrupt("header is not of this format");
  if (code >= kWireDtypeCount) Corrupt("has an unknown dtype code");
  if (ndim > kMaxDims || header.size() != HeaderBytes(ndim)) Corrupt("header has a bad size");
  if (device_type < 0 || device_type >= static_cast<int32_t>(c10::COMPILE_TIME_MAX_DEVICE_TYPES) ||
      device_index < -1 || device_index > std::numeric_limits<c10::DeviceIndex>::max()) {
    Corrupt("names no device");
  }
  const auto origin_type = static_cast<c10::DeviceType>(device_type);
  const bool from_cpu = origin_type == c10::kCPU;
  if (from_cpu != (device_index == -1) || (from_cpu && transport != kBytesInPayload) ||
      origin_type == c10::kMeta) {
    Corrupt("names no device");
  }
  if (transport != kBytesInPayload && transport != kDeviceIpc) Corrupt("has an unknown transport");
  ParsedHeader h{kWireDtypes[code], origin_type, device_index, transport, {}, {}, 1, 0};
  h.sizes.resize(ndim);
  h.strides.resize(ndim);
  std::memcpy(h.sizes.data(), header.data() + kFixedHeaderBytes, 8 * ndim);
  std::memcpy(h.strides.data(), header.data() + kFixedHeaderBytes + 8 * ndim, 8 * ndim);
  for (uint32_t d = 0; d < ndim; ++d) {
    if (h.sizes[d] < 0 || h.strides[d] < 0) Corrupt("has a negative size or stride");
    if (__builtin_mul_overflow(h.numel, h.sizes[d], &h.numel)) Corrupt("has too many elements");
  }
  try {  // (overflow-checked by torch)
    h.needed = h.numel == 0 ? 0
                            : at::detail::computeStorageNbytes(h.sizes, h.strides,
                                                               c10::elementSize(h.dtype));
  } catch (const c10::Error&) {
    Corrupt("has strides that overflow");
  }
  return h;
}

}  // namespace

size_t TensorCodec::PayloadBytes(std::string_view header) const {
  const ParsedHeader h = ParseHeader(header);
  return h.transport == kDeviceIpc ? kIpcPayloadBytes : h.needed;
}

at::Tensor TensorCodec::Read(std::string_view header, void* payload, size_t payload_bytes,
                             std::shared_ptr<void> keep_alive) const {
  const ParsedHeader parsed = ParseHeader(header);
  const c10::ScalarType dtype = parsed.dtype;
  const c10::DeviceType origin_type = parsed.origin_type;
  const int32_t device_index = parsed.device_index;
  const uint32_t transport = parsed.transport;
  const std::vector<int64_t>& sizes = parsed.sizes;
  const std::vector<int64_t>& strides = parsed.strides;
  const int64_t numel = parsed.numel;
  const size_t needed = parsed.needed;
  const bool from_cpu = origin_type == c10::kCPU;
  const c10::Device origin(origin_type, static_cast<c10::DeviceIndex>(device_index));

  if (transport == kDeviceIpc) {
    if (payload == nullptr || payload_bytes != kIpcPayloadBytes) Corrupt("has a bad IPC record");
    uint32_t length = 0;
    std::memcpy(&length, payload, 4);
    if (length == 0 || length > kMaxIpcRecordBytes) Corrupt("has a bad IPC record");
    DeviceIpc* ipc = FindDeviceIpc(origin_type);
    const std::string_view record(static_cast<const char*>(payload) + 4, length);
    // The same physical device's index here (processes may number devices differently, e.g.
    // under CUDA_VISIBLE_DEVICES).
    const c10::DeviceIndex local_index = ipc == nullptr ? -1 : ipc->LocalIndex(record);
    const c10::Device here(origin_type, local_index < 0 ? origin.index() : local_index);
    if (ipc == nullptr || !HasDevice(origin_type, here.index())) {
      throw core::FutureError(core::FutureErrc::kInvalidHandle,
                              "the published tensor is in the producer's " + origin.str() +
                                  " memory, which this process cannot open (it has no " +
                                  origin.str() + "): create the promise with device='cpu'");
    }
    const auto open = [&](std::function<void()> on_release) {
      try {
        return ipc->Open(record, here.index(), dtype, sizes, strides, std::move(on_release));
      } catch (const c10::Error& e) {
        Corrupt("could not be opened (" + origin.str() + " IPC): " + e.what_without_backtrace());
      }
    };
    if (delivery_ == Delivery::kZeroCopy) {
      // The view keeps the payload (and so the producer's block) until its storage goes.
      return open([keep_alive = std::move(keep_alive)]() mutable { keep_alive.reset(); });
    }
    at::Tensor view = open({});
    // Copied (and the copy finished) before the producer's block is released: the view and
    // keep_alive go when this returns.
    return CopyOnSideStream(view, delivery_ == Delivery::kCpu ? c10::Device(c10::kCPU) : here,
                            here);
  }

  const auto options = at::TensorOptions().dtype(dtype).device(c10::kCPU);
  at::Tensor received;
  if (numel == 0) {
    if (payload_bytes != 0) Corrupt("is empty but has a payload");
    received = at::empty_strided(sizes, strides, options);
  } else {
    if (needed > payload_bytes || payload == nullptr) Corrupt("does not fit its payload");
    received = at::from_blob(
        payload, sizes, strides, [keep_alive = std::move(keep_alive)](void*) mutable {
          keep_alive.reset();
        },
        options);
  }
  if (from_cpu || delivery_ == Delivery::kCpu || !HasDevice(origin_type, origin.index())) {
    return received;  // (a consumer without the producer's device gets the CPU tensor)
  }
  // Onto the producer's device, in this process's memory of it (the payload is released when
  // `received` goes).
  return CopyOnSideStream(received, origin, origin);
}

}  // namespace dtorch
