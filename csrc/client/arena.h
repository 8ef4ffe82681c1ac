// Host memory shared with the sidecar, carved into op buffers. Segments come from the
// sidecar's AllocSegment rpc (the grow callback, given by the Python control plane: rare);
// descriptors name bytes by (segment, offset, length), which the sidecar bounds-checks.
// Buffers are 64-byte aligned; freed space coalesces; a request that fits nowhere adds a
// segment at least twice the size of the last.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace gocomm {

class Arena {
 public:
  struct NewSegment {
    uint32_t id = 0;
    std::string path;  // a file to map (and unlink)
    size_t bytes = 0;
  };
  // Asks the sidecar for a segment of at least the given bytes.
  using Grow = std::function<NewSegment(size_t)>;

  struct Block {
    uint32_t segment = 0;
    size_t offset = 0;
    size_t bytes = 0;  // as asked (the reservation is rounded up to the alignment)
    uint8_t* ptr = nullptr;
  };

  Arena(Grow grow, size_t first);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  Block alloc(size_t nbytes);
  void release(const Block& b);
  // The mapped address of (segment, offset); nullptr for an unknown segment.
  uint8_t* at(uint32_t segment, size_t offset);
  // (id, bytes) of every segment (tests hand-make descriptors into them).
  std::vector<std::pair<uint32_t, size_t>> segments();
  // Bytes free over every segment (tests: an op's blocks came back).
  size_t free_bytes();

  static constexpr size_t kAlign = 64;

 private:
  struct Segment {
    uint8_t* base = nullptr;
    size_t size = 0;
    std::map<size_t, size_t> free;  // offset -> length
  };
  uint32_t grow(size_t need);  // under mu_; the new segment's id

  Grow grow_;
  std::mutex mu_;
  std::map<uint32_t, Segment> segs_;
  size_t next_size_;
};

}  // namespace gocomm
