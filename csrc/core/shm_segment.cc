#include "boost_config.h"  // first: checks the Boost version

#include "shm_segment.h"

#include <dirent.h>
#include <linux/futex.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include "future_error.h"

namespace dtorch::core::shm {
namespace bip = boost::interprocess;
namespace {

constexpr std::string_view kNamePrefix = "dtorch_";
constexpr size_t kRandomBytes = 16;

// Field 22 (starttime) and field 3 (state) of /proc/<pid>/stat; nullopt if there is no such
// process. The command name (field 2) may hold spaces and parentheses: parse after the last ')'.
std::optional<std::pair<char, uint64_t>> ReadStat(int32_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  std::ifstream file(path);
  std::string line;
  if (!file || !std::getline(file, line)) return std::nullopt;
  const auto paren = line.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(line.substr(paren + 1));
  char state = '?';
  fields >> state;
  std::string skip;
  for (int field = 4; field < 22; ++field) fields >> skip;  // ppid .. itrealvalue
  uint64_t start = 0;
  if (!(fields >> start)) return std::nullopt;
  return std::make_pair(state, start);
}

FutureError ShmError(const std::string& what, int error) {
  std::string hint;
  if (error == ENOSPC || error == ENOMEM) {
    hint = ": /dev/shm has no room for it (it is a RAM-backed file system; in a container, raise "
           "its size, e.g. docker run --shm-size=...)";
  } else if (error == EMFILE || error == ENFILE) {
    hint = ": too many open files";
  }
  return FutureError(FutureErrc::kSharedMemory, what + " failed: " + std::strerror(error) + hint);
}

}  // namespace

ProcessId Self() {
  static std::atomic<int32_t> cached_pid{0};
  static std::atomic<uint64_t> cached_start{0};
  const int32_t pid = getpid();
  if (cached_pid.load(std::memory_order_acquire) != pid) {
    const auto stat = ReadStat(pid);
    cached_start.store(stat ? stat->second : 0, std::memory_order_relaxed);
    cached_pid.store(pid, std::memory_order_release);
  }
  return {pid, cached_start.load(std::memory_order_relaxed)};
}

bool IsAlive(const ProcessId& process) {
  if (process.pid <= 0) return false;
  const auto stat = ReadStat(process.pid);
  if (!stat) return false;
  const char state = stat->first;
  if (state == 'Z' || state == 'X' || state == 'x') return false;  // exited, not yet reaped
  return stat->second == process.start_time;
}

void RandomBytes(void* out, size_t size) {
  auto* bytes = static_cast<unsigned char*>(out);
  while (size > 0) {
    const ssize_t got = getrandom(bytes, size, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw FutureError(FutureErrc::kSharedMemory,
                        std::string("getrandom failed: ") + std::strerror(errno));
    }
    bytes += got;
    size -= static_cast<size_t>(got);
  }
}

std::string HexOf(const void* bytes, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(size * 2);
  for (size_t i = 0; i < size; ++i) {
    const auto byte = static_cast<const unsigned char*>(bytes)[i];
    hex += kDigits[byte >> 4];
    hex += kDigits[byte & 0xf];
  }
  return hex;
}

std::string NewSegmentName(const ProcessId& owner) {
  unsigned char random[kRandomBytes];
  RandomBytes(random, sizeof(random));
  return std::string(kNamePrefix) + std::to_string(owner.pid) + "-" +
         std::to_string(owner.start_time) + "_" + HexOf(random, sizeof(random));
}

bool ParseSegmentName(std::string_view name, ProcessId* owner) {
  if (name.size() > kMaxSegmentNameBytes || name.substr(0, kNamePrefix.size()) != kNamePrefix) {
    return false;
  }
  name.remove_prefix(kNamePrefix.size());
  // <pid: 1-10 digits>-<start: 1-20 digits>_<32 lowercase hex digits>, nothing else.
  const auto number = [&](char end, size_t max_digits, uint64_t* value) {
    const auto stop = name.find(end);
    if (stop == 0 || stop == std::string_view::npos || stop > max_digits) return false;
    uint64_t parsed = 0;
    for (const char c : name.substr(0, stop)) {
      if (c < '0' || c > '9') return false;
      if (parsed > (UINT64_MAX - 9) / 10) return false;
      parsed = parsed * 10 + static_cast<uint64_t>(c - '0');
    }
    *value = parsed;
    name.remove_prefix(stop + 1);
    return true;
  };
  uint64_t pid = 0, start = 0;
  if (!number('-', 10, &pid) || pid == 0 || pid > INT32_MAX) return false;
  if (!number('_', 20, &start)) return false;
  if (name.size() != 2 * kRandomBytes) return false;
  for (const char c : name) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  if (owner) *owner = {static_cast<int32_t>(pid), start};
  return true;
}

Segment::Segment(std::unique_ptr<bip::mapped_region> region) : region_(std::move(region)) {}
Segment::~Segment() = default;
void* Segment::data() const { return region_->get_address(); }
size_t Segment::size() const { return region_->get_size(); }

std::unique_ptr<Segment> Segment::Create(const std::string& name, size_t size) {
  try {
    bip::permissions owner_only(0600);
    bip::shared_memory_object object(bip::create_only, name.c_str(), bip::read_write, owner_only);
    try {
      object.truncate(static_cast<bip::offset_t>(size));  // posix_fallocate: space reserved
      return std::unique_ptr<Segment>(
          new Segment(std::make_unique<bip::mapped_region>(object, bip::read_write)));
    } catch (...) {
      bip::shared_memory_object::remove(name.c_str());
      throw;
    }
  } catch (const bip::interprocess_exception& e) {
    const int error = e.get_native_error();
    throw ShmError("creating shared memory segment /dev/shm/" + name + " (" +
                       std::to_string(size) + " bytes)",
                   error != 0 ? error : EIO);
  }
}

std::unique_ptr<Segment> Segment::Open(const std::string& name, size_t expected_size) {
  std::unique_ptr<bip::shared_memory_object> object;
  try {
    object = std::make_unique<bip::shared_memory_object>(bip::open_only, name.c_str(),
                                                          bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    if (e.get_native_error() == ENOENT) return nullptr;
    throw ShmError("opening shared memory segment /dev/shm/" + name, e.get_native_error());
  }
  struct stat info {};
  if (fstat(object->get_mapping_handle().handle, &info) != 0) {
    throw ShmError("checking shared memory segment /dev/shm/" + name, errno);
  }
  // Another user's file under our name form, or one anybody can read, is not ours: refuse it.
  if (!S_ISREG(info.st_mode) || info.st_uid != geteuid() || (info.st_mode & 0777) != 0600) {
    throw FutureError(FutureErrc::kInvalidHandle,
                      "/dev/shm/" + name + " is not a segment of this user with mode 0600; "
                      "refusing to use it");
  }
  if (static_cast<uint64_t>(info.st_size) != expected_size) {
    throw FutureError(FutureErrc::kInvalidHandle,
                      "/dev/shm/" + name + " has " + std::to_string(info.st_size) +
                          " bytes, expected " + std::to_string(expected_size));
  }
  if (expected_size == 0) {
    throw FutureError(FutureErrc::kInvalidHandle, "an empty segment cannot be mapped");
  }
  try {
    return std::unique_ptr<Segment>(
        new Segment(std::make_unique<bip::mapped_region>(*object, bip::read_write)));
  } catch (const bip::interprocess_exception& e) {
    throw ShmError("mapping shared memory segment /dev/shm/" + name, e.get_native_error());
  }
}

void Unlink(const std::string& name) noexcept {
  try {
    bip::shared_memory_object::remove(name.c_str());
  } catch (...) {
  }
}

void ReapSegmentsOfDeadProcesses() noexcept {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  const uid_t me = geteuid();
  while (const dirent* entry = readdir(dir)) {
    ProcessId owner;
    if (!ParseSegmentName(entry->d_name, &owner)) continue;
    struct stat info {};
    if (fstatat(dirfd(dir), entry->d_name, &info, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (info.st_uid != me || !S_ISREG(info.st_mode)) continue;
    if (IsAlive(owner)) continue;
    unlinkat(dirfd(dir), entry->d_name, 0);
  }
  closedir(dir);
}

void FutexWait(const std::atomic<uint32_t>* word, uint32_t expected,
               std::chrono::nanoseconds timeout) noexcept {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  if (timeout.count() <= 0) return;
  timespec relative{};
  relative.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  relative.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAIT, expected, &relative,
          nullptr, 0);
}

void FutexWakeAll(const std::atomic<uint32_t>* word) noexcept {
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr,
          nullptr, 0);
}

}  // namespace dtorch::core::shm
