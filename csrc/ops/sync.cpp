#include "sync.h"

#include <memory>
#include <string>
#include <utility>

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "../core/promise_future.h"
#include "device_completion.h"
#include "errors.h"

namespace dtorch {
namespace {

using Producer = detail::ProducerAccess<Unit>;

// A device the caller named, checked and with its index filled in (the current one if absent).
c10::Device Resolve(const c10::Device& device) {
  if (device.is_cpu()) return c10::Device(c10::kCPU);
  const std::string type = c10::DeviceTypeName(device.type(), /*lower_case=*/true);
  TORCH_CHECK(c10::impl::hasDeviceGuardImpl(device.type()), "dtorch: sync: cannot sync ", device,
              ": this torch build has no ", type, " support");
  c10::impl::VirtualGuardImpl guard(device.type());
  const auto count = guard.deviceCount();
  TORCH_CHECK(count > 0, "dtorch: sync: cannot sync ", device, ": this process sees no ", type,
              " device");
  const auto index = device.has_index() ? device.index() : guard.getDevice().index();
  TORCH_CHECK(index < count, "dtorch: sync: device ", device, " does not exist: this process sees ",
              static_cast<int>(count), " ", type, " device(s)");
  return c10::Device(device.type(), index);
}

// The CPU sync kernel: CPU work is done when the op runs.
void SyncCpu(const c10::intrusive_ptr<VoidPromise>& promise) { Producer::SetValue(*promise, {}, "sync"); }

// The device sync kernel: complete once the device's current stream reaches this point.
void SyncDevice(const c10::Device& device, const c10::intrusive_ptr<VoidPromise>& promise) {
  Producer::Claim(*promise, "sync");
  AfterCurrentStreamWork(device, [promise](const std::optional<core::FutureError>& error) {
    if (error) {
      Producer::FailClaimed(*promise, error->code(), error->detail());
    } else {
      Producer::CompleteClaimed(*promise, {});
    }
  });
}

}  // namespace

std::vector<c10::Device> UsedDevices() {
  std::vector<c10::Device> used;
  // Every accelerator type with a device guard in this process (a CUDA build with a PrivateUse1
  // plugin loaded has two; at::getAccelerator() would name only one of them).
  for (const auto type : {c10::kCUDA, c10::kHIP, c10::kXPU, c10::kMPS, c10::kMTIA,
                          c10::kPrivateUse1}) {
    if (!c10::impl::hasDeviceGuardImpl(type)) continue;
    const auto count = c10::impl::VirtualGuardImpl(type).deviceCount();
    for (c10::DeviceIndex index = 0; index < count; ++index) {
      bool has_context = false;
      try {
        has_context =
            at::globalContext().getAcceleratorHooksInterface(type).hasPrimaryContext(index);
      } catch (const c10::Error&) {
        // A backend without hooks cannot tell: it is not counted as used.
      }
      if (has_context) used.emplace_back(type, index);
    }
  }
  if (used.empty()) used.emplace_back(c10::kCPU);
  return used;
}

c10::intrusive_ptr<VoidFutureCollect> SyncAsync(const DeviceList& devices) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dtorch::sync", "")
          .typed<c10::intrusive_ptr<VoidFutureCollect>(const DeviceList&)>();
  return op.call(devices);
}

void Sync(const DeviceList& devices) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dtorch::sync_wait", "")
                             .typed<void(const DeviceList&)>();
  op.call(devices);
}

void SyncInto(const DeviceList& devices, const c10::intrusive_ptr<VoidPromise>& promise) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dtorch::sync_into", "")
          .typed<void(const DeviceList&, const c10::intrusive_ptr<VoidPromise>&)>();
  op.call(devices, promise);
}

namespace kernels {

c10::intrusive_ptr<VoidFutureCollect> sync(const DeviceList& devices) {
  std::vector<c10::Device> targets;
  if (devices) {
    for (const auto& device : *devices) targets.push_back(Resolve(device));
  } else {
    targets = UsedDevices();
  }
  std::vector<c10::intrusive_ptr<VoidFuture>> futures;
  futures.reserve(targets.size());
  for (const auto& device : targets) {
    auto promise =
        c10::make_intrusive<VoidPromise>(std::make_unique<core::MemoryPromise<core::Unit>>());
    futures.push_back(promise->GetFuture());
    if (device.is_cpu()) {
      SyncCpu(promise);
      continue;
    }
    try {
      SyncDevice(device, promise);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "dtorch: sync: cannot sync ", device, ": ", e.what_without_backtrace());
    }
  }
  return c10::make_intrusive<VoidFutureCollect>(std::move(targets), std::move(futures));
}

void sync_into(const DeviceList& devices, const c10::intrusive_ptr<VoidPromise>& promise) {
  TORCH_CHECK(promise, "dtorch: sync_into needs a VoidPromise, got None");
  auto collect = sync(devices);  // first: a bad device raises before the promise is claimed
  Producer::Claim(*promise, "sync_into");
  collect->OnReady([collect, promise] {
    try {
      collect->Get();
    } catch (const c10::Error& e) {
      const auto* coded = CodeOf(e);
      Producer::FailClaimed(*promise, coded ? coded->code() : core::FutureErrc::kProducerError,
                            NestedMessage(e));
      return;
    }
    Producer::CompleteClaimed(*promise, {});
  });
}

void sync_wait(const DeviceList& devices) { sync(devices)->Get(); }

}  // namespace kernels
}  // namespace dtorch
