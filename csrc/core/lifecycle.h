// The library's lifecycle (torch-free): exit, fork and thread counts, owned by the runtime and
// served by participants that register themselves (the completion detectors, the completion
// pool, each kind with threads or process-wide state). This file names none of them.
//
// Exit: StopLibraryThreads() gives every participant one deadline (ExitTimeoutMs from the call,
// 1 s by default), in ascending `order`: the detectors first (a completion they run may still post
// to the pool), then the pool (it finishes posted work), then the kinds (each fails what is still
// pending with "dropped at interpreter exit"). dtorch_ops calls it from its Python atexit handler,
// while Python can still serve the threads; C++ programs get it from std::atexit (registered when
// the library loads). Later calls do nothing.
//
// Fork: pthread_atfork handlers (installed when the library loads) call every participant's
// prepare_fork in ascending order, and after_fork_in_parent / after_fork_in_child in descending
// order; in the child, the cached pid is reset and the fork generation incremented first, no
// participant has a thread, and the values pending in the parent are failed ("dropped at fork").
//
// A process about to end without the exit handler (a fork-started multiprocessing child):
// EndingWithoutExitHandler() runs each participant's ending_without_exit_handler.
//
// Lifetime: participants register from static initializers of the library (RegisterParticipant
// returns true, for `const bool registered = RegisterParticipant(...)`), before any handler can
// run, and stay registered.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <variant>

namespace dtorch::core {

// A participant's diagnostics (for tests and debugging): named counts, or a name (a segment's).
using Diagnostics = std::map<std::string, std::variant<int64_t, std::string>>;

struct LifecycleParticipant {
  std::string name;  // its key in CountLibraryThreads ("detectors", "pool", "doorbell", ...)
  int order = 0;     // see above: detectors 0, pool 10, kinds 20 and up
  // Every function may be empty (nothing to do); none may throw.
  std::function<size_t()> thread_count;
  std::function<void(std::chrono::steady_clock::time_point deadline)> stop;
  std::function<void()> prepare_fork;
  std::function<void()> after_fork_in_parent;
  std::function<void()> after_fork_in_child;
  std::function<void()> ending_without_exit_handler;
  std::function<Diagnostics()> diagnostics;
};

bool RegisterParticipant(LifecycleParticipant participant);

// Threads of each participant now, by name.
std::map<std::string, size_t> CountLibraryThreads();
// The diagnostics of each participant that has some, by name.
std::map<std::string, Diagnostics> LibraryDiagnostics();

inline constexpr int64_t kDefaultExitTimeoutMs = 1000;
// Throws std::invalid_argument when < 0.
void SetExitTimeoutMs(int64_t ms);
int64_t ExitTimeoutMs();

void StopLibraryThreads();
void EndingWithoutExitHandler();

}  // namespace dtorch::core
