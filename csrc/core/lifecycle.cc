#include "lifecycle.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "base/fork_generation.h"
#include "base/process.h"
#include "settings.h"
#include "shared_state.h"  // kMaxTimeoutMs

namespace dtorch::core {
namespace {

std::atomic<int64_t> exit_timeout_ms{kDefaultExitTimeoutMs};

struct Participants {
  std::mutex mu;  // taken by registrations (at load) and readers; held across fork
  std::vector<LifecycleParticipant> sorted;  // guarded by mu: by ascending order
};

Participants& Registered() {
  static auto* participants = new Participants();  // leaked: used by exit handlers
  return *participants;
}

// The list, copied under the lock (handlers run outside it: a stop may take its time).
std::vector<LifecycleParticipant> Snapshot() {
  std::lock_guard<std::mutex> lock(Registered().mu);
  return Registered().sorted;
}

// Registered().mu is held from PrepareFork to the after-fork handlers, which read the list
// under it.
void PrepareFork() {
  Registered().mu.lock();
  for (const auto& p : Registered().sorted) {
    if (p.prepare_fork) p.prepare_fork();
  }
}

void AfterForkInParent() {
  const auto& sorted = Registered().sorted;
  for (auto p = sorted.rbegin(); p != sorted.rend(); ++p) {
    if (p->after_fork_in_parent) p->after_fork_in_parent();
  }
  Registered().mu.unlock();
}

void AfterForkInChild() {
  ResetCurrentPidInForkChild();  // first: the handlers below ask for this process's pid
  BeginForkChildHandler();
  const auto& sorted = Registered().sorted;
  for (auto p = sorted.rbegin(); p != sorted.rend(); ++p) {
    if (p->after_fork_in_child) p->after_fork_in_child();
  }
  EndForkChildHandler();
  Registered().mu.unlock();
}

const bool process_handlers_installed = [] {
  Registered();  // constructed before any handler can run
  pthread_atfork(&PrepareFork, &AfterForkInParent, &AfterForkInChild);
  std::atexit(&StopLibraryThreads);
  return true;
}();

const bool exit_timeout_registered = RegisterSetting({
    "exit_timeout_s", Setting::Unit::kSeconds, kDefaultExitTimeoutMs, 0, kMaxTimeoutMs,
    "At interpreter exit, how long the library's threads get to finish completions in progress "
    "and work posted to the pool, before every value still pending fails with 'dropped at "
    "interpreter exit'.",
    &ExitTimeoutMs, &SetExitTimeoutMs, 30});

}  // namespace

bool RegisterParticipant(LifecycleParticipant participant) {
  auto& registered = Registered();
  std::lock_guard<std::mutex> lock(registered.mu);
  const auto at = std::upper_bound(
      registered.sorted.begin(), registered.sorted.end(), participant.order,
      [](int order, const LifecycleParticipant& p) { return order < p.order; });
  registered.sorted.insert(at, std::move(participant));
  return true;
}

std::map<std::string, size_t> CountLibraryThreads() {
  std::map<std::string, size_t> counts;
  for (const auto& p : Snapshot()) counts[p.name] += p.thread_count ? p.thread_count() : 0;
  return counts;
}

std::map<std::string, Diagnostics> LibraryDiagnostics() {
  std::map<std::string, Diagnostics> all;
  for (const auto& p : Snapshot()) {
    if (p.diagnostics) all[p.name] = p.diagnostics();
  }
  return all;
}

void SetExitTimeoutMs(int64_t ms) {
  if (ms < 0) throw std::invalid_argument("the exit timeout must be >= 0 ms");
  exit_timeout_ms = std::min(ms, kMaxTimeoutMs);  // past it: never (clock arithmetic)
}

int64_t ExitTimeoutMs() { return exit_timeout_ms.load(); }

void StopLibraryThreads() {
  (void)process_handlers_installed;
  (void)exit_timeout_registered;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(exit_timeout_ms.load());
  for (const auto& p : Snapshot()) {
    if (p.stop) p.stop(deadline);
  }
}

void EndingWithoutExitHandler() {
  for (const auto& p : Snapshot()) {
    if (p.ending_without_exit_handler) p.ending_without_exit_handler();
  }
}

}  // namespace dtorch::core
