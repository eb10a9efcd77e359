// Unguessable names and nonces (torch-free): random bytes from the kernel, and their hex form.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstddef>
#include <string>

namespace dtorch::core {

// Fills `out` with random bytes from the kernel (getrandom). Throws FutureError(kSharedMemory)
// if the kernel refuses.
void RandomBytes(void* out, size_t size);
// Lower-case hex digits of `size` bytes (two per byte).
std::string HexOf(const void* bytes, size_t size);

}  // namespace dtorch::core
