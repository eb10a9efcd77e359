// The file kind's shared-memory layout (file_kind.h's protocol): the control block of a pair and
// a process's doorbell, the state word's encoding, and the helpers over a mapped block that the
// consumer, the producers' channels and the watcher share. Private to the kind.
//
// A block is untrusted (any process of the user may write the segment): readers bound every
// field (names by kNameField, text by its recorded size), and check magic and layout version
// before anything else.
#pragma once

#include <pthread.h>
#include <sys/stat.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <boost/interprocess/sync/interprocess_mutex.hpp>
#include <boost/interprocess/sync/scoped_lock.hpp>

#include "../../base/clock.h"
#include "../../base/process.h"
#include "../../base/random.h"
#include "../../future_error.h"
#include "file_kind.h"
#include "payload_pool.h"
#include "shm_segment.h"

namespace dtorch::core::file_internal {
namespace bip = boost::interprocess;


using std::chrono::milliseconds;

constexpr uint64_t kControlMagic = 0x3170666863726f74ULL;  // "torchfp1" (little-endian)
constexpr uint64_t kDoorbellMagic = 0x3162646863726f74ULL;  // "torchdb1"
// 3: the consumer's value options are recorded in the block (a handle must name the same).
// 4: handles serialized and deserialized are counted; an error carries its exception's type and
//    the producer's traceback.
constexpr uint32_t kLayoutVersion = 4;
constexpr size_t kSegmentBytes = 4096;  // a control segment and a doorbell: one page each
constexpr size_t kNonceBytes = 16;
constexpr size_t kTypeNameBytes = 16;
constexpr size_t kMaxValueOptionsBytes = 32;  // FileHandle::value_options
constexpr uint32_t kMaxProducers = 32;
// An error's text: its detail (message), then as much of the producer's traceback as fits.
constexpr size_t kMaxErrorTextBytes = 1536;
constexpr size_t kNameField = shm::kMaxSegmentNameBytes + 1;  // NUL-terminated

// The state word: a phase, and (claimed, value, error) who claimed it.
constexpr uint32_t kPending = 0, kClaimed = 1, kValue = 2, kError = 3;
constexpr uint32_t kCreatorClaimant = 0xfe;   // the creator's own promise handle
constexpr uint32_t kConsumerClaimant = 0xfd;  // the consumer, breaking the pair
constexpr uint32_t kLockBreakerClaimant = 0xfc;  // a producer that found the lock's owner dead
inline uint32_t Phase(uint32_t state) { return state & 0xff; }
inline uint32_t Claimant(uint32_t state) { return state >> 8; }
inline uint32_t State(uint32_t phase, uint32_t claimant) { return phase | (claimant << 8); }
inline bool IsDone(uint32_t state) { return Phase(state) == kValue || Phase(state) == kError; }

// flags
constexpr uint32_t kLeftProcess = 1;     // serialized (or the creator forked)
constexpr uint32_t kCreatorDropped = 2;  // the creator's promise handle is gone
constexpr uint32_t kConsumerGone = 4;    // the pair is gone: a payload published now is withdrawn
constexpr uint32_t kWantsRing = 8;       // callbacks wait: a completion rings the doorbell

// A producer entry's state.
constexpr uint32_t kAttached = 1, kDropped = 2, kExited = 3;

// The liveness check of pending pairs (and the doorbell watcher's longest sleep).
constexpr milliseconds kLivenessPeriod{250};
// How long "no producer left" must hold before the pair breaks: a process dropping its last
// handle may be about to attach anew.
constexpr milliseconds kNoProducerGrace{500};
constexpr milliseconds kWatcherIdleExit{2000};
constexpr char kWatcherThreadName[] = "dtorch-doorbell";
constexpr int kLockTimeoutS = 10;


struct ProducerEntry {
  std::atomic<int32_t> pid;
  std::atomic<uint64_t> start_time;
  std::atomic<uint32_t> state;

  // The registered process (of this pid namespace: attach refuses others).
  ProcessId Process() const { return InThisNamespace(pid.load(), start_time.load()); }
};

struct FileControlBlock {
  // Written once by the creator, before the name is known to anybody.
  uint64_t magic;
  uint32_t layout_version;
  char type_name[kTypeNameBytes];
  unsigned char nonce[kNonceBytes];
  // The consumer's choice of delivery, NUL-terminated: a producer delivers only as it chose.
  char value_options[kMaxValueOptionsBytes + 1];
  int32_t creator_pid;
  uint64_t creator_start;
  char doorbell[kNameField];
  unsigned char doorbell_nonce[kNonceBytes];

