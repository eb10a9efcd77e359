// Which process this is, and whether another still runs (torch-free; Linux): the identity every
// kind that crosses processes records for its peers, and that the library's fork handler resets.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdint>

namespace dtorch::core {

// A process, told apart from a later one that reuses its pid by its start time (clock ticks after
// boot, /proc/<pid>/stat field 22), in a pid namespace (the inode of /proc/<pid>/ns/pid).
struct ProcessId {
  int32_t pid = 0;
  uint64_t start_time = 0;
  uint64_t pid_namespace = 0;
  bool operator==(const ProcessId& other) const {
    return pid == other.pid && start_time == other.start_time &&
           pid_namespace == other.pid_namespace;
  }
};

// getpid() without a system call on the hot paths: cached, and reset by the library's fork
// handler in the child (ResetCurrentPidInForkChild, first thing).
int32_t CurrentPid() noexcept;
void ResetCurrentPidInForkChild() noexcept;

// This process (recomputed after fork). Throws FutureError(kSharedMemory) if /proc cannot tell.
ProcessId Self();
// A process of this pid namespace.
ProcessId InThisNamespace(int32_t pid, uint64_t start_time);
// Whether `process` still runs: false only when it is known to be gone (no such pid, a zombie, or
// another start time). A process of another pid namespace, or one /proc cannot tell about now
// (out of file descriptors), counts as alive.
bool IsAlive(const ProcessId& process);

}  // namespace dtorch::core
