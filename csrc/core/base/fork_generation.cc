#include "fork_generation.h"

#include <atomic>

namespace dtorch::core {
namespace {
std::atomic<uint64_t> generation{0};
std::atomic<bool> in_child_handler{false};
}  // namespace

uint64_t ForkGeneration() noexcept { return generation.load(std::memory_order_relaxed); }

bool InForkChildHandler() noexcept { return in_child_handler.load(std::memory_order_relaxed); }

void BeginForkChildHandler() noexcept {
  generation.fetch_add(1);
  in_child_handler = true;
}

void EndForkChildHandler() noexcept { in_child_handler = false; }

}  // namespace dtorch::core
