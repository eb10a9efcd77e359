// The file kind's part in the library's lifecycle and settings (core/lifecycle.h,
// core/settings.h).
#include <chrono>
#include <climits>

#include "file_kind.h"
#include "../../lifecycle.h"
#include "payload_pool.h"
#include "../../settings.h"
#include "../../shared_state.h"  // kMaxTimeoutMs

namespace dtorch::core {
namespace {

const bool payload_idle_registered = RegisterSetting(
    {"file_payload_idle_s", Setting::Unit::kSeconds, payload::kDefaultIdleMs, 0, INT64_MAX,
     "File promises: a producer writes each value into a shared-memory segment that it and the "
     "consumer keep mapped for the next value of that size; how long such a segment, unused, is "
     "kept before both processes release it.",
     &payload::IdleMs, &payload::SetIdleMs, 60});

// Its thread is the doorbell watcher (named dtorch-doorbell).
const bool file_kind_participates = RegisterParticipant({
    "doorbell", 20, [] { return static_cast<size_t>(FileWatcherThreads()); },
    [](std::chrono::steady_clock::time_point deadline) { StopFileKind(deadline); },
    &PrepareForkFileKind, &AfterForkFileKindInParent, &AfterForkFileKindInChild,
    [] {
      MarkFileProducersExited();
      ReleaseIdleFileSegments();
    },
    [] {
      const auto kept = payload::Kept();
      return Diagnostics{{"pending_pairs", static_cast<int64_t>(PendingFilePairs())},
                         {"doorbell_segment", FileDoorbellSegment()},
                         {"kept_produced", static_cast<int64_t>(kept.produced)},
                         {"kept_received", static_cast<int64_t>(kept.received)},
                         {"kept_produced_bytes", static_cast<int64_t>(kept.produced_bytes)},
                         {"kept_received_bytes", static_cast<int64_t>(kept.received_bytes)}};
    }});

}  // namespace
}  // namespace dtorch::core
