// The file kind's payload segments, reused across values (torch-free; Linux).
//
// A value's bytes travel in a payload segment: [data: capacity bytes][trailer: one page]. The
// producer creates one (mode 0600, space reserved, pre-faulted), named for the consumer process
// (whose death then gets it reaped), and publishes its name in the pair's control block. The
// consumer maps it when it first receives a value in it and unlinks the name at once: from then
// on both processes keep their mappings and no name of it is in /dev/shm (its pages still count
// against /dev/shm's size while either maps it). Later values from that
// producer process to that consumer process are written into it again, once the consumer's view
// of the previous value is gone: the copy lands in pages both sides have mapped and touched.
//
// The trailer's state word holds the value's number in the segment and whose turn it is:
//   writing (producer) -> published -> in use (the consumer's tensor views it)
//     -> free (view gone: the producer may write the next value, number + 1) -> writing ...
//   and retired (dropped by both sides): from free or in use when either side gives it up, from
//   writing or published when the value can never be taken.
// Only compare-and-swaps from a word naming the value move it: a producer never writes into a
// live view, and nobody acts on a value that is no longer there.
//
// Bounds. Per (producer process, consumer process), segments are kept per size class (capacity
// rounded up to 4, 5, 6 or 7 x a power of two, at least 64 KiB): at most kPooledPerClass of a
// class and kMaxPooledBytes in all. A value that finds no free segment of its class and no room
// gets a one-off segment (exactly its size), dropped after use; so does one whose class capacity
// does not fit in /dev/shm when the value alone does. A segment unused for IdleMs() (neither
// written nor viewed) is retired by whichever side notices first, and so is every segment of a
// peer that died; the file kind's watcher thread runs Sweep() while any is kept.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "shm_segment.h"

namespace dtorch::core::payload {

inline constexpr size_t kPooledPerClass = 4;
inline constexpr uint64_t kMaxPooledBytes = uint64_t{1} << 30;  // per (producer, consumer)
inline constexpr int64_t kDefaultIdleMs = 5000;

// The capacity of the pooled segments that hold values of `bytes` bytes.
uint64_t ClassCapacity(uint64_t bytes);

// A producer's segment for one value, from Acquire() until the value is published or withdrawn.
class Lease {
 public:
  virtual ~Lease() = default;  // not published: as Withdraw()
  virtual void* data() const = 0;
  virtual const std::string& name() const = 0;
  // The value's number in this segment: published beside the name, checked by the consumer.
  virtual uint64_t sequence() const = 0;
  // The value is written: the consumer may receive it (call before the pair says "value").
  virtual void MarkPublished() = 0;
  // After MarkPublished: keeps `object` alive until the consumer's view of this value is gone
  // (or it was withdrawn, or the consumer died), noticed by Sweep; AnyKept() is true meanwhile.
  // For a value that only names memory the consumer maps (a device block).
  virtual void HoldUntilReleased(std::shared_ptr<void> object) = 0;
  // After publishing: the pair was gone, so nobody will receive it. The segment is free again
  // (a new one the consumer never mapped is unlinked and dropped instead). Safe to race with a
  // consumer that receives it after all.
  virtual void Withdraw() noexcept = 0;
};

// Producer: a segment for `bytes` (> 0) bytes for `consumer`: a free one of the pool, or a new one,
// in which case `before_create(name)` is called first (the producer records the name where the
// consumer will find it if this process dies before publishing). Throws FutureError(kSharedMemory)
// when no segment can be made.
std::unique_ptr<Lease> Acquire(const ProcessId& consumer, uint64_t bytes,
                               const std::function<void(const std::string&)>& before_create);

// What the consumer received: `data` stays valid while `keep_alive` lives; when it goes, the
// segment is free for the producer's next value.
struct Received {
  void* data = nullptr;
  std::shared_ptr<void> keep_alive;
};

// Consumer: the payload `name` (of this process's name form: checked by the caller), published
// with `sequence`, holding `bytes` bytes. Maps it (and unlinks its name) on first receipt.
// Throws FutureError(kSharedMemory) when it is gone, kInvalidHandle when it does not hold that
// value.
Received Receive(const std::string& name, uint64_t sequence, uint64_t bytes);

// Consumer: the pair whose value was being written into `name` broke (its producer died): a
// segment of it mapped here is dropped.
void Discard(const std::string& name) noexcept;

// Retires what has been idle for IdleMs() and what belongs to dead peers (`alive` tells);
// returns whether this process still keeps any segment (the watcher runs while AnyKept()).
bool Sweep(std::chrono::steady_clock::time_point now,
           const std::function<bool(const ProcessId&)>& alive);
bool AnyKept();

// Segments kept by this process: as producer (pooled) and as consumer (mapped for reuse).
struct Counts {
  size_t produced = 0;
  size_t received = 0;
  uint64_t produced_bytes = 0;
  uint64_t received_bytes = 0;
};
Counts Kept();

void SetIdleMs(int64_t ms);
int64_t IdleMs();

// Fork handlers: a child starts with nothing kept (the parent's segments stay the parent's).
void PrepareFork() noexcept;
void AfterForkInParent() noexcept;
void AfterForkInChild() noexcept;

}  // namespace dtorch::core::payload
