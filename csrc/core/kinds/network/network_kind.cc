// The network kind's public functions (network_kind.h): addresses and handles parsed (untrusted
// input), pairs created and attached, and the kind in the process's lifecycle.
#include "consumer.h"
#include "producer.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

// ---- parsing ----

// `text` as it may appear in a message: at most 32 printable characters.
std::string Shown(std::string_view text) {
  std::string out;
  for (char c : text.substr(0, 32)) out += (c >= 32 && c < 127) ? c : '?';
  return out;
}

bool IsHostName(std::string_view host) {
  return !host.empty() && host.size() <= 253 && std::all_of(host.begin(), host.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '-' || c == '_';
         });
}

bool IsIpv6(std::string_view host) {
  return host.size() >= 2 && host.size() <= 45 && host.find(':') != std::string_view::npos &&
         std::all_of(host.begin(), host.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') ||
                  c == ':' || c == '.';
         });
}

// Splits "host:port" (or "[v6]:port") off the front of `text`; the rest after the port stays.
// Returns false for anything else.
bool SplitAddress(std::string_view& text, StoreAddress* out) {
  std::string_view host;
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find(']');
    if (close == std::string_view::npos) return false;
    host = text.substr(1, close - 1);
    if (!IsIpv6(host)) return false;
    text.remove_prefix(close + 1);
  } else {
    const auto colon = text.find(':');
    if (colon == std::string_view::npos) return false;
    host = text.substr(0, colon);
    if (!IsHostName(host)) return false;
    text.remove_prefix(colon);
  }
  if (text.empty() || text[0] != ':') return false;
  text.remove_prefix(1);
  size_t digits = 0;
  uint32_t port = 0;
  while (digits < text.size() && digits < 6 && text[digits] >= '0' && text[digits] <= '9') {
    port = port * 10 + static_cast<uint32_t>(text[digits] - '0');
    ++digits;
  }
  if (digits == 0 || digits > 5 || port == 0 || port > 65535 || (digits > 1 && text[0] == '0')) {
    return false;
  }
  text.remove_prefix(digits);
  out->host = std::string(host);
  out->port = static_cast<uint16_t>(port);
  return true;
}

}  // namespace dtorch::core::network_internal

