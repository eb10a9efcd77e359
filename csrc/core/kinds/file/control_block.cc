#include "../../boost_config.h"  // first: checks the Boost version

#include "control_block.h"

#include <sys/stat.h>

#include "watcher.h"

namespace dtorch::core::file_internal {

std::string PayloadNameIn(const FileControlBlock* block) {
  const std::string name = ReadName(block->payload);
  ProcessId owner;
  if (!shm::ParseSegmentName(name, &owner) || !(owner == Self())) return {};
  return name;
}

// Whether `name` (of this process's name form, from a block a producer wrote) may be a payload
// segment: not one page, the size of this process's control segments and doorbell, which a
// corrupt name must not get unlinked. (A payload a producer died creating may be empty.)
bool MayBePayload(const std::string& name) {
  struct stat info {};
  return stat(("/dev/shm/" + name).c_str(), &info) == 0 &&
         static_cast<uint64_t>(info.st_size) != kSegmentBytes;
}

std::string UnlinkNamedPayload(const FileControlBlock* block) {
  const std::string name = PayloadNameIn(block);
  if (!name.empty() && MayBePayload(name)) shm::Unlink(name);
  return name;
}

namespace {
// The dead consumers released already. (Leaked, so that a producer thread still setting during
// the exit finds them; made anew in a forked child, where another thread may have held mu.)
struct ReleasedConsumers {
  std::mutex mu;
  std::set<std::pair<int32_t, uint64_t>> released;  // guarded by mu: (pid, start time)
};
std::atomic<ReleasedConsumers*> released_consumers{new ReleasedConsumers()};
}  // namespace

void ForgetReleasedConsumersInChild() noexcept {
  try {
    released_consumers.store(new ReleasedConsumers());  // (the parent's leaked)
  } catch (...) {
  }
}

// A producer found `consumer` dead (nullopt: at its exit): the segments this process keeps for
// dead consumers are dropped and every name a dead process of this user left in /dev/shm is
// unlinked (the pairs' control segments, payloads it never received), rather than at the next
// sweep or import. Once per dead consumer (its other pairs' sets find nothing new of it): a scan
// of /dev/shm.
void ReleaseWhatDeadConsumersLeft(const std::optional<ProcessId>& consumer) noexcept {
  if (consumer) {
    ReleasedConsumers& r = *released_consumers.load();
    try {
      std::lock_guard<std::mutex> lock(r.mu);
      if (!r.released.emplace(consumer->pid, consumer->start_time).second) return;
      if (r.released.size() > 4096) r.released.clear();  // (bounded; a repeat only scans again)
    } catch (...) {
    }
  }
  try {
    payload::Sweep(Clock::now(), [](const ProcessId& p) { return IsAlive(p); });
  } catch (...) {
    // (Out of memory: the watcher's sweep drops them.)
  }
  shm::ReapSegmentsOfDeadProcesses();
}

void DiscardPayloadOfDeadProducer(const FileControlBlock* block) {
  const std::string name = UnlinkNamedPayload(block);
  if (!name.empty()) payload::Discard(name);  // (one this process mapped already)
}

bool ParseHex(std::string_view hex, unsigned char* out, size_t bytes) {
  if (hex.size() != 2 * bytes) return false;
  const auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < bytes; ++i) {
    const int high = digit(hex[2 * i]), low = digit(hex[2 * i + 1]);
    if (high < 0 || low < 0) return false;
    out[i] = static_cast<unsigned char>(high * 16 + low);
  }
  return true;
}

size_t Utf8Prefix(const std::string& text, size_t room) {
  size_t bytes = std::min(text.size(), room);
  if (bytes < text.size()) {
    while (bytes > 0 && (static_cast<unsigned char>(text[bytes]) & 0xc0) == 0x80) --bytes;
  }
  return bytes;
}
size_t Utf8Suffix(const std::string& text, size_t room) {
  size_t bytes = std::min(text.size(), room);
  while (bytes > 0 && (static_cast<unsigned char>(text[text.size() - bytes]) & 0xc0) == 0x80) {
    --bytes;
  }
  return bytes;
}

FutureError InvalidSegment(const std::string& name, const std::string& why) {
  return FutureError(FutureErrc::kInvalidHandle,
                     "/dev/shm/" + name + " is not the promise this handle names (" + why + ")");
}


std::tuple<void*, size_t, std::shared_ptr<void>> ReceivePublished(const FileControlBlock* block) {
  const size_t payload_bytes = block->payload_bytes;
  if (payload_bytes == 0) return {nullptr, 0, nullptr};
  const std::string name = PayloadNameIn(block);
  if (name.empty()) {
    throw FutureError(FutureErrc::kInvalidHandle, "the published payload's name is corrupt");
  }
  auto received = payload::Receive(name, block->payload_sequence, payload_bytes);
  WatchKeptPayloads();
  return {received.data, payload_bytes, std::move(received.keep_alive)};
}

}  // namespace dtorch::core::file_internal
