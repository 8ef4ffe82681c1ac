#include "wire.h"

#include <cstring>

namespace gocomm::wire {
namespace {

// Little-endian stores (the protocol is little-endian; so are the hosts gocomm runs on).
template <typename T>
void put(uint8_t* p, T v) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the ring protocol is little-endian");
  std::memcpy(p, &v, sizeof v);
}

template <typename T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

std::string status_name(int32_t status) {
  switch (status) {
    case 1: return "invalid";
    case 2: return "unsupported";
    case 3: return "timeout";
    case 4: return "mismatch";
    case 5: return "peer lost";
    case 6: return "aborted";
    case 7: return "group broken";
    case 8: return "internal error";
    default: return "status " + std::to_string(status);
  }
}

std::vector<uint8_t> encode(const Desc& d) {
  std::vector<uint8_t> b(kDescHeader + d.bufs.size() * kBufRefSize + d.splits.size() * 8, 0);
  uint8_t* p = b.data();
  put<uint64_t>(p, d.seq);
  put<uint32_t>(p + 8, d.group);
  p[12] = d.kind;
  p[13] = d.dtype;
  p[14] = d.redop;
  p[15] = d.device;
  put<int32_t>(p + 16, d.root);
  put<int32_t>(p + 20, d.tag);
  put<uint64_t>(p + 24, d.count);
  put<uint64_t>(p + 32, d.timeout_ms);
  put<uint16_t>(p + 40, static_cast<uint16_t>(d.bufs.size()));
  put<uint32_t>(p + 44, static_cast<uint32_t>(d.splits.size()));
  put<uint32_t>(p + 48, d.stream_value);
  size_t at = kDescHeader;
  for (const BufRef& r : d.bufs) {
    put<uint32_t>(p + at, r.segment);
    put<uint64_t>(p + at + 8, r.offset);
    put<uint64_t>(p + at + 16, r.length);
    at += kBufRefSize;
  }
  for (int64_t s : d.splits) {
    put<int64_t>(p + at, s);
    at += 8;
  }
  return b;
}

bool decode_done(const uint8_t* p, size_t n, Done* out) {
  if (n < kDoneHeader) {
    return false;
  }
  out->seq = get<uint64_t>(p);
  out->status = get<int32_t>(p + 8);
  out->source = get<int32_t>(p + 12);
  out->message.assign(reinterpret_cast<const char*>(p + kDoneHeader), n - kDoneHeader);
  return true;
}

std::vector<uint8_t> encode_ipc(uint32_t segment, uint64_t size, const uint8_t handle[64]) {
  std::vector<uint8_t> b(kIpcHeader + 64, 0);
  put<uint32_t>(b.data(), segment);
  put<uint64_t>(b.data() + 8, size);
  std::memcpy(b.data() + kIpcHeader, handle, 64);
  return b;
}

std::vector<uint8_t> encode_ipc_drop(uint32_t segment) {
  std::vector<uint8_t> b(4);
  put<uint32_t>(b.data(), segment);
  return b;
}

}  // namespace gocomm::wire
