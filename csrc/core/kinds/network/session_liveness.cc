// A session's tick: its producers' liveness (heartbeats, processes on this kernel), clean-up
// for consumers that are gone, and its stop.
#include <algorithm>

#include "consumer.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

bool Session::Tick() {
  if (broken_ || stopping_) return false;
  bool consumers, producers;
  std::vector<PairKeys> cleanups;
  std::vector<std::string> keys;
  std::vector<std::function<void()>> work;
  bool links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    consumers = !pairs_.empty() || consumed_;
    producers = producers_ > 0 || !sent_.empty();
    links = !out_links_.empty();
    cleanups.swap(cleanups_);
    keys.swap(key_cleanups_);
    work.swap(next_tick_);
  }
  if (!consumers && !producers && !links && cleanups.empty() && keys.empty() && work.empty()) {
    return false;
  }
  for (auto& w : work) w();  // (noexcept: see ProducerImpl::Announce)
  if (!keys.empty()) {
    try {
      store_->DeleteKeys(keys);
      keys.clear();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);  // (the next round's)
      key_cleanups_.insert(key_cleanups_.end(), keys.begin(), keys.end());
    }
  }
  try {
    // (The heartbeat first: however long the deletes take, this process does not look dead.)
    if (consumers || producers) Beat(/*force=*/true);
    DeleteKeysOf(*store_, cleanups);
    if (consumers) {
      FindClaimHolders(LiveConsumers());
      CheckProducers(Clock::now());
    }
    if (producers) CleanUpForConsumers();
    if (links) CloseIdleLinks(Clock::now());  // (after the heartbeat: a goodbye may wait 1 s)
  } catch (const StoreError& e) {
    if (e.kind() != StoreError::Kind::kTimeout) {
      Break(e.what());
      return false;
    }
  } catch (const std::exception&) {
    // (A failure of one round: the next tries again.)
  }
  if (!cleanups.empty()) {  // (what a failed round did not delete)
    std::lock_guard<std::mutex> lock(mu_);
    cleanups_.insert(cleanups_.end(), cleanups.begin(), cleanups.end());
  }
  return true;
}

void Session::CheckProducers(Clock::time_point now) {
  // The producers the pairs in flight wait for.
  std::vector<std::shared_ptr<ConsumerImpl>> consumers = LiveConsumers();
  // By store id: the process itself where it runs on this kernel (checked by pid: at once).
  std::map<std::string, std::optional<ProcessId>> watched;
  for (auto& c : consumers) {
    if (c->Settled()) continue;
    for (auto& [id, holder] : c->LiveProducers()) {
      if (id == id_) continue;  // (this process: alive)
      auto& local = watched[id];
      if (holder.local) local = holder.local;
    }
  }
  // Their heartbeats (read without making a key: a holder named by a forged attach message has
  // none, and none is left for it). A missing key reads 0: a producer that exited cleanly
  // deleted its key. A key missing from the start is not taken for an exit: another consumer may
  // have deleted it, wrongly, or the producer exited before it was first read; the timeout
  // decides.
  const int64_t timeout_ms = heartbeat_timeout_ms.load();
  std::vector<std::string> ids;
  for (const auto& [id, local] : watched) ids.push_back(id);
  const std::vector<int64_t> beats = ReadHeartbeats(*store_, ids);
  std::vector<std::string> newly_gone;
  size_t k = 0;
  for (const auto& [id, local] : watched) {
    const int64_t beat = beats[k++];
    // A process on this kernel is checked itself: alive while it runs (its threads may still set
    // values after its exit began), gone once its pid is gone and its heartbeat is too or has
    // stood still for two ticks (the pid came in an attach message: a forged one naming a live
    // process's id with a dead pid must not make it gone).
    const std::optional<bool> local_alive =
        local ? std::optional<bool>(IsAlive(*local)) : std::nullopt;
    std::lock_guard<std::mutex> lock(mu_);
    Liveness& l = producers_liveness_[id];
    const auto gone_as = [&] {
      return l.exiting ? Liveness::State::kExited : Liveness::State::kDead;
    };
    if (l.state != Liveness::State::kAlive) continue;
    const bool advanced = beat != 0 && beat != l.last_beat;
    if (advanced) {
      l.last_beat = beat;
      l.changed_at = now;
    }
    if (local_alive) {
      if (*local_alive) continue;
      if (beat == 0 || now - l.changed_at >= milliseconds(2 * kTickMs)) {
        // (Its exit said so first: the library's exit handler, a multiprocessing child's end.
        // Its heartbeat cannot tell: another consumer that saw it gone may have deleted it.)
        l.state = gone_as();
        newly_gone.push_back(id);
      }
    } else if (beat == 0 && l.last_beat > 0) {
      l.state = Liveness::State::kExited;  // (its heartbeat was seen, then deleted)
      newly_gone.push_back(id);
    } else if (!advanced && now - l.changed_at > milliseconds(timeout_ms)) {
      l.state = gone_as();
      newly_gone.push_back(id);
    }
  }
  // A gone producer's link stops waiting for it (a hung host: its receive would wait forever).
  for (const auto& id : newly_gone) AbortLinkFrom(id);
  // Whoever sees death deletes (a consumer's identity too), in batches, once.
  for (size_t at = 0; at < newly_gone.size(); at += kBatch / 2) {
    std::vector<std::string> keys;
    for (size_t i = at; i < std::min(newly_gone.size(), at + kBatch / 2); ++i) {
      keys.push_back(HeartbeatKey(newly_gone[i]));
      keys.push_back(IdentityKey(newly_gone[i]));
    }
    store_->DeleteKeys(keys);
  }
  std::map<std::string, Liveness> snapshot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Only the producers waited for are remembered (one attaching again starts afresh).
    for (auto it = producers_liveness_.begin(); it != producers_liveness_.end();) {
      it = watched.count(it->first) != 0 ? std::next(it) : producers_liveness_.erase(it);
    }
    snapshot = producers_liveness_;
  }
  for (auto& c : consumers) {
    if (c->Settled()) continue;
    const uint64_t epoch = c->Epoch();  // (before deciding: a message after it re-decides)
    const std::string why = c->WhyFail(snapshot, now);
    if (!why.empty()) {
      FailAfterQueued(c->handle().pair, FutureErrc::kBrokenPromise, why, epoch, c->HolderIds());
    }
  }
}

