// Completion after device work, for any backend with torch's device-generic events (CUDA, XPU,
// PrivateUse1, ...): written against c10::Event / c10::impl::VirtualGuardImpl, so it needs no
// CUDA headers and compiles without CUDA.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include <c10/core/Device.h>

namespace dtorch {

// Called with std::nullopt when the work is done, or with a message naming the device
// ("device error on cuda:0: ...") when the device reported an error.
using DeviceDoneCallback = std::function<void(const std::optional<std::string>& error)>;

// Records an event on `device`'s current stream (the calling thread's) and returns at once. Once
// the work queued there so far has finished, `on_done` runs on a library poller thread (one per
// active stream, not one per call). Other streams are not waited for. `on_done` must not throw;
// what it captures lives until it has run.
void AfterCurrentStreamWork(const c10::Device& device, DeviceDoneCallback on_done);

// At process exit: stops completing pending values (they are dropped, never fulfilled), waiting
// briefly for completions in progress, so that no library thread touches Python or a device
// runtime while they are torn down. dtorch_ops calls it from an atexit handler (op
// dtorch::_at_exit); C++ programs get the same from std::atexit.
void StopDeviceCompletionsAtExit();

}  // namespace dtorch
