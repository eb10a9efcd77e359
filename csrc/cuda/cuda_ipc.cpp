// CUDA's interprocess memory sharing (DeviceIpc, ops/internal_api.h), with torch's own IPC support
// as torch.multiprocessing uses it: the caching allocator's handle + offset of a block on the
// producer (CUDACachingAllocator::shareIpcHandle), the allocator's cached mapping of that handle on
// the consumer (getIpcDevPtr, which another torch.multiprocessing receiver of the same segment
// shares). Compiled only into a CUDA build (setup.py); registered at load time without touching
// CUDA.
//
// The record (at most DeviceIpc::kMaxRecordBytes; native byte order, as both ends are on this
// host):
//   magic "dTCi" | u8 format (2) | u8 kind (0: no bytes, 1: a cudaMalloc segment's handle) |
//   u16 zero | i32 producer pid | i32 producer's device index | u64 producer's start time (clock
//   ticks after boot, /proc/<pid>/stat field 22) | u64 producer's pid namespace (the inode of
//   /proc/<pid>/ns/pid) | u8[16] device UUID |
//   u64 offset of the first byte in the handle's segment | u64 bytes exported from there |
//   u32 handle length | the handle (torch's shareable handle: a format byte, 'c', and the 64-byte
//   cudaIpcMemHandle_t; or the bare 64 bytes of older torch)
// The producer is this process only if all three of pid, start time and pid namespace are this
// process's (Self()): a pid alone may be another pid namespace's process, or an exited one's.
// Neither the record's range nor its handle is trusted: the consumer checks the view against the
// memory it actually maps (the driver's range of the opened allocation; in the producer's own
// process, the range it exported under that handle).
// Memory of the allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
// is shared through file descriptors of the producer process, which no record of this size can
// carry: Export refuses it with a message that says what to do.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../core/completion_pool.h"
#include "../core/base/process.h"
#include "../ops/device_completion.h"
#include "../ops/internal_api.h"

