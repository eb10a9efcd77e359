#include "device_completion.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "../core/completion_poller.h"

namespace dtorch {
namespace {

class EventCompletion final : public core::PendingCompletion {
 public:
  EventCompletion(c10::Event event, c10::Device device, DeviceDoneCallback on_done)
      : event_(std::move(event)), device_(device), on_done_(std::move(on_done)) {}

  bool Poll() override {
    // Make the event's device current on this (poller) thread first: otherwise querying and
    // destroying the event here would create a context on device 0 of a process that may use
    // another device only. A poller thread serves one stream (one device): set once per thread.
    thread_local std::optional<c10::Device> current_device;
    if (current_device != device_) {
      c10::impl::VirtualGuardImpl(device_.type()).setDevice(device_);
      current_device = device_;
    }
    return event_.query();
  }

  void Complete(std::exception_ptr error) noexcept override {
    std::optional<std::string> message;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const c10::Error& e) {
        message = "device error on " + device_.str() + ": " + e.what_without_backtrace();
      } catch (const std::exception& e) {
        message = "device error on " + device_.str() + ": " + e.what();
      } catch (...) {
        message = "unknown device error on " + device_.str();
      }
    }
    on_done_(message);
  }

 private:
  c10::Event event_;
  c10::Device device_;
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
  core::CompletionPoller::Instance().Submit(
      StreamKey(stream),
      std::make_unique<EventCompletion>(std::move(event), stream.device(), std::move(on_done)));
}

void StopDeviceCompletionsAtExit() {
  core::CompletionPoller::Instance().Shutdown(/*timeout_ms=*/1000);
}

}  // namespace dtorch
