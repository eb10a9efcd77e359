// Graph sync: the kernels of dtorch::sync, sync_into and sync_wait (the C++ API over them, Sync /
// SyncAsync / SyncInto, is declared in <dtorch/dtorch.h>). One VoidFuture per device, completed by
// that device's sync kernel (CPU: at once; event-capable devices: when an event recorded on the
// current stream fires, from a library detector thread), collected by a VoidFutureCollect.
#pragma once

#include <vector>

#include <c10/core/Device.h>

#include "futures.h"

namespace dtorch {

// The accelerator devices (CUDA, HIP, XPU, MPS, MTIA, PrivateUse1) that this process has used (a
// context exists on them); {cpu} when there is none.
std::vector<c10::Device> UsedDevices();

namespace kernels {
c10::intrusive_ptr<VoidFutureCollect> sync(const DeviceList& devices);
void sync_into(const DeviceList& devices, const c10::intrusive_ptr<VoidPromise>& promise);
void sync_wait(const DeviceList& devices);
}  // namespace kernels

}  // namespace dtorch
