// Completion after device work, for any backend with torch's device-generic events (CUDA, XPU,
// PrivateUse1, ...): written against c10::Event / c10::impl::VirtualGuardImpl, so it needs no
// CUDA headers and compiles without CUDA. The events are watched by the library's completion
// detectors (core/completion_detectors.h): one per active stream up to a cap, polling with
// back-off unless the device type registered its own events (DeviceEvents), which a detector can
// sleep on.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "../core/future_error.h"

namespace dtorch {

// Called with std::nullopt when the work is done, or with the reason it never will be: a
// FutureError of code kDeviceError (its detail names the device and the device's message),
// kDroppedAtExit or kDroppedAtFork.
using DeviceDoneCallback = std::function<void(const std::optional<core::FutureError>& error)>;

// Records an event on `device`'s current stream (the calling thread's) and returns at once. Once
// the work queued there so far has finished, `on_done` runs on a library detector thread. Other
// streams are not waited for. `on_done` must not throw, block or take the GIL; what it captures
// lives until it has run (and is leaked if the value is dropped at exit or fork).
// Throws c10::Error, and records nothing, while the stream is being captured into a graph
// (CheckNotCapturing) or when the device refuses the event.
void AfterCurrentStreamWork(const c10::Device& device, DeviceDoneCallback on_done);

// ---- Device types' own events (a backend opts in; internal_api.h registers them).

// One recorded event of a device type's own: what a detector waits on instead of a polled
// c10::Event. Query and Wait are called on a detector thread whose current device is the event's,
// never concurrently for one event. The destructor runs on a detector, or on the recording thread
// when the value could not be submitted (never for a value dropped at exit or fork: leaked): it
// must not assume the current device (CUDA's guards its own), throw or block.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // Non-blocking: whether the work queued before the event has finished. Throws c10::Error when the
  // device reported an error (as c10::Event::query() does).
  virtual bool Query() = 0;
  // Blocks without spinning (the thread sleeps) until the work has finished, and returns true; a
  // Timed() event also returns false once `timeout` has passed. Throws as Query does.
  virtual bool Wait(std::chrono::microseconds timeout) = 0;
  // Whether Wait honours its timeout. An untimed Wait (CUDA's cudaEventSynchronize) returns only
  // when the work has finished or failed: a detector in it serves no other stream meanwhile (see
  // core/completion_detectors.h, "Untimed waits").
  virtual bool Timed() const { return true; }
};

// A device type's event recorder. Lives for the process once registered (a registration may be
// replaced; the old recorder must stay valid, as events it recorded may be pending).
class DeviceEvents {
 public:
  virtual ~DeviceEvents() = default;
  // Records an event on `stream` (a stream of this type) on the calling thread, after the work
  // queued there so far. Must leave the caller's current device as it was. Throws c10::Error.
  // Thread-safe.
  virtual std::unique_ptr<DeviceEvent> Record(const c10::Stream& stream) = 0;
};

// ---- Graph capture.

// A device type's capture query: whether work queued on `stream` now is being captured into a
// graph (recorded to be replayed later) rather than run. Must not throw for a capturing stream;
// may throw c10::Error when the device cannot tell. Thread-safe.
using StreamCaptureQuery = bool (*)(const c10::Stream& stream);

// Refuses (TORCH_CHECK: a c10::Error that says to call `op` outside the captured region) when
// `device`'s current stream is being captured, as the type's registered query tells (none: never).
// An op that waits for device work calls it before it queues anything on the stream (a copy, a
// snapshot) or claims a promise, so that a refused call changes nothing; AfterCurrentStreamWork
// checks again before recording. Under capture the event or copy would only be recorded into the
// graph, and no value would come of the call itself. `op` names the user's call in the message
// (nullptr: a generic name). Costs one atomic load for a type without a query.
void CheckNotCapturing(const c10::Device& device, const char* op);

}  // namespace dtorch
