// Files the sidecar makes in shared memory for this process (the ring, arena segments, the
// stream counters): each is mapped here and then unlinked, both processes holding the memory
// from then on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gocomm {

struct SharedFile {
  uint8_t* data = nullptr;  // size bytes, MAP_SHARED, read-write
  size_t file_bytes = 0;    // the file's own size, for callers that check it
};

// Opens path, maps its first size bytes and unlinks it once mapped. Throws
// std::runtime_error "gocomm: cannot open|stat|map <what> <path>: <errno text>"; a file that
// could not be mapped is left in place.
SharedFile map_shared_file(const std::string& path, size_t size, const std::string& what);

}  // namespace gocomm
