#include "library_threads.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>

#include "completion_detectors.h"
#include "completion_pool.h"
#include "file_kind.h"
#include "fork_generation.h"
#include "network_kind.h"
#include "shared_state.h"  // kMaxTimeoutMs

namespace dtorch::core {
namespace {

std::atomic<int64_t> exit_timeout_ms{kDefaultExitTimeoutMs};

// Both are locked in the same order in every handler; the detectors first, since a detector's
// completion may post to the pool.
void PrepareFork() {
  CompletionDetectors::Instance().PrepareFork();
  CompletionPool::Instance().PrepareFork();
  PrepareForkFileKind();
}

void AfterForkInParent() {
  AfterForkFileKindInParent();
  CompletionPool::Instance().AfterForkInParent();
  CompletionDetectors::Instance().AfterForkInParent();
}

void AfterForkInChild() {
  shm::ResetCurrentPidInForkChild();  // first: the handlers below ask for this process's pid
  BeginForkChildHandler();
  AfterForkFileKindInChild();
  AfterForkNetworkKindInChild();
  CompletionPool::Instance().AfterForkInChild();
  CompletionDetectors::Instance().AfterForkInChild();
  EndForkChildHandler();
}

const bool process_handlers_installed = [] {
  CompletionDetectors::Instance();  // constructed before any handler can run
  CompletionPool::Instance();
  pthread_atfork(&PrepareFork, &AfterForkInParent, &AfterForkInChild);
  std::atexit(&StopLibraryThreads);
  return true;
}();

}  // namespace

LibraryThreadCounts CountLibraryThreads() {
  return {CompletionDetectors::Instance().ThreadCount(), CompletionPool::Instance().ThreadCount(),
          static_cast<size_t>(FileWatcherThreads()), NetworkKindThreads()};
}

void SetExitTimeoutMs(int64_t ms) {
  if (ms < 0) throw std::invalid_argument("the exit timeout must be >= 0 ms");
  exit_timeout_ms = std::min(ms, kMaxTimeoutMs);  // past it: never (clock arithmetic)
}

int64_t ExitTimeoutMs() { return exit_timeout_ms.load(); }

void StopLibraryThreads() {
  (void)process_handlers_installed;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(exit_timeout_ms.load());
  // The detectors first: a completion they run may still post to the pool.
  CompletionDetectors::Instance().Stop(deadline);
  CompletionPool::Instance().Stop(deadline);
  StopFileKind(deadline);
  StopNetworkKind(deadline);
}

}  // namespace dtorch::core
