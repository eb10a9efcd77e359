// Shared-memory segments and futexes of the file kind (torch-free; Linux). Process identity is
// base/process.h.
//
// Segments are POSIX shared memory (Boost.Interprocess) named
// "dtorch_<pid>-<start>-<pid namespace>_<32 hex>": the process the segment belongs to (so that
// what a dead process left behind can be told apart and reaped, by processes of its pid namespace
// only), and 128 random bits (so that nobody can guess a name).
// They are created exclusively (O_EXCL) with mode 0600, their space reserved up front (a full
// /dev/shm is an error at creation, not a SIGBUS at first write), and checked on open: a regular
// file of this user, mode 0600, of the expected size (or, for payloads, of a size checked
// against their trailer).
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "../../base/process.h"

namespace boost::interprocess {
class mapped_region;
}

namespace dtorch::core::shm {

inline constexpr size_t kMaxSegmentNameBytes = 80;
// A fresh name for a segment that belongs to `owner`.
std::string NewSegmentName(const ProcessId& owner);
// Whether `name` has exactly the form NewSegmentName makes (checked before any use of a name that
// came from another process); its owner is stored in *owner when it has.
bool ParseSegmentName(std::string_view name, ProcessId* owner = nullptr);

// A mapped segment; unmapped (not unlinked) when destroyed.
class Segment {
 public:
  // Creates `name` exclusively, mode 0600, `size` bytes reserved and zeroed, mapped read-write;
  // `populate`: its page tables filled now (MAP_POPULATE), not one fault per page at first
  // write. Throws FutureError(kSharedMemory) naming the cause (no room in /dev/shm, name taken).
  static std::unique_ptr<Segment> Create(const std::string& name, size_t size,
                                         bool populate = false);
  // Opens and maps an existing segment: nullptr if no such name exists; throws
  // FutureError(kInvalidHandle) unless it is a regular file of this user (EACCES: another
  // user's), mode 0600, of `expected_size` bytes (kAnySize: of any size but 0).
  static constexpr size_t kAnySize = SIZE_MAX;
  static std::unique_ptr<Segment> Open(const std::string& name, size_t expected_size);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  void* data() const;
  size_t size() const;

 private:
  explicit Segment(std::unique_ptr<boost::interprocess::mapped_region> region);
  const std::unique_ptr<boost::interprocess::mapped_region> region_;
};

// Removes the name (mappings stay valid). A name that is gone already is not an error.
void Unlink(const std::string& name) noexcept;
// Unlinks every segment of ours (this user, our name form, this pid namespace) whose owner process
// is gone: what a killed process left behind. Runs when the library loads.
void ReapSegmentsOfDeadProcesses() noexcept;

// Futex on a 32-bit word in shared memory (not FUTEX_PRIVATE: the waker is another process).
// Sleeps while *word == expected, at most `timeout`; spurious returns are possible.
void FutexWait(const std::atomic<uint32_t>* word, uint32_t expected,
               std::chrono::nanoseconds timeout) noexcept;
void FutexWakeAll(const std::atomic<uint32_t>* word) noexcept;

}  // namespace dtorch::core::shm
