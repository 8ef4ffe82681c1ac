#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>
#include <vector>

namespace gocomm::cuda {
namespace {

using Result = int;  // CUresult
constexpr Result kSuccess = 0;
constexpr int kAttrBufferId = 7;  // CU_POINTER_ATTRIBUTE_BUFFER_ID
constexpr int kAttrLegacyIpc = 10;  // CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
constexpr int kAttrMempool = 17;  // CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE
constexpr unsigned kWaitGeq = 0;  // CU_STREAM_WAIT_VALUE_GEQ
constexpr unsigned kStreamNonBlocking = 1;

struct Api {
  void* lib = nullptr;
  std::string error;  // why the driver could not be loaded
  Result (*getErrorString)(Result, const char**) = nullptr;
  Result (*streamWriteValue32)(Stream, DevPtr, uint32_t, unsigned) = nullptr;
  Result (*streamWaitValue32)(Stream, DevPtr, uint32_t, unsigned) = nullptr;
  Result (*pointerGetAttribute)(void*, int, DevPtr) = nullptr;
  Result (*memGetAddressRange)(DevPtr*, size_t*, DevPtr) = nullptr;
  Result (*ipcGetMemHandle)(void*, DevPtr) = nullptr;
  Result (*deviceGet)(int*, int) = nullptr;
  Result (*primaryCtxRetain)(void**, int) = nullptr;
  Result (*ctxPushCurrent)(void*) = nullptr;
  Result (*ctxPopCurrent)(void**) = nullptr;
  Result (*streamCreate)(Stream*, unsigned) = nullptr;
  Result (*streamDestroy)(Stream) = nullptr;
  Result (*streamSynchronize)(Stream) = nullptr;
  Result (*memcpyDtoHAsync)(void*, DevPtr, size_t, Stream) = nullptr;
  Result (*memcpyHtoDAsync)(DevPtr, const void*, size_t, Stream) = nullptr;
};

template <typename F>
void sym(Api& a, F*& f, const char* name) {
  f = reinterpret_cast<F*>(dlsym(a.lib, name));
  if (f == nullptr && a.error.empty()) {
    a.error = std::string("libcuda.so.1 has no ") + name;
  }
}

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    a.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (a.lib == nullptr) {
      const char* e = dlerror();
      a.error = std::string("cannot load the CUDA driver (libcuda.so.1): ") + (e ? e : "unknown error");
      return;
    }
    sym(a, a.getErrorString, "cuGetErrorString");
    sym(a, a.streamWriteValue32, "cuStreamWriteValue32_v2");
    sym(a, a.streamWaitValue32, "cuStreamWaitValue32_v2");
    sym(a, a.pointerGetAttribute, "cuPointerGetAttribute");
    sym(a, a.memGetAddressRange, "cuMemGetAddressRange_v2");
    sym(a, a.ipcGetMemHandle, "cuIpcGetMemHandle");
    sym(a, a.deviceGet, "cuDeviceGet");
    sym(a, a.primaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(a, a.ctxPushCurrent, "cuCtxPushCurrent_v2");
    sym(a, a.ctxPopCurrent, "cuCtxPopCurrent_v2");
    sym(a, a.streamCreate, "cuStreamCreate");
    sym(a, a.streamDestroy, "cuStreamDestroy_v2");
    sym(a, a.streamSynchronize, "cuStreamSynchronize");
    sym(a, a.memcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    sym(a, a.memcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  });
  if (!a.error.empty()) {
    throw Error("gocomm: " + a.error);
  }
  return a;
}

void check(const char* what, Result r) {
  if (r == kSuccess) {
    return;
  }
  const char* s = nullptr;
  api().getErrorString(r, &s);
  throw Error(std::string(what) + ": " + (s ? s : std::to_string(r)));
}

}  // namespace

void write_value(Stream stream, DevPtr addr, uint32_t value) {
  check("cuStreamWriteValue32", api().streamWriteValue32(stream, addr, value, 0));
}

void wait_value(Stream stream, DevPtr addr, uint32_t value) {
  check("cuStreamWaitValue32", api().streamWaitValue32(stream, addr, value, kWaitGeq));
}

uint64_t buffer_id(DevPtr ptr) {
  uint64_t id = 0;
  check("cuPointerGetAttribute", api().pointerGetAttribute(&id, kAttrBufferId, ptr));
  return id;
}

void allocation(DevPtr ptr, DevPtr* base, size_t* size) {
  check("cuMemGetAddressRange", api().memGetAddressRange(base, size, ptr));
}

void ipc_handle(DevPtr base, uint8_t out[64]) {
  check("cuIpcGetMemHandle", api().ipcGetMemHandle(out, base));
}

std::string no_ipc_reason(DevPtr ptr) {
  const Api& a = api();
  uint64_t pool = 0, legacy = 0;  // wide enough for the attribute's type, zero where unwritten
  if (a.pointerGetAttribute(&pool, kAttrMempool, ptr) == kSuccess && pool != 0) {
    return "it comes from a stream-ordered memory pool (cudaMallocAsync; "
           "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)";
  }
  if (a.pointerGetAttribute(&legacy, kAttrLegacyIpc, ptr) == kSuccess && legacy == 0) {
    return "it is virtual memory mapped with cuMemMap (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or "
           "another allocator built on cuMemCreate)";
  }
  return "";
}

void release_counters(int device, DevPtr addr, size_t nbytes) {
  const Api& a = api();
  int dev = 0;
  void* ctx = nullptr;
  check("cuDeviceGet", a.deviceGet(&dev, device));
  check("cuDevicePrimaryCtxRetain", a.primaryCtxRetain(&ctx, dev));
  check("cuCtxPushCurrent", a.ctxPushCurrent(ctx));
  Stream st = nullptr;
  std::vector<uint32_t> buf(nbytes / 4);
  Result r = a.streamCreate(&st, kStreamNonBlocking);
  if (r == kSuccess) {
    r = a.memcpyDtoHAsync(buf.data(), addr, nbytes, st);
  }
  if (r == kSuccess) {
    r = a.streamSynchronize(st);
  }
  if (r == kSuccess) {
    for (size_t i = 0; i + 1 < buf.size(); i += 2) {
      buf[i + 1] = buf[i] + (1u << 30);
    }
    r = a.memcpyHtoDAsync(addr, buf.data(), nbytes, st);
  }
  if (r == kSuccess) {
    r = a.streamSynchronize(st);
  }
  if (st != nullptr) {
    a.streamDestroy(st);
  }
  void* popped = nullptr;
  a.ctxPopCurrent(&popped);
  check("releasing the stream counters", r);
}

}  // namespace gocomm::cuda
