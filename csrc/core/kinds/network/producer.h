// The network kind's producer: this process's attachment to a pair (one per process and pair,
// shared by its handles).
#pragma once

#include "session.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

// ---- the producer's attachment ----

class ProducerImpl;

// Attachments of this process, shared by its handles of a pair: "<store>/<pair>" -> attachment.
extern std::mutex attachments_mu;  // (producer.cc)
inline std::map<std::string, std::weak_ptr<ProducerImpl>>& Attachments() {
  static auto* map = new std::map<std::string, std::weak_ptr<ProducerImpl>>();  // guarded
  return *map;
}

class ProducerImpl final : public NetworkProducer,
                           public std::enable_shared_from_this<ProducerImpl> {
 public:
  ProducerImpl(std::shared_ptr<Session> session, NetworkHandle handle)
      : session_(std::move(session)),
        handle_(std::move(handle)),
        record_(handle_.Serialize()),
        claim_(session_->id() + "/" + NewId().substr(0, kAttachmentHexDigits)) {}
  ~ProducerImpl() override;

  // Counts this producer for the heartbeats and announces it: now (a holder, so that a process
  // that dies at once is noticed), or on the tick thread at its next round (a first use: not on
  // the path of a value set at once).
  void Open(AttachAs as);
  // Unless this producer's value went meanwhile, checks the handle against the pair's record
  // and, if the pair waits for a producer, tells the consumer (its liveness is then watched).
  // `deserialized`: the message counts a deserialization (another one of this process too).
  // Never throws.
  void Announce(bool deserialized) noexcept;
  // A handle of the pair was serialized here: the consumer counts it in flight (now, before the
  // string leaves this process). Never throws.
  void Serialized() noexcept override;
  // This process exits: a consumer that knows of this producer is told (kExiting). Never throws.
  void Exiting() noexcept;
  // Pushes `message` to the consumer's queue, noted as sent (mu_ held). Throws StoreError.
  void SendLocked(const std::string& message);
  // Announce's work (mu_ held, standing_ pending): tells the consumer of this producer if the
  // pair waits for it, else goes silent. Throws StoreError (standing_ stays pending).
  void AnnounceLocked(bool deserialized);
  // The attach message of this attachment (throws what ThisHolder does).
  std::string AttachMessage(bool deserialized) const {
    return EncodeAttach(handle_.pair, session_->id(),
                        ThisHolder(deserialized, AttachmentOf(claim_)));
  }
  // Whether the pair is in flight and waits for the producer of `handle` (its record matches the
  // pair's, and no other producer than `claim`'s claimed it). Throws StoreError.
  static bool Awaited(Session& session, const NetworkHandle& handle, const std::string& record,
                      const std::string& claim);
  const std::string& record() const { return record_; }
  // Another thread of this process attached first: this one goes without telling the consumer.
  void Withdraw() { withdrawn_ = true; }

  ClaimOutcome TryClaim() override;
  void PublishValue(const std::string& header, std::string payload) override;
  bool SendsOverLink() const override;
  void PublishValueFrom(const std::string& header, const void* payload, size_t bytes) override;
  void PublishError(const ErrorInfo& error) noexcept override;

 private:
  // Sends the value (or error: `v.error`) over this process's link to the consumer: true when
  // it went (or the consumer fails the pair), false when the store is to carry it.
  bool SentOverLink(const ValueMessage& v, const void* payload, size_t bytes);
  // The store path's send (a value inline or in chunks). Throws FutureError(kBrokenPromise).
  void PublishThroughStore(ValueMessage v, const std::string& payload);
  enum class Standing {
    kPending,    // not announced yet (the tick thread will, unless the value goes first)
    kAnnounced,  // the pair waited for a producer: the consumer was told of this one
    kSilent,     // nothing to tell: the pair is claimed by another, failed, gone, or not the
                 // handle's (the claim says which when this producer sets)
  };

  const std::shared_ptr<Session> session_;
  const NetworkHandle handle_;
  const std::string record_;
  const std::string claim_;  // what the claim key holds once this attachment claimed the pair
  const uint64_t generation_ = ForkGeneration();
  std::mutex mu_;                           // held while announcing
  Standing standing_ = Standing::kPending;  // guarded by mu_
  std::atomic<bool> claimed_{false};       // by one of the handles sharing this attachment
  std::atomic<bool> published_{false};
  std::atomic<bool> withdrawn_{false};
};


}  // namespace dtorch::core::network_internal
