#include "cuda_driver.h"

#include <dlfcn.h>

#include <cstring>
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
constexpr int kAttrHandleTypes = 14;  // CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES
constexpr int kAttrMappingSize = 18;  // CU_POINTER_ATTRIBUTE_MAPPING_SIZE
constexpr int kAttrMappingBase = 19;  // CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR
constexpr int kHandlePosixFd = 1;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
constexpr int kHandleFabric = 8;  // CU_MEM_HANDLE_TYPE_FABRIC
constexpr unsigned kWaitGeq = 0;  // CU_STREAM_WAIT_VALUE_GEQ
constexpr unsigned kWaitEq = 1;  // CU_STREAM_WAIT_VALUE_EQ
constexpr unsigned kHostRegisterPortableDevicemap = 1 | 2;  // CU_MEMHOSTREGISTER_PORTABLE | _DEVICEMAP
constexpr unsigned kUserObjectNoDestructorSync = 1;  // CU_USER_OBJECT_NO_DESTRUCTOR_SYNC
constexpr unsigned kGraphUserObjectMove = 1;  // CU_GRAPH_USER_OBJECT_MOVE
constexpr Result kNotReady = 600;  // CUDA_ERROR_NOT_READY
constexpr int kAttrSMs = 16, kAttrMajor = 75, kAttrMinor = 76, kAttrMps = 133;  // CU_DEVICE_ATTRIBUTE_*
constexpr unsigned kHostPortableMapped = 3;  // CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
constexpr unsigned kIpcLazyPeerAccess = 1;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr unsigned kEventNoTiming = 2;  // CU_EVENT_DISABLE_TIMING

struct IpcHandle {  // CUipcMemHandle, passed by value
  char reserved[64];
};

