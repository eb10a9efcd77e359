#include "ready_notifier.h"

#include "base/fork_generation.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

namespace dtorch::core {
namespace {

int MakeEventFd() {
  const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "dtorch: eventfd");
  return fd;
}

}  // namespace

ReadyNotifier::ReadyNotifier() : fd_(MakeEventFd()) {}

ReadyNotifier::~ReadyNotifier() { ::close(fd_); }

void ReadyNotifier::Post(int64_t token) noexcept {
  {
    auto lock = LockSurvivingFork(mu_);
    tokens_.push_back(token);
  }
  const uint64_t one = 1;
  // Only fails with EAGAIN when the counter is about to overflow (2^64 - 2 unread posts): the
  // fd is readable then anyway. EINTR cannot happen for a non-blocking eventfd write.
  [[maybe_unused]] const ssize_t written = ::write(fd_, &one, sizeof(one));
}

std::vector<int64_t> ReadyNotifier::Drain() {
  uint64_t count = 0;
  // Reset readability first: a Post after this point writes again and triggers another Drain.
  [[maybe_unused]] const ssize_t n = ::read(fd_, &count, sizeof(count));  // EAGAIN: nothing new
  std::vector<int64_t> tokens;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tokens.swap(tokens_);
  }
  return tokens;
}

}  // namespace dtorch::core