namespace dtorch::core {
using namespace network_internal;

// ---- public functions ----

void SetStoreConnector(StoreConnector connector) { store_connector = connector; }

std::string StoreAddress::ToString() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

StoreAddress StoreAddress::Parse(std::string_view text) {
  StoreAddress address;
  std::string_view rest = text;
  if (!SplitAddress(rest, &address) || !rest.empty()) {
    throw std::invalid_argument(
        "dtorch: a network promise's store is \"host:port\" (an IPv6 host in brackets, a port "
        "1-65535), got \"" + std::string(text.substr(0, 64)) + "\"");
  }
  return address;
}

std::string NetworkHandle::Serialize() const {
  // (Format 1 where the consumer takes no links: a build that reads only format 1 reads it.)
  std::string out = SerializedPrefix(NetworkKind::kName) +
                    (links ? std::string(kHandleFormat) + ":g:" : std::string()) + type_name +
                    ":" + store.ToString() + ":" + consumer + ":" + pair;
  if (!value_options.empty()) out += ":" + value_options;
  return out;
}

NetworkHandle NetworkHandle::Parse(std::string_view rest, std::string_view expected_type) {
  const auto invalid = [](const std::string& why) {
    return FutureError(FutureErrc::kInvalidHandle,
                       "a serialized network promise " + why +
                           "; pass the string serialize() returned, unchanged");
  };
  NetworkHandle h;
  // Format 2 ("v2:<links>:" first) says how the consumer receives values; format 1 (the type
  // first) is a consumer of the store path only.
  if (rest.substr(0, 3) == "v2:") {
    if (rest.size() < 5 || (rest[3] != 'g' && rest[3] != 's') || rest[4] != ':') {
      throw invalid("of format 2 without its links ('g' or 's')");
    }
    h.links = rest[3] == 'g';
    rest.remove_prefix(5);
  } else if (rest.size() >= 2 && rest[0] == 'v' && rest[1] >= '0' && rest[1] <= '9') {
    throw invalid("of a format this build does not read (it reads 1 and 2): serialize and "
                  "deserialize with the same dtorch_ops");
  }
  const auto type_end = rest.find(':');
  if (type_end == std::string_view::npos) throw invalid("without a value type");
  h.type_name = std::string(rest.substr(0, type_end));
  if (h.type_name != expected_type) {
    throw FutureError(FutureErrc::kInvalidHandle,
                      "a serialized network promise of another value type ('" +
                          Shown(h.type_name) + "', expected '" + std::string(expected_type) +
                          "'): TensorPromise and VoidPromise are not interchangeable");
  }
  rest.remove_prefix(type_end + 1);
  if (!SplitAddress(rest, &h.store)) throw invalid("with a bad store address");
  if (rest.size() < 2 + 2 * kIdHexDigits || rest[0] != ':' || rest[1 + kIdHexDigits] != ':') {
    throw invalid("with bad ids");
  }
  h.consumer = std::string(rest.substr(1, kIdHexDigits));
  h.pair = std::string(rest.substr(2 + kIdHexDigits, kIdHexDigits));
  if (!IsId(h.consumer) || !IsId(h.pair)) throw invalid("with bad ids");
  rest.remove_prefix(2 + 2 * kIdHexDigits);
  if (!rest.empty()) {
    if (rest[0] != ':' || rest.size() < 2 || rest.size() > 33 ||
        !std::all_of(rest.begin() + 1, rest.end(), [](char c) {
          return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '=';
        })) {
      throw invalid("with bad value options");
    }
    h.value_options = std::string(rest.substr(1));
  }
  return h;
}

std::shared_ptr<NetworkConsumer> NetworkConsumer::Create(std::string_view type_name,
                                                         const StoreAddress& store,
                                                         std::string_view value_options,
                                                         PayloadBytesOf payload_bytes_of) {
  const std::shared_ptr<Session> session = SessionFor(store);
  NetworkHandle h;
  h.type_name = std::string(type_name);
  h.store = store;
  h.consumer = session->id();
  h.pair = NewId();
  h.value_options = std::string(value_options);
  h.links = NetworkPairGroups() != 0 && HasPairLinkFactory();
  auto consumer = std::make_shared<ConsumerImpl>(session, h, std::move(payload_bytes_of));
  try {
    session->Register(h.pair, consumer->record(), consumer);
  } catch (const StoreError& e) {
    throw Unreachable(store, e);
  }
  return consumer;
}

std::shared_ptr<NetworkProducer> NetworkProducer::Attach(const NetworkHandle& handle,
                                                         AttachAs as) {
  const std::string key = handle.store.ToString() + "/" + handle.pair;
  // An attachment found is released (and maybe destroyed, which takes attachments_mu) only after
  // the lock is: a shared_ptr outside it.
  std::shared_ptr<ProducerImpl> found;
  {
    std::lock_guard<std::mutex> lock(attachments_mu);
    auto& map = Attachments();
    if (auto it = map.find(key); it != map.end()) {
      found = it->second.lock();
      if (!found) map.erase(it);
    }
  }
  if (found) {
    // (Another handle of the same pair that is not this one's: altered.)
    if (found->record() != handle.Serialize()) throw Altered(handle);
    if (as != AttachAs::kFirstUse) found->Announce(as == AttachAs::kDeserialized);
    return found;
  }
  auto producer = std::make_shared<ProducerImpl>(SessionFor(handle.store), handle);
  producer->Open(as);
  {
    std::lock_guard<std::mutex> lock(attachments_mu);
    auto& slot = Attachments()[key];
    found = slot.lock();
    if (!found) {
      slot = producer;
      return producer;
    }
  }
  // Another thread attached meanwhile: its attachment serves.
  producer->Withdraw();
  if (found->record() != producer->record()) throw Altered(handle);
  return found;
}

void MarkNetworkProducersExiting() noexcept {
  std::vector<std::shared_ptr<Session>> sessions;
  try {
    Registry& reg = Current();
    std::lock_guard<std::mutex> lock(reg.mu);
    for (auto& [address, session] : reg.sessions) sessions.push_back(session);
  } catch (...) {
    return;
  }
  // What waits for a tick (attach messages not sent yet, handles dropped since the last round:
  // "dropped", not "died"), first, so that an exiting message follows an attach.
  const auto run_deferred = [&] {
    for (auto& s : sessions) {
      if (!s->broken()) s->RunDeferred();
    }
  };
  run_deferred();
  {
    std::vector<std::shared_ptr<ProducerImpl>> attachments;
    try {
      std::lock_guard<std::mutex> lock(attachments_mu);
      for (auto& [key, weak] : Attachments()) {
        if (auto attachment = weak.lock()) attachments.push_back(std::move(attachment));
      }
    } catch (...) {
      return;
    }
    for (auto& attachment : attachments) attachment->Exiting();
  }  // (the last reference to one may go here: its drop message waits for a tick)
  run_deferred();
}

namespace {
// The consumer of `handle`'s pair when this is its process and the handle is genuine (names it
// as its record does), else null.
std::shared_ptr<ConsumerImpl> ConsumerHere(Session& session, const NetworkHandle& handle) {
  if (session.id() != handle.consumer) return nullptr;
  auto consumer = session.Find(handle.pair);
  return consumer && consumer->record() == handle.Serialize() ? consumer : nullptr;
}
}  // namespace

std::shared_ptr<NetworkProducer> RegisterNetworkHolder(const NetworkHandle& handle) {
  const std::shared_ptr<Session> session = SessionFor(handle.store);
  if (session->id() == handle.consumer) {
    // The pair's own process: its creator's handle holds it; the deserialization is counted.
    if (const auto consumer = ConsumerHere(*session, handle)) consumer->CountDeserialized();
    return nullptr;
  }
  return NetworkProducer::Attach(handle, AttachAs::kDeserialized);
}

bool CountSerializedInCreatorProcess(const NetworkHandle& handle) {
  const std::shared_ptr<Session> session = SessionFor(handle.store);
  if (session->id() != handle.consumer) return false;
  if (const auto consumer = ConsumerHere(*session, handle)) consumer->CountSerialized();
  return true;
}

void StopNetworkKind(std::chrono::steady_clock::time_point deadline) noexcept {
  Registry& reg = Current();
  std::vector<std::shared_ptr<Session>> sessions;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    if (reg.stopped) return;
    reg.stopped = true;
    for (auto& [address, session] : reg.sessions) sessions.push_back(session);
  }
  reg.tick_cv.notify_all();
  if (sessions.empty()) return;
  // The store calls may block (a server that stopped answering): on a thread of their own, waited
  // for until the deadline.
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  try {
    std::thread([sessions, done] {
      // (First: a consumer on this kernel then says "exited", whoever deleted the heartbeat.)
      MarkNetworkProducersExiting();
      for (auto& s : sessions) s->Stop();
      std::lock_guard<std::mutex> lock(done->mu);
      done->done = true;
      done->cv.notify_all();
    }).detach();
  } catch (...) {
    for (auto& s : sessions) s->Stop();
    return;
  }
  std::unique_lock<std::mutex> lock(done->mu);
  done->cv.wait_until(lock, deadline, [&] { return done->done; });
}

