// The network kind and its store: ids and key names, deleting a pair's keys in batches,
// heartbeats, connecting, the payload checksum.
#include "internal.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

size_t PopBatchSize(int64_t backlog, size_t largest_item) {
  if (largest_item > kLargeItemBytes) return 1;
  return static_cast<size_t>(std::max<int64_t>(1, std::min<int64_t>(backlog, kPopBatch)));
}

size_t LargestItem(const std::vector<std::string>& items) {
  size_t largest = 0;
  for (const auto& item : items) largest = std::max(largest, item.size());
  return largest;
}

std::atomic<StoreConnector> store_connector{nullptr};
std::atomic<int64_t> heartbeat_timeout_ms{kDefaultNetworkHeartbeatTimeoutMs};
std::atomic<int64_t> store_timeout_ms{kDefaultNetworkStoreTimeoutMs};
std::atomic<size_t> kind_threads{0};

// Forks of this process (counted in the parent): a pair created before one may have reached the
// child without being serialized, so it has left the process.
std::atomic<uint64_t> forks_in_parent{0};
const bool fork_counter_installed = [] {
  pthread_atfork(nullptr, [] { ++forks_in_parent; }, nullptr);
  return true;
}();

std::string NewId() {
  unsigned char bytes[kIdHexDigits / 2];
  RandomBytes(bytes, sizeof(bytes));
  return HexOf(bytes, sizeof(bytes));
}

