// A process reaches a pair another process created: the control segment mapped ahead, checked
// against the handle, the process registered in the producer table (a holder), its handles'
// serializations counted.
#include "../../boost_config.h"  // first: checks the Boost version

#include "channels.h"
#include "watcher.h"

namespace dtorch::core {
using namespace file_internal;


// Control segments mapped ahead (MapFileControlSegment) and still mapped, at most
// kMaxMappedAhead: a process holding many promises it never uses keeps far from the kernel's
// limit on mappings (vm.max_map_count, 65530 by default); beyond, promises attach lazily.
std::atomic<int64_t> mapped_ahead{0};
constexpr int64_t kMaxMappedAhead = 4096;

std::shared_ptr<shm::Segment> MapFileControlSegment(const FileHandle& handle) noexcept {
  if (mapped_ahead.fetch_add(1) >= kMaxMappedAhead) {
    --mapped_ahead;
    return nullptr;
  }
  std::unique_ptr<shm::Segment> segment;
  try {
    segment = shm::Segment::Open(handle.segment, kSegmentBytes);
  } catch (...) {
  }
  if (!segment) {
    --mapped_ahead;
    return nullptr;
  }
  try {
    return std::shared_ptr<shm::Segment>(segment.release(), [](shm::Segment* mapped) {
      delete mapped;
      --mapped_ahead;
    });
  } catch (...) {  // (out of memory: the deleter ran)
    return nullptr;
  }
}

// Throws FutureError(kInvalidHandle) unless `block` (a mapped control segment: untrusted, read
// within its fields' bounds) is the pair `handle` names: its format, nonce, value type, creator
// and the consumer's value options. Nothing is registered or claimed before this passes.
static void CheckControlBlock(const FileControlBlock* block, const FileHandle& handle) {
  unsigned char nonce[kNonceBytes];
  ParseHex(handle.nonce_hex, nonce, kNonceBytes);  // validated by Parse
  ProcessId owner;
  shm::ParseSegmentName(handle.segment, &owner);
  if (owner.pid_namespace != Self().pid_namespace) {
    throw FutureError(FutureErrc::kInvalidHandle,
                      "the promise was created in another pid namespace (a container sharing "
                      "/dev/shm but not its processes): producers and consumer must see each "
                      "other's processes");
  }
  if (block->magic != kControlMagic || block->layout_version != kLayoutVersion) {
    throw InvalidSegment(handle.segment, "no control block of this format");
  }
  if (std::memcmp(block->nonce, nonce, kNonceBytes) != 0) {
    throw InvalidSegment(handle.segment, "the nonce does not match");
  }
  if (std::string(block->type_name, strnlen(block->type_name, kTypeNameBytes)) !=
          handle.type_name ||
      block->creator_pid != owner.pid || block->creator_start != owner.start_time) {
    throw InvalidSegment(handle.segment, "its value type or creator does not match");
  }
  // (A field without its NUL reads as one character too many: it matches no handle.)
  if (std::string_view(block->value_options,
                       strnlen(block->value_options, sizeof(block->value_options))) !=
      handle.value_options) {
    throw InvalidSegment(handle.segment,
                         "its value options are not the consumer's: the handle was altered; "
                         "pass the string from serialize() unchanged");
  }
}

std::shared_ptr<FileChannel> AttachFileProducer(const FileHandle& handle,
                                                std::shared_ptr<shm::Segment> mapped) {
  ProcessState& state = *process_state;
  std::shared_ptr<ProducerAttachment> existing;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    const auto it = state.attachments.find(handle.segment);
    if (it != state.attachments.end()) existing = it->second.lock();
  }
  if (existing) {
    // Attached through another handle of this segment: this one must name the same pair too.
    CheckControlBlock(existing->control_block(), handle);
    return existing;
  }
  std::shared_ptr<shm::Segment> control =
      mapped ? std::move(mapped) : shm::Segment::Open(handle.segment, kSegmentBytes);
  if (!control) return nullptr;  // the pair is gone
  auto* block = static_cast<FileControlBlock*>(control->data());
  CheckControlBlock(block, handle);
  if (IsCreatorProcess(block)) {
    return std::make_shared<CopyInCreatorChannel>(std::move(control), handle.segment);
  }