void AfterForkNetworkKindInChild() noexcept {
  // The parent's sessions (their connections and threads) are not this process's: leaked.
  try {
    registry.store(new Registry());
    new (&attachments_mu) std::mutex();
    Attachments().clear();
  } catch (...) {
  }
  kind_threads = 0;
  ForgetLinkTransportInChild();
}

size_t NetworkKindThreads() { return kind_threads.load() + LinkTransportThreads(); }

void SetNetworkHeartbeatTimeoutMs(int64_t ms) {
  if (ms < 2 * kTickMs) {
    throw std::invalid_argument("the network heartbeat timeout must be >= " +
                                std::to_string(2 * kTickMs) + " ms (two heartbeats)");
  }
  heartbeat_timeout_ms = std::min(ms, kMaxTimeoutMs);
}

int64_t NetworkHeartbeatTimeoutMs() { return heartbeat_timeout_ms.load(); }

void SetNetworkStoreTimeoutMs(int64_t ms) {
  if (ms < 100) throw std::invalid_argument("the network store timeout must be >= 100 ms");
  store_timeout_ms = std::min(ms, kMaxTimeoutMs);
}

int64_t NetworkStoreTimeoutMs() { return store_timeout_ms.load(); }

size_t PendingNetworkPairs() { return SumOverSessions(&Session::PendingPairs); }

}  // namespace dtorch::core
