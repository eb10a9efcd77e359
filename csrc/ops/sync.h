// Graph sync: wait for the work queued so far on each device's current stream, as ops
// (dtorch::sync, sync_into, sync_wait) and as the C++ API. One VoidFuture per device, completed by
// that device's sync kernel (CPU: at once; event-capable devices: when an event recorded on the
// current stream fires, from a library poller thread), collected by a VoidFutureCollect.
#pragma once

#include <optional>
#include <vector>

#include <c10/core/Device.h>

#include "futures.h"

namespace dtorch {

using DeviceList = std::optional<std::vector<c10::Device>>;

// dtorch::sync through the dispatcher: returns at once; the collect is ready when every device is.
// devices = nullopt: the devices this process has used (see UsedDevices).
c10::intrusive_ptr<VoidFutureCollect> SyncAsync(const DeviceList& devices = std::nullopt);
// dtorch::sync_wait: blocks until every device is done (the seed's Graph::Sync()).
void Sync(const DeviceList& devices = std::nullopt);
// dtorch::sync_into: completes `promise` (possibly another process's) when every device is done.
void SyncInto(const DeviceList& devices, const c10::intrusive_ptr<VoidPromise>& promise);

// The accelerator devices (CUDA, HIP, XPU, MPS, MTIA, PrivateUse1) that this process has used (a
// context exists on them); {cpu} when there is none.
std::vector<c10::Device> UsedDevices();

namespace kernels {
c10::intrusive_ptr<VoidFutureCollect> sync(const DeviceList& devices);
void sync_into(const DeviceList& devices, const c10::intrusive_ptr<VoidPromise>& promise);
void sync_wait(const DeviceList& devices);
}  // namespace kernels

}  // namespace dtorch
