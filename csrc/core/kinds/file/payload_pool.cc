#include "payload_pool.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

#include "../../base/clock.h"
#include "../../future_error.h"

namespace dtorch::core::payload {
namespace {


constexpr uint64_t kTrailerMagic = 0x3170706863726f74ULL;  // "torchpp1" (little-endian)
constexpr uint64_t kTrailerBytes = 4096;  // one page: the data before it stays page-aligned
constexpr uint64_t kMinClassBytes = 64 * 1024;
constexpr uint64_t kPageBytes = 4096;

// Trailer states.
constexpr uint32_t kWriting = 1, kPublished = 2, kInUse = 3, kFree = 4, kRetired = 5;

struct Trailer {
  // Written once by the producer before the name is published.
  uint64_t magic;
  uint64_t capacity;
  int32_t producer_pid;
  uint64_t producer_start;
  uint32_t pooled;  // kept for reuse (else a one-off, retired when its view goes)

  // The value's number in the segment (high 56 bits) and whose turn it is (low 8). Every change
  // is a compare-and-swap from a word naming the value: a party holding a stale number (the lease
  // of an earlier value, a consumer with another pair's number) changes nothing.
  std::atomic<uint64_t> word;
  std::atomic<uint32_t> producer_released;  // the producer dropped it: not to be reused
  std::atomic<int64_t> freed_at_ns;         // steady clock (CLOCK_MONOTONIC): the last view went
};
static_assert(sizeof(Trailer) <= kTrailerBytes);

Trailer* TrailerOf(const shm::Segment& segment) {
  return reinterpret_cast<Trailer*>(static_cast<char*>(segment.data()) + segment.size() -
                                    kTrailerBytes);
}

constexpr uint64_t Word(uint64_t sequence, uint32_t state) { return sequence << 8 | state; }
uint32_t StateOf(uint64_t word) { return static_cast<uint32_t>(word & 0xff); }
uint64_t SequenceOf(uint64_t word) { return word >> 8; }
uint32_t StateOf(const Trailer* t) { return StateOf(t->word.load()); }

// Moves value `sequence` from state `from` to `to`; false if the segment is not in that state
// with that value.
bool MoveValue(Trailer* t, uint64_t sequence, uint32_t from, uint32_t to) {
  uint64_t expected = Word(sequence, from);
  return t->word.compare_exchange_strong(expected, Word(sequence, to));
}

// Moves whatever value the segment holds from state `from` to `to`.
bool Move(Trailer* t, uint32_t from, uint32_t to) {
  uint64_t word = t->word.load();
  while (StateOf(word) == from) {
    if (t->word.compare_exchange_weak(word, Word(SequenceOf(word), to))) return true;
  }
  return false;
}

int64_t NowNs(Clock::time_point now = Clock::now()) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
}

std::atomic<int64_t> idle_ms{kDefaultIdleMs};

// ---- the producer's side ----

struct ProducedSegment {
  std::shared_ptr<shm::Segment> segment;
  std::string name;
  uint64_t capacity = 0;
  Clock::time_point last_used;  // guarded by State::mu
};

struct ConsumerPool {
  ProcessId consumer;
  std::vector<std::shared_ptr<ProducedSegment>> segments;
  std::vector<uint64_t> creating;  // capacities of pooled segments being made (counted in)
};

// ---- the consumer's side ----

struct ReceivedSegment {
  std::shared_ptr<shm::Segment> segment;
  std::string name;
  ProcessId producer;
  bool pooled = false;
  int32_t receiver_pid = 0;     // a forked child's copy of a view frees nothing
  bool cached = false;          // guarded by State::mu: in State::received
  Clock::time_point last_used;  // guarded by State::mu
};

// An object a producer keeps until the consumer has released value `sequence` of `segment`.
struct Held {
  std::shared_ptr<ProducedSegment> segment;  // (mapped while held: its trailer tells)
  uint64_t sequence = 0;
  ProcessId consumer;
  std::shared_ptr<void> object;
};

struct State {
  std::mutex mu;
  // Guarded by mu. Keyed by the peer's (pid, start time).
  std::map<std::pair<int32_t, uint64_t>, ConsumerPool> pools;
  std::map<std::string, std::shared_ptr<ReceivedSegment>> received;
  std::vector<Held> held;
};

// Replaced (the old one leaked) in a fork child: its mutex may be held by a thread of the parent.
State* state = new State();

class LeaseImpl final : public Lease {
 public:
  LeaseImpl(std::shared_ptr<ProducedSegment> produced, uint64_t sequence, bool fresh, bool pooled,
            ProcessId consumer)
      : produced_(std::move(produced)),
        sequence_(sequence),
        fresh_(fresh),
        pooled_(pooled),
        consumer_(consumer) {}
  ~LeaseImpl() override {
    if (!published_) Withdraw();
  }

