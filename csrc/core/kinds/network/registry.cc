// The sessions of this process, by store, and the tick thread that serves them all.
#include "consumer.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

bool Session::FromHolder(const ConsumerImpl* consumer, const Message& m) {
  return consumer != nullptr && consumer->HasLiveHolder(m.producer);
}


std::atomic<Registry*> registry{new Registry()};  // replaced (the old one leaked) in a fork child

Registry& Current() { return *registry.load(); }

size_t SumOverSessions(size_t (Session::*count)() const) {
  Registry& reg = Current();
  std::lock_guard<std::mutex> lock(reg.mu);
  size_t n = 0;
  for (auto& [address, session] : reg.sessions) n += ((*session).*count)();
  return n;
}

void TickLoop(Registry* reg) {
  Clock::time_point next_round = Clock::now() + milliseconds(kTickMs);
  for (;;) {
    std::vector<std::shared_ptr<Session>> sessions;
    uint64_t work_seen;
    bool round;
    {
      std::unique_lock<std::mutex> lock(reg->mu);
      reg->tick_cv.wait_until(lock, next_round, [&] { return reg->stopped || reg->delete_soon; });
      if (reg->stopped) break;
      reg->delete_soon = false;
      round = Clock::now() >= next_round;
      work_seen = reg->work;
      for (auto& [address, session] : reg->sessions) sessions.push_back(session);
    }
    // Between rounds: only what was queued for deletion (a value's chunks, once read).
    for (auto& session : sessions) session->DeleteQueued();
    if (!round) continue;
    next_round = Clock::now() + milliseconds(kTickMs);
    bool busy = false;
    for (auto& session : sessions) busy = session->Tick() || busy;
    if (!busy) {
      std::lock_guard<std::mutex> lock(reg->mu);
      // Work given during the round (EnsureTicking found this thread running) is the next one's.
      if (reg->work != work_seen) continue;
      reg->ticking = false;
      --kind_threads;  // (counted while reg->mu is held: a new tick thread cannot overlap)
      return;
    }
  }
  std::lock_guard<std::mutex> lock(reg->mu);
  reg->ticking = false;
  --kind_threads;
}

void EnsureTicking() {
  Registry* reg = &Current();
  std::lock_guard<std::mutex> lock(reg->mu);
  ++reg->work;
  if (reg->ticking || reg->stopped) return;
  std::thread thread(&TickLoop, reg);
  pthread_setname_np(thread.native_handle(), "dtorch-net-tick");
  thread.detach();
  reg->ticking = true;
  ++kind_threads;
}

void DeleteSoonOnTickThread() {
  {
    Registry& reg = Current();
    std::lock_guard<std::mutex> lock(reg.mu);
    reg.delete_soon = true;
  }
  Current().tick_cv.notify_all();
  EnsureTicking();
}

std::shared_ptr<Session> SessionFor(const StoreAddress& address) {
  Registry& reg = Current();
  // A session whose connection was lost (a call that timed out on any thread) breaks before it
  // is replaced: its pairs fail now rather than waiting on a session nothing ticks. (Outside
  // reg.mu: Break unregisters.)
  const auto break_lost = [](const std::shared_ptr<Session>& lost) {
    if (lost) lost->Break("its connection to the store was lost");
  };
  std::shared_ptr<Session> lost;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    if (reg.stopped) {
      throw FutureError(FutureErrc::kDroppedAtExit, "the library is shutting down");
    }
    auto it = reg.sessions.find(address);
    if (it != reg.sessions.end()) {
      if (!it->second->broken()) return it->second;
      lost = it->second;
    }
  }
  break_lost(lost);
  std::unique_ptr<KeyValueStore> connection;
  try {
    connection = Connect(address, kConnectTimeout);
  } catch (const StoreError& e) {
    throw Unreachable(address, e);
  }
  auto session = std::make_shared<Session>(address, std::move(connection));
  std::shared_ptr<Session> chosen;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto& slot = reg.sessions[address];
    if (!slot || slot->broken()) {
      lost = std::move(slot);
      slot = session;
    }
    chosen = slot;  // (else another thread connected first)
  }
  break_lost(lost);
  return chosen;
}

void Unregister(const Session* session) {
  Registry& reg = Current();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.sessions.find(session->address());
  if (it != reg.sessions.end() && it->second.get() == session) reg.sessions.erase(it);
}

}  // namespace dtorch::core::network_internal
