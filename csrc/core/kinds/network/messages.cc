// The messages on a consumer's queue: this process's identity as an attach message announces it,
// and the wire format (encode, and the bounded decode of untrusted bytes).
#include "internal.h"

namespace dtorch::core::network_internal {

using std::chrono::milliseconds;

bool IsHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool IsHostText(std::string_view s) {
  return s.size() <= kMaxHostBytes && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '-' || c == '_';
         });
}

const std::string& BootId() {
  // (Leaked: read by the exit's store thread, which may outlive static destruction.)
  static const std::string& id = *new std::string([] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string text, hex;
    std::getline(in, text);
    for (char c : text) {
      if (c != '-') hex += static_cast<char>(c >= 'A' && c <= 'F' ? c - 'A' + 'a' : c);
    }
    return hex.size() == 32 && IsHex(hex) ? hex : std::string();
  }());
  return id;
}

const std::string& HostName() {
  static const std::string& name = *new std::string([] {  // (leaked: as BootId)
    char buffer[256] = {};
    if (gethostname(buffer, sizeof(buffer) - 1) != 0) return std::string();
    std::string host(buffer, strnlen(buffer, kMaxHostBytes));
    return IsHostText(host) ? host : std::string();
  }());
  return name;
}

uint64_t ThisPidNamespace() {
  try {
    return Self().pid_namespace;
  } catch (...) {
    return 0;
  }
}

HolderInfo ThisHolder(bool deserialized, const std::string& attachment) {
  HolderInfo info;
  info.deserialized = deserialized;
  info.attachment = attachment;
  const ProcessId self = Self();
  info.pid = self.pid;
  info.start_time = self.start_time;
  info.pid_namespace = self.pid_namespace;
  info.boot_id = BootId();
  // (Tests make a holder look as if it ran on another host: 32 hex digits.)
  if (const char* fake = std::getenv("DTORCH_BOOT_ID_FOR_TESTING")) {
    if (std::strlen(fake) == 32 && IsHex(fake)) info.boot_id = fake;
  }
  info.host = HostName();
  return info;
}

std::string EncodeIdentity() {
  try {
    const HolderInfo self = ThisHolder(false, "");
    if (self.boot_id.empty()) return {};
    return std::to_string(geteuid()) + ":" + std::to_string(self.pid) + ":" +
           std::to_string(self.start_time) + ":" + std::to_string(self.pid_namespace) + ":" +
           self.boot_id;
  } catch (...) {
    return {};
  }
}

std::optional<ProcessId> LocalProcessOf(std::string_view text) {
  uint64_t fields[4] = {};
  size_t pos = 0;
  for (uint64_t& field : fields) {
    const size_t colon = text.find(':', pos);
    if (colon == std::string_view::npos || colon == pos || colon - pos > 20) return std::nullopt;
    const auto parsed = std::from_chars(text.data() + pos, text.data() + colon, field);
    if (parsed.ec != std::errc() || parsed.ptr != text.data() + colon) return std::nullopt;
    pos = colon + 1;
  }
  const std::string_view boot_id = text.substr(pos);
  if (fields[0] != geteuid() || fields[1] == 0 || fields[1] > INT32_MAX || boot_id.size() != 32 ||
      !IsHex(boot_id) || boot_id != BootId() || fields[3] == 0 ||
      fields[3] != ThisPidNamespace()) {
    return std::nullopt;
  }
  return ProcessId{static_cast<int32_t>(fields[1]), fields[2], fields[3]};
}


std::string EncodeHead(MessageType type, const std::string& pair, const std::string& producer) {
  std::string out(1, static_cast<char>(type));
  out += pair;
  out += producer;
  return out;
}


std::string EncodeAttach(const std::string& pair, const std::string& producer,
                         const HolderInfo& h) {
  std::string out = EncodeHead(kAttach, pair, producer);
  Put<uint8_t>(out, h.deserialized ? 1 : 0);
  Put<int32_t>(out, h.pid);
  Put<uint64_t>(out, h.start_time);
  Put<uint64_t>(out, h.pid_namespace);
  Put<uint8_t>(out, static_cast<uint8_t>(h.boot_id.size()));
  out += h.boot_id;
  Put<uint8_t>(out, static_cast<uint8_t>(h.host.size()));
  out += h.host;
  out += h.attachment;
  return out;
}

std::string EncodeErrorText(const ErrorInfo& error) {
  std::string type = ValidExceptionType(error.origin.exception_type)
                         ? error.origin.exception_type : std::string();
  const std::string detail = error.detail.substr(0, kMaxErrorDetailBytes / 2);
  const size_t room = kMaxErrorDetailBytes - 3 - type.size() - detail.size();
  const std::string& traceback = error.origin.traceback;
  std::string out;
  Put<uint8_t>(out, static_cast<uint8_t>(type.size()));
  out += type;
  Put<uint16_t>(out, static_cast<uint16_t>(detail.size()));
  out += detail;
  out += traceback.size() <= room ? traceback : traceback.substr(traceback.size() - room);
  return out;
}

