// The network kind's store (core/network_kind.h): a client of torch.distributed's c10d TCPStore,
// the store a torch.distributed job already runs (its default group's store, or one of the
// user's), so the kind speaks c10d's own protocol to it. Registered when the library loads.
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "../core/network_kind.h"

namespace dtorch {
namespace {

using core::StoreError;

std::vector<uint8_t> Bytes(std::string_view s) { return {s.begin(), s.end()}; }
std::string String(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// c10d's errors as the core's: a timeout (DistStoreError: a wait that ran out), or the store out
// of reach (DistNetworkError, or any other failure of the connection: a socket that closed).
template <typename Fn>
auto Translated(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::DistNetworkError& e) {
    throw StoreError(StoreError::Kind::kUnreachable, e.what_without_backtrace());
  } catch (const c10::DistStoreError& e) {
    throw StoreError(StoreError::Kind::kTimeout, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    throw StoreError(StoreError::Kind::kUnreachable, e.what_without_backtrace());
  } catch (const std::system_error& e) {
    throw StoreError(StoreError::Kind::kUnreachable, e.what());
  }
}

class TcpStoreConnection final : public core::KeyValueStore {
 public:
  explicit TcpStoreConnection(c10::intrusive_ptr<c10d::TCPStore> store)
      : store_(std::move(store)) {}

  void Set(const std::string& key, std::string_view value) override {
    Translated([&] { store_->set(key, Bytes(value)); });
  }
  std::string CompareSet(const std::string& key, const std::string& expected,
                         const std::string& desired) override {
    return Translated([&] { return String(store_->compareSet(key, Bytes(expected), Bytes(desired))); });
  }
  std::string Get(const std::string& key) override {
    return Translated([&] { return String(store_->get(key)); });
  }
  int64_t Add(const std::string& key, int64_t delta) override {
    return Translated([&] { return store_->add(key, delta); });
  }
  bool DeleteKey(const std::string& key) override {
    return Translated([&] { return store_->deleteKey(key); });
  }
  bool Check(const std::string& key) override {
    return Translated([&] { return store_->check({key}); });
  }
  void QueuePush(const std::string& key, std::string_view value) override {
    Translated([&] { store_->queuePush(key, Bytes(value)); });
  }
  std::string QueuePopBlocking(const std::string& key) override {
    return Translated([&] { return String(store_->queuePop(key, /*block=*/true)); });
  }
  std::optional<std::string> QueuePopNow(const std::string& key) override {
    try {
      return Translated([&]() -> std::optional<std::string> {
        return String(store_->queuePop(key, /*block=*/false));
      });
    } catch (const StoreError& e) {
      // (DistQueueEmptyError is a DistStoreError: an empty queue, not a timeout.)
      if (e.kind() == StoreError::Kind::kTimeout) return std::nullopt;
      throw;
    }
  }
  int64_t QueueLength(const std::string& key) override {
    return Translated([&] { return store_->queueLen(key); });
  }

 private:
  const c10::intrusive_ptr<c10d::TCPStore> store_;
};

// Throws StoreError(kUnreachable) at once where host:port cannot be connected to: c10d retries a
// refused connection, or a name that does not resolve, for its whole timeout and then again (for
// workers that start before their server), but a network pair's store is one its consumer has
// already reached. Connects with a plain socket, closed at once (the server ignores it).
void ProbeReachable(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int resolved = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (resolved != 0) {
    throw StoreError(StoreError::Kind::kUnreachable,
                     "the host name '" + host + "' does not resolve: " + gai_strerror(resolved));
  }
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                          a->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    int failure = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (failure == EINPROGRESS) {
      pollfd polled{fd, POLLOUT, 0};
      const int ready = poll(&polled, 1, static_cast<int>(timeout.count()));
      socklen_t size = sizeof(failure);
      if (ready == 1) {
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &failure, &size);
      } else {
        failure = ready == 0 ? ETIMEDOUT : errno;
      }
    }
    close(fd);
    if (failure == 0) {
      freeaddrinfo(found);
      return;
    }
    error = std::strerror(failure);
  }
  freeaddrinfo(found);
  throw StoreError(StoreError::Kind::kUnreachable,
                   "cannot connect to " + host + ":" + std::to_string(port) + ": " + error);
}

std::unique_ptr<core::KeyValueStore> ConnectTcpStore(const std::string& host, uint16_t port,
                                                     std::chrono::milliseconds timeout) {
  ProbeReachable(host, port, std::min(timeout, std::chrono::milliseconds(10000)));
  c10d::TCPStoreOptions options;
  options.port = port;
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  return Translated([&] {
    return std::make_unique<TcpStoreConnection>(c10::make_intrusive<c10d::TCPStore>(host, options));
  });
}

const bool registered = [] {
  core::SetStoreConnector(&ConnectTcpStore);
  return true;
}();

}  // namespace
}  // namespace dtorch