  uint32_t slot = 0;
  try {
    // Held for a few stores by any live process: a wait this long means a stuck peer.
    bip::scoped_lock<bip::interprocess_mutex> lock(block->producers_mu, bip::defer_lock);
    if (!lock.try_lock_for(std::chrono::seconds(kLockTimeoutS))) {
      throw FutureError(FutureErrc::kSharedMemory,
                        "another process has held this promise's lock for " +
                            std::to_string(kLockTimeoutS * 1000) + " ms; it seems stuck");
    }
    const auto self = Self();
    const uint32_t count = std::min(block->producer_count.load(), kMaxProducers);
    slot = count;
    // This process's entry of a handle it dropped is taken again: a process that receives the
    // promise time and again (a queue, a loop) keeps one entry.
    for (uint32_t i = 0; i < count; ++i) {
      const auto& entry = block->producers[i];
      if (entry.pid.load() == self.pid && entry.start_time.load() == self.start_time &&
          entry.state.load() == kDropped) {
        slot = i;
        break;
      }
    }
    if (slot < count) {
      block->producers[slot].state = kAttached;
    } else {
      if (slot >= kMaxProducers) {
        throw FutureError(FutureErrc::kSharedMemory,
                          "more than " + std::to_string(kMaxProducers) +
                              " processes held this promise; a promise has at most that many "
                              "producer processes");
      }
      block->producers[slot].pid = self.pid;
      block->producers[slot].start_time = self.start_time;
      block->producers[slot].state = kAttached;
      block->producer_count.store(slot + 1, std::memory_order_release);
    }
  } catch (const bip::lock_exception&) {
    // The consumer may not know that producer (it may have died before registering): the pair
    // is failed here.
    const std::string why = "a producer died holding this promise's lock, so the promise can "
                            "no longer be used";
    std::shared_ptr<shm::Segment> doorbell;
    try {
      doorbell = ConsumerDoorbellOf(handle.segment, block);
    } catch (...) {  // (a corrupt doorbell: the watcher's liveness round still sees the failure)
    }
    ChannelBase breaker(control, kLockBreakerClaimant, doorbell);
    if (breaker.TryClaim() == ClaimOutcome::kClaimed) {
      breaker.PublishError({FutureErrc::kBrokenPromise, why});
    }
    throw FutureError(FutureErrc::kBrokenPromise, why);
  }
  auto attachment = std::make_shared<ProducerAttachment>(std::move(control), handle.segment, slot);
  std::lock_guard<std::mutex> lock(state.mu);
  auto& cached = state.attachments[handle.segment];
  if (auto raced = cached.lock()) return raced;  // another thread attached meanwhile
  cached = attachment;
  // A long-lived producer attaches to many pairs: forget those it no longer holds.
  if (state.attachments.size() >= 2 * state.attachments_after_sweep + 64) {
    for (auto it = state.attachments.begin(); it != state.attachments.end();) {
      it = it->second.expired() ? state.attachments.erase(it) : std::next(it);
    }
    state.attachments_after_sweep = state.attachments.size();
  }
  return attachment;
}

std::shared_ptr<FileChannel> RegisterFileHolder(const FileHandle& handle,
                                                std::shared_ptr<shm::Segment> mapped,
                                                bool* counted) noexcept {
  *counted = false;
  if (!mapped) return nullptr;
  try {
    auto* block = static_cast<FileControlBlock*>(mapped->data());
    CheckControlBlock(block, handle);
    if (IsCreatorProcess(block)) {
      block->deserialized.fetch_add(1);  // (the creator's own handle holds the pair here)
      *counted = true;
      return nullptr;
    }
    auto channel = AttachFileProducer(handle, mapped);
    if (channel) {
      block->deserialized.fetch_add(1);  // (after its entry: FileControlBlock)
      *counted = true;
    }
    return channel;
  } catch (...) {
    return nullptr;  // (the first use attaches again, and says why it cannot)
  }
}

void CountFileSerialization(const FileHandle& handle,
                            std::shared_ptr<shm::Segment> mapped) noexcept {
  try {
    if (!mapped) mapped = shm::Segment::Open(handle.segment, kSegmentBytes);
    if (!mapped) return;  // (the pair is gone: nothing waits for the count)
    auto* block = static_cast<FileControlBlock*>(mapped->data());
    CheckControlBlock(block, handle);
    block->serialized.fetch_add(1);
  } catch (...) {
    // (Not the pair's segment, or /dev/shm refuses: the handle is passed on all the same.)
  }
}

}  // namespace dtorch::core
