// The network kind's store (core/kinds/network/network_kind.h): a client of torch.distributed's c10d TCPStore,
// the store a torch.distributed job already runs (its default group's store, or one of the
// user's): the kind speaks c10d's own protocol to it, with a deadline on every exchange.
// Registered when the library loads.
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#if __has_include(<torch/csrc/distributed/c10d/TCPStoreBackend.hpp>)
#include <torch/csrc/distributed/c10d/TCPStoreBackend.hpp>
#else  // torch 2.14 moved it (the same header: the same protocol)
#include <torch/csrc/distributed/c10d/store/TCPStoreBackend.hpp>
#endif

#include "../../core/kinds/network/network_kind.h"

namespace dtorch {
namespace {

using core::StoreError;

// One connection to a c10d TCPStore server, speaking c10d's own wire protocol (its QueryType
// codes and validation number, TCPStoreBackend.hpp; the requests c10d's TCPStore client sends),
// on a socket of ours: c10d's client waits for an answer without a bound (its constructor's
// ping, compareSet, check), so a store that accepts connections but never answers (frozen,
// SIGSTOPped, cut off without a reset) would block the caller forever. Here every exchange has
// a deadline, NetworkStoreTimeoutMs() (config.network_store_timeout_s); a wait for a key has the
// connection's wait timeout, and then that deadline for the server to confirm the cancel. A call
// that ran past its deadline leaves the exchange half done: the connection is broken for good
// (every later call throws at once) and the kind connects again for new pairs.
//
// Thread-safety: calls are serialized by mu_ (as c10d's activeOpLock_); Abort may be called from
// any thread, also while another is inside a call.
class TcpStoreConnection final : public core::KeyValueStore {
 public:
  using Clock = std::chrono::steady_clock;

  // Connects (refused: at once) and does c10d's first exchange (validate, then ping).
  TcpStoreConnection(const std::string& host, uint16_t port, std::chrono::milliseconds wait)
      : where_(host.find(':') != std::string::npos ? "[" + host + "]:" + std::to_string(port)
                                                   : host + ":" + std::to_string(port)),
        wait_(wait) {
    const auto deadline = Deadline();
    fd_ = ConnectSocket(host, port, deadline);
    try {
      std::lock_guard<std::mutex> lock(mu_);
      Request validate(QueryType::VALIDATE);
      validate.Value<uint32_t>(c10d::detail::validationMagicNumber);
      Send(validate, deadline);
      Request ping(QueryType::PING);
      const uint32_t nonce = static_cast<uint32_t>(getpid());
      ping.Value<uint32_t>(nonce);
      Send(ping, deadline);
      if (Receive<uint32_t>(deadline) != nonce) {
        broken_ = true;
        throw StoreError(StoreError::Kind::kUnreachable,
                         "what listens at " + where_ + " is no torch.distributed TCPStore (its "
                         "answer to a ping was wrong)");
      }
    } catch (...) {
      close(fd_);
      throw;
    }
  }
  ~TcpStoreConnection() override { close(fd_); }

