#include "fork_generation.h"

#include <atomic>

namespace dtorch::core {
namespace {
std::atomic<uint64_t> generation{0};
}  // namespace

uint64_t ForkGeneration() noexcept { return generation.load(std::memory_order_relaxed); }

void IncrementForkGenerationInChild() noexcept { generation.fetch_add(1); }

}  // namespace dtorch::core