  void* data() const override { return produced_->segment->data(); }
  const std::string& name() const override { return produced_->name; }
  uint64_t sequence() const override { return sequence_; }

  void MarkPublished() override {
    MoveValue(trailer(), sequence_, kWriting, kPublished);  // (seq_cst: the data is written)
    published_ = true;
  }

  void HoldUntilReleased(std::shared_ptr<void> object) override {
    if (!object) return;
    std::lock_guard<std::mutex> lock(state->mu);
    state->held.push_back({produced_, sequence_, consumer_, std::move(object)});
  }

  void Withdraw() noexcept override {
    published_ = true;  // (done with it either way)
    Trailer* t = trailer();
    const uint32_t to = fresh_ ? kRetired : kFree;
    // (Received after all, or retired: nothing to do.)
    if (!MoveValue(t, sequence_, kWriting, to) && !MoveValue(t, sequence_, kPublished, to)) {
      return;
    }
    if (fresh_) {
      // The consumer never mapped it: it can never be reused.
      shm::Unlink(produced_->name);
      if (pooled_) Forget();
    }
  }

 private:
  Trailer* trailer() const { return TrailerOf(*produced_->segment); }

  void Forget() noexcept {
    std::lock_guard<std::mutex> lock(state->mu);
    for (auto& [key, pool] : state->pools) {
      auto& list = pool.segments;
      const auto it = std::find(list.begin(), list.end(), produced_);
      if (it != list.end()) {
        list.erase(it);
        return;
      }
    }
  }

  const std::shared_ptr<ProducedSegment> produced_;
  const uint64_t sequence_;  // this lease's value
  const bool fresh_;
  const bool pooled_;
  const ProcessId consumer_;
  bool published_ = false;
};

}  // namespace

uint64_t ClassCapacity(uint64_t bytes) {
  if (bytes <= kMinClassBytes) return kMinClassBytes;
  // The smallest m * 2^k >= bytes with m in {4, 5, 6, 7}: at most 25 % unused.
  const int top = 63 - __builtin_clzll(bytes - 1);  // 2^top <= bytes - 1 < 2^(top + 1)
  const uint64_t step = uint64_t{1} << (top - 2);
  return (bytes + step - 1) / step * step;
}

std::unique_ptr<Lease> Acquire(const ProcessId& consumer, uint64_t bytes,
                               const std::function<void(const std::string&)>& before_create) {
  const uint64_t capacity = ClassCapacity(bytes);
  bool pooled = false;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    auto& pool = state->pools[{consumer.pid, consumer.start_time}];
    pool.consumer = consumer;
    size_t of_class = 0;
    uint64_t kept_bytes = 0;
    for (auto& produced : pool.segments) {
      kept_bytes += produced->capacity;
      if (produced->capacity != capacity) continue;
      ++of_class;
      Trailer* t = TrailerOf(*produced->segment);
      uint64_t word = t->word.load();
      if (!t->producer_released.load() && StateOf(word) == kFree &&
          t->word.compare_exchange_strong(word, Word(SequenceOf(word) + 1, kWriting))) {
        produced->last_used = Clock::now();
        return std::make_unique<LeaseImpl>(produced, SequenceOf(word) + 1, /*fresh=*/false,
                                           /*pooled=*/true, consumer);
      }
    }
    for (const uint64_t reserved : pool.creating) {
      kept_bytes += reserved;
      of_class += reserved == capacity ? 1 : 0;
    }
    pooled = of_class < kPooledPerClass && kept_bytes + capacity <= kMaxPooledBytes;
    if (pooled) pool.creating.push_back(capacity);  // (other threads count it in meanwhile)
  }
  // Ends the reservation; adds the segment to the pool if it is one.
  const auto settle = [&](const std::shared_ptr<ProducedSegment>& made) noexcept {
    std::lock_guard<std::mutex> lock(state->mu);
    auto& pool = state->pools[{consumer.pid, consumer.start_time}];
    pool.consumer = consumer;
    const auto it = std::find(pool.creating.begin(), pool.creating.end(), capacity);
    if (it != pool.creating.end()) pool.creating.erase(it);
    if (made) pool.segments.push_back(made);
  };
  const bool reserved = pooled;
  const uint64_t exact = (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
  auto produced = std::make_shared<ProducedSegment>();
  try {
    produced->name = shm::NewSegmentName(consumer);  // the consumer's: its death reaps it
    before_create(produced->name);
    for (;;) {
      produced->capacity = pooled ? capacity : exact;
      try {
        produced->segment = shm::Segment::Create(
            produced->name, produced->capacity + kTrailerBytes, /*populate=*/true);
        break;
      } catch (const FutureError&) {
        // No room for the size class's capacity (up to 25 % more): the value alone may fit.
        if (!pooled || capacity == exact) throw;
        pooled = false;
      }
    }
  } catch (...) {
    if (reserved) settle(nullptr);
    throw;
  }
  auto* t = new (TrailerOf(*produced->segment)) Trailer();
  const auto self = Self();
  t->capacity = produced->capacity;
  t->producer_pid = self.pid;
  t->producer_start = self.start_time;
  t->pooled = pooled ? 1 : 0;
  t->word.store(Word(1, kWriting));
  t->magic = kTrailerMagic;
  produced->last_used = Clock::now();
  if (reserved) settle(pooled ? produced : nullptr);
  return std::make_unique<LeaseImpl>(std::move(produced), 1, /*fresh=*/true, pooled, consumer);
}