std::optional<ErrorInfo> DecodeErrorText(uint32_t code, std::string_view text) {
  if (text.size() < 3) return std::nullopt;
  const size_t type_bytes = static_cast<unsigned char>(text[0]);
  if (text.size() < 3 + type_bytes) return std::nullopt;
  ErrorInfo error{static_cast<FutureErrc>(code), ""};
  error.origin.exception_type = std::string(text.substr(1, type_bytes));
  if (!ValidExceptionType(error.origin.exception_type)) return std::nullopt;
  uint16_t detail_bytes = 0;
  std::memcpy(&detail_bytes, text.data() + 1 + type_bytes, 2);
  const size_t start = 3 + type_bytes;
  if (text.size() - start < detail_bytes) return std::nullopt;
  error.detail = std::string(text.substr(start, detail_bytes));
  error.origin.traceback = std::string(text.substr(start + detail_bytes));
  return error;
}

std::string EncodeValue(const std::string& pair, const std::string& producer,
                        const ValueMessage& v, std::string_view inline_payload) {
  std::string out = EncodeHead(kValue, pair, producer);
  out.reserve(out.size() + 33 + v.header.size() + inline_payload.size());
  Put<uint8_t>(out, v.error ? 1 : 0);
  Put<uint32_t>(out, v.code);
  Put<uint64_t>(out, v.payload_bytes);
  Put<uint32_t>(out, v.chunks);
  Put<uint64_t>(out, v.checksum);
  Put<uint32_t>(out, static_cast<uint32_t>(v.header.size()));
  out += v.header;
  out.append(inline_payload.data(), inline_payload.size());
  return out;
}

std::optional<Message> Decode(const std::string& bytes) {
  Message m;
  if (bytes.empty()) return std::nullopt;
  m.type = static_cast<MessageType>(bytes[0]);
  if (m.type == kWake) return bytes.size() == 1 ? std::optional<Message>(m) : std::nullopt;
  if (m.type != kAttach && m.type != kDropped && m.type != kValue && m.type != kRecheck &&
      m.type != kSerialized && m.type != kExiting && m.type != kLinkRequest) {
    return std::nullopt;
  }
  if (bytes.size() < 1 + 2 * kIdHexDigits) return std::nullopt;
  m.pair = bytes.substr(1, kIdHexDigits);
  m.producer = bytes.substr(1 + kIdHexDigits, kIdHexDigits);
  if (!IsId(m.pair) || !IsId(m.producer)) return std::nullopt;
  size_t pos = 1 + 2 * kIdHexDigits;
  const auto get = [&](void* out, size_t n) {
    if (bytes.size() - pos < n) return false;
    std::memcpy(out, bytes.data() + pos, n);
    pos += n;
    return true;
  };
  if (m.type == kAttach) {
    HolderInfo& h = m.holder;
    uint8_t flags = 0, boot_bytes = 0, host_bytes = 0;
    if (!get(&flags, 1) || flags > 1 || !get(&h.pid, 4) || !get(&h.start_time, 8) ||
        !get(&h.pid_namespace, 8) || !get(&boot_bytes, 1) ||
        (boot_bytes != 0 && boot_bytes != 32) || bytes.size() - pos < boot_bytes) {
      return std::nullopt;
    }
    h.deserialized = flags == 1;
    h.boot_id = bytes.substr(pos, boot_bytes);
    pos += boot_bytes;
    if (!get(&host_bytes, 1) || host_bytes > kMaxHostBytes ||
        bytes.size() - pos != host_bytes + kAttachmentHexDigits) {
      return std::nullopt;
    }
    h.host = bytes.substr(pos, host_bytes);
    h.attachment = bytes.substr(pos + host_bytes);
    if (h.pid <= 0 || !IsHex(h.boot_id) || !IsHostText(h.host) || !IsHex(h.attachment)) {
      return std::nullopt;
    }
    return m;
  }
  if (m.type == kDropped) {
    if (bytes.size() - pos != kAttachmentHexDigits) return std::nullopt;
    m.attachment = bytes.substr(pos);
    return IsHex(m.attachment) ? std::optional<Message>(m) : std::nullopt;
  }
  if (m.type != kValue) return pos == bytes.size() ? std::optional<Message>(m) : std::nullopt;
  uint8_t status = 0;
  uint32_t header_bytes = 0;
  ValueMessage& v = m.value;
  if (!get(&status, 1) || !get(&v.code, 4) || !get(&v.payload_bytes, 8) || !get(&v.chunks, 4) ||
      !get(&v.checksum, 8) || !get(&header_bytes, 4)) {
    return std::nullopt;
  }
  if (status > 1) return std::nullopt;
  v.error = status == 1;
  const size_t header_limit = v.error ? kMaxErrorDetailBytes : kMaxValueHeaderBytes;
  if (header_bytes > header_limit || bytes.size() - pos < header_bytes) return std::nullopt;
  v.header = bytes.substr(pos, header_bytes);
  pos += header_bytes;
  if (v.error) {
    if (v.code > static_cast<uint32_t>(kLastFutureErrc) || v.payload_bytes != 0 || v.chunks != 0 ||
        pos != bytes.size()) {
      return std::nullopt;
    }
    return m;
  }
  if (v.chunks == 0) {
    if (v.payload_bytes != bytes.size() - pos || v.payload_bytes > kInlineValueBytes) {
      return std::nullopt;
    }
    v.inline_payload = std::string_view(bytes).substr(pos);
  } else {
    // Exactly as many chunks as the size needs (each full but the last).
    if (pos != bytes.size() || v.payload_bytes <= kInlineValueBytes ||
        v.chunks != (v.payload_bytes + kChunkBytes - 1) / kChunkBytes) {
      return std::nullopt;
    }
  }
  return m;
}

}  // namespace dtorch::core::network_internal
