// The network kind's point-to-point links (links.h): the producer's sends, the consumer's
// receiving threads, idle links closed, and the settings.
#include "links.h"

#include <cxxabi.h>

#include "consumer.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

namespace {

std::mutex factory_mu;
PairLinkFactory& FactorySlot() {  // guarded by factory_mu
  static auto* factory = new PairLinkFactory();  // (leaked: used by threads until the exit)
  return *factory;
}
std::atomic<bool> has_factory{false};
std::atomic<int64_t> pair_groups{1};
std::atomic<int64_t> pair_idle_ms{kDefaultNetworkPairIdleMs};
// A link was made in this process: the transport's own thread (Gloo's device loop) runs.
std::atomic<bool> transport_thread{false};

template <typename V>
bool Take(std::string_view& in, V* out) {
  if (in.size() < sizeof(V)) return false;
  std::memcpy(out, in.data(), sizeof(V));
  in.remove_prefix(sizeof(V));
  return true;
}

// How long one send may take: the heartbeat timeout (a consumer that stopped receiving is
// taken for a hung one by then), plus time for the bytes at a slow network's 20 MB/s.
milliseconds SendTimeout(size_t bytes) {
  return milliseconds(heartbeat_timeout_ms.load() + static_cast<int64_t>(bytes / 20000));
}

}  // namespace

PairLinkFactory LinkFactory() {
  std::lock_guard<std::mutex> lock(factory_mu);
  return FactorySlot();
}

std::string LinkPrefix(const std::string& name) { return std::string(kKeyPrefix) + "p/" + name; }

std::vector<std::string> RendezvousKeys(const std::string& name) {
  const std::string prefix = LinkPrefix(name);
  return {prefix + "/0/0", prefix + "/0/1"};
}

std::string EncodeFrame(FrameType type, std::string_view body) {
  std::string out;
  out.reserve(kFrameHeadBytes + body.size());
  Put<uint32_t>(out, kFrameMagic);
  Put<char>(out, static_cast<char>(type));
  Put<uint32_t>(out, static_cast<uint32_t>(body.size()));
  out.append(body.data(), body.size());
  return out;
}

size_t LinkTransportThreads() { return transport_thread.load() ? 1 : 0; }

void ForgetLinkTransportInChild() noexcept { transport_thread = false; }

// ---- the producer's end ----

LinkSend Session::SendOverLink(const std::string& consumer, const std::string& frame,
                               const void* payload, size_t payload_bytes) {
  if (frame.size() > kFrameBytes) return LinkSend::kNotSent;  // (never: the caller's bound)
  std::shared_ptr<OutLink> out;
  std::unique_lock<std::timed_mutex> lock;
  for (;;) {
    {
      std::lock_guard<std::mutex> session_lock(mu_);
      if (broken_ || stopping_) return LinkSend::kNotSent;
      auto& slot = out_links_[consumer];
      if (!slot) slot = std::make_shared<OutLink>();
      out = slot;
    }
    // Bounded: a thread that holds the GIL here while another, holding this lock, waits for the
    // GIL in the factory must not wait forever (its value goes through the store instead).
    lock = std::unique_lock<std::timed_mutex>(out->mu, std::defer_lock);
    if (!lock.try_lock_for(kLinkLockWait)) return LinkSend::kNotSent;
    std::lock_guard<std::mutex> session_lock(mu_);
    // (Erased as idle meanwhile: the current one serves, never two links to one consumer.)
    if (const auto it = out_links_.find(consumer); it != out_links_.end() && it->second == out) {
      break;
    }
    lock.unlock();
  }
  EnsureTicking();  // (its idle close)
  const Clock::time_point now = Clock::now();
  if (!out->link) {
    if (now < out->retry_after) return LinkSend::kNotSent;
    const PairLinkFactory factory = LinkFactory();
    if (!factory) return LinkSend::kNotSent;
    std::string name = NewId();
    try {
      // (A consumer on this kernel that is gone makes no end: the store path knows what to do
      // with a value for it, before its identity goes in a clean-up for it.)
      if (ConsumerGoneHere(consumer)) return LinkSend::kNotSent;
      // The request is recorded as a message to the consumer (a clean-up for a consumer that
      // died drains its queue, this request among it).
      SendTo(consumer, name, 0, EncodeHead(kLinkRequest, name, id_));
      out->link = factory(address_, LinkPrefix(name), 1, kLinkConnectTimeout);
      transport_thread = true;
    } catch (abi::__forced_unwind&) {
      throw;  // (a thread ended by the runtime: unwound, never swallowed)
    } catch (...) {
      out->retry_after = Clock::now() + kLinkRetryAfter;
      DeleteKeysSoon(RendezvousKeys(name));
      return LinkSend::kNotSent;
    }
    out->name = std::move(name);
    out->keys_deleted = false;
    out->connected = true;
  }
  out->SetLive(out->link);
  const auto failed = [&](LinkSend outcome) {
    out->SetLive(nullptr);
    out->link.reset();
    out->connected = false;
    out->retry_after = Clock::now() + kLinkRetryAfter;  // (this value's store fallback too)
    if (!out->keys_deleted) DeleteKeysSoon(RendezvousKeys(out->name));
    return outcome;
  };
  try {
    out->link->Send(frame.data(), frame.size(), kFrameTag, SendTimeout(frame.size()));
  } catch (...) {
    return failed(LinkSend::kNotSent);
  }
  if (payload_bytes > 0) {
    try {
      out->link->Send(payload, payload_bytes, kPayloadTag, SendTimeout(payload_bytes));
    } catch (...) {
      return failed(LinkSend::kLost);
    }
  }
  out->SetLive(nullptr);
  out->last_used = Clock::now();
  if (!out->keys_deleted) {
    // (Received: the consumer's end read its peer's key before its first receive was posted.)
    DeleteKeysSoon(RendezvousKeys(out->name));
    out->keys_deleted = true;
  }
  return LinkSend::kSent;
}