Received Receive(const std::string& name, uint64_t sequence, uint64_t bytes) {
  const auto corrupt = [&](const std::string& why) {
    return FutureError(FutureErrc::kInvalidHandle,
                       "the value's payload segment /dev/shm/" + name + " " + why);
  };
  std::shared_ptr<ReceivedSegment> entry;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    const auto it = state->received.find(name);
    if (it != state->received.end()) entry = it->second;
  }
  if (!entry) {
    std::shared_ptr<shm::Segment> segment = shm::Segment::Open(name, shm::Segment::kAnySize);
    if (!segment) {
      throw FutureError(FutureErrc::kSharedMemory,
                        "the value's payload segment /dev/shm/" + name + " is gone");
    }
    // (Checked before its name goes: a name that is not a payload's is left alone.)
    if (segment->size() <= kTrailerBytes || segment->size() % kPageBytes != 0) {
      throw corrupt("has a bad size");
    }
    const Trailer* t = TrailerOf(*segment);
    if (t->magic != kTrailerMagic || t->capacity != segment->size() - kTrailerBytes) {
      throw corrupt("has no payload trailer of this format");
    }
    shm::Unlink(name);  // mapped here and by its producer: the name is no longer needed
    entry = std::make_shared<ReceivedSegment>();
    entry->producer = InThisNamespace(t->producer_pid, t->producer_start);
    entry->pooled = t->pooled != 0;  // (read once: the producer can write the trailer anytime)
    entry->segment = std::move(segment);
    entry->name = name;
    entry->receiver_pid = CurrentPid();
  }
  Trailer* t = TrailerOf(*entry->segment);
  if (bytes > entry->segment->size() - kTrailerBytes) throw corrupt("is smaller than the value");
  if (!MoveValue(t, sequence, kPublished, kInUse)) {
    throw corrupt("does not hold this value (it was withdrawn or reused)");
  }
  {
    std::lock_guard<std::mutex> lock(state->mu);
    entry->last_used = Clock::now();
    if (entry->pooled && !entry->cached) {
      entry->cached = true;
      state->received[name] = entry;
    }
  }
  // The view's end: free for the producer's next value, unless either side gave it up.
  std::shared_ptr<void> keep_alive(entry.get(), [entry, sequence](void*) {
    if (CurrentPid() != entry->receiver_pid) return;
    Trailer* t = TrailerOf(*entry->segment);
    State* s = state;
    std::lock_guard<std::mutex> lock(s->mu);
    entry->last_used = Clock::now();
    t->freed_at_ns.store(NowNs(entry->last_used));
    if (entry->cached && !t->producer_released.load() &&
        MoveValue(t, sequence, kInUse, kFree)) {
      return;
    }
    MoveValue(t, sequence, kInUse, kRetired);
    if (entry->cached) {
      entry->cached = false;
      s->received.erase(entry->name);  // (the mapping goes with the last reference: here)
    }
  });
  return {entry->segment->data(), std::move(keep_alive)};
}

void Discard(const std::string& name) noexcept {
  std::shared_ptr<ReceivedSegment> dropped;  // unmapped outside mu
  std::lock_guard<std::mutex> lock(state->mu);
  const auto it = state->received.find(name);
  if (it == state->received.end()) return;
  Trailer* t = TrailerOf(*it->second->segment);
  if (!Move(t, kWriting, kRetired) && !Move(t, kPublished, kRetired)) return;
  it->second->cached = false;
  dropped = std::move(it->second);
  state->received.erase(it);
}

