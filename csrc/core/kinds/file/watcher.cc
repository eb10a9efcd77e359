#include "../../boost_config.h"  // first: checks the Boost version

#include "watcher.h"

#include <pthread.h>

#include "consumer.h"

namespace dtorch::core::file_internal {

ProcessState* process_state = new ProcessState();
std::atomic<uint64_t> forks_in_parent{0};

// ---------------------------------------------------------------------------------------------
// The watcher: one thread per process while it has pending pairs (it serves their callbacks and
// checks their producers' liveness) or keeps payload segments (it releases idle ones).

void RunWatcher(ProcessState* state) {
  auto next_liveness = Clock::now();
  auto idle_since = Clock::now();
  std::map<int32_t, std::pair<ProcessId, bool>> liveness;
  for (;;) {
    std::shared_ptr<shm::Segment> doorbell_segment;
    std::vector<std::shared_ptr<ConsumerImpl>> consumers;
    std::vector<std::shared_ptr<shm::Segment>> unmapped_doorbells;  // (outside mu)
    std::vector<std::shared_ptr<shm::Segment>> retired;                // (outside mu)
    uint32_t seen = 0;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->stopping) break;
      retired.swap(state->retired_mappings);
      doorbell_segment = state->doorbell;
      // Read before the pairs are checked: a ring after this is not missed.
      seen = doorbell_segment ? AsDoorbell(doorbell_segment)->rings.load() : state->wake.load();
      consumers = LiveConsumersLocked(*state);
      const auto now = Clock::now();
      // Consumers' doorbells no attachment here has used for the idle time: unmapped.
      const auto keep = milliseconds(payload::IdleMs());
      for (auto it = state->doorbells.begin(); it != state->doorbells.end();) {
        const bool unused = it->second.segment.use_count() == 1 &&
                            now - it->second.last_used >= keep;
        if (unused) unmapped_doorbells.push_back(std::move(it->second.segment));
        it = unused ? state->doorbells.erase(it) : std::next(it);
      }
      if (consumers.empty() && state->orphans.empty()) {
        if (now - idle_since >= kWatcherIdleExit) {
          // No pair of this process is pending: the doorbell goes (made again on demand), so
          // that nothing of a process that exits without the library's exit handler (a fork
          // child ending in os._exit) outlives it but what it still held.
          ReleaseDoorbellLocked(*state);
          doorbell_segment.reset();
          // (Asked now, under mu: a segment kept since the last sweep must not be missed.)
          if (!payload::AnyKept() && state->doorbells.empty()) {
            state->watcher_running = false;
            state->watcher_exited.notify_all();
            return;
          }
        }
      } else {
        idle_since = now;
      }
    }
    const auto now = Clock::now();
    const bool check_liveness = now >= next_liveness;
    if (check_liveness) {
      next_liveness = now + kLivenessPeriod;
      liveness.clear();
    }
    const auto alive = [&](const ProcessId& process) {
      auto it = liveness.find(process.pid);
      if (it == liveness.end() || !(it->second.first == process)) {
        it = liveness.insert_or_assign(process.pid, std::make_pair(process, IsAlive(process)))
                 .first;
      }
      return it->second.second;
    };
    std::vector<std::shared_ptr<ConsumerImpl>> done;
    try {
      for (auto& consumer : consumers) {
        if (!check_liveness && !consumer->HasCallbacks()) continue;
        if (consumer->Check(now, check_liveness, alive)) done.push_back(consumer);
      }
      if (check_liveness) {
        CheckOrphanPayloads(*state, alive);
        payload::Sweep(now, alive);
      }
    } catch (...) {
      // (Out of memory, say.) The next round checks again; the watcher must not die.
    }
    if (!done.empty()) {
      std::lock_guard<std::mutex> lock(state->mu);
      auto& list = state->consumers;
      // (Compared without locking the weak pointers: a shared_ptr made here could be the last
      // one, and its destructor takes mu.)
      list.erase(std::remove_if(list.begin(), list.end(),
                                [&](const std::weak_ptr<ConsumerImpl>& weak) {
                                  return weak.expired() ||
                                         std::any_of(done.begin(), done.end(), [&](auto& d) {
                                           return !weak.owner_before(d) && !d.owner_before(weak);
                                         });
                                }),
                 list.end());
    }
    consumers.clear();  // outside mu: a last reference may unlink segments
    done.clear();
    retired.clear();  // (unmapped now, not after the sleep)
    unmapped_doorbells.clear();
    const auto sleep = std::max<Clock::duration>(next_liveness - Clock::now(), milliseconds(1));
    if (doorbell_segment) {
      auto* doorbell = AsDoorbell(doorbell_segment);
      doorbell->sleeping.store(1);
      if (doorbell->rings.load() == seen) shm::FutexWait(&doorbell->rings, seen, sleep);
      doorbell->sleeping.store(0);
    } else {
      shm::FutexWait(&state->wake, seen, sleep);
    }
  }
  std::lock_guard<std::mutex> lock(state->mu);
  state->watcher_running = false;
  state->watcher_exited.notify_all();
}