  void Set(const std::string& key, std::string_view value) override {
    std::lock_guard<std::mutex> lock(mu_);
    Request r(QueryType::SET);
    r.String(kKeyPrefix, key);
    r.String(value);
    Send(r, Deadline());
  }
  std::string CompareSet(const std::string& key, const std::string& expected,
                         const std::string& desired) override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = Deadline();
    Request r(QueryType::COMPARE_SET);
    r.String(kKeyPrefix, key);
    r.String(expected);
    r.String(desired);
    Send(r, deadline);
    return ReceiveBytes(deadline);
  }
  std::string Get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    WaitFor(key);
    const auto deadline = Deadline();
    Request r(QueryType::GET);
    r.String(kKeyPrefix, key);
    Send(r, deadline);
    return ReceiveBytes(deadline);
  }
  int64_t Add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = Deadline();
    Request r(QueryType::ADD);
    r.String(kKeyPrefix, key);
    r.Value<int64_t>(delta);
    Send(r, deadline);
    return Receive<int64_t>(deadline);
  }
  bool DeleteKey(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = Deadline();
    Request r(QueryType::DELETE_KEY);
    r.String(kKeyPrefix, key);
    Send(r, deadline);
    return Receive<int64_t>(deadline) == 1;
  }
  bool Check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = Deadline();
    Request r(QueryType::CHECK);
    r.Value<uint64_t>(1);
    r.String(kKeyPrefix, key);
    Send(r, deadline);
    const auto answer = Receive<CheckResponseType>(deadline);
    if (answer != CheckResponseType::READY && answer != CheckResponseType::NOT_READY) {
      throw Garbled("check");
    }
    return answer == CheckResponseType::READY;
  }
  void QueuePush(const std::string& key, std::string_view value) override {
    std::lock_guard<std::mutex> lock(mu_);
    Request r(QueryType::QUEUE_PUSH);
    r.String(kKeyPrefix, key);
    r.String(value);
    Send(r, Deadline());
  }
  std::string QueuePopBlocking(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    WaitFor(key);  // (a queue's key exists while it holds an item)
    if (auto item = PopLocked(key)) return std::move(*item);
    throw StoreError(StoreError::Kind::kTimeout, "the queue was emptied meanwhile");
  }
  std::optional<std::string> QueuePopNow(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return PopLocked(key);
  }
  int64_t QueueLength(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = Deadline();
    Request r(QueryType::QUEUE_LEN);
    r.String(kKeyPrefix, key);
    Send(r, deadline);
    return Receive<int64_t>(deadline);
  }
  // Batches: the requests go in one send, then their answers are read (c10d's server answers
  // the requests of a connection in order).
  std::vector<bool> DeleteKeys(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto deadline = Deadline();
    Request batch(QueryType::DELETE_KEY);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i != 0) batch.Code(QueryType::DELETE_KEY);
      batch.String(kKeyPrefix, keys[i]);
    }
    std::vector<bool> existed;
    if (keys.empty()) return existed;
    Send(batch, deadline);
    existed.reserve(keys.size());
    // (Each answer its own deadline: a server that answers is not silent.)
    for (size_t i = 0; i < keys.size(); ++i) existed.push_back(Receive<int64_t>(Deadline()) == 1);
    return existed;
  }
  std::vector<std::string> CompareSets(const std::vector<std::string>& keys,
                                       const std::string& expected,
                                       const std::string& desired) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> answers;
    if (keys.empty()) return answers;
    Request batch(QueryType::COMPARE_SET);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (i != 0) batch.Code(QueryType::COMPARE_SET);
      batch.String(kKeyPrefix, keys[i]);
      batch.String(expected);
      batch.String(desired);
    }
    Send(batch, Deadline());
    answers.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) answers.push_back(ReceiveBytes(Deadline()));
    return answers;
  }
  std::vector<std::string> QueuePopSome(const std::string& key, size_t max_items, bool block,
                                        int64_t* left) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (block) WaitFor(key);  // (a queue's key exists while it holds an item)
    const auto deadline = Deadline();
    Request batch(QueryType::QUEUE_POP);
    batch.String(kKeyPrefix, key);
    for (size_t i = 1; i < max_items; ++i) {
      batch.Code(QueryType::QUEUE_POP);
      batch.String(kKeyPrefix, key);
    }
    batch.Code(QueryType::QUEUE_LEN);
    batch.String(kKeyPrefix, key);
    Send(batch, deadline);
    std::vector<std::string> items;
    for (size_t i = 0; i < std::max<size_t>(max_items, 1); ++i) {
      // (Each answer its own deadline: items of megabytes each take their time.)
      if (Receive<int64_t>(Deadline()) > 0) items.push_back(ReceiveBytes(Deadline()));
    }
    const int64_t length = Receive<int64_t>(Deadline());
    if (left != nullptr) *left = length;
    if (block && items.empty()) {
      throw StoreError(StoreError::Kind::kTimeout, "the queue was emptied meanwhile");
    }
    return items;
  }
  bool Broken() const noexcept override { return broken_.load(); }
  void Abort() noexcept override {
    aborted_ = true;
    shutdown(fd_, SHUT_RDWR);  // (wakes a call blocked in poll; the fd stays ours until closed)
  }

 private:
  using QueryType = c10d::detail::QueryType;
  using CheckResponseType = c10d::detail::CheckResponseType;
  using WaitResponseType = c10d::detail::WaitResponseType;
  // c10d's TCPStore client puts this before every key.
  static constexpr std::string_view kKeyPrefix = "/";

  // A request's bytes: the query code, then its fields (strings: a uint64 length, the bytes;
  // values in the host's byte order), as c10d's SendBuffer writes them.
  class Request {
   public:
    explicit Request(QueryType type) { Code(type); }
    // Another request's code: requests after the first are pipelined in the same send.
    void Code(QueryType type) { bytes_.push_back(static_cast<char>(type)); }
    template <typename T>
    void Value(T value) {
      bytes_.append(reinterpret_cast<const char*>(&value), sizeof(T));
    }
    void String(std::string_view s) { String({}, s); }
    void String(std::string_view prefix, std::string_view s) {
      Value<uint64_t>(prefix.size() + s.size());
      bytes_.append(prefix);
      bytes_.append(s);
    }
    const std::string& bytes() const { return bytes_; }

   private:
    std::string bytes_;
  };

  Clock::time_point Deadline() const {
    return Clock::now() + std::chrono::milliseconds(core::NetworkStoreTimeoutMs());
  }

  StoreError Broken(const std::string& why) {
    broken_ = true;
    return StoreError(StoreError::Kind::kUnreachable, "the store at " + where_ + " " + why);
  }
  StoreError Garbled(const char* call) {
    return Broken(std::string("answered a ") + call + " with bytes of no c10d TCPStore answer");
  }
  StoreError Silent() {
    return Broken("did not answer within " + std::to_string(core::NetworkStoreTimeoutMs()) +
                  " ms (config.network_store_timeout_s)");
  }

  // Waits until the socket is ready for `events` or `deadline` passes (false then).
  bool Ready(short events, Clock::time_point deadline) {
    for (;;) {
      if (aborted_) throw Broken("was given up on (its session broke)");
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd polled{fd_, events, 0};
      const int n = poll(&polled, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
      if (n > 0) return true;  // (POLLERR/POLLHUP: the send or recv that follows says what)
      if (n < 0 && errno != EINTR) throw Broken(std::string("cannot be polled: ") + strerror(errno));
    }
  }

  void Send(const Request& r, Clock::time_point deadline) {
    if (aborted_) throw Broken("was given up on (its session broke)");
    if (broken_) throw Broken("is no longer reachable on this connection (an earlier call failed)");
    const std::string& bytes = r.bytes();
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!Ready(POLLOUT, deadline)) throw Silent();
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        throw Broken(std::string("closed the connection: ") + strerror(errno));
      }
    }
  }

  void ReceiveInto(char* data, size_t size, Clock::time_point deadline) {
    size_t got = 0;
    while (got < size) {
      const ssize_t n = recv(fd_, data + got, size - got, 0);
      if (n > 0) {
        got += static_cast<size_t>(n);
      } else if (n == 0) {
        throw Broken("closed the connection");
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!Ready(POLLIN, deadline)) throw Silent();
      } else if (errno != EINTR) {
        throw Broken(std::string("closed the connection: ") + strerror(errno));
      }
    }
  }
  template <typename T>
  T Receive(Clock::time_point deadline) {
    T value;
    ReceiveInto(reinterpret_cast<char*>(&value), sizeof(T), deadline);
    return value;
  }
  std::string ReceiveBytes(Clock::time_point deadline) {
    const uint64_t size = Receive<uint64_t>(deadline);
    // (The server refuses values over its limit; a length past it is not an answer of its.)
    if (size > kMaxAnswerBytes) throw Garbled("request");
    std::string bytes(size, '\0');
    ReceiveInto(bytes.data(), size, deadline);
    return bytes;
  }

  // c10d's WAIT for one key: the server answers once the key exists; past the wait timeout the
  // wait is cancelled (StoreError kTimeout, the connection still usable).
  void WaitFor(const std::string& key) {
    Request r(QueryType::WAIT);
    r.Value<uint64_t>(1);
    r.String(kKeyPrefix, key);
    Send(r, Deadline());
    const auto waited = Clock::now() + wait_;
    if (Ready(POLLIN, waited)) {
      if (Receive<WaitResponseType>(Deadline()) != WaitResponseType::STOP_WAITING) {
        throw Garbled("wait");
      }
      return;
    }
    const auto deadline = Deadline();
    Send(Request(QueryType::CANCEL_WAIT), deadline);
    auto answer = Receive<WaitResponseType>(deadline);
    if (answer == WaitResponseType::STOP_WAITING) {  // (the key came as the wait was cancelled)
      answer = Receive<WaitResponseType>(deadline);
    }
    if (answer != WaitResponseType::WAIT_CANCELED) throw Garbled("cancelled wait");
    throw StoreError(StoreError::Kind::kTimeout,
                     "no key " + key + " at " + where_ + " within " +
                         std::to_string(wait_.count()) + " ms");
  }

  std::optional<std::string> PopLocked(const std::string& key) {
    const auto deadline = Deadline();
    Request r(QueryType::QUEUE_POP);
    r.String(kKeyPrefix, key);
    Send(r, deadline);
    const int64_t items = Receive<int64_t>(deadline);
    if (items <= 0) return std::nullopt;
    return ReceiveBytes(deadline);
  }

  // Connects a non-blocking socket to host:port by `deadline`: a refused connection, or a name
  // that does not resolve, fails at once (c10d retries both for its whole timeout, for workers
  // that start before their server; a network pair's store is one its consumer already reached).
  int ConnectSocket(const std::string& host, uint16_t port, Clock::time_point deadline) {
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
    size_t addresses = 0;
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) ++addresses;
    for (addrinfo* a = found; a != nullptr; a = a->ai_next, --addresses) {
      // (Each address its share of what is left: one that drops packets, say IPv6 on a host
      // without a route for it, must not use up the time of those after it.)
      const auto share = Clock::now() + (deadline - Clock::now()) / static_cast<int>(addresses);
      const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                            a->ai_protocol);
      if (fd < 0) {
        error = std::strerror(errno);
        continue;
      }
      int failure = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
      if (failure == EINPROGRESS) {
        fd_ = fd;
        try {
          if (Ready(POLLOUT, share)) {
            socklen_t size = sizeof(failure);
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &failure, &size) != 0) failure = errno;
          } else {
            failure = ETIMEDOUT;
          }
        } catch (const StoreError&) {
          failure = ECONNABORTED;
        }
        broken_ = false;
      }
      if (failure == 0) {
        const int on = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));  // (as c10d's socket)
        freeaddrinfo(found);
        return fd;
      }
      close(fd);
      error = std::strerror(failure);
    }
    freeaddrinfo(found);
    throw StoreError(StoreError::Kind::kUnreachable, "cannot connect to " + where_ + ": " + error);
  }

  // The largest answer read: the server keeps values of up to 8 MiB (kChunkBytes), with room.
  static constexpr uint64_t kMaxAnswerBytes = uint64_t{64} << 20;

  const std::string where_;
  const std::chrono::milliseconds wait_;
  int fd_ = -1;
  std::mutex mu_;
  std::atomic<bool> broken_{false};  // set under mu_; read by Broken() from any thread
  std::atomic<bool> aborted_{false};
};

std::unique_ptr<core::KeyValueStore> ConnectTcpStore(const std::string& host, uint16_t port,
                                                     std::chrono::milliseconds timeout) {
  return std::make_unique<TcpStoreConnection>(host, port, timeout);
}

const bool registered = [] {
  core::SetStoreConnector(&ConnectTcpStore);
  return true;
}();

}  // namespace
}  // namespace dtorch
