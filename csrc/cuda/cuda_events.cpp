// CUDA's completions without spinning, and its graph-capture check (device_completion.h), through
// the CUDA runtime. Compiled only into a CUDA build (setup.py). Registered with the library by a
// static initialiser that touches no CUDA state: loading the library creates no context, and a
// machine without a GPU loads it as before.
//
// Events: torch's c10::Events for CUDA are created without cudaEventBlockingSync, so waiting for
// one spins a core. These are created with it (and without timing), so a detector sleeps in
// cudaEventSynchronize until the stream reaches the event. That wait has no timeout: DeviceEvent's
// Timed() is false, and the detectors handle it (core/completion_detectors.h, "Untimed waits").
// Nothing is inserted into the user's stream but the event record itself (no host function, which
// a CUDA graph would capture).
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../core/base/fork_generation.h"
#include "../ops/internal_api.h"

namespace dtorch::cuda {
namespace {

// Free events per device, reused: creating one is a driver call, and thousands of values may be
// pending. A fork child gets a new pool (the parent's events and mutex are not valid there).
class EventPool {
 public:
  // Kept free per device; more are destroyed (a burst of pending values leaves no pile behind).
  static constexpr size_t kMaxFreePerDevice = 1024;

  static EventPool& Current() {
    // Leaked: events may be released after static destruction began (a detector at exit).
    static std::atomic<EventPool*> current{nullptr};
    EventPool* pool = current.load();
    if (pool == nullptr || pool->generation_ != core::ForkGeneration()) {
      auto* made = new EventPool();
      if (current.compare_exchange_strong(pool, made)) {
        pool = made;  // (the previous one, a parent's, is leaked with its events)
      } else {
        delete made;  // another thread made it first: `pool` is that one
      }
    }
    return *pool;
  }

  // On a thread whose current device is `device`.
  cudaEvent_t Acquire(c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = FreeLocked(device);
      if (!free.empty()) {
        cudaEvent_t event = free.back();
        free.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    C10_CUDA_CHECK(
        cudaEventCreateWithFlags(&event, cudaEventBlockingSync | cudaEventDisableTiming));
    return event;
  }

  // On any thread (its current device is left as it was).
  void Release(c10::DeviceIndex device, cudaEvent_t event) noexcept {
    try {
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto& free = FreeLocked(device);
        if (free.size() < kMaxFreePerDevice) {
          free.push_back(event);
          return;
        }
      }
      // Destroyed on its own device (another current device would get a context created).
      const c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK_WARN(cudaEventDestroy(event));
    } catch (...) {
      // (No memory for the free list, or no device: the event is leaked.)
    }
  }

 private:
  std::vector<cudaEvent_t>& FreeLocked(c10::DeviceIndex device) {
    const auto index = static_cast<size_t>(device);
    if (free_.size() <= index) free_.resize(index + 1);
    return free_[index];
  }

  const uint64_t generation_ = core::ForkGeneration();
  std::mutex mu_;
  std::vector<std::vector<cudaEvent_t>> free_;  // guarded by mu_: per device index
};

class CudaEvent final : public DeviceEvent {
 public:
  CudaEvent(cudaEvent_t event, c10::DeviceIndex device) : event_(event), device_(device) {}
  ~CudaEvent() override { EventPool::Current().Release(device_, event_); }

  cudaEvent_t get() const { return event_; }

  bool Query() override {
    // Relaxed: while another thread captures a CUDA graph in the "global" mode (torch's default),
    // querying an event would be refused, and would invalidate that capture.
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    const cudaError_t error = cudaEventQuery(event_);
    if (error == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it, as c10::Event::query() does
      return false;
    }
    C10_CUDA_CHECK(error);
    return true;
  }

  bool Wait(std::chrono::microseconds /*timeout: none in CUDA*/) override {
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    C10_CUDA_CHECK(cudaEventSynchronize(event_));  // sleeps: created with cudaEventBlockingSync
    return true;
  }

  bool Timed() const override { return false; }

 private:
  const cudaEvent_t event_;
  const c10::DeviceIndex device_;
};

class CudaEvents final : public DeviceEvents {
 public:
  std::unique_ptr<DeviceEvent> Record(const c10::Stream& stream) override {
    const c10::cuda::CUDAStream cuda_stream(stream);
    const c10::DeviceIndex device = stream.device_index();
    // An event is created on, and recorded on a stream of, its own device; the caller's current
    // device is restored (without creating a context on it).
    const c10::cuda::CUDAGuard guard(device);
    auto event = std::make_unique<CudaEvent>(EventPool::Current().Acquire(device), device);
    C10_CUDA_CHECK(cudaEventRecord(event->get(), cuda_stream.stream()));
    return event;
  }
};

// Whether work queued on `stream` now would be captured into a CUDA graph rather than run.
bool StreamIsCapturing(const c10::Stream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t error =
      cudaStreamIsCapturing(c10::cuda::CUDAStream(stream).stream(), &status);
  if (error == cudaErrorStreamCaptureImplicit) {
    // The legacy default stream while another stream captures in the "global" mode: work queued
    // on it now would join (and invalidate) that capture.
    (void)cudaGetLastError();
    return true;
  }
  C10_CUDA_CHECK(error);
  return status != cudaStreamCaptureStatusNone;  // active, or invalidated but not yet ended
}

// No CUDA call here: only pointers are stored.
const bool registered = [] {
  static auto* const events = new CudaEvents();  // leaked: lives for the process
  RegisterDeviceEvents(c10::kCUDA, events);
  RegisterCaptureCheck(c10::kCUDA, &StreamIsCapturing);
  return true;
}();

}  // namespace
}  // namespace dtorch::cuda
