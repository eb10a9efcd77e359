// A session handles what its watcher popped: attach, drop, serialize, exiting and value
// messages (each checked against what the session knows), and deletes what ended.
#include "consumer.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

void Session::Handle(KeyValueStore& connection, const Message& m) {
  if (m.type == kWake) return;
  const std::shared_ptr<ConsumerImpl> consumer = Find(m.pair);
  if (m.type == kRecheck) {
    if (m.producer != id_) return;  // (only this process's own tick sends them)
    std::optional<QueuedFailure> failure;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = failures_after_queued_.find(m.pair);
      if (it == failures_after_queued_.end()) return;  // (not this session's)
      failure = std::move(it->second);
      failures_after_queued_.erase(it);
    }
    // (A holder or a handle in flight the tick did not know of: it decides again.)
    if (consumer && consumer->Epoch() == failure->epoch) {
      consumer->FailAsDecided(connection, failure->error, failure->gone);
    }
    return;
  }
  // (This process's own handles are no holders and send none of these: a message that says it
  // is from this process is forged.)
  if (m.type != kValue && m.producer == id_) return;
  if (m.type == kLinkRequest) return LinkRequested(m.producer, m.pair);
  if (m.type == kExiting) {
    if (!FromHolder(consumer.get(), m)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Liveness& l = producers_liveness_[m.producer];
      l.exiting = true;
      // (Found gone by the tick before this message was read: it exited, and a verdict that
      // said "died" is decided again.)
      if (l.state == Liveness::State::kDead) l.state = Liveness::State::kExited;
    }
    consumer->Changed();
    return;
  }
  if (m.type == kAttach || m.type == kDropped || m.type == kSerialized) {
    if (!consumer) return;
    bool tracked = true;
    if (m.type == kAttach) {
      tracked = consumer->Attached(m.producer, m.holder);
      if (tracked) {
        // A process that attaches is alive, whatever it was found to be before.
        std::lock_guard<std::mutex> lock(mu_);
        Liveness& l = producers_liveness_[m.producer];
        if (l.state != Liveness::State::kAlive) l = Liveness{};
      }
    } else if (m.type == kDropped) {
      if (FromHolder(consumer.get(), m)) consumer->Dropped(m.producer, m.attachment);
    } else if (FromHolder(consumer.get(), m)) {
      consumer->CountSerialized();
    }
    if (!tracked) {
      consumer->Fail(FutureErrc::kInvalidHandle,
                     "more than " + std::to_string(kMaxHoldersPerPair) + " processes attached "
                     "to the promise on the store at " + address_.ToString() + " (the limit of "
                     "holders one network promise tracks): pass a promise to fewer processes, "
                     "or make one per producer");
    }
    return;
  }
  // A value: for a pair in flight whose value has not come, else (a pair dropped here, or a
  // repeat) only its keys go.
  if (!consumer) return ValueForNoPair(m);
  if (consumer->Settled()) {
    if (m.value.chunks > 0) DeleteSoon({m.pair, false, m.value.chunks});
    return;
  }
  Receive(connection, m, consumer);
}

void Session::Receive(KeyValueStore& connection, const Message& m,
                      const std::shared_ptr<ConsumerImpl>& consumer) {
  const ValueMessage& v = m.value;
  consumer->ValueArrived();
  if (v.error) {
    std::optional<ErrorInfo> error = DecodeErrorText(v.code, v.header);
    if (!error) {
      error = ErrorInfo{FutureErrc::kInvalidHandle, "the error read from the store at " +
                                                        address_.ToString() + " is corrupt"};
    } else if (m.producer == id_) {
      error->origin.native = consumer->Native();  // (set by the creator's own handle)
    }
    consumer->state().TryComplete(Result<NetworkValue>::Error(std::move(*error)));
    return;
  }
  auto payload = std::make_shared<std::string>();
  // Its size is checked before any chunk is read: it must be the size its header implies, and
  // fit in this machine's memory (the message's word, read from the store, is untrusted).
  std::string problem = consumer->CheckPayloadBytes(v.header, v.payload_bytes);
  // The chunks found (deleted once read, or once found wrong).
  uint32_t chunks_found = 0;
  if (!problem.empty()) {
    chunks_found = v.chunks;  // (whatever of them exists, up to the first one missing)
  } else if (v.chunks == 0) {
    payload->assign(v.inline_payload.data(), v.inline_payload.size());
  } else {
    try {
      // Grown as the chunks come, never from the producer's word alone.
      payload->reserve(std::min<uint64_t>(v.payload_bytes, uint64_t{64} << 20));
      for (uint32_t i = 0; i < v.chunks && problem.empty(); ++i) {
        // (Checked first: a get waits for a missing key, here for the watcher's long timeout.)
        if (!connection.Check(ChunkKey(m.pair, i))) {
          problem = "chunk " + std::to_string(i) + " is missing";
          break;
        }
        const std::string chunk = connection.Get(ChunkKey(m.pair, i));
        chunks_found = i + 1;
        const uint64_t expected =
            i + 1 < v.chunks ? kChunkBytes : v.payload_bytes - uint64_t{kChunkBytes} * i;
        if (chunk.size() != expected) {
          problem = "chunk " + std::to_string(i) + " has " + std::to_string(chunk.size()) +
                    " bytes, expected " + std::to_string(expected);
        } else {
          payload->append(chunk);
        }
      }
    } catch (const StoreError& e) {
      if (e.kind() != StoreError::Kind::kTimeout) throw;  // (the store went away: Break)
      problem = std::string("a chunk could not be read (") + e.what() + ")";
      chunks_found = v.chunks;  // (not known: up to the first one missing)
    } catch (const std::bad_alloc&) {
      problem = "it does not fit in this process's memory";
      chunks_found = v.chunks;
    } catch (const std::length_error&) {
      problem = "it does not fit in this process's memory";
      chunks_found = v.chunks;
    }
  }
  if (problem.empty() && Checksum(payload->data(), payload->size()) != v.checksum) {
    problem = "its checksum does not match its bytes";
  }
  if (problem.empty()) {
    char* data = payload->empty() ? nullptr : payload->data();
    const size_t size = payload->size();
    consumer->state().TryComplete(
        Result<NetworkValue>::Value(NetworkValue{v.header, std::move(payload), data, size}));
  } else {
    consumer->state().TryComplete(Result<NetworkValue>::Error(
        FutureErrc::kInvalidHandle, "the value read from the store at " + address_.ToString() +
                                        " is corrupt: " + problem));
  }
  // (The claim stays while the pair does: a second producer is told it came second. The
  // chunks go on the tick thread: the watcher goes on to the next message.)
  if (chunks_found > 0) DeleteSoon({m.pair, false, chunks_found});
}

