#include "ipc_cache.h"

#include <stdexcept>

namespace gocomm {

wire::BufRef IpcCache::ref(cuda::DevPtr ptr, uint64_t n, size_t claim) {
  if (n == 0) {
    return wire::BufRef{wire::kCudaSegment, 0, 0};
  }
  const uint64_t bid = cuda::buffer_id(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(bid);
  if (it == entries_.end()) {
    cuda::DevPtr base = 0;
    size_t size = 0;
    cuda::allocation(ptr, &base, &size);
    for (auto e = entries_.begin(); e != entries_.end();) {
      if (e->second.base < base + size && base < e->second.base + e->second.size) {
        put_(wire::kRecIpcDrop, wire::encode_ipc_drop(e->second.segment));
        e = entries_.erase(e);
      } else {
        ++e;
      }
    }
    uint8_t handle[64];
    try {
      cuda::ipc_handle(base, handle);
    } catch (const cuda::Error& err) {
      throw std::runtime_error(std::string("gocomm: this tensor's memory cannot be shared with the sidecar (") +
                               err.what() +
                               "); allocations from PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True have no CUDA IPC "
                               "handle: unset it");
    }
    const uint32_t seg = wire::kCudaSegment | next_++;
    put_(wire::kRecIpc, wire::encode_ipc(seg, claim ? claim : size, handle));
    it = entries_.emplace(bid, Entry{seg, base, size}).first;
  }
  return wire::BufRef{it->second.segment, ptr - it->second.base, n};
}

}  // namespace gocomm
