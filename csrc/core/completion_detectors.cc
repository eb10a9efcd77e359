#include "completion_detectors.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "future_error.h"
#include "lifecycle.h"
#include "settings.h"
#include "shared_state.h"  // kMaxTimeoutMs

namespace dtorch::core {
namespace {

using std::chrono::microseconds;
constexpr microseconds kMinBackoff{20};
constexpr microseconds kMaxBackoff{1000};
// Completions examined per key and round: those behind a finished one are usually finished too.
constexpr size_t kBatch = 64;

std::exception_ptr Dropped(FutureErrc code) {
  const char* detail =
      code == FutureErrc::kDroppedAtExit
          ? "the value was still pending when dtorch_ops stopped its threads at process exit; "
            "wait for it before the program exits, or in an atexit handler registered after "
            "dtorch_ops was imported (those run before the library stops)"
          : "the value was pending in the parent process when it forked, and device work does "
            "not survive fork; get it in the parent, or start workers with the 'spawn' method";
  return std::make_exception_ptr(FutureError(code, detail));
}

// Completes `items` with `error`, then leaks them (see the header: what they hold may belong to a
// runtime being torn down, or to the parent's device context).
void CompleteAndLeak(std::vector<PendingCompletion*>& items, FutureErrc code) {
  const auto error = Dropped(code);
  for (auto* item : items) item->Complete(error);
  items.clear();
}

}  // namespace

struct CompletionDetectors::Key {
  explicit Key(std::string key_name) : name(std::move(key_name)) {}
  const std::string name;
  std::deque<std::unique_ptr<PendingCompletion>> items;
  Detector* detector = nullptr;  // the one serving this key, for as long as the key is active
};

struct CompletionDetectors::Detector {
  std::condition_variable cv;  // a key given to it, or Stop
  std::vector<Key*> keys;      // the keys it serves
  bool notified = false;
  bool blocking = false;       // inside a blocking wait: a new key would wait for the slice
  bool untimed = false;        // that wait ends only with its work: a new key would wait for it
  std::chrono::steady_clock::time_point slice_end;  // of a timed wait
};

struct CompletionDetectors::State {
  std::mutex mu;
  std::condition_variable changed;  // a detector exited, or completions finished
  // Everything below is guarded by mu.
  std::map<std::string, std::unique_ptr<Key>> keys;  // the active keys
  std::list<std::unique_ptr<Detector>> detectors;     // the live detector threads
  int64_t max_threads = kDefaultMaxThreads;
  int64_t idle_exit_ms = kDefaultIdleExitMs;
  size_t pending = 0;     // submitted, not yet completed
  size_t completing = 0;  // inside Complete() on a detector, outside mu
  uint64_t notified_wakeups = 0;
  bool stopping = false;  // Stop() began: no new values, detectors finish what is done
  // Stop() dropped what was pending: detectors touch nothing more. Set under mu; also read
  // without it between polls.
  std::atomic<bool> dropped{false};
  int fail_thread_starts_for_testing = 0;
};

CompletionDetectors::CompletionDetectors() : state_(new State()) {}

CompletionDetectors& CompletionDetectors::Instance() {
  // Leaked on purpose: detached detectors may outlive static destruction.
  static CompletionDetectors* detectors = new CompletionDetectors();
  return *detectors;
}

void CompletionDetectors::Submit(const std::string& key,
                                 std::unique_ptr<PendingCompletion> completion) {
  State& st = *state_;
  std::unique_lock<std::mutex> lock(st.mu);
  if (st.stopping) {
    lock.unlock();
    std::vector<PendingCompletion*> late{completion.release()};
    CompleteAndLeak(late, FutureErrc::kDroppedAtExit);
    return;
  }
  auto& slot = st.keys[key];
  if (!slot) slot = std::make_unique<Key>(key);
  Key& k = *slot;
  k.items.push_back(std::move(completion));
  ++st.pending;
  if (k.detector != nullptr) return;  // active: its detector reaches this one after the others
  try {
    AssignLocked(k);
  } catch (...) {
    // Take back exactly this completion: a queued item that no detector serves would keep its
    // value pending forever.
    k.items.pop_back();
    --st.pending;
    st.keys.erase(key);
    throw;
  }
}

void CompletionDetectors::AssignLocked(Key& key) {
  State& st = *state_;
  const auto alive = static_cast<int64_t>(st.detectors.size());
  // Not blocked first, then one in a timed wait (it sees a new key when its slice ends), then one
  // in an untimed wait (it sees it when its work has finished: the last choice); among equals the
  // fewest keys, then the timed wait whose slice ends first.
  const auto rank = [](const Detector& d) { return d.blocking ? (d.untimed ? 2 : 1) : 0; };
  const auto better = [&rank](const Detector& a, const Detector& b) {
    if (rank(a) != rank(b)) return rank(a) < rank(b);
    if (a.keys.size() != b.keys.size()) return a.keys.size() < b.keys.size();
    return rank(a) == 1 && a.slice_end < b.slice_end;
  };
  const auto least_loaded = [&](bool busy_only) {
    Detector* chosen = nullptr;
    for (auto& detector : st.detectors) {
      if (busy_only && detector->keys.empty()) continue;
      if (chosen == nullptr || better(*detector, *chosen)) chosen = detector.get();
    }
    return chosen;
  };
  Detector* chosen = nullptr;
  if (alive <= st.max_threads) {
    chosen = least_loaded(/*busy_only=*/false);  // an idle detector if there is one
    if ((chosen == nullptr || !chosen->keys.empty()) && alive < st.max_threads) {
      StartDetectorLocked(key);
      return;
    }
  } else {
    // Above a lowered cap: share a busy detector; the idle ones are on their way out.
    chosen = least_loaded(/*busy_only=*/true);
    if (chosen == nullptr) chosen = least_loaded(/*busy_only=*/false);
  }
  chosen->keys.push_back(&key);
  key.detector = chosen;
  chosen->notified = true;
  chosen->cv.notify_one();
}

void CompletionDetectors::StartDetectorLocked(Key& key) {
  State& st = *state_;
  st.detectors.push_back(std::make_unique<Detector>());
  Detector* detector = st.detectors.back().get();
  detector->keys.push_back(&key);
  key.detector = detector;
  try {
    if (st.fail_thread_starts_for_testing > 0) {
      --st.fail_thread_starts_for_testing;
      throw std::system_error(EAGAIN, std::generic_category(), "dtorch: cannot start a thread");
    }
    // Started under the lock: the thread waits for it before looking at its keys. Named here,
    // so that it is counted by name as soon as it exists.
    std::thread thread([this, detector] { Run(detector); });
    pthread_setname_np(thread.native_handle(), kThreadName);
    thread.detach();
  } catch (...) {
    key.detector = nullptr;
    st.detectors.pop_back();
    throw;
  }
}

void CompletionDetectors::Run(Detector* self) {
  State& st = *state_;
  // What a round learned about one key: its first `items` (oldest first), how many of them are
  // done, and the errors of those.
  struct Probe {
    Key* key;
    std::vector<PendingCompletion*> items;
    std::vector<std::exception_ptr> errors;
  };
  std::vector<Probe> probes;
  std::vector<std::pair<std::unique_ptr<PendingCompletion>, std::exception_ptr>> finished;
  microseconds backoff = kMinBackoff;
  std::unique_lock<std::mutex> lock(st.mu);
  for (;;) {
    if (self->keys.empty()) {
      // Idle: exit when stopping, or when the cap was lowered below the detectors alive.
      if (st.stopping || static_cast<int64_t>(st.detectors.size()) > st.max_threads) break;
      const auto idle_deadline =
          std::chrono::steady_clock::now() + std::chrono::milliseconds(st.idle_exit_ms);
      self->notified = false;
      if (!self->cv.wait_until(lock, idle_deadline, [&] { return self->notified; })) break;
      ++st.notified_wakeups;
      continue;
    }
    // One round: examine the oldest completions of each key, outside the lock. Only this thread
    // takes items off its keys, so the pointers stay valid and stay the oldest meanwhile.
    const bool block = !st.stopping && self->keys.size() == 1 &&
                       self->keys.front()->items.front()->CanBlock();
    // (An untimed wait ignores the slice: see "Untimed waits" in the header.)
    const bool untimed = block && !self->keys.front()->items.front()->WaitIsTimed();
    const auto slice = std::chrono::milliseconds(kBlockingSliceMs);
    self->notified = false;  // a key given during the round ends the back-off below at once
    probes.clear();
    for (Key* key : self->keys) {
      Probe probe{key, {}, {}};
      const size_t n = std::min(key->items.size(), kBatch);
      for (size_t i = 0; i < n; ++i) probe.items.push_back(key->items[i].get());
      probes.push_back(std::move(probe));
    }
    self->blocking = block;
    self->untimed = untimed;
    self->slice_end = untimed ? std::chrono::steady_clock::time_point::max()
                              : std::chrono::steady_clock::now() + slice;
    lock.unlock();
    for (Probe& probe : probes) {
      for (PendingCompletion* item : probe.items) {
        if (st.dropped) break;  // Stop() failed these already
        std::exception_ptr error;
        bool done;
        try {
          done = block && probe.errors.empty()
                     ? item->WaitFor(slice)
                     : item->Poll();
        } catch (...) {
          error = std::current_exception();
          done = true;
        }
        if (!done) break;
        probe.errors.push_back(error);
      }
    }
    lock.lock();
    self->blocking = false;
    self->untimed = false;
    if (st.dropped) break;  // Stop() gave up on this detector and dropped its keys' items
    finished.clear();
    for (Probe& probe : probes) {
      for (auto& error : probe.errors) {
        finished.emplace_back(std::move(probe.key->items.front()), error);
        probe.key->items.pop_front();
      }
    }
    st.completing += finished.size();
    lock.unlock();
    // In order within each key: the probes' keys are distinct, and each key's items in order.
    for (auto& [item, error] : finished) item->Complete(error);
    lock.lock();
    st.completing -= finished.size();
    st.pending -= finished.size();
    if (!finished.empty()) st.changed.notify_all();
    if (st.dropped) {  // Stop() stopped waiting: destroy nothing, Python may be finalizing
      for (auto& entry : finished) (void)entry.first.release();
      break;
    }
    lock.unlock();
    // Released outside the lock: dropping a tensor's last reference may take the GIL. Not counted
    // in `completing`, so PrepareFork (on a thread holding the GIL in os.fork) never waits for it.
    finished.clear();
    lock.lock();
    if (st.dropped) break;  // Stop() timed out meanwhile and destroyed the keys
    for (Probe& probe : probes) {
      Key* key = probe.key;
      if (key->items.empty()) {  // inactive: the next submission assigns it afresh
        self->keys.erase(std::find(self->keys.begin(), self->keys.end(), key));
        st.keys.erase(key->name);
      }
    }
    const bool progressed = std::any_of(probes.begin(), probes.end(),
                                        [](const Probe& p) { return !p.errors.empty(); });
    if (progressed) {
      backoff = kMinBackoff;
      continue;
    }
    if (st.stopping) break;  // the final rounds found nothing more that is done
    if (block) continue;     // the blocking wait itself was the pause
    if (self->cv.wait_for(lock, backoff, [&] { return self->notified; })) ++st.notified_wakeups;
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
  // Exit (idle, stopping, or abandoned by Stop). Keys still served are left to Stop, which drops
  // what they hold.
  for (Key* key : self->keys) key->detector = nullptr;
  st.detectors.remove_if([self](const std::unique_ptr<Detector>& d) { return d.get() == self; });
  st.changed.notify_all();
}

void CompletionDetectors::Stop(std::chrono::steady_clock::time_point deadline) {
  State& st = *state_;
  std::vector<PendingCompletion*> dropped;
  {
    std::unique_lock<std::mutex> lock(st.mu);
    if (st.dropped) return;
    st.stopping = true;
    for (auto& detector : st.detectors) {
      detector->notified = true;
      detector->cv.notify_one();
    }
    // A detector in an untimed wait on its only key cannot be woken, and has nothing done to
    // complete: not waited for (see the header).
    st.changed.wait_until(lock, deadline, [&] {
      return st.completing == 0 &&
             std::all_of(st.detectors.begin(), st.detectors.end(),
                         [](const std::unique_ptr<Detector>& d) {
                           return d->untimed && d->keys.size() == 1;
                         });
    });
    st.dropped = true;
    for (auto& [name, key] : st.keys) {
      for (auto& item : key->items) dropped.push_back(item.release());
    }
    st.pending -= dropped.size();
    st.keys.clear();
    for (auto& detector : st.detectors) detector->keys.clear();  // abandoned: see Run
  }
  CompleteAndLeak(dropped, FutureErrc::kDroppedAtExit);
}

void CompletionDetectors::PrepareFork() {
  State& st = *state_;
  std::unique_lock<std::mutex> lock(st.mu);
  // A Complete() in progress has popped its item: in the child nobody would complete it.
  st.changed.wait(lock, [&] { return st.completing == 0; });
  lock.release();  // held across fork(); unlocked by AfterForkInParent / reset in the child
}

void CompletionDetectors::AfterForkInParent() { state_->mu.unlock(); }

void CompletionDetectors::AfterForkInChild() {
  // The only thread here is the one that forked. The parent's state is leaked: its mutex is held
  // (PrepareFork) and its condition variables may count waiters that do not exist here.
  State* parent = state_;
  std::vector<PendingCompletion*> dropped;
  for (auto& [name, key] : parent->keys) {
    for (auto& item : key->items) dropped.push_back(item.release());
  }
  auto* fresh = new State();
  fresh->max_threads = parent->max_threads;
  fresh->idle_exit_ms = parent->idle_exit_ms;
  state_ = fresh;
  CompleteAndLeak(dropped, FutureErrc::kDroppedAtFork);
}

void CompletionDetectors::SetMaxThreads(int64_t count) {
  if (count < 1) throw std::invalid_argument("needs at least 1 detector thread");
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->max_threads = count;
  WakeIdleLocked();  // beyond a lowered cap, idle detectors exit
}

int64_t CompletionDetectors::MaxThreads() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->max_threads;
}

void CompletionDetectors::SetIdleExitMs(int64_t ms) {
  if (ms < 1) throw std::invalid_argument("the idle time before a detector exits must be >= 1 ms");
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->idle_exit_ms = std::min(ms, kMaxTimeoutMs);  // past it: never (clock arithmetic)
  WakeIdleLocked();  // idle ones restart their wait with the new time
}

void CompletionDetectors::WakeIdleLocked() {
  for (auto& detector : state_->detectors) {
    if (detector->keys.empty()) {
      detector->notified = true;
      detector->cv.notify_one();
    }
  }
}

int64_t CompletionDetectors::IdleExitMs() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->idle_exit_ms;
}