void RetireMapping(std::shared_ptr<shm::Segment> segment) noexcept {
  if (!segment || segment.use_count() > 1) return;  // (mapped for others still)
  ProcessState& state = *process_state;
  std::unique_lock<std::mutex> lock(state.mu);
  if (state.watcher_running && !state.stopping && state.retired_mappings.size() < 256) {
    try {
      state.retired_mappings.push_back(std::move(segment));
    } catch (...) {  // (out of memory: unmapped here)
      lock.unlock();
      segment.reset();
      return;
    }
    // A batch: the watcher unmaps it now rather than at its next liveness round.
    if (state.retired_mappings.size() == 64) {
      if (state.doorbell) Ring(AsDoorbell(state.doorbell));
      state.wake.fetch_add(1);
      shm::FutexWakeAll(&state.wake);
    }
    return;
  }
  lock.unlock();
  segment.reset();
}

void WatchKeptPayloads() noexcept {
  ProcessState& state = *process_state;
  std::lock_guard<std::mutex> lock(state.mu);
  try {
    if (!state.watcher_running && payload::AnyKept()) EnsureWatcherLocked(state);
  } catch (...) {
    // No thread now (std::system_error): the next value tries again; until then, idle segments
    // stay mapped.
  }
}

// The consumers still alive (the list forgets the others). Destroy the result outside mu: it may
// hold the last reference to one, whose destructor takes mu.
std::vector<std::shared_ptr<ConsumerImpl>> LiveConsumersLocked(ProcessState& state) {
  std::vector<std::shared_ptr<ConsumerImpl>> live;
  live.reserve(state.consumers.size());
  auto& list = state.consumers;
  list.erase(std::remove_if(list.begin(), list.end(),
                            [&](const std::weak_ptr<ConsumerImpl>& weak) {
                              auto consumer = weak.lock();
                              if (!consumer) return true;
                              live.push_back(std::move(consumer));
                              return false;
                            }),
             list.end());
  return live;
}

void ReleaseDoorbellLocked(ProcessState& state) {
  if (!state.doorbell) return;
  shm::Unlink(state.doorbell_name);
  state.doorbell.reset();
}

void AdoptOrphanPayload(std::shared_ptr<shm::Segment> control) {
  ProcessState& state = *process_state;
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.stopping) {
    DiscardPayloadOfDeadProducer(static_cast<FileControlBlock*>(control->data()));
    return;
  }
  state.orphans.push_back({std::move(control)});
  EnsureWatcherLocked(state);
}

void CheckOrphanPayloads(ProcessState& state,
                         const std::function<bool(const ProcessId&)>& alive) {
  std::vector<OrphanPayload> orphans;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    orphans.swap(state.orphans);
  }
  std::vector<OrphanPayload> still_writing;
  for (auto& orphan : orphans) {
    auto* b = static_cast<FileControlBlock*>(orphan.control->data());
    const auto* claimer = ClaimingProducer(b, b->state.load());
    if (claimer && alive(claimer->Process())) {
      still_writing.push_back(std::move(orphan));
      continue;
    }
    // Died writing; or finished, and withdrew its payload, unless it died before it could: a
    // value nobody will take is received and dropped (a no-op if it was withdrawn).
    const uint32_t phase = Phase(b->state.load());
    if (phase == kClaimed) DiscardPayloadOfDeadProducer(b);
    if (phase == kValue) {
      try {
        ReceivePublished(b);
      } catch (...) {
      }
    }
  }
  std::lock_guard<std::mutex> lock(state.mu);
  for (auto& orphan : still_writing) state.orphans.push_back(std::move(orphan));
}

void EnsureWatcherLocked(ProcessState& state) {
  if (state.watcher_running || state.stopping) return;
  std::thread thread([s = &state] { RunWatcher(s); });
  pthread_setname_np(thread.native_handle(), kWatcherThreadName);
  thread.detach();
  state.watcher_running = true;
}

std::shared_ptr<shm::Segment> ProducerDoorbell(ProcessState& state, const std::string& name,
                                               const unsigned char* nonce) {
  std::shared_ptr<shm::Segment> segment;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    const auto it = state.doorbells.find(name);
    if (it != state.doorbells.end()) {
      it->second.last_used = Clock::now();
      segment = it->second.segment;
    }
  }
  if (!segment) {
    // Gone: the consumer has no pending pair (its watcher went idle) or it exited; this pair is
    // then complete or its consumer gone, and nobody needs the ring.
    segment = shm::Segment::Open(name, kSegmentBytes);
    if (!segment) return nullptr;
    std::lock_guard<std::mutex> lock(state.mu);
    state.doorbells[name] = {segment, Clock::now()};
    EnsureWatcherLocked(state);  // (it releases the mapping when unused)
  }
  const auto* block = AsDoorbell(segment);
  if (block->magic != kDoorbellMagic || std::memcmp(block->nonce, nonce, kNonceBytes) != 0) {
    throw InvalidSegment(name, "not the consumer's doorbell");
  }
  return segment;
}

std::shared_ptr<shm::Segment> ConsumerDoorbellOf(const std::string& segment,
                                                 const FileControlBlock* block) {
  const std::string name = ReadName(block->doorbell);
  if (!shm::ParseSegmentName(name)) throw InvalidSegment(segment, "its doorbell's name is corrupt");
  return ProducerDoorbell(*process_state, name, block->doorbell_nonce);
}

}  // namespace dtorch::core::file_internal
