#include "../../boost_config.h"  // first: checks the Boost version

#include "consumer.h"

namespace dtorch::core {
using namespace file_internal;

std::shared_ptr<FileConsumer> FileConsumer::Create(std::string_view type_name,
                                                   std::string_view value_options) {
  if (type_name.size() >= kTypeNameBytes) {
    throw std::logic_error("a file kind value type name is at most 15 characters");
  }
  if (!ValidValueOptions(value_options)) {
    throw std::logic_error("file kind value options are at most 32 of [a-z0-9_=]");
  }
  ProcessState& state = *process_state;
  // One critical section: the watcher, going idle, must not unlink the doorbell this pair names.
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.stopping) {
    throw FutureError(FutureErrc::kDroppedAtExit,
                      "file promises cannot be created once the process is exiting");
  }
  auto doorbell = OwnDoorbellLocked(state);
  EnsureWatcherLocked(state);  // first: it unlinks the doorbell if this pair is never made
  const auto self = Self();
  FileHandle handle;
  handle.type_name = std::string(type_name);
  handle.value_options = std::string(value_options);
  handle.segment = shm::NewSegmentName(self);
  std::shared_ptr<shm::Segment> control = shm::Segment::Create(handle.segment, kSegmentBytes);
  auto* block = new (control->data()) FileControlBlock();  // zeroed; atomics and mutex built
  RandomBytes(block->nonce, kNonceBytes);
  handle.nonce_hex = HexOf(block->nonce, kNonceBytes);
  std::memcpy(block->type_name, type_name.data(), type_name.size());
  std::memcpy(block->value_options, value_options.data(), value_options.size());
  block->creator_pid = self.pid;
  block->creator_start = self.start_time;
  WriteName(block->doorbell, state.doorbell_name);
  std::memcpy(block->doorbell_nonce, AsDoorbell(doorbell)->nonce, kNonceBytes);
  block->layout_version = kLayoutVersion;
  block->magic = kControlMagic;  // last: a producer checks it first

  // (Room first: a consumer destroyed here, under mu, would take mu in its destructor.)
  state.consumers.reserve(state.consumers.size() + 1);
  auto consumer = std::make_shared<ConsumerImpl>(std::move(control), std::move(handle),
                                                 std::move(doorbell));
  state.consumers.push_back(consumer);
  return consumer;
}

}  // namespace dtorch::core
