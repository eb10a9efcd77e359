#include "process.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

#include "../future_error.h"

namespace dtorch::core {
namespace {

// What /proc/<pid>/stat says: the state (field 3) and start time (field 22) of the process; gone
// when there is no such process; unknown when it cannot be read now (EMFILE, ENOMEM...).
struct Stat {
  enum { kRunning, kGone, kUnknown } status = kUnknown;
  char state = '?';
  uint64_t start_time = 0;
};

Stat ReadStat(int32_t pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  Stat stat;
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT || errno == ESRCH) stat.status = Stat::kGone;
    return stat;
  }
  char buffer[1024];
  ssize_t got;
  do {
    got = read(fd, buffer, sizeof(buffer) - 1);
  } while (got < 0 && errno == EINTR);
  const int read_error = errno;
  close(fd);
  if (got <= 0) {
    if (got < 0 && read_error == ESRCH) stat.status = Stat::kGone;  // exited since the open
    return stat;
  }
  buffer[got] = '\0';
  // The command name (field 2) may hold spaces and parentheses: parse after the last ')'.
  const char* paren = strrchr(buffer, ')');
  if (paren == nullptr) return stat;
  std::istringstream fields(paren + 1);
  fields >> stat.state;
  std::string skip;
  for (int field = 4; field < 22; ++field) fields >> skip;  // ppid .. itrealvalue
  if (!(fields >> stat.start_time)) return stat;
  stat.status = Stat::kRunning;
  return stat;
}

uint64_t PidNamespace(const char* path) {
  struct stat info {};
  return ::stat(path, &info) == 0 ? static_cast<uint64_t>(info.st_ino) : 0;
}

}  // namespace

namespace {
std::atomic<int32_t> current_pid{0};
}  // namespace

int32_t CurrentPid() noexcept {
  int32_t pid = current_pid.load(std::memory_order_relaxed);
  if (pid == 0) {
    pid = static_cast<int32_t>(getpid());
    current_pid.store(pid, std::memory_order_relaxed);
  }
  return pid;
}

void ResetCurrentPidInForkChild() noexcept { current_pid.store(0, std::memory_order_relaxed); }

ProcessId Self() {
  // Per process: a fork child computes its own (racing writers store the same values).
  static std::atomic<int32_t> cached_pid{0};
  static std::atomic<uint64_t> cached_start{0}, cached_namespace{0};
  const int32_t pid = CurrentPid();
  if (cached_pid.load(std::memory_order_acquire) != pid) {
    // /proc must be this pid namespace's (unshare -p without a new /proc shows another's).
    char self_link[32] = {};
    const ssize_t link_bytes = readlink("/proc/self", self_link, sizeof(self_link) - 1);
    const bool own_proc = link_bytes > 0 && std::to_string(pid) == self_link;
    const Stat stat = own_proc ? ReadStat(pid) : Stat();
    const uint64_t pid_namespace = PidNamespace("/proc/self/ns/pid");
    if (!own_proc || stat.status != Stat::kRunning || pid_namespace == 0) {
      throw FutureError(FutureErrc::kSharedMemory,
                        "cannot read this process's identity from /proc (is this pid namespace's /proc mounted?)");
    }
    cached_start.store(stat.start_time, std::memory_order_relaxed);
    cached_namespace.store(pid_namespace, std::memory_order_relaxed);
    cached_pid.store(pid, std::memory_order_release);
  }
  return {pid, cached_start.load(std::memory_order_relaxed),
          cached_namespace.load(std::memory_order_relaxed)};
}

ProcessId InThisNamespace(int32_t pid, uint64_t start_time) {
  return {pid, start_time, Self().pid_namespace};
}

bool IsAlive(const ProcessId& process) {
  if (process.pid <= 0) return false;
  if (process.pid_namespace != Self().pid_namespace) return true;  // cannot tell
  const Stat stat = ReadStat(process.pid);
  if (stat.status == Stat::kGone) return false;
  if (stat.status == Stat::kUnknown) return true;  // cannot tell now: asked again later
  if (stat.state == 'Z' || stat.state == 'X' || stat.state == 'x') return false;  // exited
  return stat.start_time == process.start_time;
}

}  // namespace dtorch::core