namespace dtorch::cuda {
namespace {

constexpr char kMagic[4] = {'d', 'T', 'C', 'i'};
constexpr uint8_t kFormat = 2;
constexpr uint8_t kNoBytes = 0;
constexpr uint8_t kMallocHandle = 1;
constexpr size_t kHandleBytes = CUDA_IPC_HANDLE_SIZE;  // a cudaIpcMemHandle_t
constexpr char kTorchMallocHandleType = 'c';           // torch's SHAREABLE_CUDA_MALLOC
constexpr size_t kFixedBytes = 4 + 1 + 1 + 2 + 4 + 4 + 8 + 8 + 16 + 8 + 8 + 4;
// (The torch handle format, the largest, fits.)
static_assert(kFixedBytes + kHandleBytes + 2 <= DeviceIpc::kMaxRecordBytes);

struct Record {
  uint8_t kind = kNoBytes;
  int32_t pid = 0;
  int32_t device = 0;
  uint64_t start_time = 0;
  uint64_t pid_namespace = 0;
  std::array<uint8_t, 16> uuid{};
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  std::string handle;
};

std::string Encode(const Record& r) {
  std::string out(kFixedBytes + r.handle.size(), '\0');
  char* p = out.data();
  const auto put = [&p](const void* data, size_t size) {
    std::memcpy(p, data, size);
    p += size;
  };
  const uint16_t zero = 0;
  const auto handle_bytes = static_cast<uint32_t>(r.handle.size());
  put(kMagic, 4);
  put(&kFormat, 1);
  put(&r.kind, 1);
  put(&zero, 2);
  put(&r.pid, 4);
  put(&r.device, 4);
  put(&r.start_time, 8);
  put(&r.pid_namespace, 8);
  put(r.uuid.data(), 16);
  put(&r.offset, 8);
  put(&r.nbytes, 8);
  put(&handle_bytes, 4);
  put(r.handle.data(), r.handle.size());
  return out;
}

[[noreturn]] void BadRecord(const char* what) {
  TORCH_CHECK(false, "dtorch: a CUDA IPC record ", what,
              ": it was not written by this version of dtorch_ops, or it is corrupt");
}

// Validates everything but what only opening can tell (the handle's bytes).
Record Decode(std::string_view bytes) {
  if (bytes.size() < kFixedBytes || bytes.size() > DeviceIpc::kMaxRecordBytes) {
    BadRecord("has a bad size");
  }
  const char* p = bytes.data();
  const auto get = [&p](void* data, size_t size) {
    std::memcpy(data, p, size);
    p += size;
  };
  char magic[4];
  uint8_t format = 0;
  uint16_t zero = 0;
  uint32_t handle_bytes = 0;
  Record r;
  get(magic, 4);
  get(&format, 1);
  get(&r.kind, 1);
  get(&zero, 2);
  get(&r.pid, 4);
  get(&r.device, 4);
  get(&r.start_time, 8);
  get(&r.pid_namespace, 8);
  get(r.uuid.data(), 16);
  get(&r.offset, 8);
  get(&r.nbytes, 8);
  get(&handle_bytes, 4);
  if (std::memcmp(magic, kMagic, 4) != 0 || format != kFormat || zero != 0) {
    BadRecord("has an unknown format");
  }
  if (handle_bytes != bytes.size() - kFixedBytes) BadRecord("has a bad handle size");
  r.handle.assign(p, handle_bytes);
  if (r.pid <= 0 || r.pid_namespace == 0 || r.device < 0 ||
      r.device > std::numeric_limits<c10::DeviceIndex>::max()) {
    BadRecord("names no process or device");
  }
  if (r.offset > std::numeric_limits<uint64_t>::max() - r.nbytes) BadRecord("has a bad range");
  if (r.kind == kNoBytes) {
    if (r.nbytes != 0 || !r.handle.empty()) BadRecord("has a bad empty range");
  } else if (r.kind == kMallocHandle) {
    const bool bare = r.handle.size() == kHandleBytes;
    const bool torch_format =
        r.handle.size() == kHandleBytes + 2 && r.handle[1] == kTorchMallocHandleType;
    if (!bare && !torch_format) BadRecord("has a bad handle");
  } else {
    BadRecord("has an unknown kind");
  }
  return r;
}

// This process's identity (Self(): cached, recomputed in a fork child), as a c10::Error when
// /proc cannot tell it.
core::ProcessId SelfId() {
  try {
    return core::Self();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "dtorch: CUDA IPC: ", e.what());
  }
}

// Whether this process wrote `r`: its pid, start time and pid namespace are all this process's.
bool FromThisProcess(const Record& r) {
  const core::ProcessId producer{r.pid, r.start_time, r.pid_namespace};
  return producer == SelfId();
}

// The driver's range (base, size) of the allocation that holds `address` in the current context:
// cuMemGetAddressRange, through the runtime's driver entry point (neither libcuda linked, nor a
// function c10's DriverAPI may lack). Throws c10::Error when the driver cannot tell.
std::pair<uintptr_t, size_t> AllocationRange(const void* address) {
  using GetAddressRange = PFN_cuMemGetAddressRange_v3020;
  static const GetAddressRange get_address_range = []() -> GetAddressRange {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t error = cudaGetDriverEntryPointByVersion(
        "cuMemGetAddressRange", &entry, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t error =
        cudaGetDriverEntryPoint("cuMemGetAddressRange", &entry, cudaEnableDefault, &found);
#endif
    if (error != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<GetAddressRange>(entry);
  }();
  TORCH_CHECK(get_address_range != nullptr,
              "dtorch: CUDA IPC: the CUDA driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult result =
      get_address_range(&base, &size, reinterpret_cast<CUdeviceptr>(address));
  TORCH_CHECK(result == CUDA_SUCCESS, "dtorch: CUDA IPC: cannot tell the range of the opened "
              "CUDA memory (cuMemGetAddressRange: CUDA driver error ", static_cast<int>(result),
              ")");
  return {static_cast<uintptr_t>(base), size};
}

// Checks that the view's `span` bytes from `offset` lie within the `available` bytes from the
// mapped memory's start.
void CheckFits(uint64_t offset, uint64_t span, uint64_t available, int32_t producer) {
  TORCH_CHECK(offset <= available && span <= available - offset, "dtorch: CUDA IPC: the record "
              "of process ", producer, " names bytes [", offset, ", ", offset, " + ", span,
              ") of memory that has ", available, " bytes: it does not match the memory its "
              "handle opens (corrupt)");
}

// Device UUIDs (cudaGetDeviceProperties creates no context), cached per index.
std::array<uint8_t, 16> DeviceUuid(c10::DeviceIndex device) {
  static std::mutex mu;
  static auto& cache = *new std::unordered_map<int, std::array<uint8_t, 16>>();  // guarded by mu
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(device);
    if (it != cache.end()) return it->second;
  }
  cudaDeviceProp properties{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  std::array<uint8_t, 16> uuid{};
  std::memcpy(uuid.data(), properties.uuid.bytes, uuid.size());
  std::lock_guard<std::mutex> lock(mu);
  cache[device] = uuid;
  return uuid;
}

// What this process exported, by handle: the producer's own process cannot open its handles
// (CUDA refuses), so there a record resolves to the block itself, as torch.multiprocessing's
// shared_cache does. Each handle's entry keeps the segment's base and the end of what was exported
// from it (the furthest of its blocks' ends): a record is checked against that, as a consumer's
// against the driver's range. Segments are >= 2 MiB, so the map stays small; it is emptied beyond
// a bound.
class LocalExports {
 public:
  struct Exported {
    char* segment_base = nullptr;
    uint64_t end = 0;  // bytes from segment_base that were exported
  };

  static LocalExports& Instance() {
    static auto* exports = new LocalExports();  // leaked: used until the process ends
    return *exports;
  }
  void Remember(const std::string& handle, char* segment_base, uint64_t end) {
    std::lock_guard<std::mutex> lock(mu_);
    if (exports_.size() >= kMaxEntries) exports_.clear();
    Exported& entry = exports_[handle];
    if (entry.segment_base != segment_base) {
      entry = Exported{segment_base, end};  // new, or a segment that reuses a freed one's handle
    } else if (end > entry.end) {
      entry.end = end;
    }
  }
  std::optional<Exported> Find(const std::string& handle) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = exports_.find(handle);
    if (it == exports_.end()) return std::nullopt;
    return it->second;
  }

 private:
  static constexpr size_t kMaxEntries = 1 << 16;
  std::mutex mu_;
  std::unordered_map<std::string, Exported> exports_;  // guarded by mu_
};

// A view's hold on what it maps: released once its storage is freed and the work queued on the
// freeing thread's current stream by then has finished.
struct OpenedView {
  std::shared_ptr<void> mapping;     // torch's mapping of the segment (none in the producer)
  std::function<void()> on_release;  // the caller's
  c10::DeviceIndex device = 0;

  void Finish() noexcept {
    try {
      mapping.reset();  // (torch closes the handle on the segment's device)
      if (on_release) on_release();
    } catch (...) {
      // (A CUDA error while unmapping, or a caller's callback that threw: nothing to tell.)
    }
  }
};

// Keeps `view` (its mapping stays open, the producer keeps its block) for the process: when its
// readers cannot be waited for.
void Keep(std::shared_ptr<OpenedView> view) noexcept {
  try {
    new std::shared_ptr<OpenedView>(std::move(view));
  } catch (...) {
  }
}

// The storage's deleter: on whatever thread frees it, maybe holding the GIL, so it never blocks
// on the device when it can help it.
void ReleaseView(std::shared_ptr<OpenedView> view) noexcept {
  const c10::Device device(c10::kCUDA, view->device);
  try {
    // Kernels queued on this thread's current stream may still read the memory (torch's rule for
    // IPC tensors): release after them, on the pool (unmapping and the caller's callback are not
    // for a detector).
    AfterCurrentStreamWork(device, [view](const std::optional<core::FutureError>& error) {
      if (error) {  // the device failed, or the process exits or forks: keep it
        Keep(view);
        return;
      }
      try {
        core::CompletionPool::Instance().Post([view] { view->Finish(); });
      } catch (...) {
        Keep(view);
      }
    });
    return;
  } catch (...) {
    // No event: the stream is being captured into a graph (which may read the view whenever it
    // is replayed), or no detector thread could start, or CUDA is unusable (a fork child).
  }
  try {
    const auto stream = c10::cuda::getCurrentCUDAStream(view->device);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
    if (status == cudaStreamCaptureStatusNone) {
      {
        const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
        stream.synchronize();
      }
      view->Finish();
      return;
    }
  } catch (...) {
    (void)cudaGetLastError();
  }
  Keep(std::move(view));
}

at::Tensor MakeView(void* data, std::shared_ptr<OpenedView> view, c10::ScalarType dtype,
                    c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  const c10::Device device(c10::kCUDA, view->device);
  at::Tensor tensor =
      at::for_blob(data, sizes)
          .strides(strides)
          .deleter([view = std::move(view)](void*) mutable { ReleaseView(std::move(view)); })
          .options(at::TensorOptions().dtype(dtype).device(device))
          .target_device(device)  // (not asked of CUDA: a peer's mapping may report another)
          .make_tensor();
  // As torch.multiprocessing marks what it receives: torch refuses to share it on (its memory is
  // not the allocator's) with a clear message.
  tensor.storage().unsafeGetStorageImpl()->set_received_cuda(true);
  return tensor;
}

class CudaIpc final : public DeviceIpc {
 public:
  std::string Export(const at::Tensor& block) override {
    TORCH_CHECK(block.defined() && block.is_cuda(),
                "dtorch: CUDA IPC exports a CUDA tensor, got ",
                block.defined() ? block.device().str() : std::string("an undefined tensor"));
    const c10::DeviceIndex device = block.device().index();
    // On a pool thread: the allocator and the runtime act on the current device.
    const c10::cuda::CUDAGuard guard(device);
    const c10::Storage& storage = block.storage();
    const auto start = static_cast<uint64_t>(block.storage_offset()) *
                       static_cast<uint64_t>(block.element_size());
    TORCH_CHECK(start <= storage.nbytes(), "dtorch: CUDA IPC: the tensor starts past its storage");
    Record r;
    const core::ProcessId self = SelfId();
    r.pid = self.pid;
    r.start_time = self.start_time;
    r.pid_namespace = self.pid_namespace;
    r.device = device;
    r.uuid = DeviceUuid(device);
    r.nbytes = storage.nbytes() - start;
    if (r.nbytes == 0 || storage.data() == nullptr) {
      r.nbytes = 0;
      return Encode(r);  // nothing to map: opened as an empty view
    }
    void* base = storage.mutable_data();
    c10::cuda::CUDACachingAllocator::ShareableHandle shared;
    try {
      shared = c10::cuda::CUDACachingAllocator::shareIpcHandle(base);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "dtorch: cannot share ", block.device(),
                  " memory with another process: ", e.what_without_backtrace(),
                  " (the memory must come from torch's CUDA caching allocator)");
    }
    const bool malloc_handle =
        shared.handle.size() == kHandleBytes ||
        (shared.handle.size() == kHandleBytes + 2 && shared.handle[1] == kTorchMallocHandleType);
    TORCH_CHECK(malloc_handle, "dtorch: cannot share ", block.device(),
                " memory from the CUDA caching allocator's expandable segments "
                "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) with another process: turn "
                "them off in the producer process (expandable_segments:False, or "
                "torch.cuda.memory._set_allocator_settings(\"expandable_segments:False\") before "
                "its tensors are allocated), or create the promise with device=\"cpu\"");
    TORCH_CHECK(shared.offset >= 0, "dtorch: CUDA IPC: a negative offset from the allocator");
    r.kind = kMallocHandle;
    r.offset = static_cast<uint64_t>(shared.offset) + start;
    r.handle = std::move(shared.handle);
    LocalExports::Instance().Remember(r.handle, static_cast<char*>(base) - shared.offset,
                                      r.offset + r.nbytes);
    std::string record = Encode(r);
    TORCH_INTERNAL_ASSERT(record.size() <= kMaxRecordBytes);
    return record;
  }

  at::Tensor Open(std::string_view bytes, c10::DeviceIndex index, c10::ScalarType dtype,
                  c10::IntArrayRef sizes, c10::IntArrayRef strides,
                  std::function<void()> on_release) override {
    const Record r = Decode(bytes);
    TORCH_CHECK(sizes.size() == strides.size(), "dtorch: CUDA IPC: ", sizes.size(),
                " sizes but ", strides.size(), " strides");
    int64_t numel = 1;
    for (size_t d = 0; d < sizes.size(); ++d) {
      TORCH_CHECK(sizes[d] >= 0 && strides[d] >= 0,
                  "dtorch: CUDA IPC: a view with a negative size or stride");
      TORCH_CHECK(!__builtin_mul_overflow(numel, sizes[d], &numel),
                  "dtorch: CUDA IPC: a view with too many elements");
    }
    // The bytes the view spans (torch checks the arithmetic for overflow).
    const uint64_t span =
        numel == 0 ? 0 : at::detail::computeStorageNbytes(sizes, strides, c10::elementSize(dtype));
    TORCH_CHECK(span <= r.nbytes, "dtorch: CUDA IPC: the view spans ", span,
                " bytes, but the record exports ", r.nbytes, ": the record does not match the "
                "tensor's header (corrupt)");

    auto view = std::make_shared<OpenedView>();
    view->on_release = std::move(on_release);
    const bool same_process = FromThisProcess(r);
    // The producer's own process: its own block, on its own device.
    view->device = same_process ? static_cast<c10::DeviceIndex>(r.device) : index;
    const auto count = c10::cuda::device_count();
    TORCH_CHECK(view->device >= 0 && view->device < count, "dtorch: cannot open CUDA memory of "
                "process ", r.pid, " on cuda:", static_cast<int>(view->device),
                ": this process sees ", static_cast<int>(count), " CUDA device(s)");
    if (r.kind == kNoBytes || span == 0) {
      // Nothing to map (the producer's block is not needed either).
      return MakeView(nullptr, std::move(view), dtype, sizes, strides);
    }
    char* data = nullptr;
    if (same_process) {
      const auto exported = LocalExports::Instance().Find(r.handle);
      TORCH_CHECK(exported.has_value(), "dtorch: a CUDA IPC record names this process, which "
                  "did not export it (corrupt)");
      CheckFits(r.offset, span, exported->end, r.pid);
      data = exported->segment_base + r.offset;
    } else {
      // torch's CUDA state (its caching allocator, which maps the handle) is set up lazily, on
      // the first CUDA tensor: a consumer whose first CUDA use is this value has none yet.
      at::globalContext().lazyInitDevice(c10::kCUDA);
      const c10::cuda::CUDAGuard guard(view->device);  // torch maps on the current device
      try {
        view->mapping = c10::cuda::CUDACachingAllocator::getIpcDevPtr(r.handle);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "dtorch: cannot open the CUDA memory that process ", r.pid,
                    " shared from its cuda:", r.device, " on cuda:", static_cast<int>(view->device),
                    ": ", e.what_without_backtrace(),
                    " (has the producer exited? Can this process's device reach that one? "
                    "Create the promise with device=\"cpu\" to receive a CPU tensor instead)");
      }
      // The record's offset and size are the producer's word: check them against what the
      // handle actually mapped, or a bad record makes the copy fault (a sticky error that loses
      // this process's CUDA context).
      char* const mapped = static_cast<char*>(view->mapping.get());
      const auto [range_base, range_size] = AllocationRange(mapped);
      const auto at = reinterpret_cast<uintptr_t>(mapped);
      TORCH_CHECK(at >= range_base && at - range_base <= range_size,
                  "dtorch: CUDA IPC: the opened memory lies outside its allocation's range");
      CheckFits(r.offset, span, range_size - (at - range_base), r.pid);
      data = mapped + r.offset;
    }
    return MakeView(data, std::move(view), dtype, sizes, strides);
  }

  c10::DeviceIndex LocalIndex(std::string_view bytes) override {
    try {
      const Record r = Decode(bytes);
      if (FromThisProcess(r)) return static_cast<c10::DeviceIndex>(r.device);
      const auto count = c10::cuda::device_count();
      for (c10::DeviceIndex i = 0; i < count; ++i) {
        if (DeviceUuid(i) == r.uuid) return i;
      }
    } catch (const c10::Error&) {
      // A bad record, or a device that cannot tell its UUID.
    }
    return -1;
  }
};

const bool registered = [] {
  static auto* const ipc = new CudaIpc();  // leaked: lives for the process
  RegisterDeviceIpc(c10::kCUDA, ipc);
  return true;
}();

}  // namespace
}  // namespace dtorch::cuda
