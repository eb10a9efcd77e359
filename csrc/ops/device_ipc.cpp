// The registry of device types' interprocess memory sharing (DeviceIpc, internal_api.h):
// device-generic, filled at load time by backends (csrc/cuda/ for CUDA).
#include "internal_api.h"

#include <array>
#include <atomic>

#include <c10/util/Exception.h>

namespace dtorch {
namespace {

// Constant-initialised: a backend's static initialiser may register before this file's run.
std::array<std::atomic<DeviceIpc*>, c10::COMPILE_TIME_MAX_DEVICE_TYPES> device_ipcs{};

}  // namespace

void RegisterDeviceIpc(c10::DeviceType type, DeviceIpc* ipc) {
  const auto index = static_cast<size_t>(type);
  TORCH_CHECK(index < device_ipcs.size(), "dtorch: RegisterDeviceIpc: device type ", index,
              " is out of range");
  device_ipcs[index] = ipc;
}

DeviceIpc* FindDeviceIpc(c10::DeviceType type) {
  const auto index = static_cast<size_t>(type);
  return index < device_ipcs.size() ? device_ipcs[index].load() : nullptr;
}

}  // namespace dtorch
