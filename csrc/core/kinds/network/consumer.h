// The network kind's consumer: the creator's end of a pair, on its process's session.
#pragma once

#include "session.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

// ---- the consumer's pair ----

class ConsumerImpl final : public NetworkConsumer,
                           public std::enable_shared_from_this<ConsumerImpl> {
 public:
  ConsumerImpl(std::shared_ptr<Session> session, NetworkHandle handle,
               PayloadBytesOf payload_bytes_of)
      : session_(std::move(session)),
        handle_(std::move(handle)),
        record_(handle_.Serialize()),
        payload_bytes_of_(std::move(payload_bytes_of)) {}
  ~ConsumerImpl() override {
    if (ForkGeneration() == generation_) session_->Forget(handle_.pair, value_arrived_);
  }

  const NetworkHandle& handle() const override { return handle_; }
  const std::string& record() const { return record_; }
  bool InCreatorProcess() const override { return ForkGeneration() == generation_; }
  void MarkLeftProcess() override {
    left_process_ = true;
    CountSerialized();
  }
  void CreatorDropped(bool claimed_here) override;
  bool RetrieveFuture() override { return !future_retrieved_.exchange(true); }
  SharedState<NetworkValue>& state() { return state_; }
  // ReceivedSource (the future's).
  bool WaitUntil(Deadline deadline) const override {
    CheckInCreatorProcess();
    return state_.WaitUntil(deadline);
  }
  bool IsReady() const override { return state_.IsReady(); }
  void OnReady(std::function<void()> callback) override { state_.OnReady(std::move(callback)); }
  ReceivedValue Take() override {
    CheckInCreatorProcess();
    NetworkValue value = state_.Take();
    const bool empty = value.payload_bytes == 0;
    return ReceivedValue{std::move(value.header), empty ? nullptr : value.payload,
                         value.payload_bytes, std::move(value.keep_alive)};
  }
  void FutureDropped() override { state_.DropResult(); }

  // A future inherited by a forked child: the pair's watcher is the parent's, nothing would
  // complete it here (throws, as memory futures pending at fork fail).
  void CheckInCreatorProcess() const {
    if (ForkGeneration() == generation_) return;
    throw FutureError(FutureErrc::kDroppedAtFork,
                      "the network future was in flight in the parent process when it forked; "
                      "its value goes to the parent: get it there, or create the pair in this "
                      "process");
  }
  // Complete, whether or not its result was taken (get() consumes: IsReady() is then false).
  bool Settled() const { return state_.IsReady() || !state_.Valid(); }
  bool KnowsNoProducer() const {
    std::lock_guard<std::mutex> lock(mu_);
    return producers_.empty();
  }
  void ValueArrived() { value_arrived_ = true; }
  // Why a value message's payload size cannot be this pair's ("" when it can): the size its
  // header implies (the codec's word), and at most this machine's memory.
  std::string CheckPayloadBytes(std::string_view header, uint64_t bytes) const {
    if (payload_bytes_of_) {
      uint64_t implied = 0;
      try {
        implied = payload_bytes_of_(header);
      } catch (const FutureError& e) {
        return "its header is no " + handle_.type_name + " value's (" + e.detail() + ")";
      } catch (const std::exception& e) {
        return "its header is no " + handle_.type_name + " value's (" + e.what() + ")";
      }
      if (implied != bytes) {
        return "it says it has " + std::to_string(bytes) + " bytes, and its header " +
               std::to_string(implied);
      }
    }
    return CheckMemory(bytes);
  }
  // Why `bytes` cannot be received here ("" when they can): more than this machine's memory.
  static std::string CheckMemory(uint64_t bytes) {
    static const uint64_t memory = [] {
      const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
      return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page)
                                   : std::numeric_limits<uint64_t>::max();
    }();
    if (bytes > memory) {
      return "its " + std::to_string(bytes) + " bytes are more than this machine's memory (" +
             std::to_string(memory) + " bytes)";
    }
    return {};
  }

  // A holder of this pair: a process that deserialized a handle or used one (its attach
  // message), or claimed the pair (FindClaimHolders; nothing more known of it then).
  struct Holder {
    bool dropped = false;
    std::string attachment;  // its latest attachment's id ("" when not known)
    int32_t pid = 0;     // 0: not known
    std::string host;    // its host's name when it is not this one
    std::optional<ProcessId> local;  // on this kernel: checked by pid, not by heartbeat
  };

  // On the session's threads. Each message that changes what the tick decides from (a holder,
  // a handle serialized) bumps the epoch: a failure decided before it is not applied.
  // False (nothing recorded) for a holder past kMaxHoldersPerPair.
  bool Attached(const std::string& producer, const std::optional<HolderInfo>& info) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!TrackLocked(producer)) return false;
    Holder& holder = producers_[producer];
    holder.dropped = false;  // (a process that dropped a handle and attached again: live)
    if (info) {
      holder.attachment = info->attachment;
      holder.pid = info->pid;
      if (!info->boot_id.empty() && info->boot_id == BootId() &&
          info->pid_namespace == ThisPidNamespace()) {
        // (A process of another pid namespace cannot be checked from here: its heartbeat.)
        holder.local = ProcessId{info->pid, info->start_time, info->pid_namespace};
      } else if (info->boot_id != BootId()) {
        holder.host = info->host.empty() ? "another host" : info->host;
      }
      if (info->deserialized) ++deserialized_;
    }
    ++epoch_;
    return true;
  }
  // `attachment` of `producer` dropped the pair (an earlier one's late message changes nothing).
  // (Only a known holder's: FromHolder.)
  void Dropped(const std::string& producer, const std::string& attachment) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = producers_.find(producer);
    if (it == producers_.end()) return;
    Holder& holder = it->second;
    if (!holder.attachment.empty() && holder.attachment != attachment) return;
    holder.dropped = true;
    ++epoch_;
  }
  // Whether `producer` is a holder of the pair not known to have dropped it.
  bool HasLiveHolder(const std::string& producer) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = producers_.find(producer);
    return it != producers_.end() && !it->second.dropped;
  }
  // A handle was serialized: in the creator's process (MarkLeftProcess), or by a holder.
  void CountSerialized() {
    std::lock_guard<std::mutex> lock(mu_);
    ++serialized_;
    ++epoch_;
  }
  // A handle was deserialized in this (the creator's) process.
  void CountDeserialized() {
    std::lock_guard<std::mutex> lock(mu_);
    ++deserialized_;
    ++epoch_;
  }
  uint64_t Epoch() const {
    std::lock_guard<std::mutex> lock(mu_);
    return epoch_;
  }
  // Something the tick's verdict depends on changed (a holder said it is exiting).
  void Changed() {
    std::lock_guard<std::mutex> lock(mu_);
    ++epoch_;
  }
  // Why the pair should fail now (empty: it should not): every holder gone (unless a handle is
  // still in flight: then the attach deadline), or none attached by the deadline. `liveness` is
  // the session's, read under its lock.
  std::string WhyFail(const std::map<std::string, Liveness>& liveness, Clock::time_point now);
  // The holders not known to have dropped the pair, and what is known of each.
  std::vector<std::pair<std::string, Holder>> LiveProducers() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<std::string, Holder>> out;
    for (const auto& [id, holder] : producers_) {
      if (!holder.dropped) out.emplace_back(id, holder);
    }
    return out;
  }
  // The creator's own handle set an exception object: kept for the error message its value
  // message brings back to this process.
  void KeepNative(std::shared_ptr<const NativeError> native) override {
    std::lock_guard<std::mutex> lock(mu_);
    native_ = std::move(native);
  }
  std::shared_ptr<const NativeError> Native() const {
    std::lock_guard<std::mutex> lock(mu_);
    return native_;
  }
  // Fails the pair now (the store went away; a promise that never left the process dropped).
  void Fail(FutureErrc code, const std::string& detail) {
    if (!Settled()) state_.TryComplete(Result<NetworkValue>::Error(code, detail));
  }
  // The watcher applies the tick's verdict (every holder gone): first takes the claim on
  // `connection` (so that a producer cannot claim it after), unless a producer holds it that is
  // not one of the holders the verdict found gone (`gone`): its value is on the way.
  void FailAsDecided(KeyValueStore& connection, const ErrorInfo& error,
                     const std::set<std::string>& gone);
  // The holders known now (the tick's verdict names them gone).
  std::set<std::string> HolderIds() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<std::string> ids;
    for (const auto& [id, holder] : producers_) ids.insert(id);
    return ids;
  }

 private:
  bool LeftProcess() const {
    return left_process_ || forks_in_parent.load() != forks_at_creation_;
  }
  // Whether `producer` is, or may become, one of producers_ (mu_ held).
  bool TrackLocked(const std::string& producer) const {
    return producers_.size() < kMaxHoldersPerPair || producers_.count(producer) != 0;
  }

  const std::shared_ptr<Session> session_;
  const NetworkHandle handle_;
  const std::string record_;  // what the claim key holds until a producer claims the pair
  const PayloadBytesOf payload_bytes_of_;  // the codec's (null: not checked)
  const uint64_t generation_ = ForkGeneration();
  const uint64_t forks_at_creation_ = forks_in_parent.load();
  SharedState<NetworkValue> state_;
  std::atomic<bool> left_process_{false};
  std::atomic<bool> future_retrieved_{false};
  std::atomic<bool> value_arrived_{false};  // its value message was read (its chunks deleted)
  mutable std::mutex mu_;
  std::map<std::string, Holder> producers_;  // guarded by mu_: by store id
  std::optional<Clock::time_point> creator_dropped_at_;  // guarded by mu_
  // guarded by mu_: handles serialized and deserialized (wrapping counts; see WhyFail)
  uint32_t serialized_ = 0;
  uint32_t deserialized_ = 0;
  uint64_t epoch_ = 0;                                 // guarded by mu_
  std::optional<Clock::time_point> all_gone_since_;    // guarded by mu_: the tick's
  std::shared_ptr<const NativeError> native_;          // guarded by mu_
};


}  // namespace dtorch::core::network_internal