void Session::CleanUpForConsumers() {
  // (One at a time: the exit's and a tick round in progress would each forget what the other
  // read.)
  std::lock_guard<std::mutex> one_at_a_time(cleanup_mu_);
  std::map<std::string, std::vector<SentPair>> sent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sent = sent_;
  }
  const Clock::time_point now = Clock::now();
  const int64_t timeout_ms = heartbeat_timeout_ms.load();
  for (auto& [consumer, pairs] : sent) {
    bool received = store_->QueueLength(QueueKey(consumer)) == 0;
    bool dead = false;
    if (!received && consumer != id_) {
      const int64_t beat = ReadHeartbeat(*store_, consumer);
      std::lock_guard<std::mutex> lock(mu_);
      Liveness& l = consumers_liveness_[consumer];
      if (beat == 0 && l.last_beat > 0) {
        dead = true;  // (it exited: its heartbeat was seen, then deleted)
      } else if (beat != l.last_beat) {
        l.last_beat = beat;
        l.changed_at = now;
      } else if (now - l.changed_at > milliseconds(timeout_ms)) {
        dead = true;
      }
    }
    if (!received && !dead && consumer != id_) dead = ConsumerGoneHere(consumer);
    if (dead) {
      std::vector<std::string> names;
      for (const auto& p : pairs) names.push_back(p.pair);
      DeleteWhatADeadConsumerLeft(consumer, names);
      received = true;
    }
    if (received) {
      // (Only what was pushed before the queue was read above: more may have been sent, or be
      // on its way, meanwhile.)
      std::set<uint64_t> done;
      for (const auto& p : pairs) {
        if (p.pushed) done.insert(p.seq);
      }
      std::lock_guard<std::mutex> lock(mu_);
      auto& now_sent = sent_[consumer];
      now_sent.erase(std::remove_if(now_sent.begin(), now_sent.end(),
                                    [&](const SentPair& p) { return done.count(p.seq) != 0; }),
                     now_sent.end());
      if (now_sent.empty()) {
        sent_.erase(consumer);
        consumers_liveness_.erase(consumer);
        consumer_processes_.erase(consumer);
      }
    }
  }
}

