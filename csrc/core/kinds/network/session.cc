// A session's heartbeat, its watcher (popping the consumers' queue) and its pairs.
#include "consumer.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

// ---- Session ----

void Session::Beat(bool force) {
  const int64_t now = NowMs();
  if (!force && now - last_beat_ms_.load() < kTickMs / 2) return;
  store_->Add(HeartbeatKey(id_), 1);
  last_beat_ms_ = now;
}

void Session::Register(const std::string& pair, const std::string& record,
                       const std::shared_ptr<ConsumerImpl>& consumer) {
  bool identity_tried;
  {
    std::lock_guard<std::mutex> lock(mu_);
    identity_tried = identity_tried_;
  }
  if (!identity_tried) {
    const std::string identity = EncodeIdentity();
    if (!identity.empty()) store_->Set(IdentityKey(id_), identity);  // (before anyone looks)
    std::lock_guard<std::mutex> lock(mu_);
    identity_tried_ = true;
    identity_written_ = !identity.empty();
  }
  store_->Set(ClaimKey(pair), record);  // (first: a pair that failed to register has no key)
  bool first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // (Break fails the pairs it finds: one registered after it would never fail.)
    if (broken_) throw StoreError(StoreError::Kind::kUnreachable, "its connection was lost");
    first = pairs_.empty();
    consumed_ = true;
    pairs_[pair] = consumer;
    if (!watching_) StartWatcherLocked();
  }
  // The consumer's heartbeat exists before its promise can leave the process: a producer that
  // finds none takes the consumer for dead.
  Beat(/*force=*/first);
  EnsureTicking();
}

bool Session::WakeWatcherLocked() {
  if (!watcher_blocked_ || wake_pending_) return false;
  wake_pending_ = true;
  return true;
}

void Session::Forget(const std::string& pair, bool value_arrived) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pairs_.erase(pair);
    // (No value message read: a producer may have written chunks, or may yet.)
    cleanups_.push_back({pair, true, value_arrived ? 0 : std::numeric_limits<uint32_t>::max()});
    if (forgotten_.insert(pair).second) {
      forgotten_order_.push_back(pair);
      if (forgotten_order_.size() > kForgottenPairsKept) {
        forgotten_.erase(forgotten_order_.front());
        forgotten_order_.pop_front();
      }
    }
    // The watcher exits when it finds no pair left; one in its pop is woken to find that.
    wake = pairs_.empty() && WakeWatcherLocked();
  }
  if (wake && !broken_) {
    // From the tick thread: a store call here could block the thread dropping the future.
    AtNextTick([self = shared_from_this()] {
      try {
        self->store_->QueuePush(QueueKey(self->id_), std::string(1, kWake));
      } catch (...) {
        // (The store went away, and with it the watcher's pop; a later wake may be sent.)
        std::lock_guard<std::mutex> lock(self->mu_);
        self->wake_pending_ = false;
      }
    });
  }
  EnsureTicking();  // (the tick deletes the pair's keys)
}

void Session::StartWatcherLocked() {
  // Its own connection: a blocking pop holds the connection it runs on. (Kept for the next
  // watcher: this one leaves it only once it is done with it.)
  if (!watch_connection_) {
    try {
      watch_connection_ = Connect(address_, kWatcherTimeout);
    } catch (const StoreError& e) {
      throw Unreachable(address_, e);
    }
  }
  std::thread thread([self = shared_from_this(), connection = watch_connection_] {
    self->Watch(connection);
  });
  pthread_setname_np(thread.native_handle(), "dtorch-net-watch");
  thread.detach();
  watching_ = true;
  ++kind_threads;
}

std::shared_ptr<ConsumerImpl> Session::Find(const std::string& pair) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pairs_.find(pair);
  return it == pairs_.end() ? nullptr : it->second.lock();
}

std::vector<std::shared_ptr<ConsumerImpl>> Session::LiveConsumers() {
  std::vector<std::shared_ptr<ConsumerImpl>> consumers;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [pair, weak] : pairs_) {
    if (auto c = weak.lock()) consumers.push_back(std::move(c));
  }
  return consumers;
}

void Session::Watch(const std::shared_ptr<KeyValueStore>& connection) {
  const std::string queue = QueueKey(id_);
  const auto leave = [&] {  // (mu_ held)
    watching_ = false;
    watcher_blocked_ = false;
    --kind_threads;
  };
  bool drained = false;
  // The items the queue held after the last pop: popped in batches, without waiting, until none
  // is left (a flood of messages costs a round trip per kPopBatch of them, not per message).
  int64_t backlog = 0;
  size_t largest = 0;  // the largest item of the last batch
  for (;;) {
    bool pop = true;
    const bool block = backlog <= 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // (A wake on its way is popped first: none is left in the queue.)
      if (stopping_ || broken_) return leave();
      if (pairs_.empty() && !wake_pending_) {
        if (drained) return leave();
        pop = false;
      } else {
        drained = false;
        watcher_blocked_ = block;
      }
    }
    if (!pop) {
      // No pair left: what the queue still holds (a late drop message, a value for a pair
      // dropped meanwhile) is handled now, so that nothing of it is left in the store; as many
      // items as it held now, at most (a sender that goes on pushing does not hold it here).
      try {
        DrainQueue(*connection, queue, [&](const std::string& bytes) {
          if (const std::optional<Message> m = Decode(bytes)) Handle(*connection, *m);
        });
      } catch (...) {
        // (The store went away: nothing is left to wait for.)
      }
      backlog = 0;
      drained = true;
      continue;
    }
    std::vector<std::string> items;
    std::string failure;
    try {
      items = connection->QueuePopSome(queue, block ? 1 : PopBatchSize(backlog, largest), block,
                                       &backlog);
      largest = LargestItem(items);
    } catch (const StoreError& e) {
      backlog = 0;
      if (e.kind() != StoreError::Kind::kTimeout) failure = e.what();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      watcher_blocked_ = false;
      for (const auto& bytes : items) {
        if (bytes.size() == 1 && bytes[0] == kWake) wake_pending_ = false;
      }
    }
    if (!failure.empty()) {
      if (!stopping_) Break(failure);
      std::lock_guard<std::mutex> lock(mu_);
      return leave();
    }
    for (const auto& bytes : items) {
      const std::optional<Message> m = Decode(bytes);
      if (!m) continue;  // not a message of this kind (the queue is ours: junk is dropped)
      try {
        Handle(*connection, *m);
      } catch (const StoreError& e) {
        if (!stopping_) Break(e.what());
        std::lock_guard<std::mutex> lock(mu_);
        return leave();
      } catch (...) {
        // (Handle fails the pair of a message it cannot complete; nothing else can throw.)
      }
    }
  }
}

}  // namespace dtorch::core::network_internal
