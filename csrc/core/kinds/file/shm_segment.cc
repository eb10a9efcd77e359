#include "../../boost_config.h"  // first: checks the Boost version

#include "shm_segment.h"

#include <dirent.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <sstream>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include "../../base/random.h"
#include "../../future_error.h"

namespace dtorch::core::shm {
namespace bip = boost::interprocess;
namespace {

constexpr std::string_view kNamePrefix = "dtorch_";
constexpr size_t kRandomBytes = 16;

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

std::string NewSegmentName(const ProcessId& owner) {
  unsigned char random[kRandomBytes];
  RandomBytes(random, sizeof(random));
  return std::string(kNamePrefix) + std::to_string(owner.pid) + "-" +
         std::to_string(owner.start_time) + "-" + std::to_string(owner.pid_namespace) + "_" +
         HexOf(random, sizeof(random));
}

bool ParseSegmentName(std::string_view name, ProcessId* owner) {
  if (name.size() > kMaxSegmentNameBytes || name.substr(0, kNamePrefix.size()) != kNamePrefix) {
    return false;
  }
  name.remove_prefix(kNamePrefix.size());
  // <pid: 1-10 digits>-<start: 1-20 digits>-<pid namespace: 1-20 digits>_<32 lowercase hex
  // digits>, nothing else.
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
  uint64_t pid = 0, start = 0, pid_namespace = 0;
  if (!number('-', 10, &pid) || pid == 0 || pid > INT32_MAX) return false;
  if (!number('-', 20, &start)) return false;
  if (!number('_', 20, &pid_namespace)) return false;
  if (name.size() != 2 * kRandomBytes) return false;
  for (const char c : name) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  if (owner) *owner = {static_cast<int32_t>(pid), start, pid_namespace};
  return true;
}

Segment::Segment(std::unique_ptr<bip::mapped_region> region) : region_(std::move(region)) {}
Segment::~Segment() = default;
void* Segment::data() const { return region_->get_address(); }
size_t Segment::size() const { return region_->get_size(); }

std::unique_ptr<Segment> Segment::Create(const std::string& name, size_t size, bool populate) {
  try {
    bip::permissions owner_only(0600);
    bip::shared_memory_object object(bip::create_only, name.c_str(), bip::read_write, owner_only);
    try {
      object.truncate(static_cast<bip::offset_t>(size));  // posix_fallocate: space reserved
      return std::unique_ptr<Segment>(new Segment(std::make_unique<bip::mapped_region>(
          object, bip::read_write, 0, 0, nullptr,
          populate ? bip::map_options_t(MAP_POPULATE) : bip::default_map_options)));
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
    if (e.get_native_error() == EACCES) {
      throw FutureError(FutureErrc::kInvalidHandle,
                        "/dev/shm/" + name + " belongs to another user; refusing to use it");
    }
    switch (e.get_native_error()) {
      // A directory, a symbolic link (shm_open does not follow one), a device or a FIFO under
      // our name form: a forged handle, not a failure of the system's.
      case EISDIR: case ELOOP: case ENOTDIR: case ENXIO: case ENODEV: case EINVAL:
        throw FutureError(FutureErrc::kInvalidHandle,
                          "/dev/shm/" + name + " is not a shared memory segment (" +
                              std::strerror(e.get_native_error()) + "); refusing to use it");
      default:
        break;
    }
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
  if (expected_size != kAnySize && static_cast<uint64_t>(info.st_size) != expected_size) {
    throw FutureError(FutureErrc::kInvalidHandle,
                      "/dev/shm/" + name + " has " + std::to_string(info.st_size) +
                          " bytes, expected " + std::to_string(expected_size));
  }
  if (info.st_size == 0) {
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
  std::map<std::pair<int32_t, uint64_t>, bool> alive;  // a live owner may have many segments
  try {
    const uint64_t pid_namespace = Self().pid_namespace;
    while (const dirent* entry = readdir(dir)) {
      ProcessId owner;
      if (!ParseSegmentName(entry->d_name, &owner)) continue;
      if (owner.pid_namespace != pid_namespace) continue;  // its liveness is not ours to tell
      struct stat info {};
      if (fstatat(dirfd(dir), entry->d_name, &info, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (info.st_uid != me || !S_ISREG(info.st_mode)) continue;
      const auto key = std::make_pair(owner.pid, owner.start_time);
      auto it = alive.find(key);
      if (it == alive.end()) it = alive.emplace(key, IsAlive(owner)).first;
      if (!it->second) unlinkat(dirfd(dir), entry->d_name, 0);
    }
  } catch (...) {
    // No identity (no /proc): reap nothing.
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