void Session::CloseIdleLinks(Clock::time_point now) {
  std::vector<std::shared_ptr<OutLink>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [consumer, out] : out_links_) links.push_back(out);
  }
  const milliseconds idle(pair_idle_ms.load());
  std::vector<std::shared_ptr<OutLink>> unused;
  for (auto& out : links) {
    std::unique_lock<std::timed_mutex> lock(out->mu, std::try_to_lock);
    if (!lock.owns_lock()) continue;  // (a send in progress: not idle)
    if (out->link && now - out->last_used >= idle) {
      out->connected = false;
      try {
        // The consumer's thread ends the link when it reads this (nothing is in flight: this
        // lock is every sender's).
        const std::string bye = EncodeFrame(kFrameBye, {});
        out->link->Send(bye.data(), bye.size(), kFrameTag, milliseconds(1000));
      } catch (...) {
      }
      out->link.reset();
    }
    if (!out->link && now >= out->retry_after) unused.push_back(out);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = out_links_.begin(); it != out_links_.end();) {
    const bool drop = std::find(unused.begin(), unused.end(), it->second) != unused.end();
    it = drop ? out_links_.erase(it) : std::next(it);
  }
}

// ---- the consumer's end ----

void Session::LinkRequested(const std::string& producer, const std::string& name) {
  if (!HasPairLinkFactory() || stopping_ || broken_) return;
  auto in = std::make_shared<InLink>(producer, name);
  std::shared_ptr<InLink> replaced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = in_links_[producer];
    if (!slot && in_links_.size() >= kMaxLinksIn) {
      in_links_.erase(producer);
      return;  // (the producer's end times out: its values go through the store)
    }
    // (A new link of the same producer replaces its old one: that one failed at its end.)
    replaced = std::move(slot);
    slot = in;
  }
  if (replaced) replaced->Abort();
  try {
    ++kind_threads;
    std::thread thread([self = shared_from_this(), in] { self->ReceiveOnLink(in); });
    pthread_setname_np(thread.native_handle(), "dtorch-net-pair");
    thread.detach();
  } catch (...) {
    --kind_threads;
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = in_links_.find(producer); it != in_links_.end() && it->second == in) {
      in_links_.erase(it);
    }
  }
}

