#include "random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "../future_error.h"

namespace dtorch::core {

void RandomBytes(void* out, size_t size) {
  auto* bytes = static_cast<unsigned char*>(out);
  while (size > 0) {
    const ssize_t got = getrandom(bytes, size, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw FutureError(FutureErrc::kSharedMemory,
                        std::string("getrandom failed: ") + std::strerror(errno));
    }
    bytes += got;
    size -= static_cast<size_t>(got);
  }
}

std::string HexOf(const void* bytes, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(size * 2);
  for (size_t i = 0; i < size; ++i) {
    const auto byte = static_cast<const unsigned char*>(bytes)[i];
    hex += kDigits[byte >> 4];
    hex += kDigits[byte & 0xf];
  }
  return hex;
}

}  // namespace dtorch::core
