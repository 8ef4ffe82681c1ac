// The few CUDA driver calls the client makes, from libcuda.so.1 loaded at run time (dlopen):
// the library builds and loads on machines without a GPU or driver, and only the prototypes
// called here are declared (no cuda.h). Every entry is checked: a missing driver or symbol
// is an error naming it, raised where the call is made.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace gocomm::cuda {

using Stream = void*;  // CUstream (== cudaStream_t)
using DevPtr = uint64_t;  // CUdeviceptr

// A driver call that failed: what was called and the driver's words.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Queue on stream: *addr = value (32 bits).
void write_value(Stream stream, DevPtr addr, uint32_t value);
// Queue on stream: wait until (int32)(*addr - value) >= 0.
void wait_value(Stream stream, DevPtr addr, uint32_t value);
// The process-unique id of the allocation holding ptr (never reused).
uint64_t buffer_id(DevPtr ptr);
// (base, size) of the allocation holding ptr.
void allocation(DevPtr ptr, DevPtr* base, size_t* size);
// The 64-byte CUDA IPC handle of the allocation starting at base.
void ipc_handle(DevPtr base, uint8_t out[64]);
// Why the memory at ptr has no CUDA IPC handle, in words, or "" where the driver does not
// say: a stream-ordered pool's memory (cudaMallocAsync) or virtual memory mapped with cuMemMap
// (torch's expandable segments).
std::string no_ipc_reason(DevPtr ptr);
// Set every (ready, done) pair of the counters at addr to done = ready + 2^30, through a
// stream of its own that waits for nothing: streams stuck on a counter of a sidecar that is
// gone go on. Makes the primary context of device current first.
void release_counters(int device, DevPtr addr, size_t nbytes);

}  // namespace gocomm::cuda