void Session::ReceiveOnLink(const std::shared_ptr<InLink>& in) {
  std::unique_ptr<PairLink> link;
  bool keys_deleted = false;
  try {
    const PairLinkFactory factory = LinkFactory();
    if (factory) link = factory(address_, LinkPrefix(in->name), 0, kLinkConnectTimeout);
    if (link) transport_thread = true;
  } catch (abi::__forced_unwind&) {
    --kind_threads;
    throw;  // (a thread ended by the runtime: unwound, never swallowed)
  } catch (...) {
  }
  // What a receive may still be posted into (an aborted receive stays posted): released only
  // after the link, whose end closes with it.
  std::unique_ptr<char[]> frame;
  std::shared_ptr<char> payload_in_flight;
  if (link) {
    {
      std::lock_guard<std::mutex> lock(in->mu);
      in->link = link.get();
      if (in->aborted) link->Abort();
    }
    frame.reset(new (std::nothrow) char[kFrameBytes]());
    size_t last_frame_bytes = 0;
    while (frame) {
      // (A shorter message than the last leaves its bytes behind: zeroed, never parsed.)
      std::memset(frame.get(), 0, last_frame_bytes);
      try {
        link->Receive(frame.get(), kFrameBytes, kFrameTag);
      } catch (...) {
        break;  // (the producer is gone, or closed it, or this process aborted it)
      }
      if (!keys_deleted) {
        DeleteKeysSoon(RendezvousKeys(in->name));
        keys_deleted = true;
      }
      last_frame_bytes = kFrameBytes;
      if (!HandleFrame(*in, *link, frame.get(), &payload_in_flight, &last_frame_bytes)) break;
    }
    std::lock_guard<std::mutex> lock(in->mu);
    in->link = nullptr;
  }
  if (!keys_deleted) DeleteKeysSoon(RendezvousKeys(in->name));
  link.reset();  // (first: then the buffers its receives used)
  frame.reset();
  payload_in_flight.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = in_links_.find(in->producer); it != in_links_.end() && it->second == in) {
      in_links_.erase(it);
    }
  }
  --kind_threads;
}

bool Session::HandleFrame(InLink& in, PairLink& link, const char* frame,
                          std::shared_ptr<char>* payload_in_flight, size_t* frame_bytes) {
  std::string_view bytes(frame, kFrameBytes);
  uint32_t magic = 0, body_bytes = 0;
  char type = 0;
  if (!Take(bytes, &magic) || magic != kFrameMagic || !Take(bytes, &type) ||
      !Take(bytes, &body_bytes) || body_bytes > bytes.size()) {
    return false;
  }
  *frame_bytes = kFrameHeadBytes + body_bytes;
  bytes = bytes.substr(0, body_bytes);
  if (type == kFrameBye) return false;
  uint64_t payload_bytes = 0;
  if (type == kFramePayload) {
    if (!Take(bytes, &payload_bytes) || payload_bytes == 0) return false;
  } else if (type != kFrameValue) {
    return false;
  }
  const std::string message(bytes);
  std::optional<Message> m = Decode(message);
  // (The link is the producer's: a message that names another producer is not its.)
  if (!m || m->type != kValue || m->producer != in.producer || m->value.chunks != 0 ||
      (type == kFramePayload && (m->value.error || m->value.payload_bytes != 0))) {
    return false;
  }
  ValueMessage& v = m->value;
  if (type == kFramePayload) v.payload_bytes = payload_bytes;
  const std::shared_ptr<ConsumerImpl> consumer = Find(m->pair);
  const bool wanted = consumer && !consumer->Settled();
  if (v.error) {
    if (wanted) {
      consumer->ValueArrived();
      std::optional<ErrorInfo> error = DecodeErrorText(v.code, v.header);
      if (!error) {
        error = ErrorInfo{FutureErrc::kInvalidHandle,
                          "the error received from the producer is corrupt"};
      }
      consumer->state().TryComplete(Result<NetworkValue>::Error(std::move(*error)));
    } else if (!consumer) {
      ValueForNoPair(*m);
    }
    return true;
  }
  const auto fail = [&](const std::string& problem) {
    consumer->state().TryComplete(Result<NetworkValue>::Error(
        FutureErrc::kInvalidHandle,
        "the value received from the producer over its link is corrupt: " + problem));
  };
  if (type == kFrameValue) {
    if (!wanted) {
      if (!consumer) ValueForNoPair(*m);
      return true;
    }
    consumer->ValueArrived();
    const std::string problem = consumer->CheckPayloadBytes(v.header, v.payload_bytes);
    if (!problem.empty()) {
      fail(problem);
      return true;
    }
    auto payload = std::make_shared<std::string>(v.inline_payload);
    char* data = payload->empty() ? nullptr : payload->data();
    consumer->state().TryComplete(Result<NetworkValue>::Value(
        NetworkValue{v.header, std::move(payload), data, v.inline_payload.size()}));
    return true;
  }
  // A payload follows: its size is checked before a byte of it is received (a pair not in
  // flight here is checked against memory only; its bytes are received and dropped).
  std::string problem;
  if (wanted) {
    consumer->ValueArrived();
    problem = consumer->CheckPayloadBytes(v.header, v.payload_bytes);
  } else {
    problem = ConsumerImpl::CheckMemory(v.payload_bytes);
  }
  std::shared_ptr<char> buffer;
  if (problem.empty()) {
    buffer = std::shared_ptr<char>(new (std::nothrow) char[v.payload_bytes],
                                   std::default_delete<char[]>());
    if (!buffer) problem = "it does not fit in this process's memory";
  }
  if (!problem.empty()) {
    // (Its bytes cannot be received: the link goes, and the producer's send fails.)
    if (wanted) fail(problem);
    return false;
  }
  try {
    link.Receive(buffer.get(), v.payload_bytes, kPayloadTag);
  } catch (const std::exception& e) {
    *payload_in_flight = buffer;  // (kept until the link is gone: the receive may stay posted)
    if (wanted) {
      consumer->state().TryComplete(Result<NetworkValue>::Error(
          FutureErrc::kBrokenPromise,
          std::string("the producer's link failed while it sent the value (") + e.what() +
              "): the producer died or was cut off"));
    }
    return false;
  }
  if (!wanted) {
    if (!consumer) ValueForNoPair(*m);
    return true;
  }
  char* data = buffer.get();
  consumer->state().TryComplete(Result<NetworkValue>::Value(
      NetworkValue{v.header, std::move(buffer), data, v.payload_bytes}));
  return true;
}