void Session::DeleteWhatADeadConsumerLeft(const std::string& consumer,
                                          const std::vector<std::string>& pairs) {
  // The consumer will not read its queue: drain it (as many items as it holds now: a sender
  // that goes on pushing does not hold this thread), and delete the keys of `pairs` (what this
  // process sent it, or at its own exit its own pairs: claims, and the chunks a value message
  // for one names), in batches. A message naming another pair is not this process's to act on
  // (a forged one may name anyone's pair): another producer's goes back to the queue, for that
  // producer's own clean-up; one that claims to be this process's is forged, and dropped.
  const std::string queue = QueueKey(consumer);
  const bool own = consumer == id_;
  std::set<std::string> ours(pairs.begin(), pairs.end());
  std::vector<PairKeys> doomed;
  for (const auto& pair : ours) doomed.push_back({pair, true, 0});
  if (own) {  // (the pairs dropped here too: a late value's chunks are named by its message)
    std::lock_guard<std::mutex> lock(mu_);
    ours.insert(forgotten_.begin(), forgotten_.end());
  }
  std::vector<std::string> others;
  DrainQueue(*store_, queue, [&](const std::string& bytes) {
    const std::optional<Message> m = Decode(bytes);
    if (!m || m->type == kWake) return;
    if (ours.count(m->pair) == 0) {
      if (own) return;
      if (m->producer != id_) {
        others.push_back(bytes);
        return;
      }
      // (Sent after `pairs` was read: this process's all the same if it is recorded, as a
      // message is before its push, and its claim goes too. Otherwise forged, and dropped.)
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!SentToLocked(consumer, m->pair)) return;
      }
      ours.insert(m->pair);
      doomed.push_back({m->pair, true, 0});
    }
    if (m->type == kValue && m->value.chunks > 0) doomed.push_back({m->pair, false, m->value.chunks});
  });
  DeleteKeysOf(*store_, doomed);
  for (const auto& bytes : others) store_->QueuePush(queue, bytes);
  store_->DeleteKeys({HeartbeatKey(consumer), IdentityKey(consumer)});
  std::lock_guard<std::mutex> lock(mu_);
  consumer_processes_.erase(consumer);
}

bool Session::SentToLocked(const std::string& consumer, const std::string& pair) const {
  const auto it = sent_.find(consumer);
  if (it == sent_.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(),
                     [&](const SentPair& sent) { return sent.pair == pair; });
}

bool Session::ConsumerGoneHere(const std::string& consumer) {
  std::optional<ProcessId> process;
  bool known;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = consumer_processes_.find(consumer);
    known = it != consumer_processes_.end();
    if (known) process = it->second;
  }
  if (!known) {
    // (compare_set with one value as both reads without waiting: a get would wait for a missing
    // key. A consumer that wrote none, or exited and deleted it, is not found gone here.)
    const std::string text = store_->CompareSet(IdentityKey(consumer), kMissing, kMissing);
    process = text == kMissing ? std::nullopt : LocalProcessOf(text);
    std::lock_guard<std::mutex> lock(mu_);
    consumer_processes_[consumer] = process;
  }
  return process && !IsAlive(*process);
}

void Session::Stop() noexcept {
  stopping_ = true;
  StopLinks();
  std::vector<std::shared_ptr<ConsumerImpl>> consumers = LiveConsumers();
  for (auto& c : consumers) {
    c->state().TryComplete(Result<NetworkValue>::Error(
        FutureErrc::kDroppedAtExit, "the process exits with the value still in flight"));
  }
  if (broken()) return;
  RunDeferred();
  // First what is this process's own to delete: a clean-up for others that fails or runs past
  // the exit's deadline must not leave it.
  bool sent = false, consumed = false;
  std::vector<std::string> ours;  // this process's pairs in flight
  try {
    bool wake, identity_written;
    std::vector<PairKeys> cleanups;
    {
      std::lock_guard<std::mutex> lock(mu_);
      consumed = consumed_;
      for (const auto& [pair, weak] : pairs_) ours.push_back(pair);
      cleanups.swap(cleanups_);
      // (A wake deferred to a tick that will not run: sent now, unless RunDeferred sent it.)
      wake = watcher_blocked_ && !wake_pending_;
      identity_written = identity_written_;
      sent = !sent_.empty();
    }
    for (auto& c : consumers) {
      cleanups.push_back({c->handle().pair, true, std::numeric_limits<uint32_t>::max()});
    }
    DeleteKeysOf(*store_, cleanups);
    store_->DeleteKey(HeartbeatKey(id_));  // others see "exited", not "died"
    if (identity_written) store_->DeleteKey(IdentityKey(id_));
    if (wake) store_->QueuePush(QueueKey(id_), std::string(1, kWake));
  } catch (...) {
  }
  // What this process sent consumers that are gone (one on this kernel: at once) goes with it.
  try {
    if (sent) CleanUpForConsumers();
  } catch (...) {
  }
  // Last (a flooded queue must not hold the rest up): what is left in this process's queue
  // (values for the pairs failed above, messages nobody will read) goes with it, with what
  // those messages name of its pairs, and what was queued for deletion meanwhile.
  try {
    if (consumed) DeleteWhatADeadConsumerLeft(id_, ours);
    std::vector<PairKeys> late;
    std::vector<std::string> keys;
    {
      std::lock_guard<std::mutex> lock(mu_);
      late.swap(cleanups_);
      keys.swap(key_cleanups_);
    }
    if (!keys.empty()) store_->DeleteKeys(keys);
    DeleteKeysOf(*store_, late);
  } catch (...) {
  }
}

}  // namespace dtorch::core::network_internal
