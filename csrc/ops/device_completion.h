// Completion after device work, for any backend with torch's device-generic events (CUDA, XPU,
// PrivateUse1, ...): written against c10::Event / c10::impl::VirtualGuardImpl, so it needs no
// CUDA headers and compiles without CUDA. The events are watched by the library's completion
// detectors (core/completion_detectors.h): one per active stream up to a cap, polling with
// back-off unless the device type registered a blocking wait.
#pragma once

#include <chrono>
#include <functional>
#include <optional>

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/Event.h>

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
void AfterCurrentStreamWork(const c10::Device& device, DeviceDoneCallback on_done);

// A device type's blocking wait: blocks until `event` has completed or `timeout` has passed,
// whichever comes first (a detector serving several streams relies on it), and returns whether it
// completed;
// throws, as c10::Event::query() does, when the device reported an error. It must sleep, not
// spin: it is what lets a detector wait for a stream without polling. Called on a detector
// thread whose current device is the event's.
using BlockingEventWait = bool (*)(const c10::Event& event, std::chrono::microseconds timeout);

// A device type opts in to blocking waits with RegisterBlockingEventWait (internal_api.h): values
// whose event is recorded from then on are waited for that way; the others keep polling with
// back-off. Backends register at load time (the simulated device of the tests does; CUDA's comes
// with blocking-sync events); nullptr opts a type out again.

}  // namespace dtorch
