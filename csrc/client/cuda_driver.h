// The few CUDA driver calls the client makes, from libcuda.so.1 loaded at run time (dlopen):
// the library builds and loads on machines without a GPU or driver, and only the prototypes
// called here are declared (no cuda.h). Every entry is checked: a missing driver or symbol
// is an error naming it, raised where the call is made.
#pragma once

#include <array>
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
// Whether the memory at ptr is virtual memory mapped with cuMemMap (torch's expandable
// segments): no legacy CUDA IPC handle, no stream-ordered pool, and a mapping the driver names.
bool mapped_memory(DevPtr ptr);
// (base, size) of the one cuMemMap mapping holding ptr (a chunk of an expandable segment).
void mapping(DevPtr ptr, DevPtr* base, size_t* size);
// A POSIX file descriptor of the physical allocation mapped at base, for another process to
// import (cuMemRetainAllocationHandle, cuMemExportToShareableHandle, cuMemRelease of the
// retained handle: the fd holds the allocation on its own). The caller closes it.
int export_fd(DevPtr base);
// Why the allocation mapped at ptr cannot be exported to a POSIX fd, in words, or "" where
// the driver does not say: it was created with a fabric handle only, or with none.
std::string no_fd_reason(DevPtr ptr);

// ----- the in-process engine's calls (csrc/client/inprocess.cc) ------------------------------

using Function = void*;  // CUfunction
using Event = void*;  // CUevent

// Make device's primary context current on this thread where none is (torch creates it
// lazily, so a driver call can come before any tensor of the thread).
void ensure_context(int device);
// (major, minor) compute capability, and the SM count, of device.
void capability(int device, int* major, int* minor);
int sm_count(int device);
// Whether contexts on device are MPS clients.
bool mps_client(int device);
// The device's UUID as the driver reports it (a MIG instance's own where it is one), which
// the sidecar knows the device by.
std::array<uint8_t, 16> device_uuid(int device);
// Load a module image (a cubin's bytes) into the current context; its kernel name.
void* module_load(const std::string& image);
Function module_function(void* module, const char* name);
// Queue fn on stream: grid x block threads, smem bytes of dynamic shared memory; params
// the driver's array of pointers to each argument (copied at the call).
void launch(Function fn, unsigned grid, unsigned block, unsigned smem, Stream stream, void** params);
// How many blocks of fn (threads each, smem bytes of dynamic shared memory) one SM holds at once.
int blocks_per_sm(Function fn, int threads, size_t smem = 0);
// A zeroed device allocation of its own (outside torch's allocator, so that its IPC handle
// names it alone), in the current context; never freed.
DevPtr mem_alloc_zeroed(size_t nbytes);
// Copy nbytes from the host to the device, synchronously.
void copy_to_device(DevPtr dst, const void* src, size_t nbytes);
// bytes of zeroed pinned host memory the GPU writes to: host address, device address.
void host_words(size_t nbytes, void** host, DevPtr* dev);
// Map another process's allocation by its 64-byte CUDA IPC handle (in the current context).
DevPtr ipc_open(const uint8_t handle[64]);
// Events without timing, in the current context.
Event event_create();
void event_record(Event ev, Stream stream);
// Queue on stream: wait for ev's last record.
void stream_wait_event(Stream stream, Event ev);
// Whether the work before ev's last record finished (no wait).
bool event_done(Event ev);
// Block until the work before ev's last record finished.
void event_sync(Event ev);
void event_destroy(Event ev);

}  // namespace gocomm::cuda
