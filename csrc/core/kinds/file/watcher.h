// The file kind's per-process state and its one thread ("dtorch-doorbell"): the pending pairs
// of this process (their callbacks and their producers' liveness), its doorbell, the payload
// segments it keeps, the consumers' doorbells it mapped as a producer, and mappings retired to
// be unmapped off the hot path. Private to the kind.
#pragma once

#include "control_block.h"

namespace dtorch::core::file_internal {

class ProducerAttachment;  // channels.h
// ---------------------------------------------------------------------------------------------
// The process-wide parts: the doorbell watcher and the producer attachments.

class ConsumerImpl;
// Forks of this process (counted in the parent): a pair created before one may have reached the
// child without being serialized.
extern std::atomic<uint64_t> forks_in_parent;  // (watcher.cc)

// A pair whose consumer is gone while a producer may still be writing its payload: settled once
// the producer finished (it withdraws the payload itself) or died (its payload, named for this
// live process, would not be reaped: unlinked here).
struct OrphanPayload {
  std::shared_ptr<shm::Segment> control;
};

struct ProcessState {
  std::mutex mu;
  std::condition_variable watcher_exited;
  // Everything below is guarded by mu.
  std::vector<std::weak_ptr<ConsumerImpl>> consumers;  // this process's pending pairs
  std::vector<OrphanPayload> orphans;
  std::shared_ptr<shm::Segment> doorbell;              // this process's doorbell (made on demand)
  std::string doorbell_name;
  bool watcher_running = false;
  bool stopping = false;
  // Wakes a watcher that has no doorbell (the process keeps payloads but has no pending pair).
  std::atomic<uint32_t> wake{0};
  // Control segments to unmap on the watcher's next round (RetireMapping).
  std::vector<std::shared_ptr<shm::Segment>> retired_mappings;
  // This process's producer attachments, by control segment.
  std::map<std::string, std::weak_ptr<ProducerAttachment>> attachments;
  size_t attachments_after_sweep = 0;
  // Consumers' doorbells mapped here as a producer, by name: kept while used and for the
  // payload idle time after (a producer serving one promise after another would map and unmap
  // its consumer's doorbell for each).
  struct MappedDoorbell {
    std::shared_ptr<shm::Segment> segment;
    Clock::time_point last_used;
  };
  std::map<std::string, MappedDoorbell> doorbells;
};

// Replaced (the old one leaked) in a fork child: its mutex may be held by a thread of the parent.
extern ProcessState* process_state;  // (watcher.cc)

void EnsureWatcherLocked(ProcessState& state);
void ReleaseDoorbellLocked(ProcessState& state);
std::vector<std::shared_ptr<ConsumerImpl>> LiveConsumersLocked(ProcessState& state);
void CheckOrphanPayloads(ProcessState& state,
                         const std::function<bool(const ProcessId&)>& alive);
void AdoptOrphanPayload(std::shared_ptr<shm::Segment> control);

inline DoorbellBlock* AsDoorbell(const std::shared_ptr<shm::Segment>& segment) {
  return static_cast<DoorbellBlock*>(segment->data());
}

// This process's doorbell, made on first use.
inline std::shared_ptr<shm::Segment> OwnDoorbellLocked(ProcessState& state) {
  if (!state.doorbell) {
    auto name = shm::NewSegmentName(Self());
    std::shared_ptr<shm::Segment> segment = shm::Segment::Create(name, kSegmentBytes);
    auto* block = new (segment->data()) DoorbellBlock();
    RandomBytes(block->nonce, kNonceBytes);
    block->magic = kDoorbellMagic;
    state.doorbell = std::move(segment);
    state.doorbell_name = std::move(name);
  }
  return state.doorbell;
}

// Runs the watcher while this process keeps payload segments (it releases them when idle).
void WatchKeptPayloads() noexcept;

// Drops a control segment's mapping. If this is its last reference, the munmap is left to the
// watcher's next round (the caller being, mostly, a thread that just took or set a value: an
// munmap in a process with several threads costs a TLB shootdown, 10-20 us on these VMs); done
// here when no watcher runs. Never call it holding ProcessState::mu.
void RetireMapping(std::shared_ptr<shm::Segment> segment) noexcept;

}  // namespace dtorch::core::file_internal
