// The file kind in the process's lifecycle (registration.cc registers it): exit, fork, and what
// it reports (threads, pending pairs, its doorbell).
#include "../../boost_config.h"  // first: checks the Boost version

#include "consumer.h"

namespace dtorch::core {
using namespace file_internal;

void StopFileKind(std::chrono::steady_clock::time_point deadline) noexcept {
  ProcessState& state = *process_state;
  std::vector<std::shared_ptr<ConsumerImpl>> consumers;
  {
    std::unique_lock<std::mutex> lock(state.mu);
    state.stopping = true;
    if (state.doorbell) Ring(AsDoorbell(state.doorbell));
    state.wake.fetch_add(1);
    shm::FutexWakeAll(&state.wake);
    state.watcher_exited.wait_until(lock, deadline, [&] { return !state.watcher_running; });
    consumers = LiveConsumersLocked(state);
    state.retired_mappings.clear();  // (unmapped: the watcher has stopped, or is stuck)
    for (auto& orphan : state.orphans) {
      DiscardPayloadOfDeadProducer(static_cast<FileControlBlock*>(orphan.control->data()));
    }
    state.orphans.clear();
    ReleaseDoorbellLocked(state);
  }
  for (auto& consumer : consumers) consumer->StopAtExit();
  MarkFileProducersExited();
  // A producer's exit: what it made for consumers that died is not left in /dev/shm.
  if (payload::Kept().produced > 0) ReleaseWhatDeadConsumersLeft(std::nullopt);
  // Leaked: a pending future may still be destroyed later in the exit, by another thread.
  new std::vector<std::shared_ptr<ConsumerImpl>>(std::move(consumers));
}

void MarkFileProducersExited() noexcept {
  ProcessState& state = *process_state;
  std::vector<std::shared_ptr<ProducerAttachment>> attachments;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    for (auto& [name, weak] : state.attachments) {
      if (auto attachment = weak.lock()) attachments.push_back(std::move(attachment));
    }
  }
  for (auto& attachment : attachments) attachment->Leave(kExited);
}

void ReleaseIdleFileSegments() noexcept {
  ProcessState& state = *process_state;
  std::vector<std::shared_ptr<ConsumerImpl>> consumers;  // released outside mu
  std::lock_guard<std::mutex> lock(state.mu);
  consumers = LiveConsumersLocked(state);
  const bool pending = std::any_of(consumers.begin(), consumers.end(),
                                   [](const auto& consumer) { return consumer->Pending(); });
  if (!pending && state.orphans.empty()) ReleaseDoorbellLocked(state);
}

void PrepareForkFileKind() noexcept {
  process_state->mu.lock();
  payload::PrepareFork();
}

void AfterForkFileKindInParent() noexcept {
  ++forks_in_parent;
  payload::AfterForkInParent();
  process_state->mu.unlock();
}

void AfterForkFileKindInChild() noexcept {
  // The parent's state (its watcher, its doorbell, its consumers, its payload segments) stays
  // the parent's.
  payload::AfterForkInChild();
  ForgetReleasedConsumersInChild();
  ProcessState* parents = process_state;
  process_state = new ProcessState();
  // Unmapped here: nothing in the child uses them. (The old state is leaked: its mutex is held,
  // by PrepareFork.)
  parents->doorbell.reset();
  parents->orphans.clear();
  parents->doorbells.clear();
  parents->retired_mappings.clear();
}

int FileWatcherThreads() {
  std::lock_guard<std::mutex> lock(process_state->mu);
  return process_state->watcher_running ? 1 : 0;
}

size_t PendingFilePairs() {
  std::lock_guard<std::mutex> lock(process_state->mu);
  size_t count = 0;
  for (const auto& weak : process_state->consumers) count += weak.expired() ? 0 : 1;
  return count;
}

std::string FileDoorbellSegment() {
  std::lock_guard<std::mutex> lock(process_state->mu);
  return process_state->doorbell ? process_state->doorbell_name : std::string();
}

void HoldFilePromiseLockForTesting(const FileHandle& handle) {
  // (Received as a deserialized promise is: a holder, its deserialization counted.)
  bool counted = false;
  auto channel = RegisterFileHolder(handle, MapFileControlSegment(handle), &counted);
  if (!channel) throw std::runtime_error("the pair is gone, or this process cannot hold it");
  auto control = shm::Segment::Open(handle.segment, kSegmentBytes);
  auto* block = static_cast<FileControlBlock*>(control->data());
  block->producers_mu.lock();
  for (;;) pause();
}

namespace {
// What killed processes left behind goes when the library loads.
const bool reaped_at_load = (shm::ReapSegmentsOfDeadProcesses(), true);
}  // namespace

}  // namespace dtorch::core
