// Shared-memory segments, process identity and futexes for the kinds that cross processes
// (torch-free; Linux).
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

namespace boost::interprocess {
class mapped_region;
}

namespace dtorch::core::shm {

// A process, told apart from a later one that reuses its pid by its start time (clock ticks after
// boot, /proc/<pid>/stat field 22), in a pid namespace (the inode of /proc/<pid>/ns/pid).
struct ProcessId {
  int32_t pid = 0;
  uint64_t start_time = 0;
  uint64_t pid_namespace = 0;
  bool operator==(const ProcessId& other) const {
    return pid == other.pid && start_time == other.start_time &&
           pid_namespace == other.pid_namespace;
  }
};

// getpid() without a system call on the hot paths: cached, and reset by the library's fork
// handler in the child (ResetCurrentPidInForkChild, first thing).
int32_t CurrentPid() noexcept;
void ResetCurrentPidInForkChild() noexcept;

// This process (recomputed after fork). Throws FutureError(kSharedMemory) if /proc cannot tell.
ProcessId Self();
// A process of this pid namespace.
ProcessId InThisNamespace(int32_t pid, uint64_t start_time);
// Whether `process` still runs: false only when it is known to be gone (no such pid, a zombie, or
// another start time). A process of another pid namespace, or one /proc cannot tell about now
// (out of file descriptors), counts as alive.
bool IsAlive(const ProcessId& process);

// Fills `out` with random bytes from the kernel (getrandom).
void RandomBytes(void* out, size_t size);
std::string HexOf(const void* bytes, size_t size);

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