void Session::AbortLinkFrom(const std::string& producer) {
  std::shared_ptr<InLink> in;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = in_links_.find(producer); it != in_links_.end()) in = it->second;
  }
  if (in) in->Abort();
}

void Session::StopLinks() noexcept {
  std::vector<std::shared_ptr<InLink>> ins;
  std::vector<std::shared_ptr<OutLink>> outs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [producer, in] : in_links_) ins.push_back(in);
    for (auto& [consumer, out] : out_links_) outs.push_back(out);
    out_links_.clear();
  }
  for (auto& in : ins) in->Abort();
  for (auto& out : outs) {
    out->AbortLive();  // (a send blocked in it gives up)
  }
}

size_t Session::LinksIn() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_links_.size();
}

size_t Session::LinksOut() const {
  std::lock_guard<std::mutex> lock(mu_);  // (never out->mu: a sender holds it, then takes mu_)
  size_t n = 0;
  for (const auto& [consumer, out] : out_links_) n += out->connected.load() ? 1 : 0;
  return n;
}

void Session::DeleteKeysSoon(std::vector<std::string> keys) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    key_cleanups_.insert(key_cleanups_.end(), keys.begin(), keys.end());
  }
  DeleteSoonOnTickThread();
}

}  // namespace dtorch::core::network_internal

namespace dtorch::core {
using namespace network_internal;

void SetPairLinkFactory(PairLinkFactory factory) {
  std::lock_guard<std::mutex> lock(factory_mu);
  has_factory = static_cast<bool>(factory);
  FactorySlot() = std::move(factory);
}

bool HasPairLinkFactory() { return has_factory.load(); }

void SetNetworkPairGroups(int64_t enabled) {
  if (enabled != 0 && enabled != 1) {
    throw std::invalid_argument("network_pair_groups is 1 (links where both ends can) or 0 "
                                "(the store only)");
  }
  pair_groups = enabled;
}

int64_t NetworkPairGroups() { return pair_groups.load(); }

void SetNetworkPairIdleMs(int64_t ms) {
  if (ms < 100) throw std::invalid_argument("the network pair idle time must be >= 100 ms");
  pair_idle_ms = std::min(ms, kMaxTimeoutMs);
}

int64_t NetworkPairIdleMs() { return pair_idle_ms.load(); }

size_t NetworkLinksIn() { return SumOverSessions(&Session::LinksIn); }

size_t NetworkLinksOut() { return SumOverSessions(&Session::LinksOut); }

}  // namespace dtorch::core
