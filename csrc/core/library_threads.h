// The library's threads as a whole (torch-free): the completion detectors, the completion pool
// and the file kind's doorbell watcher (core/completion_detectors.h, core/completion_pool.h,
// core/file_kind.h), stopped together at exit and reset
// together after fork.
//
// Exit: StopLibraryThreads() gives them one deadline (ExitTimeoutMs from the call, 1 s by
// default): the pool finishes posted work, the detectors complete what is done, and every value
// still pending is then failed with "dropped at interpreter exit". dtorch_ops calls it from its
// Python atexit handler, while Python can still serve the threads; C++ programs get it from
// std::atexit (registered when the library loads). Later calls do nothing.
//
// Fork: pthread_atfork handlers (registered when the library loads) keep both consistent across
// fork(); in the child, the fork generation is incremented, neither has a thread, and the values
// pending in the parent are failed ("dropped at fork").
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dtorch::core {

struct LibraryThreadCounts {
  size_t detectors = 0;  // named dtorch-detect
  size_t pool = 0;       // named dtorch-pool
  size_t doorbell = 0;   // named dtorch-doorbell: the file kind's watcher (core/file_kind.h)
  size_t network = 0;    // dtorch-net-watch (one per store) and dtorch-net-tick (core/network_kind.h)
};

LibraryThreadCounts CountLibraryThreads();

inline constexpr int64_t kDefaultExitTimeoutMs = 1000;
// Throws std::invalid_argument when < 0.
void SetExitTimeoutMs(int64_t ms);
int64_t ExitTimeoutMs();

void StopLibraryThreads();

}  // namespace dtorch::core
