// The network kind's point-to-point links (private to the kind): how a value travels over a
// PairLink (network_kind.h) instead of the store, and the two ends' state.
//
// A producer process that sets a value of a pair whose handle says "g" (its consumer receives
// over links), while this process has a PairLinkFactory and config.network_pair_groups is 1,
// sends it over its link to that consumer process: one per (consumer process, producer process),
// made on first use. To make one, the producer pushes a link request (kLinkRequest, naming a new
// link id) onto the consumer's queue and makes its end (rank 1) on the rendezvous prefix
// "dtorch/n/p/<link id>"; the consumer's watcher starts the link's receiving thread
// ("dtorch-net-pair"), which makes the other end (rank 0) and receives what comes. The claim is
// the store's, as on the store path (a compare_set from the pair's record): both paths take
// claims from one place, so a value is set once whichever path each producer takes.
//
// On the link, frames come on kFrameTag, each at most kFrameBytes, into a fixed buffer (a
// message larger than the posted receive would end the receiving process: Gloo's rule):
//   u32 kFrameMagic | u8 type | u32 body bytes | body
//   'V' a value message (EncodeValue: an error, or a value of at most kLinkInlineBytes inline)
//   'P' u64 payload bytes | a value message without its payload: the payload follows on
//       kPayloadTag, received straight into the value's own memory once the header was checked
//       (the size its codec header implies, and at most this machine's memory)
//   'B' the producer closes the link (idle for config.network_pair_idle_s): nothing follows
// Anything else (or a value message naming another producer) closes the link: the producer's
// next value makes a new one. A value that cannot be this pair's fails its pair, as on the store.
//
// Rendezvous keys are deleted once both ends exchanged a frame (by both ends: whichever comes
// first), or once making the link failed. A producer whose send fails before its frame went
// sends the value through the store; after it went, the consumer has it or fails its pair.
#pragma once

#include "internal.h"

namespace dtorch::core::network_internal {

constexpr uint32_t kFrameMagic = 0x31746c64;  // "dlt1"
constexpr size_t kFrameHeadBytes = 9;
constexpr size_t kFrameBytes = size_t{64} << 10;
constexpr size_t kLinkInlineBytes = size_t{32} << 10;
constexpr uint32_t kFrameTag = 1;
constexpr uint32_t kPayloadTag = 2;
enum FrameType : char { kFrameValue = 'V', kFramePayload = 'P', kFrameBye = 'B' };
// Receiving threads of one consumer process at most (each is a producer process's link): a
// flood of link requests costs links, not threads without bound.
constexpr size_t kMaxLinksIn = 512;
// Making a link waits this long for the peer's end (then the store path serves that value).
constexpr milliseconds kLinkConnectTimeout{5000};
// After a link could not be made to a consumer, values to it go through the store this long.
constexpr milliseconds kLinkRetryAfter{2000};
// A sender waits this long for another's send on the same link, then uses the store.
constexpr milliseconds kLinkLockWait{1000};

// The rendezvous prefix of link `name`, and the keys Gloo leaves under it.
std::string LinkPrefix(const std::string& name);
std::vector<std::string> RendezvousKeys(const std::string& name);

// A frame: `type` and `body` (at most kFrameBytes in all; checked by the caller).
std::string EncodeFrame(FrameType type, std::string_view body);

// The producer's link to one consumer process.
struct OutLink {
  std::timed_mutex mu;  // held for a whole send (a frame and its payload): one value at a time
  std::shared_ptr<PairLink> link;  // guarded by mu: null until made, and after it failed
  std::string name;                // guarded by mu: its link id
  Clock::time_point last_used;     // guarded by mu
  Clock::time_point retry_after;   // guarded by mu: no new link to this consumer before it
  bool keys_deleted = false;       // guarded by mu
  std::atomic<bool> connected{false};  // link is set (read without mu: diagnostics)
  // The link while a send may be in it, for the exit's Abort (which cannot wait for mu).
  std::mutex live_mu;
  std::shared_ptr<PairLink> live;  // guarded by live_mu
  void SetLive(std::shared_ptr<PairLink> link) {
    std::lock_guard<std::mutex> lock(live_mu);
    live = std::move(link);
  }
  void AbortLive() noexcept {
    std::shared_ptr<PairLink> link;
    {
      std::lock_guard<std::mutex> lock(live_mu);
      link = live;
    }
    if (link) link->Abort();
  }
};

// The consumer's end of one producer process's link, served by its receiving thread.
struct InLink {
  InLink(std::string producer, std::string name)
      : producer(std::move(producer)), name(std::move(name)) {}
  const std::string producer;  // its store id
  const std::string name;      // its link id
  std::mutex mu;
  PairLink* link = nullptr;  // guarded by mu: while the thread has one (owned by the thread)
  bool aborted = false;      // guarded by mu
  // Wakes its thread (blocked in a receive), which then ends the link.
  void Abort() noexcept {
    std::lock_guard<std::mutex> lock(mu);
    aborted = true;
    if (link != nullptr) link->Abort();
  }
};

// What SendOverLink did.
enum class LinkSend {
  kSent,     // the consumer received it all
  kNotSent,  // nothing went: send it through the store
  kLost,     // the frame went but not the whole payload: the consumer fails the pair
};

// The link factory of this process (empty when it has none).
PairLinkFactory LinkFactory();

}  // namespace dtorch::core::network_internal
