// The library's one clock (torch-free): deadlines, ages and heartbeats are all measured on the
// monotonic clock, never the wall clock (a clock step must not fire or stall a timeout).
#pragma once

#include <chrono>
#include <cstdint>

namespace dtorch::core {

using Clock = std::chrono::steady_clock;

// Milliseconds on Clock since an arbitrary origin (the same one in every thread of a process).
inline int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace dtorch::core