bool Sweep(Clock::time_point now, const std::function<bool(const ProcessId&)>& alive) {
  const auto idle = std::chrono::milliseconds(idle_ms.load());
  const int64_t idle_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(idle).count();
  std::vector<std::shared_ptr<ProducedSegment>> dropped_produced;  // unmapped outside mu
  std::vector<std::shared_ptr<ReceivedSegment>> dropped_received;
  std::vector<Held> released;  // destroyed outside mu (a device block's memory goes back)
  bool any = false;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    // Held until the consumer's view of that value is gone: the value is no longer published or
    // in use (free, reused, retired, or withdrawn), or the consumer died.
    for (auto it = state->held.begin(); it != state->held.end();) {
      const uint64_t word = TrailerOf(*it->segment->segment)->word.load();
      const bool viewed = word == Word(it->sequence, kPublished) ||
                          word == Word(it->sequence, kInUse);
      if (viewed && alive(it->consumer)) {
        ++it;
      } else {
        released.push_back(std::move(*it));
        it = state->held.erase(it);
      }
    }
    for (auto pool_it = state->pools.begin(); pool_it != state->pools.end();) {
      auto& pool = pool_it->second;
      const bool consumer_alive = alive(pool.consumer);
      auto& list = pool.segments;
      for (auto it = list.begin(); it != list.end();) {
        auto& produced = *it;
        Trailer* t = TrailerOf(*produced->segment);
        bool drop = false;
        if (!consumer_alive) {
          shm::Unlink(produced->name);  // (never received: still named)
          drop = true;
        } else if (StateOf(t) == kRetired) {
          drop = true;
        } else if (now - produced->last_used >= idle && NowNs(now) - t->freed_at_ns >= idle_ns) {
          // Free: retired for both. In use: the consumer retires it when its view goes.
          drop = Move(t, kFree, kRetired) || StateOf(t) == kInUse;
        }
        if (drop) {
          t->producer_released.store(1);
          dropped_produced.push_back(std::move(produced));
          it = list.erase(it);
        } else {
          ++it;
        }
      }
      pool_it = list.empty() && pool.creating.empty() ? state->pools.erase(pool_it)
                                                      : std::next(pool_it);
    }
    for (auto it = state->received.begin(); it != state->received.end();) {
      auto& entry = it->second;
      Trailer* t = TrailerOf(*entry->segment);
      const uint32_t now_state = StateOf(t);
      bool drop = now_state == kRetired;
      if (!drop && (t->producer_released.load() || now - entry->last_used >= idle)) {
        drop = Move(t, kFree, kRetired);
      }
      // A dead producer writes nothing more into it. (A value it published stays until taken;
      // one it died writing is discarded when its pair breaks.)
      if (!drop && now_state != kInUse && now_state != kPublished && !alive(entry->producer)) {
        drop = Move(t, now_state, kRetired);
      }
      if (drop) {
        entry->cached = false;
        dropped_received.push_back(std::move(entry));
        it = state->received.erase(it);
      } else {
        ++it;
      }
    }
    any = !state->pools.empty() || !state->received.empty() || !state->held.empty();
  }
  return any;
}

bool AnyKept() {
  std::lock_guard<std::mutex> lock(state->mu);
  return !state->pools.empty() || !state->received.empty() || !state->held.empty();
}

Counts Kept() {
  Counts counts;
  std::lock_guard<std::mutex> lock(state->mu);
  for (const auto& [key, pool] : state->pools) {
    for (const auto& produced : pool.segments) {
      ++counts.produced;
      counts.produced_bytes += produced->capacity;
    }
  }
  for (const auto& [name, entry] : state->received) {
    ++counts.received;
    counts.received_bytes += entry->segment->size() - kTrailerBytes;
  }
  return counts;
}

void SetIdleMs(int64_t ms) {
  if (ms < 0) throw std::invalid_argument("the payload idle time must be >= 0 ms");
  idle_ms = ms;
}

int64_t IdleMs() { return idle_ms.load(); }

void PrepareFork() noexcept { state->mu.lock(); }
void AfterForkInParent() noexcept { state->mu.unlock(); }
void AfterForkInChild() noexcept {
  // The parent's segments are unmapped here (the child would keep them in memory for as long as
  // it lives), except those a view inherited by the child still holds. (The old state is leaked:
  // its mutex is held, by PrepareFork; nothing else touches it now.)
  State* parents = state;
  state = new State();
  parents->pools.clear();
  parents->received.clear();
  // What the parent holds for its consumers (device blocks) is the parent's: leaked here.
  for (auto& held : parents->held) new std::shared_ptr<void>(std::move(held.object));
  parents->held.clear();
}

}  // namespace dtorch::core::payload
