// CUDA allocations of this process registered with the sidecar by CUDA IPC handle (kRecIpc
// records), keyed by the driver's buffer id, so that a descriptor names a tensor's bytes as
// (segment, offset, length). An allocation torch freed and the driver reused shows up with a
// new buffer id over the same addresses: the entries it overlaps are dropped then (kRecIpcDrop).
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda_driver.h"
#include "wire.h"

namespace gocomm {

class IpcCache {
 public:
  // put writes a control record into the submission ring (waiting for room).
  using Put = std::function<void(uint16_t type, const std::vector<uint8_t>& payload)>;
  explicit IpcCache(Put put) : put_(std::move(put)) {}

  // (segment, offset, length) naming n bytes at ptr, registering its allocation on first
  // use. The allocation's device must be current (its context), and attached to the sidecar.
  // A non-zero claim is sent as the size of an allocation registered now instead of the
  // driver's (tests of the sidecar's own check of that size).
  wire::BufRef ref(cuda::DevPtr ptr, uint64_t n, size_t claim = 0);

 private:
  struct Entry {
    uint32_t segment;
    cuda::DevPtr base;
    size_t size;
  };
  Put put_;
  std::mutex mu_;
  std::unordered_map<uint64_t, Entry> entries_;  // buffer id -> registration
  uint32_t next_ = 1;
};

}  // namespace gocomm
