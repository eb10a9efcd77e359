// The event-gated get_tensor kernel, written once against torch's device-generic event and stream
// API (c10::Event, c10::impl::VirtualGuardImpl) so it serves every backend that registers a
// DeviceGuardImplInterface, and compiles without CUDA.
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "../core/completion_poller.h"
#include "get_tensor.h"

namespace dtorch::kernels {
namespace {

// Holds the tensor (so its memory outlives the device work), the event and the promise until the
// event has completed, then fulfils the promise on the poller thread.
class EventCompletion final : public core::PendingCompletion {
 public:
  EventCompletion(c10::Event event, at::Tensor tensor, c10::intrusive_ptr<TensorPromise> promise)
      : event_(std::move(event)), tensor_(std::move(tensor)), promise_(std::move(promise)) {}

  bool Poll() override { return event_.query(); }

  void Complete(std::exception_ptr error) noexcept override {
    try {
      if (error) std::rethrow_exception(error);
      promise_->SetValue(tensor_);
    } catch (const std::exception& e) {
      SetExceptionNoThrow(std::string("device error while waiting for the tensor on ") +
                          tensor_.device().str() + ": " + e.what());
    } catch (...) {
      SetExceptionNoThrow("unknown device error while waiting for the tensor on " +
                          tensor_.device().str());
    }
  }

 private:
  void SetExceptionNoThrow(const std::string& message) noexcept {
    try {
      promise_->SetException(message);
    } catch (...) {
      // Already satisfied by someone else: the first completion stands.
    }
  }

  c10::Event event_;
  at::Tensor tensor_;
  c10::intrusive_ptr<TensorPromise> promise_;
};

std::string StreamKey(const c10::Stream& stream) {
  return std::to_string(static_cast<int>(stream.device_type())) + ":" +
         std::to_string(stream.device_index()) + ":" + std::to_string(stream.id());
}

}  // namespace

void get_tensor_device(const at::Tensor& input, const c10::intrusive_ptr<TensorPromise>& promise) {
  TORCH_CHECK(promise, "dtorch: get_tensor needs a TensorPromise, got None");
  const c10::Device device = input.device();
  c10::impl::VirtualGuardImpl guard(device.type());
  const c10::Stream stream = guard.getStream(device);
  c10::Event event(device.type());
  event.record(stream);
  core::CompletionPoller::Instance().Submit(
      StreamKey(stream), std::make_unique<EventCompletion>(std::move(event), input, promise));
}

}  // namespace dtorch::kernels
