// What the library needs to survive fork() (torch-free).
//
// The fork generation: 0 in the process that loaded the library, incremented in each child
// created by fork() (by the library's pthread_atfork child handler). State that threads of a parent
// may have left behind (waiters counted on a condition variable, an event loop's notifier) compares
// generations to know it is in a child.
//
// The child handler runs on the child's only thread, where a locked mutex is held by a thread of
// the parent that does not exist there: the values it fails take their locks with LockSurvivingFork,
// which re-initialises such a mutex instead of waiting for it forever.
//
// Thread-safety: may be called from any thread.
#pragma once

#include <cstdint>
#include <mutex>
#include <new>

namespace dtorch::core {

uint64_t ForkGeneration() noexcept;
// Whether this is the fork child handler (see above).
bool InForkChildHandler() noexcept;

// The library's pthread_atfork child handler brackets its work with these.
void BeginForkChildHandler() noexcept;
void EndForkChildHandler() noexcept;

// Locks `mu` and returns its lock. In the fork child handler, a mutex that is locked is held by a
// thread that does not exist: it is re-initialised (its owner is gone, not destroyed) and locked.
inline std::unique_lock<std::mutex> LockSurvivingFork(std::mutex& mu) {
  if (!InForkChildHandler()) return std::unique_lock<std::mutex>(mu);
  if (!mu.try_lock()) {
    new (&mu) std::mutex();
    mu.lock();
  }
  return std::unique_lock<std::mutex>(mu, std::adopt_lock);
}

}  // namespace dtorch::core
