#include "producer.h"
#include "consumer.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

std::mutex attachments_mu;

FutureError Altered(const NetworkHandle& handle) {
  return FutureError(FutureErrc::kInvalidHandle,
                     "a serialized network promise that does not match the pair it names on the "
                     "store at " + handle.store.ToString() + " (its consumer, value type, value "
                     "options or store address were altered); pass the string serialize() "
                     "returned, unchanged");
}

void ProducerImpl::Open(AttachAs as) {
  session_->ProducerAttached();
  EnsureTicking();
  if (as != AttachAs::kFirstUse) {
    Announce(as == AttachAs::kDeserialized);
    return;
  }
  session_->AtNextTick([weak = std::weak_ptr<ProducerImpl>(shared_from_this())] {
    if (auto producer = weak.lock()) producer->Announce(false);
  });
}

bool ProducerImpl::Awaited(Session& session, const NetworkHandle& handle,
                           const std::string& record, const std::string& claim) {
  KeyValueStore& store = session.store();
  const std::string key = ClaimKey(handle.pair);
  // (c10d's compare_set answers `expected` for a missing key, as for a matching one: the check
  // tells them apart.)
  if (!store.Check(key)) return false;  // no such pair in flight
  const std::string holder = store.CompareSet(key, record, record);
  // Waiting for a producer, or claimed by this one (a device value on its way).
  return holder == record || holder == claim;
}

void ProducerImpl::SendLocked(const std::string& message) {
  session_->SendTo(handle_.consumer, handle_.pair, 0, message);
}

void ProducerImpl::AnnounceLocked(bool deserialized) {
  // Nothing to tell: the value's message said it all, or this is the creator's own process
  // (its handle holds the pair; a copy there is no holder), or the pair does not wait for this
  // handle's producer. (Still pending if the store cannot be reached: a later call may tell.)
  if (published_ || withdrawn_ || session_->id() == handle_.consumer ||
      !Awaited(*session_, handle_, record_, claim_)) {
    standing_ = Standing::kSilent;
    return;
  }
  session_->Beat(/*force=*/false);  // (its heartbeat exists before the consumer watches it)
  SendLocked(AttachMessage(deserialized));
  standing_ = Standing::kAnnounced;
}

void ProducerImpl::Announce(bool deserialized) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    if (standing_ == Standing::kPending) {
      AnnounceLocked(deserialized);
    } else if (standing_ == Standing::kAnnounced && deserialized && !published_) {
      // (Known to the consumer already: another deserialization of this process is counted.)
      SendLocked(AttachMessage(true));
    }
  } catch (...) {
    // (The store cannot be reached: the consumer learns of that through its own connection, and
    // this producer's set raises.)
  }
}

void ProducerImpl::Exiting() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (published_ || ForkGeneration() != generation_ || session_->broken()) return;
  try {
    // (An attach still waiting for the tick goes first, here: whichever thread would have sent
    // it, the exiting message must come after it.)
    if (standing_ == Standing::kPending) AnnounceLocked(false);
    if (standing_ != Standing::kAnnounced) return;
    SendLocked(EncodeHead(kExiting, handle_.pair, session_->id()));
  } catch (...) {
  }
}

void ProducerImpl::Serialized() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    // (Not announced yet: first, so that the consumer knows this process held it.)
    if (standing_ == Standing::kPending) AnnounceLocked(false);
    if (standing_ != Standing::kAnnounced || published_) return;  // (nobody waits for a count)
    SendLocked(EncodeHead(kSerialized, handle_.pair, session_->id()));
  } catch (...) {
    // (The store cannot be reached: the pair fails through the consumer's own connection.)
  }
}

ProducerImpl::~ProducerImpl() {
  if (ForkGeneration() != generation_) return;
  if (!published_ && !withdrawn_ && standing_ != Standing::kSilent && !session_->broken() &&
      session_->id() != handle_.consumer) {  // (the creator's own process holds no handle)
    // Dropped unset: the consumer is told, by the tick thread (a store call here could block the
    // thread that drops the promise), if the pair waits for this handle's producer (an altered
    // handle must not break the real pair: checked first when it was not announced).
    try {
      session_->AtNextTick([session = session_, handle = handle_, record = record_,
                            claim = claim_, announced = standing_ == Standing::kAnnounced] {
        try {
          if (announced || Awaited(*session, handle, record, claim)) {
            // (Never announced: its attach message first. A consumer takes a drop only from a
            // holder it knows: a forged one for a made-up process changes nothing.)
            if (!announced) {
              std::string attach;
              try {
                attach = EncodeAttach(handle.pair, session->id(),
                                      ThisHolder(false, AttachmentOf(claim)));
              } catch (...) {
                // (Who this process is cannot be read: the drop is told all the same.)
              }
              if (!attach.empty()) session->store().QueuePush(QueueKey(handle.consumer), attach);
            }
            session->SendTo(handle.consumer, handle.pair, 0,
                            EncodeHead(kDropped, handle.pair, session->id()) +
                                AttachmentOf(claim));
          }
        } catch (...) {
        }
      });
      EnsureTicking();
    } catch (...) {
    }
  }
  session_->ProducerDetached();
  std::lock_guard<std::mutex> lock(attachments_mu);
  auto& map = Attachments();
  auto it = map.find(handle_.store.ToString() + "/" + handle_.pair);
  if (it != map.end() && it->second.expired()) map.erase(it);
}