  std::atomic<uint32_t> state;    // the futex word
  std::atomic<uint32_t> waiters;  // consumer threads sleeping on `state`
  std::atomic<uint32_t> flags;
  std::atomic<int64_t> creator_dropped_ms;  // steady clock (CLOCK_MONOTONIC), for the deadline
  // Handles of the promise serialized and deserialized, in any process (wrapping counts): while
  // more were serialized than deserialized, a handle may be on its way to a process that will
  // hold it. A holder increments `deserialized` only after its entry is in the table.
  std::atomic<uint32_t> serialized;
  std::atomic<uint32_t> deserialized;
  std::atomic<uint32_t> producer_count;     // entries in use; grows only, under producers_mu
  bip::interprocess_mutex producers_mu;     // robust; guards adding producer entries
  ProducerEntry producers[kMaxProducers];

  // The completion, written by the claimant before `state` says value or error.
  uint32_t error_code;
  uint32_t detail_bytes;     // of error_text: the detail
  uint32_t traceback_bytes;  // of error_text, after the detail: the producer's traceback
  char exception_type[kMaxExceptionTypeBytes + 1];  // NUL-terminated; "" for none
  char error_text[kMaxErrorTextBytes];
  char payload[kNameField];  // the payload segment (payload_pool.h), written before it is used
  uint64_t payload_sequence;  // the value's number in that segment
  uint64_t payload_bytes;
  uint32_t header_bytes;
  char header[kMaxValueHeaderBytes];
};
static_assert(sizeof(FileControlBlock) <= kSegmentBytes);

// The producer entry whose process claimed the pair (`state` is its state word), or null: not
// claimed, or claimed by the creator, the consumer or a lock breaker.
inline const ProducerEntry* ClaimingProducer(const FileControlBlock* block, uint32_t state) {
  if (Phase(state) != kClaimed || Claimant(state) >= kMaxProducers) return nullptr;
  return &block->producers[Claimant(state)];
}
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
              std::atomic<uint64_t>::is_always_lock_free);

struct DoorbellBlock {
  uint64_t magic;
  unsigned char nonce[kNonceBytes];
  std::atomic<uint32_t> rings;     // the futex word: bumped by every completion
  std::atomic<uint32_t> sleeping;  // the watcher sleeps on `rings`: wake it
};
static_assert(sizeof(DoorbellBlock) <= kSegmentBytes);

inline std::string ReadName(const char (&field)[kNameField]) {
  return std::string(field, strnlen(field, kNameField));
}

inline void WriteName(char (&field)[kNameField], const std::string& name) {
  std::memset(field, 0, kNameField);
  std::memcpy(field, name.data(), std::min(name.size(), kNameField - 1));
}

inline void Ring(DoorbellBlock* doorbell) noexcept {
  if (doorbell == nullptr) return;
  doorbell->rings.fetch_add(1);
  if (doorbell->sleeping.load() != 0) shm::FutexWakeAll(&doorbell->rings);
}

// Value options of the form FileHandle::value_options allows.
inline bool ValidValueOptions(std::string_view options) {
  return options.size() <= kMaxValueOptionsBytes &&
         std::all_of(options.begin(), options.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '=';
         });
}

// The payload segment's name a producer wrote into the block, checked (it must be named for this
// process, the consumer: a producer's names for it are): "" when there is none or it is not.
std::string PayloadNameIn(const FileControlBlock* block);
// Unlinks the payload segment the block names if it is still named (a new segment nobody has
// received); returns its name ("" when there is none, or it is corrupt).
std::string UnlinkNamedPayload(const FileControlBlock* block);
// A producer found `consumer` dead (nullopt: at its exit): what dead processes of this user left
// goes now (control_block.cc).
void ReleaseWhatDeadConsumersLeft(const std::optional<ProcessId>& consumer) noexcept;
// The dead consumers released already are forgotten (a forked child: the parent's set is
// leaked, its lock may be held).
void ForgetReleasedConsumersInChild() noexcept;
// The pair's producer died before publishing: what it was writing goes.
void DiscardPayloadOfDeadProducer(const FileControlBlock* block);
bool ParseHex(std::string_view hex, unsigned char* out, size_t bytes);
// How many bytes of `text`'s start (end) fit in `room`, cut at a UTF-8 character boundary.
size_t Utf8Prefix(const std::string& text, size_t room);
size_t Utf8Suffix(const std::string& text, size_t room);
FutureError InvalidSegment(const std::string& name, const std::string& why);
// The payload of the value published in `block` (this process being its consumer): received
// (mapped, on first receipt, and its name unlinked). Null for a value without one.
std::tuple<void*, size_t, std::shared_ptr<void>> ReceivePublished(const FileControlBlock* block);

}  // namespace dtorch::core::file_internal