struct Api {
  void* lib = nullptr;
  std::string error;  // why the driver could not be loaded
  Result (*getErrorString)(Result, const char**) = nullptr;
  Result (*streamWriteValue32)(Stream, DevPtr, uint32_t, unsigned) = nullptr;
  Result (*streamWaitValue32)(Stream, DevPtr, uint32_t, unsigned) = nullptr;
  Result (*pointerGetAttribute)(void*, int, DevPtr) = nullptr;
  Result (*memGetAddressRange)(DevPtr*, size_t*, DevPtr) = nullptr;
  Result (*ipcGetMemHandle)(void*, DevPtr) = nullptr;
  // CUmemGenericAllocationHandle is an unsigned long long
  Result (*memRetainAllocationHandle)(unsigned long long*, void*) = nullptr;
  Result (*memExportToShareableHandle)(void*, unsigned long long, int, unsigned long long) = nullptr;
  Result (*memRelease)(unsigned long long) = nullptr;
  Result (*deviceGet)(int*, int) = nullptr;
  Result (*primaryCtxRetain)(void**, int) = nullptr;
  // cuStreamGetCaptureInfo_v3 (12.3+, with edge data), or _v2 on older drivers
  Result (*captureInfoV2)(Stream, int*, uint64_t*, void**, const void**, size_t*) = nullptr;
  Result (*captureInfoV3)(Stream, int*, uint64_t*, void**, const void**, const void**, size_t*) = nullptr;
  Result (*userObjectCreate)(void**, void*, void (*)(void*), unsigned, unsigned) = nullptr;
  Result (*graphRetainUserObject)(void*, void*, unsigned, unsigned) = nullptr;
  Result (*userObjectRelease)(void*, unsigned) = nullptr;
  Result (*memHostRegister)(void*, size_t, unsigned) = nullptr;
  Result (*memHostGetDevicePointer)(DevPtr*, void*, unsigned) = nullptr;
  Result (*memHostUnregister)(void*) = nullptr;
  // the in-process engine's
  Result (*ctxGetCurrent)(void**) = nullptr;
  Result (*ctxSetCurrent)(void*) = nullptr;
  Result (*deviceGetAttribute)(int*, int, int) = nullptr;
  Result (*deviceGetUuid)(uint8_t*, int) = nullptr;
  Result (*moduleLoadData)(void**, const void*) = nullptr;
  Result (*moduleGetFunction)(Function*, void*, const char*) = nullptr;
  Result (*launchKernel)(Function, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, Stream,
                         void**, void**) = nullptr;
  Result (*occupancy)(int*, Function, int, size_t) = nullptr;
  Result (*memAlloc)(DevPtr*, size_t) = nullptr;
  Result (*memsetD8)(DevPtr, unsigned char, size_t) = nullptr;
  Result (*memcpyHtoD)(DevPtr, const void*, size_t) = nullptr;
  Result (*memHostAlloc)(void**, size_t, unsigned) = nullptr;
  Result (*ipcOpenMemHandle)(DevPtr*, IpcHandle, unsigned) = nullptr;
  Result (*eventCreate)(Event*, unsigned) = nullptr;
  Result (*eventRecord)(Event, Stream) = nullptr;
  Result (*streamWaitEvent)(Stream, Event, unsigned) = nullptr;
  Result (*eventQuery)(Event) = nullptr;
  Result (*eventSynchronize)(Event) = nullptr;
  Result (*eventDestroy)(Event) = nullptr;
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
    sym(a, a.memRetainAllocationHandle, "cuMemRetainAllocationHandle");
    sym(a, a.memExportToShareableHandle, "cuMemExportToShareableHandle");
    sym(a, a.memRelease, "cuMemRelease");
    sym(a, a.deviceGet, "cuDeviceGet");
    sym(a, a.primaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(a, a.userObjectCreate, "cuUserObjectCreate");
    sym(a, a.graphRetainUserObject, "cuGraphRetainUserObject");
    sym(a, a.userObjectRelease, "cuUserObjectRelease");
    sym(a, a.memHostRegister, "cuMemHostRegister_v2");
    sym(a, a.memHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
    sym(a, a.memHostUnregister, "cuMemHostUnregister");
    a.captureInfoV3 = reinterpret_cast<decltype(a.captureInfoV3)>(dlsym(a.lib, "cuStreamGetCaptureInfo_v3"));
    if (a.captureInfoV3 == nullptr) {
      sym(a, a.captureInfoV2, "cuStreamGetCaptureInfo_v2");
    }
    sym(a, a.ctxGetCurrent, "cuCtxGetCurrent");
    sym(a, a.ctxSetCurrent, "cuCtxSetCurrent");
    sym(a, a.deviceGetAttribute, "cuDeviceGetAttribute");
    sym(a, a.deviceGetUuid, "cuDeviceGetUuid_v2");
    sym(a, a.moduleLoadData, "cuModuleLoadData");
    sym(a, a.moduleGetFunction, "cuModuleGetFunction");
    sym(a, a.launchKernel, "cuLaunchKernel");
    sym(a, a.occupancy, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    sym(a, a.memAlloc, "cuMemAlloc_v2");
    sym(a, a.memsetD8, "cuMemsetD8_v2");
    sym(a, a.memcpyHtoD, "cuMemcpyHtoD_v2");
    sym(a, a.memHostAlloc, "cuMemHostAlloc");
    sym(a, a.ipcOpenMemHandle, "cuIpcOpenMemHandle_v2");
    sym(a, a.eventCreate, "cuEventCreate");
    sym(a, a.eventRecord, "cuEventRecord");
    sym(a, a.streamWaitEvent, "cuStreamWaitEvent");
    sym(a, a.eventQuery, "cuEventQuery");
    sym(a, a.eventSynchronize, "cuEventSynchronize");
    sym(a, a.eventDestroy, "cuEventDestroy_v2");
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

void wait_value_eq(Stream stream, DevPtr addr, uint32_t value) {
  check("cuStreamWaitValue32", api().streamWaitValue32(stream, addr, value, kWaitEq));
}

Capture capture_info(Stream stream) {
  const Api& a = api();
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  uint64_t id = 0;
  void* graph = nullptr;
  const void* deps = nullptr;
  const void* edges = nullptr;
  size_t ndeps = 0;
  if (a.captureInfoV3 != nullptr) {
    check("cuStreamGetCaptureInfo", a.captureInfoV3(stream, &status, &id, &graph, &deps, &edges, &ndeps));
  } else {
    check("cuStreamGetCaptureInfo", a.captureInfoV2(stream, &status, &id, &graph, &deps, &ndeps));
  }
  Capture c;
  c.active = status != 0;
  c.graph = status == 1 ? graph : nullptr;  // 1: active, 2: invalidated
  return c;
}

void retain_user_object(void* graph, void (*destroy)(void*), void* arg) {
  const Api& a = api();
  void* obj = nullptr;
  Result r = a.userObjectCreate(&obj, arg, destroy, 1, kUserObjectNoDestructorSync);
  if (r != kSuccess) {
    destroy(arg);
    check("cuUserObjectCreate", r);
  }
  r = a.graphRetainUserObject(graph, obj, 1, kGraphUserObjectMove);
  if (r != kSuccess) {
    a.userObjectRelease(obj, 1);  // ours was the only reference: destroy(arg) runs
    check("cuGraphRetainUserObject", r);
  }
}

DevPtr host_register(void* p, size_t n) {
  const Api& a = api();
  check("cuMemHostRegister", a.memHostRegister(p, n, kHostRegisterPortableDevicemap));
  DevPtr d = 0;
  check("cuMemHostGetDevicePointer", a.memHostGetDevicePointer(&d, p, 0));
  return d;
}

bool host_unregister(void* p) {
  return api().memHostUnregister(p) == kSuccess;
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

bool mapped_memory(DevPtr ptr) {
  const Api& a = api();
  uint64_t pool = 0, legacy = 0, base = 0;
  return a.pointerGetAttribute(&pool, kAttrMempool, ptr) == kSuccess && pool == 0 &&
         a.pointerGetAttribute(&legacy, kAttrLegacyIpc, ptr) == kSuccess && legacy == 0 &&
         a.pointerGetAttribute(&base, kAttrMappingBase, ptr) == kSuccess && base != 0;
}

void mapping(DevPtr ptr, DevPtr* base, size_t* size) {
  const Api& a = api();
  uint64_t b = 0, n = 0;  // a CUdeviceptr and a size_t: 8 bytes each
  check("cuPointerGetAttribute(MAPPING_BASE_ADDR)", a.pointerGetAttribute(&b, kAttrMappingBase, ptr));
  check("cuPointerGetAttribute(MAPPING_SIZE)", a.pointerGetAttribute(&n, kAttrMappingSize, ptr));
  *base = b;
  *size = n;
}

int export_fd(DevPtr base) {
  const Api& a = api();
  unsigned long long h = 0;
  check("cuMemRetainAllocationHandle", a.memRetainAllocationHandle(&h, reinterpret_cast<void*>(base)));
  int fd = -1;
  const Result r = a.memExportToShareableHandle(&fd, h, kHandlePosixFd, 0);
  a.memRelease(h);  // the retain's reference only: torch holds its own, the fd another
  check("cuMemExportToShareableHandle", r);
  return fd;
}

std::string no_fd_reason(DevPtr ptr) {
  uint64_t types = 0;  // a bitmask of CUmemAllocationHandleType, zero where unwritten
  if (api().pointerGetAttribute(&types, kAttrHandleTypes, ptr) != kSuccess || (types & kHandlePosixFd) != 0) {
    return "";
  }
  if (types & kHandleFabric) {
    return "it was created with a fabric handle only (CU_MEM_HANDLE_TYPE_FABRIC: torch picks it on IMEX systems), "
           "which gocomm does not import";
  }
  return "it was created with no exportable handle (TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0, the default of fbcode "
         "builds of torch)";
}

void ensure_context(int device) {
  const Api& a = api();
  void* cur = nullptr;
  check("cuCtxGetCurrent", a.ctxGetCurrent(&cur));
  if (cur != nullptr) {
    return;
  }
  int dev = 0;
  void* ctx = nullptr;
  check("cuDeviceGet", a.deviceGet(&dev, device));
  check("cuDevicePrimaryCtxRetain", a.primaryCtxRetain(&ctx, dev));
  check("cuCtxSetCurrent", a.ctxSetCurrent(ctx));
}

namespace {
int attribute(int device, int attr) {
  const Api& a = api();
  int dev = 0, v = 0;
  check("cuDeviceGet", a.deviceGet(&dev, device));
  check("cuDeviceGetAttribute", a.deviceGetAttribute(&v, attr, dev));
  return v;
}
}  // namespace

void capability(int device, int* major, int* minor) {
  *major = attribute(device, kAttrMajor);
  *minor = attribute(device, kAttrMinor);
}

int sm_count(int device) {
  return attribute(device, kAttrSMs);
}

bool mps_client(int device) {
  return attribute(device, kAttrMps) != 0;
}

std::array<uint8_t, 16> device_uuid(int device) {
  const Api& a = api();
  int dev = 0;
  std::array<uint8_t, 16> uuid{};
  check("cuDeviceGet", a.deviceGet(&dev, device));
  check("cuDeviceGetUuid", a.deviceGetUuid(uuid.data(), dev));
  return uuid;
}

void* module_load(const std::string& image) {
  void* mod = nullptr;
  check("cuModuleLoadData", api().moduleLoadData(&mod, image.data()));
  return mod;
}

Function module_function(void* module, const char* name) {
  Function fn = nullptr;
  check("cuModuleGetFunction", api().moduleGetFunction(&fn, module, name));
  return fn;
}

void launch(Function fn, unsigned grid, unsigned block, unsigned smem, Stream stream, void** params) {
  check("cuLaunchKernel", api().launchKernel(fn, grid, 1, 1, block, 1, 1, smem, stream, params, nullptr));
}

int blocks_per_sm(Function fn, int threads, size_t smem) {
  int per = 0;
  check("cuOccupancyMaxActiveBlocksPerMultiprocessor", api().occupancy(&per, fn, threads, smem));
  return per;
}

DevPtr mem_alloc_zeroed(size_t nbytes) {
  DevPtr p = 0;
  check("cuMemAlloc", api().memAlloc(&p, nbytes));
  check("cuMemsetD8", api().memsetD8(p, 0, nbytes));
  return p;
}

void copy_to_device(DevPtr dst, const void* src, size_t nbytes) {
  check("cuMemcpyHtoD", api().memcpyHtoD(dst, src, nbytes));
}

void host_words(size_t nbytes, void** host, DevPtr* dev) {
  check("cuMemHostAlloc", api().memHostAlloc(host, nbytes, kHostPortableMapped));
  std::memset(*host, 0, nbytes);
  check("cuMemHostGetDevicePointer", api().memHostGetDevicePointer(dev, *host, 0));
}

DevPtr ipc_open(const uint8_t handle[64]) {
  IpcHandle h;
  std::memcpy(h.reserved, handle, 64);
  DevPtr p = 0;
  check("cuIpcOpenMemHandle", api().ipcOpenMemHandle(&p, h, kIpcLazyPeerAccess));
  return p;
}

Event event_create() {
  Event ev = nullptr;
  check("cuEventCreate", api().eventCreate(&ev, kEventNoTiming));
  return ev;
}

void event_record(Event ev, Stream stream) {
  check("cuEventRecord", api().eventRecord(ev, stream));
}

void stream_wait_event(Stream stream, Event ev) {
  check("cuStreamWaitEvent", api().streamWaitEvent(stream, ev, 0));
}

bool event_done(Event ev) {
  const Result r = api().eventQuery(ev);
  if (r == kNotReady) {
    return false;
  }
  check("cuEventQuery", r);
  return true;
}

void event_destroy(Event ev) {
  api().eventDestroy(ev);  // nothing to do about a failure here
}

void event_sync(Event ev) {
  check("cuEventSynchronize", api().eventSynchronize(ev));
}

}  // namespace gocomm::cuda
