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

  bool Poll() override {
    // Make the event's device current on this (poller) thread first: otherwise querying and
    // destroying the event here would create a context on device 0 of a process that may use
    // another device only. A poller thread serves one stream, so this is set once in effect.
    c10::impl::VirtualGuardImpl(event_.device_type()).setDevice(tensor_.device());
    return event_.query();
  }

  void Complete(std::exception_ptr error) noexcept override {
    try {
      if (!error) {
        promise_->SetValue(tensor_);
        return;
      }
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        promise_->SetException("device error while waiting for the tensor on " +
                               tensor_.device().str() + ": " + e.what());
      } catch (...) {
        promise_->SetException("unknown device error while waiting for the tensor on " +
                               tensor_.device().str());
      }
    } catch (...) {
      // The promise was satisfied meanwhile by another producer: the first completion stands.
    }
  }

 private:
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
  // The CPU kernel would raise at once on a used promise; raise here too, not on a poller thread.
  TORCH_CHECK(!promise->IsSatisfied(), "dtorch: get_tensor: the promise already holds a value or "
              "an exception; a promise is fulfilled once, use a new one per value");
  const c10::Device device = input.device();
  c10::impl::VirtualGuardImpl guard(device.type());
  const c10::Stream stream = guard.getStream(device);
  c10::Event event(device.type());
  event.record(stream);
  core::CompletionPoller::Instance().Submit(
      StreamKey(stream), std::make_unique<EventCompletion>(std::move(event), input, promise));
}

}  // namespace dtorch::kernels
