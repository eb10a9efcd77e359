// The attach deadline every kind that crosses processes shares (torch-free): how long a promise
// in flight (serialized, or inherited by a forked child) whose creator dropped it, or that a
// holder passed on before every holder was gone, waits for a process to hold it before its future
// fails with "no producer attached". Setting: attach_timeout_s (settings.h).
//
// Thread-safety: may be called from any thread.
#pragma once

#include <cstdint>

namespace dtorch::core {

inline constexpr int64_t kDefaultAttachTimeoutMs = 30000;
// Throws std::invalid_argument when < 0.
void SetAttachTimeoutMs(int64_t ms);
int64_t AttachTimeoutMs();

}  // namespace dtorch::core
