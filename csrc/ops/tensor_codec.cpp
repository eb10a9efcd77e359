#include "tensor_codec.h"

#include <cstring>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include "../core/future_error.h"

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

// header: u32 dtype code, u32 ndim, i64 sizes[ndim], i64 strides[ndim] (native byte order: both
// ends are on one host).
constexpr size_t HeaderBytes(size_t ndim) { return 8 + 16 * ndim; }
static_assert(HeaderBytes(kMaxDims) <= core::kMaxValueHeaderBytes);

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

}  // namespace

void TensorCodec::CheckValue(const at::Tensor& value) const {
  TORCH_CHECK_VALUE(value.defined(), "dtorch: a file promise needs a defined tensor");
  TORCH_CHECK(value.device().is_cpu(), "dtorch: a file promise carries CPU tensors in this "
              "version (device tensors across processes come later); got a tensor on ",
              value.device(), ": pass t.cpu(), or use a memory promise in the same process");
  TORCH_CHECK(value.layout() == c10::kStrided && !value.is_nested(), "dtorch: a file promise "
              "carries strided (dense) tensors; got layout ", value.layout(),
              value.is_nested() ? " (nested)" : "", ": convert it first (e.g. t.to_dense())");
  TORCH_CHECK(WireCode(value.scalar_type()) >= 0, "dtorch: a file promise cannot carry dtype ",
              value.scalar_type(), " (quantized and bit-packed dtypes are not supported): "
              "convert it first (e.g. t.dequantize())");
  TORCH_CHECK(value.dim() <= kMaxDims, "dtorch: a file promise carries tensors of at most ",
              kMaxDims, " dimensions, got ", value.dim());
  TORCH_CHECK_TYPE(!value.key_set().has(c10::DispatchKey::Python), "dtorch: a file promise "
                   "carries plain tensors; got a tensor subclass with its own "
                   "__torch_dispatch__: pass the plain tensor(s) it holds");
}

std::string TensorCodec::Header(const at::Tensor& value, size_t* payload_bytes) const {
  const auto strides = PayloadStrides(value);
  const auto ndim = static_cast<uint32_t>(value.dim());
  std::string header(HeaderBytes(ndim), '\0');
  const auto code = static_cast<uint32_t>(WireCode(value.scalar_type()));
  std::memcpy(&header[0], &code, 4);
  std::memcpy(&header[4], &ndim, 4);
  std::memcpy(&header[8], value.sizes().data(), 8 * ndim);
  std::memcpy(&header[8 + 8 * ndim], strides.data(), 8 * ndim);
  *payload_bytes = value.numel() * value.element_size();
  return header;
}

void TensorCodec::WritePayload(const at::Tensor& value, void* payload,
                               size_t payload_bytes) const {
  if (value.is_non_overlapping_and_dense() && !value.is_conj() && !value.is_neg() &&
      !value._is_zerotensor()) {
    // Its elements fill [data, data + payload_bytes) in the payload's order (strides >= 0), and
    // no lazy conjugation or negation is pending (nor is it a ZeroTensor, which has no data):
    // one memcpy, at memory bandwidth, instead of an element-wise copy.
    TORCH_INTERNAL_ASSERT(payload_bytes == static_cast<size_t>(value.nbytes()));
    std::memcpy(payload, value.const_data_ptr(), payload_bytes);
    return;
  }
  at::NoGradGuard no_grad;
  at::from_blob(payload, value.sizes(), PayloadStrides(value),
                value.options().dtype(value.scalar_type()).requires_grad(false))
      .copy_(value);
}

at::Tensor TensorCodec::Read(std::string_view header, void* payload, size_t payload_bytes,
                             std::shared_ptr<void> keep_alive) const {
  if (header.size() < 8) Corrupt("header is truncated");
  uint32_t code = 0, ndim = 0;
  std::memcpy(&code, header.data(), 4);
  std::memcpy(&ndim, header.data() + 4, 4);
  if (code >= kWireDtypeCount) Corrupt("has an unknown dtype code");
  if (ndim > kMaxDims || header.size() != HeaderBytes(ndim)) Corrupt("header has a bad size");
  std::vector<int64_t> sizes(ndim), strides(ndim);
  std::memcpy(sizes.data(), header.data() + 8, 8 * ndim);
  std::memcpy(strides.data(), header.data() + 8 + 8 * ndim, 8 * ndim);
  const auto dtype = kWireDtypes[code];
  int64_t numel = 1;
  for (uint32_t d = 0; d < ndim; ++d) {
    if (sizes[d] < 0 || strides[d] < 0) Corrupt("has a negative size or stride");
    if (__builtin_mul_overflow(numel, sizes[d], &numel)) Corrupt("has too many elements");
  }
  const auto options = at::TensorOptions().dtype(dtype).device(c10::kCPU);
  if (numel == 0) {
    if (payload_bytes != 0) Corrupt("is empty but has a payload");
    return at::empty_strided(sizes, strides, options);
  }
  size_t needed = 0;  // the bytes its elements span (overflow-checked by torch)
  try {
    needed = at::detail::computeStorageNbytes(sizes, strides, c10::elementSize(dtype));
  } catch (const c10::Error&) {
    Corrupt("has strides that overflow");
  }
  if (needed > payload_bytes || payload == nullptr) Corrupt("does not fit its payload");
  return at::from_blob(
      payload, sizes, strides, [keep_alive = std::move(keep_alive)](void*) mutable {
        keep_alive.reset();
      },
      options);
}

}  // namespace dtorch
