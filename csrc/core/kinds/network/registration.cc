// The network kind's part in the library's lifecycle and settings (core/lifecycle.h,
// core/settings.h).
#include <chrono>

#include "../../lifecycle.h"
#include "network_kind.h"
#include "../../settings.h"
#include "../../shared_state.h"  // kMaxTimeoutMs

namespace dtorch::core {
namespace {

const bool network_settings_registered =
    RegisterSetting(
        {"network_heartbeat_timeout_s", Setting::Unit::kSeconds,
         kDefaultNetworkHeartbeatTimeoutMs, 1000, kMaxTimeoutMs,
         "Network promises: a process with network pairs in flight bumps its heartbeat in the "
         "store every 0.5 s; how long a producer's heartbeat may stand still before its consumers "
         "count it dead and fail the futures it was to set.",
         &NetworkHeartbeatTimeoutMs, &SetNetworkHeartbeatTimeoutMs, 50}) &&
    RegisterSetting(
        {"network_store_timeout_s", Setting::Unit::kSeconds, kDefaultNetworkStoreTimeoutMs, 100,
         kMaxTimeoutMs,
         "Network promises: the bound of every exchange with the store (connecting, each call of "
         "a producer, a consumer or the library's thread): a store that does not answer within it "
         "(frozen, cut off) fails the calls and the pairs waiting on it with BrokenPromiseError "
         "naming the store.",
         &NetworkStoreTimeoutMs, &SetNetworkStoreTimeoutMs, 51}) &&
    RegisterSetting(
        {"network_pair_groups", Setting::Unit::kCount, 1, 0, 1,
         "Network promises: 1 sends values over a point-to-point link (a 2-rank Gloo group per "
         "consumer process and producer process, made through the store on first use) where "
         "both ends run Python with torch.distributed's Gloo; 0 sends them through the store "
         "only. The consumer's setting when it creates a pair is written in the pair's handle; "
         "a producer with 0 uses the store whatever the handle says.",
         &NetworkPairGroups, &SetNetworkPairGroups, 52}) &&
    RegisterSetting(
        {"network_pair_idle_s", Setting::Unit::kSeconds, kDefaultNetworkPairIdleMs, 100,
         kMaxTimeoutMs,
         "Network promises: a producer's point-to-point link that carried nothing for this long "
         "is closed (the consumer's receiving thread for it exits); the next value makes a new "
         "one (a few milliseconds).",
         &NetworkPairIdleMs, &SetNetworkPairIdleMs, 53});

// Its threads: one watcher per store (dtorch-net-watch) and the tick thread (dtorch-net-tick).
const bool network_kind_participates = RegisterParticipant({
    "network", 30, &NetworkKindThreads,
    [](std::chrono::steady_clock::time_point deadline) { StopNetworkKind(deadline); }, nullptr,
    nullptr, &AfterForkNetworkKindInChild, &MarkNetworkProducersExiting, [] {
      return Diagnostics{{"pending_pairs", static_cast<int64_t>(PendingNetworkPairs())},
                         {"links_in", static_cast<int64_t>(NetworkLinksIn())},
                         {"links_out", static_cast<int64_t>(NetworkLinksOut())}};
    }});

}  // namespace
}  // namespace dtorch::core
