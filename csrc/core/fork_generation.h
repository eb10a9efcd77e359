// The fork generation of this process (torch-free): 0 in the process that loaded the library,
// incremented in each child created by fork() (by the library's pthread_atfork child handler).
// State that threads of a parent may have left behind (waiters counted on a condition variable)
// compares generations to know it is in a child.
//
// Thread-safety: may be called from any thread.
#pragma once

#include <cstdint>

namespace dtorch::core {

uint64_t ForkGeneration() noexcept;

// Called once in a fork child, before anything else of the library runs there.
void IncrementForkGenerationInChild() noexcept;

}  // namespace dtorch::core
