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
         &NetworkStoreTimeoutMs, &SetNetworkStoreTimeoutMs, 51});

// Its threads: one watcher per store (dtorch-net-watch) and the tick thread (dtorch-net-tick).
const bool network_kind_participates = RegisterParticipant({
    "network", 30, &NetworkKindThreads,
    [](std::chrono::steady_clock::time_point deadline) { StopNetworkKind(deadline); }, nullptr,
    nullptr, &AfterForkNetworkKindInChild, &MarkNetworkProducersExiting, [] {
      return Diagnostics{{"pending_pairs", static_cast<int64_t>(PendingNetworkPairs())}};
    }});

}  // namespace
}  // namespace dtorch::core