size_t CompletionDetectors::ThreadCount() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->detectors.size();
}

size_t CompletionDetectors::PendingCount() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->pending;
}

size_t CompletionDetectors::ActiveKeys() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->keys.size();
}

uint64_t CompletionDetectors::NotifiedWakeups() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->notified_wakeups;
}

void CompletionDetectors::FailThreadStartsForTesting(int count) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->fail_thread_starts_for_testing = count;
}

namespace {

const bool detector_settings_registered =
    RegisterSetting({"max_detector_threads", Setting::Unit::kCount,
                     static_cast<int64_t>(CompletionDetectors::kDefaultMaxThreads), 1, INT64_MAX,
                     "Detector threads (named dtorch-detect) at most: one per device stream with "
                     "pending values up to this, beyond which streams share them.",
                     [] { return CompletionDetectors::Instance().MaxThreads(); },
                     [](int64_t n) { CompletionDetectors::Instance().SetMaxThreads(n); }, 10}) &&
    RegisterSetting({"detector_idle_exit_s", Setting::Unit::kSeconds,
                     CompletionDetectors::kDefaultIdleExitMs, 1, kMaxTimeoutMs,
                     "How long a detector thread with nothing to watch waits before it exits.",
                     [] { return CompletionDetectors::Instance().IdleExitMs(); },
                     [](int64_t ms) { CompletionDetectors::Instance().SetIdleExitMs(ms); }, 11});

// First of the lifecycle: a detector's completion may post to the pool. (Constructed here, before
// any fork handler can run.)
const bool detectors_participate = RegisterParticipant({
    "detectors", 0, [] { return CompletionDetectors::Instance().ThreadCount(); },
    [](std::chrono::steady_clock::time_point deadline) {
      CompletionDetectors::Instance().Stop(deadline);
    },
    [] { CompletionDetectors::Instance().PrepareFork(); },
    [] { CompletionDetectors::Instance().AfterForkInParent(); },
    [] { CompletionDetectors::Instance().AfterForkInChild(); }, nullptr,
    [] {
      const auto& detectors = CompletionDetectors::Instance();
      return Diagnostics{
          {"threads", static_cast<int64_t>(detectors.ThreadCount())},
          {"pending", static_cast<int64_t>(detectors.PendingCount())},
          {"active_streams", static_cast<int64_t>(detectors.ActiveKeys())},
          {"notified_wakeups", static_cast<int64_t>(detectors.NotifiedWakeups())}};
    }});

}  // namespace

}  // namespace dtorch::core
