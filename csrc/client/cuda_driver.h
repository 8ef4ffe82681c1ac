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
// Queue on stream: wait until *addr == value.
void wait_value_eq(Stream stream, DevPtr addr, uint32_t value);

// Whether stream is capturing a CUDA graph (cuStreamGetCaptureInfo), and the graph being
// built (null where the capture was invalidated).
struct Capture {
  bool active = false;
  void* graph = nullptr;  // CUgraph
};
Capture capture_info(Stream stream);
// Attaches to graph a user object whose destroy(arg) runs once the graph and everything
// instantiated from it are gone (on a thread of the driver's, where no CUDA call may be made);
// the graph takes the only reference. On a failure destroy(arg) has run, or runs soon (the
// driver's release), and the error is thrown.
void retain_user_object(void* graph, void (*destroy)(void*), void* arg);
// Pins n bytes of host memory at p (page-aligned) and maps them for the current context's
// device; their device address.
DevPtr host_register(void* p, size_t n);
// Undoes host_register; false where the driver refused (it may be gone at exit).
bool host_unregister(void* p);
// Copies n u32 words to device memory at addr through a stream of its own that waits for
// nothing, and waits for the copy. Makes the primary context of device current first.
void write_words(int device, DevPtr addr, const uint32_t* words, size_t n);
// The process-unique id of the allocation holding ptr (never reused).
uint64_t buffer_id(DevPtr ptr);
// (base, size) of the allocation holding ptr.
void allocation(DevPtr ptr, DevPtr* base, size_t* size);
// The 64-byte CUDA IPC handle of the allocation starting at base.
void ipc_handle(DevPtr base, uint8_t out[64]);
// Set every (ready, done) pair of the counters at addr to done = ready + 2^30, through a
// stream of its own that waits for nothing: streams stuck on a counter of a sidecar that is
// gone go on. Makes the primary context of device current first.
void release_counters(int device, DevPtr addr, size_t nbytes);

}  // namespace gocomm::cuda
