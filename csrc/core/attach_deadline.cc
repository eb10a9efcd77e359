#include "attach_deadline.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "shared_state.h"  // kMaxTimeoutMs
#include "settings.h"

namespace dtorch::core {
namespace {
std::atomic<int64_t> attach_timeout_ms{kDefaultAttachTimeoutMs};
}  // namespace

void SetAttachTimeoutMs(int64_t ms) {
  if (ms < 0) throw std::invalid_argument("the attach timeout must be >= 0 ms");
  attach_timeout_ms = std::min(ms, kMaxTimeoutMs);  // past it: never (clock arithmetic)
}

int64_t AttachTimeoutMs() { return attach_timeout_ms.load(); }

namespace {
const bool attach_timeout_registered = RegisterSetting(
    {"attach_timeout_s", Setting::Unit::kSeconds, kDefaultAttachTimeoutMs, 0, kMaxTimeoutMs,
     "File and network promises: how long a promise in flight waits for a process to hold it "
     "before its future fails with 'no producer attached': one serialized (or inherited by a "
     "forked child) whose creator dropped its handle and that no process received, and one that a "
     "holder passed on (serialized) before every holder was gone, counted from then.",
     &AttachTimeoutMs, &SetAttachTimeoutMs, 40});
}  // namespace

}  // namespace dtorch::core