bool IsId(std::string_view s) {
  return s.size() == kIdHexDigits && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

std::string AttachmentOf(const std::string& claim) { return claim.substr(kIdHexDigits + 1); }

bool IsClaimValue(std::string_view s) {
  return s.size() == kIdHexDigits + 1 + kAttachmentHexDigits && s[kIdHexDigits] == '/' &&
         IsId(s.substr(0, kIdHexDigits)) &&
         std::all_of(s.begin() + kIdHexDigits + 1, s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string QueueKey(const std::string& process) { return kKeyPrefix + std::string("q/") + process; }
std::string HeartbeatKey(const std::string& process) {
  return kKeyPrefix + std::string("hb/") + process;
}
std::string IdentityKey(const std::string& process) {
  return kKeyPrefix + std::string("id/") + process;
}
std::string ClaimKey(const std::string& pair) { return kKeyPrefix + std::string("c/") + pair; }
std::string ChunkKey(const std::string& pair, uint32_t i) {
  return kKeyPrefix + std::string("v/") + pair + "/" + std::to_string(i);
}

void DeleteKeysOf(KeyValueStore& store, std::vector<PairKeys>& doomed) {
  struct Next {
    size_t index;      // in doomed
    uint32_t chunk;    // the next chunk to try
  };
  std::vector<Next> open;  // pairs whose chunks may go on
  while (!doomed.empty()) {
    // One batch: claims and first chunks of the pairs at the back, then more chunks of those
    // that had theirs.
    std::vector<std::string> keys;
    std::vector<std::pair<size_t, uint32_t>> chunk_of;  // key -> (doomed index, chunk), or npos
    const size_t first = doomed.size() - std::min(doomed.size(), kBatch / 2);
    for (size_t i = first; i < doomed.size(); ++i) {
      PairKeys& p = doomed[i];
      if (p.claim) {
        keys.push_back(ClaimKey(p.pair));
        chunk_of.emplace_back(std::string::npos, 0);
      }
      if (p.chunks > 0) {
        keys.push_back(ChunkKey(p.pair, 0));
        chunk_of.emplace_back(i, 0);
      }
    }
    const std::vector<bool> existed = store.DeleteKeys(keys);
    for (size_t k = 0; k < keys.size(); ++k) {
      const size_t i = chunk_of[k].first;
      if (i != std::string::npos && existed[k] && doomed[i].chunks > 1) open.push_back({i, 1});
    }
    // The chunks after the first, of the pairs that had one.
    while (!open.empty()) {
      keys.clear();
      std::vector<size_t> owner;  // open index per key
      for (size_t o = 0; o < open.size() && keys.size() < kBatch; ++o) {
        const PairKeys& p = doomed[open[o].index];
        for (uint32_t c = open[o].chunk; c < p.chunks && keys.size() < kBatch; ++c) {
          keys.push_back(ChunkKey(p.pair, c));
          owner.push_back(o);
        }
      }
      const std::vector<bool> gone = store.DeleteKeys(keys);
      std::vector<bool> done(open.size(), false);
      std::vector<uint32_t> tried(open.size(), 0);
      for (size_t k = 0; k < keys.size(); ++k) {
        ++tried[owner[k]];
        if (!gone[k]) done[owner[k]] = true;  // (the first missing: its last)
      }
      std::vector<Next> still;
      for (size_t o = 0; o < open.size(); ++o) {
        const uint32_t next = open[o].chunk + tried[o];
        if (!done[o] && next < doomed[open[o].index].chunks) still.push_back({open[o].index, next});
      }
      open.swap(still);
    }
    doomed.resize(first);
  }
}

void DrainQueue(KeyValueStore& store, const std::string& queue,
                const std::function<void(const std::string&)>& each) {
  int64_t left = store.QueueLength(queue);
  size_t largest = 0;
  for (int64_t budget = left; left > 0 && budget > 0;) {
    const auto items =
        store.QueuePopSome(queue, PopBatchSize(std::min(budget, left), largest), false, &left);
    if (items.empty()) return;
    largest = LargestItem(items);
    budget -= static_cast<int64_t>(items.size());
    for (const auto& bytes : items) each(bytes);
  }
}


int64_t HeartbeatOf(const std::string& text) {
  int64_t beat = 0;
  const auto parsed = std::from_chars(text.data(), text.data() + text.size(), beat);
  return parsed.ec == std::errc() && parsed.ptr == text.data() + text.size() && beat > 0 ? beat
                                                                                          : 0;
}

int64_t ReadHeartbeat(KeyValueStore& store, const std::string& process) {
  return HeartbeatOf(store.CompareSet(HeartbeatKey(process), kMissing, kMissing));
}

std::vector<int64_t> ReadHeartbeats(KeyValueStore& store, const std::vector<std::string>& processes) {
  std::vector<int64_t> beats;
  beats.reserve(processes.size());
  for (size_t at = 0; at < processes.size(); at += kBatch) {
    std::vector<std::string> keys;
    for (size_t i = at; i < std::min(processes.size(), at + kBatch); ++i) {
      keys.push_back(HeartbeatKey(processes[i]));
    }
    for (const auto& text : store.CompareSets(keys, kMissing, kMissing)) {
      beats.push_back(HeartbeatOf(text));
    }
  }
  return beats;
}

std::unique_ptr<KeyValueStore> Connect(const StoreAddress& address, milliseconds timeout) {
  const StoreConnector connector = store_connector.load();
  if (connector == nullptr) {
    throw StoreError(StoreError::Kind::kOther, "this build of dtorch_ops has no store client");
  }
  return connector(address.host, address.port, timeout);
}

FutureError Unreachable(const StoreAddress& address, const std::exception& e) {
  return FutureError(FutureErrc::kBrokenPromise,
                     "the store at " + address.ToString() + " cannot be reached (" + e.what() +
                         "): is its server (the TCPStore created with is_master=True) running, "
                         "and reachable from this host?");
}

uint64_t Checksum(const char* data, size_t n) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                   0x082EFA98EC4E6C89ull};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int lane = 0; lane < 4; ++lane) {
      uint64_t word;
      std::memcpy(&word, data + i + 8 * lane, 8);
      h[lane] = (h[lane] ^ word) * kMul;
      h[lane] ^= h[lane] >> 29;
    }
  }
  for (; i < n; ++i) {
    h[0] = (h[0] ^ static_cast<unsigned char>(data[i])) * kMul;
    h[0] ^= h[0] >> 29;
  }
  uint64_t r = n;
  for (uint64_t lane : h) {
    r = (r ^ lane) * kMul;
    r ^= r >> 32;
  }
  return r;
}

}  // namespace dtorch::core::network_internal