ClaimOutcome ProducerImpl::TryClaim() {
  if (claimed_) return ClaimOutcome::kClaimedByAnother;  // another handle sharing this attachment
  std::string holder;
  try {
    holder = session_->store().CompareSet(ClaimKey(handle_.pair), record_, claim_);
  } catch (const StoreError& e) {
    throw Unreachable(handle_.store, e);
  }
  if (holder == claim_) {
    return claimed_.exchange(true) ? ClaimOutcome::kClaimedByAnother : ClaimOutcome::kClaimed;
  }
  if (holder == kFailedClaim) return ClaimOutcome::kFailedByConsumer;
  if (IsClaimValue(holder)) return ClaimOutcome::kClaimedByAnother;
  if (holder == record_) return ClaimOutcome::kPairGone;  // (a missing key: no such pair in flight)
  throw Altered(handle_);
}

bool ProducerImpl::SendsOverLink() const {
  return handle_.links && NetworkPairGroups() != 0 && HasPairLinkFactory() &&
         handle_.consumer != session_->id();  // (the creator's own process: its queue)
}

bool ProducerImpl::SentOverLink(const ValueMessage& v, const void* payload, size_t bytes) {
  if (!SendsOverLink()) return false;
  std::string frame;
  const void* follows = nullptr;
  if (v.error || bytes <= kLinkInlineBytes) {
    frame = EncodeFrame(kFrameValue,
                        EncodeValue(handle_.pair, session_->id(), v,
                                    std::string_view(static_cast<const char*>(payload), bytes)));
  } else {
    ValueMessage head = v;
    head.payload_bytes = 0;
    std::string body;
    Put<uint64_t>(body, bytes);
    body += EncodeValue(handle_.pair, session_->id(), head, {});
    frame = EncodeFrame(kFramePayload, body);
    follows = payload;
  }
  const LinkSend sent =
      session_->SendOverLink(handle_.consumer, frame, follows, follows ? bytes : 0);
  if (sent == LinkSend::kNotSent) return false;
  // (Noted as sent to the consumer: should it die before it deleted the claim, this process's
  // clean-up for it does.)
  session_->Recorded(handle_.consumer, handle_.pair);
  return true;
}

void ProducerImpl::PublishValueFrom(const std::string& header, const void* payload,
                                    size_t bytes) {
  ValueMessage v;
  v.header = header;
  v.payload_bytes = bytes;
  if (SentOverLink(v, payload, bytes)) {
    published_ = true;
    return;
  }
  PublishValue(header, std::string(static_cast<const char*>(payload), bytes));
}

void ProducerImpl::PublishValue(const std::string& header, std::string payload) {
  ValueMessage v;
  v.header = header;
  v.payload_bytes = payload.size();
  if (!SentOverLink(v, payload.data(), payload.size())) {
    PublishThroughStore(std::move(v), payload);
  }
  published_ = true;
}

void ProducerImpl::PublishThroughStore(ValueMessage v, const std::string& payload) {
  v.checksum = Checksum(payload.data(), payload.size());
  try {
    if (payload.size() <= kInlineValueBytes) {
      session_->SendTo(handle_.consumer, handle_.pair, 0,
                       EncodeValue(handle_.pair, session_->id(), v, payload));
    } else {
      if (handle_.consumer != session_->id() && session_->ConsumerGoneHere(handle_.consumer)) {
        // Nobody will read it: no chunk is written, and what the consumer left goes (the claim
        // among it). (Asked for chunked values only: one round trip at most, beside megabytes.)
        std::vector<std::string> pairs = session_->SentPairs(handle_.consumer);
        pairs.push_back(handle_.pair);
        session_->DeleteWhatADeadConsumerLeft(handle_.consumer, pairs);
        published_ = true;
        return;
      }
      v.chunks = static_cast<uint32_t>((payload.size() + kChunkBytes - 1) / kChunkBytes);
      for (uint32_t i = 0; i < v.chunks; ++i) {
        const size_t start = size_t{i} * kChunkBytes;
        session_->store().Set(
            ChunkKey(handle_.pair, i),
            std::string_view(payload).substr(start, std::min(kChunkBytes, payload.size() - start)));
      }
      session_->SendTo(handle_.consumer, handle_.pair, v.chunks,
                       EncodeValue(handle_.pair, session_->id(), v, {}));
    }
  } catch (const StoreError& e) {
    const FutureError error = Unreachable(handle_.store, e);
    PublishError(ErrorInfo{error.code(), error.detail()});  // (if the store still takes it)
    try {  // (what was written of the value, if the store still answers)
      for (uint32_t i = 0; i < v.chunks; ++i) session_->store().DeleteKey(ChunkKey(handle_.pair, i));
    } catch (...) {
    }
    throw error;
  }
}

void ProducerImpl::PublishError(const ErrorInfo& error) noexcept {
  try {
    ValueMessage v;
    v.error = true;
    v.code = static_cast<uint32_t>(error.code);
    v.header = EncodeErrorText(error);
    if (SentOverLink(v, nullptr, 0)) {
      published_ = true;
      return;
    }
    session_->SendTo(handle_.consumer, handle_.pair, 0,
                     EncodeValue(handle_.pair, session_->id(), v, {}));
    published_ = true;
  } catch (...) {
    // (The store cannot be reached: the consumer learns of it through its own connection.)
  }
}

}  // namespace dtorch::core::network_internal