void Session::Break(const std::string& why) {
  if (broken_.exchange(true)) return;
  Unregister(this);
  // (A call blocked on a store that stopped answering gives up now: the watcher's pop too.)
  std::shared_ptr<KeyValueStore> watch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    watch = watch_connection_;
  }
  if (watch) watch->Abort();
  store_->Abort();
  // (What waits for a tick holds this session: dropped, outside mu_, so that nothing keeps the
  // broken session and its connections alive.)
  std::vector<std::function<void()>> deferred;
  {
    std::lock_guard<std::mutex> lock(mu_);
    deferred.swap(next_tick_);
  }
  for (auto& c : LiveConsumers()) {
    c->Fail(FutureErrc::kBrokenPromise, "the store at " + address_.ToString() +
                                            " went away while the value was awaited (" + why + ")");
  }
}

void Session::DeleteSoon(PairKeys keys) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cleanups_.push_back(std::move(keys));
  }
  DeleteSoonOnTickThread();
}

void Session::DeleteQueued() {
  if (broken_ || stopping_) return;
  std::vector<PairKeys> cleanups;
  std::vector<std::string> keys;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cleanups.swap(cleanups_);
    keys.swap(key_cleanups_);
  }
  if (!keys.empty()) {
    try {
      store_->DeleteKeys(keys);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);  // (the next round's)
      key_cleanups_.insert(key_cleanups_.end(), keys.begin(), keys.end());
    }
  }
  if (cleanups.empty()) return;
  try {
    DeleteKeysOf(*store_, cleanups);
  } catch (const StoreError& e) {
    if (e.kind() != StoreError::Kind::kTimeout) Break(e.what());
  } catch (...) {
    // (The next round tries again.)
  }
  if (!cleanups.empty()) {  // (what a failed pass did not delete: the next round's)
    std::lock_guard<std::mutex> lock(mu_);
    cleanups_.insert(cleanups_.end(), cleanups.begin(), cleanups.end());
  }
}

void Session::ValueForNoPair(const Message& m) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // (Never made here: nothing of it can be ours. One dropped here is kept while it is one of
    // the latest kForgottenPairsKept: each message naming it costs a delete pass, on the tick
    // thread.)
    if (forgotten_.count(m.pair) == 0) return;
  }
  DeleteSoon({m.pair, true, m.value.chunks});
}

void Session::FailAfterQueued(const std::string& pair, FutureErrc code,
                              const std::string& detail, uint64_t epoch,
                              std::set<std::string> gone) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failures_after_queued_[pair] = QueuedFailure{ErrorInfo{code, detail}, epoch, std::move(gone)};
  }
  try {
    store_->QueuePush(QueueKey(id_), EncodeHead(kRecheck, pair, id_));
  } catch (...) {
    // (The store went away: the watcher fails every pair anyway. Not kept: the next tick
    // decides again while the pair is unsettled.)
    std::lock_guard<std::mutex> lock(mu_);
    failures_after_queued_.erase(pair);
  }
}

void Session::FindClaimHolders(const std::vector<std::shared_ptr<ConsumerImpl>>& consumers) {
  std::vector<std::shared_ptr<ConsumerImpl>> unknown;
  for (auto& c : consumers) {
    if (!c->Settled() && c->KnowsNoProducer()) unknown.push_back(c);
  }
  if (unknown.empty()) return;
  // At most kClaimsReadPerTick a round, in turn: a claim read is a round trip. (compare_set with
  // the record as both values reads without waiting: a get would wait for a deleted key.)
  const size_t n = std::min(unknown.size(), kClaimsReadPerTick);
  const size_t first = claims_read_++ * kClaimsReadPerTick % unknown.size();
  for (size_t k = 0; k < n; ++k) {
    ConsumerImpl& c = *unknown[(first + k) % unknown.size()];
    const std::string holder = store_->CompareSet(ClaimKey(c.handle().pair), c.record(), c.record());
    if (IsClaimValue(holder) && holder.compare(0, kIdHexDigits, id_) != 0) {
      // (Watched from the next round; past the holders' limit the pair fails at the next
      // attach message.)
      c.Attached(holder.substr(0, kIdHexDigits), std::nullopt);
    }
  }
}

}  // namespace dtorch::core::network_internal
