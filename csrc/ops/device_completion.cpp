#include "device_completion.h"

#include "internal_api.h"

#include <array>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "../core/completion_detectors.h"

namespace dtorch {
namespace {

std::array<std::atomic<BlockingEventWait>, c10::COMPILE_TIME_MAX_DEVICE_TYPES> blocking_waits{};

class EventCompletion final : public core::PendingCompletion {
 public:
  EventCompletion(c10::Event event, c10::Device device, BlockingEventWait blocking_wait,
                  DeviceDoneCallback on_done)
      : event_(std::move(event)),
        device_(device),
        blocking_wait_(blocking_wait),
        on_done_(std::move(on_done)) {}

  bool Poll() override {
    MakeDeviceCurrent();
    return event_.query();
  }

  bool CanBlock() const override { return blocking_wait_ != nullptr; }

  bool WaitFor(std::chrono::microseconds timeout) override {
    MakeDeviceCurrent();
    return blocking_wait_(event_, timeout);
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

 private:
  // Querying or destroying the event on a thread whose current device is another would create a
  // context on that device (device 0 of a process that may use another only). A detector may
  // serve streams of several devices: set when it changes.
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

  c10::Event event_;
  const c10::Device device_;
  const BlockingEventWait blocking_wait_;
  DeviceDoneCallback on_done_;
};

std::string StreamKey(const c10::Stream& stream) {
  return std::to_string(static_cast<int>(stream.device_type())) + ":" +
         std::to_string(stream.device_index()) + ":" + std::to_string(stream.id());
}

}  // namespace

void AfterCurrentStreamWork(const c10::Device& device, DeviceDoneCallback on_done) {
  c10::impl::VirtualGuardImpl guard(device.type());
  const c10::Stream stream = guard.getStream(device);
  c10::Event event(device.type());
  event.record(stream);
  const auto blocking_wait = blocking_waits[static_cast<size_t>(device.type())].load();
  core::CompletionDetectors::Instance().Submit(
      StreamKey(stream), std::make_unique<EventCompletion>(std::move(event), stream.device(),
                                                           blocking_wait, std::move(on_done)));
}

void RegisterBlockingEventWait(c10::DeviceType type, BlockingEventWait wait) {
  const auto index = static_cast<size_t>(type);
  TORCH_CHECK(index < blocking_waits.size(), "dtorch: RegisterBlockingEventWait: device type ",
              index, " is out of range");
  blocking_waits[index] = wait;
}

}  // namespace dtorch
