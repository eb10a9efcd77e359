#include "consumer.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

// ---- ConsumerImpl ----

void ConsumerImpl::CreatorDropped(bool claimed_here) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    creator_dropped_at_ = Clock::now();
  }
  // A promise that never left this process has no other producer: broken now, unless it set
  // the pair itself (the value is on its way through the store). (One that left waits for its
  // producers, or the attach deadline: the tick.)
  if (!LeftProcess() && !claimed_here) {
    Fail(FutureErrc::kBrokenPromise,
         "the promise was destroyed before a value or an exception was set");
  }
}

std::string ConsumerImpl::WhyFail(const std::map<std::string, Liveness>& liveness,
                                  Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t attach_ms = AttachTimeoutMs();
  if (producers_.empty()) {
    if (creator_dropped_at_ && LeftProcess() &&
        now - *creator_dropped_at_ > milliseconds(attach_ms)) {
      return "no producer attached within " + std::to_string(attach_ms) +
             " ms of the promise being dropped here (config.attach_timeout_s)";
    }
    return {};
  }
  // What names a holder in a message: its pid (and host, when it is another), else its store id.
  const auto who = [](const std::string& id, const Holder& holder) {
    if (holder.pid == 0) return "store id " + id.substr(0, 8);
    return "pid " + std::to_string(holder.pid) + (holder.host.empty() ? "" : " on " + holder.host);
  };
  std::string died, exited, dropped;
  for (const auto& [id, holder] : producers_) {
    if (holder.dropped) {
      if (dropped.empty()) dropped = who(id, holder);
      continue;
    }
    const auto it = liveness.find(id);
    if (id == session_->id() || it == liveness.end() ||
        it->second.state == Liveness::State::kAlive) {
      all_gone_since_.reset();  // (this process's own handle decides for it)
      return {};
    }
    if (it->second.state == Liveness::State::kExited) {
      if (exited.empty()) exited = who(id, holder);
    } else if (died.empty()) {
      died = who(id, holder) + (holder.local ? "" : ": its heartbeat stopped for " +
                                                     std::to_string(heartbeat_timeout_ms.load()) +
                                                     " ms");
    }
  }
  if (!all_gone_since_) all_gone_since_ = now;
  if (static_cast<int32_t>(serialized_ - deserialized_) > 0) {
    // A holder passed the promise on before it went, and that handle has not arrived: the attach
    // deadline is the backstop for one that never will.
    if (now - *all_gone_since_ < milliseconds(attach_ms)) return {};
    return "no producer attached within " + std::to_string(attach_ms) +
           " ms after the last process holding the promise was gone, and " +
           std::to_string(serialized_ - deserialized_) +
           " serialized handle(s) of it were never deserialized (config.attach_timeout_s)";
  }
  if (!died.empty()) return "producer died (" + died + ") without setting a value";
  if (!exited.empty()) return "producer exited (" + exited + ") without setting a value";
  return "producer dropped the promise (" + dropped + ") without setting a value";
}

void ConsumerImpl::FailAsDecided(KeyValueStore& connection, const ErrorInfo& error,
                                 const std::set<std::string>& gone) {
  if (Settled()) return;
  if (LeftProcess()) {
    try {
      const std::string holder =
          connection.CompareSet(ClaimKey(handle_.pair), record_, kFailedClaim);
      // A producer claimed it: its value is on the way, unless that producer is one found gone.
      if (IsClaimValue(holder) && gone.count(holder.substr(0, kIdHexDigits)) == 0) return;
    } catch (const std::exception&) {
      // (The store cannot be reached: the pair fails all the same.)
    }
  }
  state_.TryComplete(Result<NetworkValue>::Error(error));
}

}  // namespace dtorch::core::network_internal
