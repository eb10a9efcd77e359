// The network kind's session: one per store per process (its connection, its consumers' pairs,
// the watcher that pops their queue, the heartbeats and liveness of their producers).
#pragma once

#include "internal.h"
#include "links.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;


// ---- the sessions: one per store per process ----

// What this process knows of another's heartbeat.
struct Liveness {
  int64_t last_beat = -1;  // the heartbeat counter last read
  Clock::time_point changed_at = Clock::now();
  enum class State { kAlive, kExited, kDead } state = State::kAlive;
  bool exiting = false;  // it said so ('X'): once gone, it exited
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(StoreAddress address, std::unique_ptr<KeyValueStore> connection)
      : address_(std::move(address)), id_(NewId()), store_(std::move(connection)) {}

  const StoreAddress& address() const { return address_; }
  const std::string& id() const { return id_; }
  KeyValueStore& store() { return *store_; }
  // Its connection was lost (a call that failed or timed out on it, on any thread), or it broke.
  bool broken() const { return broken_ || store_->Broken(); }

  // Bumps this process's heartbeat: always when `force`, else unless it was bumped within half a
  // tick (a process that starts a pair between two ticks must not look exited, or dead with a
  // counter others read long ago). Throws StoreError.
  void Beat(bool force);

  // Consumer side. Register writes the pair's record (throws StoreError).
  void Register(const std::string& pair, const std::string& record,
                const std::shared_ptr<ConsumerImpl>& consumer);
  void Forget(const std::string& pair, bool value_arrived);
  size_t PendingPairs() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pairs_.size();
  }
  // Producer side.
  void ProducerAttached() {
    std::lock_guard<std::mutex> lock(mu_);
    ++producers_;
  }
  void ProducerDetached() {
    std::lock_guard<std::mutex> lock(mu_);
    --producers_;
  }
  // Runs `work` on the tick thread, at its next round (a producer's attach message: not on the
  // path of a value set at once, which tells the consumer all the attach message would).
  void AtNextTick(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // (A broken session is ticked by nobody: what `work` holds, the session itself among it,
      // goes now, outside mu_.)
      if (!broken_) {
        next_tick_.push_back(std::move(work));
        return;
      }
    }
    work = nullptr;
  }
  // Runs now what waits for the next round: the process exits, and that round may never come
  // (a handle dropped just before the exit tells its consumer, which would otherwise find this
  // process gone and say "died").
  void RunDeferred() noexcept {
    for (int round = 0; round < 4; ++round) {  // (work may queue more: a last reference dropped)
      std::vector<std::function<void()>> work;
      {
        std::lock_guard<std::mutex> lock(mu_);
        work.swap(next_tick_);
      }
      if (work.empty()) return;
      for (auto& w : work) w();  // (noexcept: see ProducerImpl::Announce)
    }
  }
  // Whether `consumer` ran on this kernel and is gone (its identity read once from the store).
  // Throws StoreError.
  bool ConsumerGoneHere(const std::string& consumer);
  // `consumer` is gone: its queue drained, the keys its messages name and the claims of `pairs`
  // deleted, and its heartbeat and identity. Throws StoreError.
  void DeleteWhatADeadConsumerLeft(const std::string& consumer,
                                   const std::vector<std::string>& pairs);
  // Pushes `message`, about `pair` (a value in `chunks` chunks, or none), to `consumer`'s queue:
  // what it names is this process's to delete should that consumer die before reading it. It is
  // recorded before the push, so that a clean-up draining the queue meanwhile knows the message
  // as this process's (a record made after the push would miss it, and the chunks would stay).
  // Throws StoreError.
  void SendTo(const std::string& consumer, const std::string& pair, uint32_t chunks,
              const std::string& message) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seq = ++sent_seq_;
      sent_[consumer].push_back({pair, chunks, seq, false});
    }
    try {
      store_->QueuePush(QueueKey(consumer), message);
    } catch (...) {
      MarkPushed(consumer, seq);  // (it may have arrived: known read once the queue is empty)
      throw;
    }
    MarkPushed(consumer, seq);
  }
  // A value for `pair` went to `consumer` over a link: recorded as SendTo records a message
  // (pushed), so that a clean-up for that consumer, should it die, deletes the pair's claim.
  void Recorded(const std::string& consumer, const std::string& pair) {
    std::lock_guard<std::mutex> lock(mu_);
    sent_[consumer].push_back({pair, 0, ++sent_seq_, true});
  }
  // The pairs this process sent `consumer` messages about, not yet known read.
  std::vector<std::string> SentPairs(const std::string& consumer) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> pairs;
    if (const auto it = sent_.find(consumer); it != sent_.end()) {
      for (const auto& sent : it->second) pairs.push_back(sent.pair);
    }
    return pairs;
  }
  // Fails `pair` once the watcher has handled the messages queued before now (kRecheck), unless
  // one of them changed what the decision was made from (the consumer's epoch, at `epoch` now).
  void FailAfterQueued(const std::string& pair, FutureErrc code, const std::string& detail,
                       uint64_t epoch, std::set<std::string> gone);
  // Heartbeats, liveness and clean-up; on the tick thread. False once it has nothing to do.
  bool Tick();
  // What DeleteSoon queued, now (the tick thread, between rounds).
  void DeleteQueued();
  // The store went away: fails every pair in flight here.
  void Break(const std::string& why);
  // At exit: fails the pairs in flight, deletes their keys and this process's heartbeat, wakes
  // the watcher.
  void Stop() noexcept;

 private:
  struct SentPair {
    std::string pair;
    uint32_t chunks;
    uint64_t seq;  // (which record: the same pair may be sent more than one message)
    bool pushed;   // its push returned (until then an empty queue does not mean it was read)
  };
  void MarkPushed(const std::string& consumer, uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    if (const auto it = sent_.find(consumer); it != sent_.end()) {
      // (From the back: the newest records are the ones being pushed.)
      for (auto sent = it->second.rbegin(); sent != it->second.rend(); ++sent) {
        if (sent->seq == seq) {
          sent->pushed = true;
          break;
        }
      }
    }
  }
  // Whether a message about `pair` to `consumer` is recorded here (not yet known read).
  bool SentToLocked(const std::string& consumer, const std::string& pair) const;
  void StartWatcherLocked();
  void Watch(const std::shared_ptr<KeyValueStore>& connection);
  void Handle(KeyValueStore& connection, const Message& m);
  void Receive(KeyValueStore& connection, const Message& m, const std::shared_ptr<ConsumerImpl>& c);
  // Deletes `keys` soon, on the tick thread (off the watcher, which delivers the other pairs'
  // values): at once, between its rounds.
  void DeleteSoon(PairKeys keys);
  // A value message names a pair not in flight here: a pair dropped here (kept in forgotten_)
  // may have a late value's chunks in the store (deleted); one never made here (forged) has
  // nothing of ours (no store call).
  void ValueForNoPair(const Message& m);
  // The holder of a message that names one: a known holder of the pair (kSerialized and
  // kExiting come only from holders that announced themselves).
  static bool FromHolder(const ConsumerImpl* consumer, const Message& m);
  void CheckProducers(Clock::time_point now);
  // Watches the claim holders of pairs that know of no producer (one that claimed, then died
  // before it was announced, would otherwise never be watched).
  void FindClaimHolders(const std::vector<std::shared_ptr<ConsumerImpl>>& consumers);
  void CleanUpForConsumers();
  std::vector<std::shared_ptr<ConsumerImpl>> LiveConsumers();

  // ---- point-to-point links (links.cc, links.h) ----
 public:
  // Producer side: sends `frame` to `consumer`'s process over this process's link to it (made
  // if need be), then `payload_bytes` of `payload` when there are any. Never throws.
  LinkSend SendOverLink(const std::string& consumer, const std::string& frame,
                        const void* payload, size_t payload_bytes);
  // Consumer side: `producer` asks for link `name` (its link request): its receiving thread
  // starts (replacing an older link of that producer).
  void LinkRequested(const std::string& producer, const std::string& name);
  // `producer` was found gone: its link's thread stops waiting for it.
  void AbortLinkFrom(const std::string& producer);
  size_t LinksIn() const;
  size_t LinksOut() const;

 private:
  void ReceiveOnLink(const std::shared_ptr<InLink>& in);
  // One frame received on `link` (kFrameBytes at `frame`): false when the link is to end.
  // `*payload_in_flight`: a payload buffer a failed receive may still be posted into (the
  // caller releases it after the link); `*frame_bytes`: how much of `frame` the frame used.
  bool HandleFrame(InLink& in, PairLink& link, const char* frame,
                   std::shared_ptr<char>* payload_in_flight, size_t* frame_bytes);
  // On the tick thread: links that sent nothing for config.network_pair_idle_s are closed.
  void CloseIdleLinks(Clock::time_point now);
  // At exit: every link's blocked call gives up.
  void StopLinks() noexcept;
  // Deletes `keys` soon, on the tick thread (rendezvous keys).
  void DeleteKeysSoon(std::vector<std::string> keys);
  std::map<std::string, std::shared_ptr<OutLink>> out_links_;  // guarded by mu_: by consumer
  std::map<std::string, std::shared_ptr<InLink>> in_links_;    // guarded by mu_: by producer
  std::vector<std::string> key_cleanups_;                      // guarded by mu_

 public:
  // The consumer of `pair` in this process, if it is still in flight.
  std::shared_ptr<ConsumerImpl> Find(const std::string& pair);

 private:
  // Wakes the watcher from its pop, if it is in one and no wake is on its way (caller: mu_ held;
  // push the wake after releasing it when this returns true).
  bool WakeWatcherLocked();

  const StoreAddress address_;
  const std::string id_;
  const std::unique_ptr<KeyValueStore> store_;
  std::atomic<bool> broken_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> last_beat_ms_{std::numeric_limits<int64_t>::min() / 2};
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::weak_ptr<ConsumerImpl>> pairs_;  // guarded by mu_
  // The watcher's connection, kept for the next watcher (guarded by mu_).
  std::shared_ptr<KeyValueStore> watch_connection_;
  bool watching_ = false;        // guarded by mu_: a watcher thread runs
  bool watcher_blocked_ = false;  // guarded by mu_: it is in (or entering) its pop
  bool wake_pending_ = false;     // guarded by mu_: a wake message is on its way to it
  std::map<std::string, Liveness> producers_liveness_;  // guarded by mu_: as a consumer
  std::map<std::string, Liveness> consumers_liveness_;  // guarded by mu_: as a producer
  // guarded by mu_: as a producer, the consumers' processes on this kernel, by store id (nullopt:
  // elsewhere, or no identity)
  std::map<std::string, std::optional<ProcessId>> consumer_processes_;
  std::mutex cleanup_mu_;          // held by CleanUpForConsumers (not with mu_)
  bool identity_tried_ = false;    // guarded by mu_: as a consumer
  bool identity_written_ = false;  // guarded by mu_: as a consumer
  int64_t producers_ = 0;  // guarded by mu_: announced NetworkProducers of this process here
  std::map<std::string, std::vector<SentPair>> sent_;  // guarded by mu_: by consumer
  uint64_t sent_seq_ = 0;                              // guarded by mu_
  std::vector<PairKeys> cleanups_;                     // guarded by mu_
  // guarded by mu_: pairs dropped here, oldest first (at most kForgottenPairsKept)
  std::deque<std::string> forgotten_order_;
  std::unordered_set<std::string> forgotten_;
  std::vector<std::function<void()>> next_tick_;       // guarded by mu_
  struct QueuedFailure {
    ErrorInfo error;
    uint64_t epoch;              // the consumer's epoch when it was decided
    std::set<std::string> gone;  // the holders it found gone
  };
  std::map<std::string, QueuedFailure> failures_after_queued_;  // guarded by mu_: by pair
  size_t claims_read_ = 0;  // FindClaimHolders' rounds (the tick thread's only)
  // guarded by mu_: this process has awaited values here. Its heartbeat then goes on until it
  // exits: producers with messages for it must not take an idle consumer for a dead one.
  bool consumed_ = false;
};


// ---- the registry and the tick thread ----

struct Registry {
  uint64_t generation = ForkGeneration();
  std::mutex mu;
  std::map<StoreAddress, std::shared_ptr<Session>> sessions;  // guarded by mu
  std::condition_variable tick_cv;
  bool ticking = false;   // guarded by mu: the tick thread runs
  uint64_t work = 0;      // guarded by mu: EnsureTicking calls (work given since a round began)
  bool stopped = false;   // guarded by mu: the library's exit ran
  bool delete_soon = false;  // guarded by mu: a session queued keys to delete (DeleteSoon)
};
extern std::atomic<Registry*> registry;  // (registry.cc)

}  // namespace dtorch::core::network_internal
