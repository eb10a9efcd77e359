#include "device_completion.h"

#include "internal_api.h"

#include <array>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "../core/completion_detectors.h"

namespace dtorch {
namespace {

// Per device type, set at load time by backends (and switched by the simulated device's tests).
// Zero-initialised atomics: constant-initialised, so a backend's static initialiser may register
// before or after this translation unit's own.
std::array<std::atomic<DeviceEvents*>, c10::COMPILE_TIME_MAX_DEVICE_TYPES> device_events{};
std::array<std::atomic<StreamCaptureQuery>, c10::COMPILE_TIME_MAX_DEVICE_TYPES> capture_queries{};

template <typename T>
std::atomic<T>& Slot(std::array<std::atomic<T>, c10::COMPILE_TIME_MAX_DEVICE_TYPES>& slots,
                     c10::DeviceType type, const char* registration) {
  const auto index = static_cast<size_t>(type);
  TORCH_CHECK(index < slots.size(), "dtorch: ", registration, ": device type ", index,
              " is out of range");
  return slots[index];
}

class EventCompletion final : public core::PendingCompletion {
 public:
  // A c10::Event, polled.
  EventCompletion(c10::Event event, c10::Device device, DeviceDoneCallback on_done)
      : polled_(std::move(event)), device_(device), on_done_(std::move(on_done)) {}

  // The device type's own event, which a detector can sleep on.
  EventCompletion(std::unique_ptr<DeviceEvent> event, c10::Device device,
                  DeviceDoneCallback on_done)
      : own_(std::move(event)), device_(device), on_done_(std::move(on_done)) {}

  bool Poll() override {
    MakeDeviceCurrent();
    return own_ ? own_->Query() : polled_->query();
  }

  bool CanBlock() const override { return own_ != nullptr; }
  bool WaitIsTimed() const override { return own_ == nullptr || own_->Timed(); }

  bool WaitFor(std::chrono::microseconds timeout) override {
    MakeDeviceCurrent();
    return own_->Wait(timeout);
  }

  void Complete(std::exception_ptr error) noexcept override {
    if (!error) {
      on_done_(std::nullopt);
      return;
    }
    try {
      std::rethrow_exception(error);
    } catch (const core::FutureError& e) {  // dropped at exit or fork
      on_done_(e);
    } catch (const c10::Error& e) {
      on_done_(DeviceError(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      on_done_(DeviceError(e.what()));
    } catch (...) {
      on_done_(DeviceError("unknown error"));
    }
  }

  // The event goes with it: a c10::Event is destroyed on its own device by its guard
  // implementation (CUDA's sets the device around cudaEventDestroy), a DeviceEvent minds its own
  // (DeviceEvent's contract). Either may be destroyed on the recording thread, whose current device
  // must not change.

 private:
  // Querying or waiting for the event on a thread whose current device is another would create a
  // context on that device (device 0 of a process that may use another only). Only detectors
  // call this (Poll, WaitFor), and a detector may serve streams of several devices: set when it
  // changes, and left set.
  void MakeDeviceCurrent() {
    thread_local std::optional<c10::Device> current_device;
    if (current_device != device_) {
      c10::impl::VirtualGuardImpl(device_.type()).setDevice(device_);
      current_device = device_;
    }
  }

  core::FutureError DeviceError(const std::string& message) const {
    return core::FutureError(core::FutureErrc::kDeviceError,
                             device_.str() + " reported: " + message);
  }

  std::optional<c10::Event> polled_;   // one of these two
  std::unique_ptr<DeviceEvent> own_;
  const c10::Device device_;
  DeviceDoneCallback on_done_;
};

std::string StreamKey(const c10::Stream& stream) {
  return std::to_string(static_cast<int>(stream.device_type())) + ":" +
         std::to_string(stream.device_index()) + ":" + std::to_string(stream.id());
}

void RefuseIfCapturing(StreamCaptureQuery query, const c10::Stream& stream, const char* op) {
  if (query == nullptr || !query(stream)) return;
  const bool cuda = stream.device_type() == c10::kCUDA;
  TORCH_CHECK(false, "dtorch: ", op != nullptr ? op : "get_tensor, to_torch_async and sync",
              " cannot run while the current stream of ", stream.device(),
              " is being captured into a ",
              c10::DeviceTypeName(stream.device_type(), /*lower_case=*/false), " graph",
              cuda ? " (torch.cuda.graph, torch.cuda.make_graphed_callables, torch.compile's CUDA "
                     "graphs)"
                   : "",
              ": the capture only records the device work, so the value would not exist when "
              "the call needs it. Call it outside the captured region, e.g. on the graph's "
              "output tensors after graph.replay().");
}

}  // namespace

void AfterCurrentStreamWork(const c10::Device& device, DeviceDoneCallback on_done) {
  c10::impl::VirtualGuardImpl guard(device.type());
  const c10::Stream stream = guard.getStream(device);
  RefuseIfCapturing(Slot(capture_queries, device.type(), "AfterCurrentStreamWork").load(), stream,
                    nullptr);
  std::unique_ptr<EventCompletion> completion;
  if (DeviceEvents* events = device_events[static_cast<size_t>(device.type())].load()) {
    completion = std::make_unique<EventCompletion>(events->Record(stream), stream.device(),
                                                   std::move(on_done));
  } else {
    c10::Event event(device.type());
    event.record(stream);
    completion =
        std::make_unique<EventCompletion>(std::move(event), stream.device(), std::move(on_done));
  }
  core::CompletionDetectors::Instance().Submit(StreamKey(stream), std::move(completion));
}

void CheckNotCapturing(const c10::Device& device, const char* op) {
  const StreamCaptureQuery query = Slot(capture_queries, device.type(), "CheckNotCapturing").load();
  if (query == nullptr) return;  // (no stream looked up: the common case costs one load)
  RefuseIfCapturing(query, c10::impl::VirtualGuardImpl(device.type()).getStream(device), op);
}

void RegisterDeviceEvents(c10::DeviceType type, DeviceEvents* events) {
  Slot(device_events, type, "RegisterDeviceEvents") = events;
}

void RegisterCaptureCheck(c10::DeviceType type, StreamCaptureQuery query) {
  Slot(capture_queries, type, "RegisterCaptureCheck") = query;
}

}  // namespace dtorch
