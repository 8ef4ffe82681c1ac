// CUDA allocations of this process registered with the sidecar, so that a descriptor names a
// tensor's bytes as (segment, offset, length): by CUDA IPC handle (kRecIpc records), keyed by
// the driver's buffer id; or, for memory mapped with cuMemMap (torch's expandable segments),
// as the run of chunks the tensor spans, each chunk's POSIX fd passed over the sidecar's fd
// socket (FdChannel; docs/decisions/0029-expandable-segments.md), keyed by address range.
// The sidecar's mapping keeps the memory alive, so a registration is dropped (kRecIpcDrop,
// both kinds) as soon as torch gives the memory back:
//
//  1. torch's caching allocator reports every segment it frees (SEGMENT_FREE: empty_cache,
//     a release under memory pressure, a CUDA graph's pool) and unmaps (SEGMENT_UNMAP) to a
//     trace tracker attached at the first registration; the registrations that range overlaps
//     are forgotten at once and their drops queued. The tracker runs with the allocator's lock
//     held (and maybe the GIL): it only takes this cache's map lock, which no one holds while
//     calling into the allocator, the ring or Python, and never waits for the ring.
//  2. A sender thread writes the queued drops into the ring; it may wait for room.
//  3. Registrations and drops are written under one lock (reg_mu_), so a drop never precedes
//     its registration in the ring. A drop follows every op that names the segment: an op's
//     tensors stay referenced until the sidecar reported it done, so torch cannot free their
//     segment before that op is in the ring; the sidecar resolves an op's segments when it
//     reads the op, and unmaps a dropped segment only once no op holds it.
//  4. Memory torch's allocator does not report (another allocator, a tracker torch refuses)
//     is dropped lazily: an allocation that shows up with a new buffer id over addresses a
//     registration covers replaces it. Chunks are registered only where the allocator reports
//     what it unmaps (nothing tells a chunk unmapped and another mapped at its addresses).
//  5. Chunks are registered synchronously: the fd socket's answer (the sidecar mapped them)
//     comes before ref returns, so before any op naming the segment is in the ring; their
//     drops go through the ring, written under reg_mu_ like every drop (invariant 3). A run
//     of chunks stays registered while none of it is unmapped; a tensor inside a registered
//     run reuses it, one that reaches past it registers the run it spans.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda_driver.h"
#include "wire.h"

namespace gocomm {

class IpcCache {
 public:
  // put writes a control record into the submission ring (waiting for room; throws once the
  // session is lost or closed).
  using Put = std::function<void(uint16_t type, const std::vector<uint8_t>& payload)>;
  // send_fds has the sidecar map chunks (fds[i] of sizes[i] bytes, back to back) as segment
  // seg and returns once it did (throws with its words otherwise); it closes every fd
  // (FdChannel::send).
  using SendFds =
      std::function<void(uint32_t seg, const std::vector<int>& fds, const std::vector<uint64_t>& sizes)>;
  // The driver's answers about an allocation (cuda_driver.h; tests fake them).
  struct Driver {
    std::function<uint64_t(cuda::DevPtr)> buffer_id;
    std::function<void(cuda::DevPtr, cuda::DevPtr*, size_t*)> allocation;
    std::function<void(cuda::DevPtr, uint8_t*)> ipc_handle;  // throws cuda::Error
    std::function<std::string(cuda::DevPtr)> no_ipc_reason;
    // memory mapped with cuMemMap: whether ptr is, the mapping (chunk) holding it, an fd of
    // the chunk at base (throws cuda::Error), and why there is none
    std::function<bool(cuda::DevPtr)> mapped;
    std::function<void(cuda::DevPtr, cuda::DevPtr*, size_t*)> mapping;
    std::function<int(cuda::DevPtr)> export_fd;
    std::function<std::string(cuda::DevPtr)> no_fd_reason;
    // Attaches the allocator hook (invariant 1); false where torch's allocator refuses it.
    std::function<bool()> hook;
    static Driver real();
  };

  // The most chunks one registration spans (pg/fdchan.go: 80 GiB of 20 MiB chunks).
  static constexpr size_t kMaxChunks = 4096;

  IpcCache(Put put, Driver driver = Driver::real());
  // Where chunks go (invariant 5); until set, memory mapped with cuMemMap is refused.
  void set_send_fds(SendFds send);
  ~IpcCache();
  IpcCache(const IpcCache&) = delete;
  IpcCache& operator=(const IpcCache&) = delete;

  // (segment, offset, length) naming n bytes at ptr, registering its allocation on first
  // use. The allocation's device must be current (its context), and attached to the sidecar.
  // A non-zero claim is sent as the size of an allocation registered now instead of the
  // driver's (tests of the sidecar's own check of that size).
  wire::BufRef ref(cuda::DevPtr ptr, uint64_t n, size_t claim = 0);
  // Every live cache forgets the registrations [addr, addr + size) overlaps and queues their
  // drops: the allocator hook (invariant 1). Never blocks on the ring.
  static void released(cuda::DevPtr addr, size_t size);
  // Waits (at most timeout_s) until every queued drop is in the ring; false on timeout.
  bool flush(double timeout_s);
  // Stops the sender (queued drops are not sent: the session is ending) and leaves the hook.
  void close();
  // Registrations held (both kinds).
  size_t size();
  // Whether torch's allocator reports the memory it releases to this cache (known once
  // something was registered).
  bool hooked() const { return hooked_; }

 private:
  struct Entry {
    uint32_t segment;
    cuda::DevPtr base;
    size_t size;
    bool ready;  // its kRecIpc is in the ring
  };
  void forget(cuda::DevPtr addr, size_t size);
  // Registers the chunks [ptr, ptr + n) spans (invariant 5); reg_mu_ held.
  wire::BufRef register_chunks(cuda::DevPtr ptr, uint64_t n);
  // A ready run of chunks holding [ptr, ptr + n); mu_ held.
  bool known_run(cuda::DevPtr ptr, uint64_t n, wire::BufRef* out);
  void send_loop();

  Put put_;
  Driver drv_;
  std::mutex reg_mu_;  // registrations and drops, in ring order (invariant 3)
  uint32_t next_ = 1;  // under reg_mu_
  std::mutex mu_;  // the map and the drop queue; held only briefly (invariant 1)
  std::condition_variable cv_;
  std::unordered_map<uint64_t, Entry> entries_;  // buffer id -> registration
  std::vector<Entry> runs_;  // runs of chunks (invariant 5)
  SendFds send_fds_;  // under reg_mu_
  std::vector<uint32_t> drops_;  // queued for the sender
  uint64_t queued_ = 0, sent_ = 0;  // drops queued and written (or given up) so far
  bool stop_ = false;
  std::atomic<bool> hooked_{false};
  std::thread sender_;
  int owner_;  // the process that made it: a child forked from it closes nothing (close())
};

}  // namespace gocomm
