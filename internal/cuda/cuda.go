// Package cuda binds the few CUDA driver API calls the sidecar needs, loaded at run time
// from libcuda.so.1 so that pgserver builds without a CUDA toolkit and starts where there is
// no driver (it then serves CPU tensors and says why CUDA is unavailable).
//
// Three layers: the C table of function pointers filled by dlsym (cuda.h is not needed:
// the prototypes below are the only ones used); thin wrappers returning Result, the driver's
// status, which implements error with its own string table; and the typed functions the rest
// of the sidecar calls. Every wrapper checks that the library is loaded: calling an
// unresolved pointer would kill the process, so "not loaded" is an error, never a crash.
package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
typedef void* CUmodule;
typedef void* CUfunction;
typedef unsigned long long CUdeviceptr;
typedef struct { char bytes[64]; } CUipcMemHandle;
typedef struct { char bytes[64]; } CUipcEventHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;             // CU_MEM_LOCATION_TYPE_DEVICE = 1
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc; // 12 bytes, as cuda.h

static void* gc_lib;
static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDriverGetVersion)(int*);
static CUresult (*p_cuDeviceGetCount)(int*);
static CUresult (*p_cuDeviceGet)(CUdevice*, int);
static CUresult (*p_cuDeviceGetAttribute)(int*, int, CUdevice);
static CUresult (*p_cuDeviceGetName)(char*, int, CUdevice);
static CUresult (*p_cuDeviceGetUuid)(CUuuid*, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
static CUresult (*p_cuDevicePrimaryCtxRelease)(CUdevice);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuStreamCreate)(CUstream*, unsigned int);
static CUresult (*p_cuStreamDestroy)(CUstream);
static CUresult (*p_cuStreamSynchronize)(CUstream);
static CUresult (*p_cuStreamWaitValue32)(CUstream, CUdeviceptr, uint32_t, unsigned int);
static CUresult (*p_cuStreamWriteValue32)(CUstream, CUdeviceptr, uint32_t, unsigned int);
static CUresult (*p_cuEventCreate)(CUevent*, unsigned int);
static CUresult (*p_cuEventDestroy)(CUevent);
static CUresult (*p_cuEventRecord)(CUevent, CUstream);
static CUresult (*p_cuEventQuery)(CUevent);
static CUresult (*p_cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
static CUresult (*p_cuModuleLoadData)(CUmodule*, const void*);
static CUresult (*p_cuModuleUnload)(CUmodule);
static CUresult (*p_cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
static CUresult (*p_cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**, void**);
static CUresult (*p_cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned int);
static CUresult (*p_cuIpcCloseMemHandle)(CUdeviceptr);
static CUresult (*p_cuMemAlloc)(CUdeviceptr*, size_t);
static CUresult (*p_cuMemFree)(CUdeviceptr);
static CUresult (*p_cuMemHostRegister)(void*, size_t, unsigned int);
static CUresult (*p_cuMemHostUnregister)(void*);
static CUresult (*p_cuMemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned int);
static CUresult (*p_cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
static CUresult (*p_cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
static CUresult (*p_cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
static CUresult (*p_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*, int);
static CUresult (*p_cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*p_cuMemAddressFree)(CUdeviceptr, size_t);
static CUresult (*p_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
static CUresult (*p_cuMemUnmap)(CUdeviceptr, size_t);
static CUresult (*p_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
static CUresult (*p_cuMemRelease)(CUmemGenericAllocationHandle);

// gc_load opens the library and resolves every symbol; it returns the name of the first
// missing symbol (or the dlerror text) in err, and -1, on failure.
static int gc_load(const char* path, char* err, int errlen) {
	void* h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
	if (!h) {
		const char* e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		return -1;
	}
#define SYM(var, name) do { *(void**)(&var) = dlsym(h, name); if (!var) { snprintf(err, errlen, "symbol %s missing", name); return -1; } } while (0)
	SYM(p_cuInit, "cuInit");
	SYM(p_cuDriverGetVersion, "cuDriverGetVersion");
	SYM(p_cuDeviceGetCount, "cuDeviceGetCount");
	SYM(p_cuDeviceGet, "cuDeviceGet");
	SYM(p_cuDeviceGetAttribute, "cuDeviceGetAttribute");
	SYM(p_cuDeviceGetName, "cuDeviceGetName");
	SYM(p_cuDeviceGetUuid, "cuDeviceGetUuid_v2");
	SYM(p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	SYM(p_cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
	SYM(p_cuCtxSetCurrent, "cuCtxSetCurrent");
	SYM(p_cuStreamCreate, "cuStreamCreate");
	SYM(p_cuStreamDestroy, "cuStreamDestroy_v2");
	SYM(p_cuStreamSynchronize, "cuStreamSynchronize");
	SYM(p_cuStreamWaitValue32, "cuStreamWaitValue32_v2");
	SYM(p_cuStreamWriteValue32, "cuStreamWriteValue32_v2");
	SYM(p_cuEventCreate, "cuEventCreate");
	SYM(p_cuEventDestroy, "cuEventDestroy_v2");
	SYM(p_cuEventRecord, "cuEventRecord");
	SYM(p_cuEventQuery, "cuEventQuery");
	SYM(p_cuStreamWaitEvent, "cuStreamWaitEvent");
	SYM(p_cuModuleLoadData, "cuModuleLoadData");
	SYM(p_cuModuleUnload, "cuModuleUnload");
	SYM(p_cuModuleGetFunction, "cuModuleGetFunction");
	SYM(p_cuLaunchKernel, "cuLaunchKernel");
	SYM(p_cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
	SYM(p_cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
	SYM(p_cuMemAlloc, "cuMemAlloc_v2");
	SYM(p_cuMemFree, "cuMemFree_v2");
	SYM(p_cuMemHostRegister, "cuMemHostRegister_v2");
	SYM(p_cuMemHostUnregister, "cuMemHostUnregister");
	SYM(p_cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
	SYM(p_cuMemGetAddressRange, "cuMemGetAddressRange_v2");
	SYM(p_cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
	SYM(p_cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
	SYM(p_cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
	SYM(p_cuMemAddressReserve, "cuMemAddressReserve");
	SYM(p_cuMemAddressFree, "cuMemAddressFree");
	SYM(p_cuMemMap, "cuMemMap");
	SYM(p_cuMemUnmap, "cuMemUnmap");
	SYM(p_cuMemSetAccess, "cuMemSetAccess");
	SYM(p_cuMemRelease, "cuMemRelease");
#undef SYM
	gc_lib = h;
	return 0;
}

static CUresult gc_cuInit(unsigned int f) { return p_cuInit(f); }
static CUresult gc_cuDriverGetVersion(int* v) { return p_cuDriverGetVersion(v); }
static CUresult gc_cuDeviceGetCount(int* n) { return p_cuDeviceGetCount(n); }
static CUresult gc_cuDeviceGet(CUdevice* d, int i) { return p_cuDeviceGet(d, i); }
static CUresult gc_cuDeviceGetAttribute(int* v, int a, CUdevice d) { return p_cuDeviceGetAttribute(v, a, d); }
static CUresult gc_cuDeviceGetName(char* s, int n, CUdevice d) { return p_cuDeviceGetName(s, n, d); }
static CUresult gc_cuDeviceGetUuid(CUuuid* u, CUdevice d) { return p_cuDeviceGetUuid(u, d); }
static CUresult gc_cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) { return p_cuDevicePrimaryCtxRetain(c, d); }
static CUresult gc_cuDevicePrimaryCtxRelease(CUdevice d) { return p_cuDevicePrimaryCtxRelease(d); }
static CUresult gc_cuCtxSetCurrent(CUcontext c) { return p_cuCtxSetCurrent(c); }
static CUresult gc_cuStreamCreate(CUstream* s, unsigned int f) { return p_cuStreamCreate(s, f); }
static CUresult gc_cuStreamDestroy(CUstream s) { return p_cuStreamDestroy(s); }
static CUresult gc_cuStreamSynchronize(CUstream s) { return p_cuStreamSynchronize(s); }
static CUresult gc_cuStreamWaitValue32(CUstream s, CUdeviceptr a, uint32_t v, unsigned int f) { return p_cuStreamWaitValue32(s, a, v, f); }
static CUresult gc_cuStreamWriteValue32(CUstream s, CUdeviceptr a, uint32_t v, unsigned int f) { return p_cuStreamWriteValue32(s, a, v, f); }
static CUresult gc_cuEventCreate(CUevent* e, unsigned int f) { return p_cuEventCreate(e, f); }
static CUresult gc_cuEventDestroy(CUevent e) { return p_cuEventDestroy(e); }
static CUresult gc_cuEventRecord(CUevent e, CUstream s) { return p_cuEventRecord(e, s); }
static CUresult gc_cuEventQuery(CUevent e) { return p_cuEventQuery(e); }
static CUresult gc_cuStreamWaitEvent(CUstream s, CUevent e, unsigned int f) { return p_cuStreamWaitEvent(s, e, f); }
static CUresult gc_cuModuleLoadData(CUmodule* m, const void* image) { return p_cuModuleLoadData(m, image); }
static CUresult gc_cuModuleUnload(CUmodule m) { return p_cuModuleUnload(m); }
static CUresult gc_cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) { return p_cuModuleGetFunction(f, m, name); }
// gc_launch packs the kernel's parameters (n values of sizes[i] bytes, back to back in vals)
// into C memory the driver reads during the call.
static CUresult gc_launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned shared, CUstream s, const char* vals, const int* sizes, int n) {
	void* ptrs[64];
	char buf[1024];
	if (n > 64) return 1;
	int off = 0;
	for (int i = 0; i < n; i++) {
		off = (off + 7) & ~7;
		if (off + sizes[i] > (int)sizeof buf) return 1;
		memcpy(buf + off, vals, sizes[i]);
		ptrs[i] = buf + off;
		vals += sizes[i];
		off += sizes[i];
	}
	return p_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, s, ptrs, NULL);
}
static CUresult gc_cuIpcOpenMemHandle(CUdeviceptr* p, const void* h, unsigned int f) {
	CUipcMemHandle hh; memcpy(&hh, h, sizeof hh); return p_cuIpcOpenMemHandle(p, hh, f);
}
static CUresult gc_cuIpcCloseMemHandle(CUdeviceptr p) { return p_cuIpcCloseMemHandle(p); }
static CUresult gc_cuMemAlloc(CUdeviceptr* p, size_t n) { return p_cuMemAlloc(p, n); }
static CUresult gc_cuMemFree(CUdeviceptr p) { return p_cuMemFree(p); }
// flags 0x1 | 0x2: CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
static CUresult gc_cuMemHostRegister(void* p, size_t n) { return p_cuMemHostRegister(p, n, 0x1 | 0x2); }
static CUresult gc_cuMemHostUnregister(void* p) { return p_cuMemHostUnregister(p); }
static CUresult gc_cuMemHostGetDevicePointer(CUdeviceptr* d, void* p) { return p_cuMemHostGetDevicePointer(d, p, 0); }
static CUresult gc_cuMemGetAddressRange(CUdeviceptr* b, size_t* n, CUdeviceptr p) { return p_cuMemGetAddressRange(b, n, p); }
static CUresult gc_cuMemcpyDtoHAsync(void* d, CUdeviceptr s, size_t n, CUstream st) { return p_cuMemcpyDtoHAsync(d, s, n, st); }
static CUresult gc_cuMemcpyHtoDAsync(CUdeviceptr d, const void* s, size_t n, CUstream st) { return p_cuMemcpyHtoDAsync(d, s, n, st); }
// a POSIX fd is passed as the pointer-sized value itself (cuMemImportFromShareableHandle)
static CUresult gc_cuMemImportFd(CUmemGenericAllocationHandle* h, int fd) { return p_cuMemImportFromShareableHandle(h, (void*)(uintptr_t)fd, 1); }
static CUresult gc_cuMemAddressReserve(CUdeviceptr* p, size_t n, size_t align) { return p_cuMemAddressReserve(p, n, align, 0, 0); }
static CUresult gc_cuMemAddressFree(CUdeviceptr p, size_t n) { return p_cuMemAddressFree(p, n); }
static CUresult gc_cuMemMap(CUdeviceptr p, size_t n, CUmemGenericAllocationHandle h) { return p_cuMemMap(p, n, 0, h, 0); }
static CUresult gc_cuMemUnmap(CUdeviceptr p, size_t n) { return p_cuMemUnmap(p, n); }
// read-write access (CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3) for one device (CU_MEM_LOCATION_TYPE_DEVICE = 1)
static CUresult gc_cuMemSetAccessRW(CUdeviceptr p, size_t n, int dev) {
	CUmemAccessDesc d;
	memset(&d, 0, sizeof d);
	d.location.type = 1;
	d.location.id = dev;
	d.flags = 3;
	return p_cuMemSetAccess(p, n, &d, 1);
}
static CUresult gc_cuMemRelease(CUmemGenericAllocationHandle h) { return p_cuMemRelease(h); }
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
)

// ErrNotLoaded: the driver library is not (or could not be) loaded.
var ErrNotLoaded = errors.New("cuda: driver library not loaded")

var (
	loadOnce sync.Once
	loadErr  = ErrNotLoaded
	// libOpen: libcuda is open (gc_lib set), read on every call without a cgo call of its own
	libOpen atomic.Bool
)

// Load opens libcuda.so.1 and initializes the driver, once; later calls return the first
// call's result.
func Load() error {
	loadOnce.Do(func() {
		var buf [512]C.char
		path := C.CString("libcuda.so.1")
		defer C.free(unsafe.Pointer(path))
		if C.gc_load(path, &buf[0], C.int(len(buf))) != 0 {
			loadErr = fmt.Errorf("%w: %s", ErrNotLoaded, C.GoString(&buf[0]))
			return
		}
		libOpen.Store(true)
		if r := Result(C.gc_cuInit(0)); r != Success {
			loadErr = fmt.Errorf("cuda: cuInit: %w", r)
			return
		}
		loadErr = nil
	})
	return loadErr
}

// DriverVersion is the CUDA version the driver supports, as the driver reports it (13000
// for 13.0).
func DriverVersion() (int, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var v C.int
	if err := check("cuDriverGetVersion", C.gc_cuDriverGetVersion(&v)); err != nil {
		return 0, err
	}
	return int(v), nil
}

func loaded() error {
	if !libOpen.Load() {
		return ErrNotLoaded
	}
	return nil
}

// Result is the driver's status code; every non-Success value is an error.
type Result int32

// Results the sidecar tells apart.
const (
	Success           Result = 0
	ErrInvalidValue   Result = 1
	ErrOutOfMemory    Result = 2
	ErrNotInitialized Result = 3
	ErrNoDevice       Result = 100
	ErrInvalidDevice  Result = 101
	ErrInvalidHandle  Result = 400
	ErrNotReady       Result = 600
	ErrNotSupported   Result = 801
)

// names works without the library (messages when it is absent or broken).
var names = map[Result]string{
	Success: "CUDA_SUCCESS", ErrInvalidValue: "CUDA_ERROR_INVALID_VALUE",
	ErrOutOfMemory: "CUDA_ERROR_OUT_OF_MEMORY", ErrNotInitialized: "CUDA_ERROR_NOT_INITIALIZED",
	ErrNoDevice: "CUDA_ERROR_NO_DEVICE", ErrInvalidDevice: "CUDA_ERROR_INVALID_DEVICE",
	ErrInvalidHandle: "CUDA_ERROR_INVALID_HANDLE", ErrNotReady: "CUDA_ERROR_NOT_READY",
	ErrNotSupported: "CUDA_ERROR_NOT_SUPPORTED",
	201:             "CUDA_ERROR_INVALID_CONTEXT", 208: "CUDA_ERROR_ALREADY_MAPPED", 217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
	700: "CUDA_ERROR_ILLEGAL_ADDRESS", 719: "CUDA_ERROR_LAUNCH_FAILED", 999: "CUDA_ERROR_UNKNOWN",
}

func (r Result) Error() string {
	if s, ok := names[r]; ok {
		return s
	}
	return fmt.Sprintf("CUDA error %d", int32(r))
}

// check turns a status into a Go error exactly once (a zero status stored in an error
// would be a non-nil error).
func check(what string, r C.CUresult) error {
	if Result(r) == Success {
		return nil
	}
	return fmt.Errorf("cuda: %s: %w", what, Result(r))
}

// DeviceCount is the number of visible devices.
func DeviceCount() (int, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var n C.int
	return int(n), check("cuDeviceGetCount", C.gc_cuDeviceGetCount(&n))
}

// Device is a device ordinal's handle.
type Device int32

// DeviceGet returns the device of an ordinal.
func DeviceGet(ordinal int) (Device, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var d C.CUdevice
	return Device(d), check("cuDeviceGet", C.gc_cuDeviceGet(&d, C.int(ordinal)))
}

// Device attributes read here (cuda.h CUdevice_attribute).
const (
	AttrComputeCapabilityMajor = 75
	AttrComputeCapabilityMinor = 76
	AttrCanUseStreamMemOps     = 92
	AttrMPSEnabled             = 133
)

// Attribute reads one device attribute.
func (d Device) Attribute(attr int) (int, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var v C.int
	return int(v), check("cuDeviceGetAttribute", C.gc_cuDeviceGetAttribute(&v, C.int(attr), C.CUdevice(d)))
}

// Name of the device, e.g. "NVIDIA H200".
func (d Device) Name() (string, error) {
	if err := loaded(); err != nil {
		return "", err
	}
	var buf [256]C.char
	if err := check("cuDeviceGetName", C.gc_cuDeviceGetName(&buf[0], C.int(len(buf)), C.CUdevice(d))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

// UUID of the device.
func (d Device) UUID() ([16]byte, error) {
	var u [16]byte
	if err := loaded(); err != nil {
		return u, err
	}
	var cu C.CUuuid
	if err := check("cuDeviceGetUuid", C.gc_cuDeviceGetUuid(&cu, C.CUdevice(d))); err != nil {
		return u, err
	}
	copy(u[:], C.GoBytes(unsafe.Pointer(&cu.bytes[0]), 16))
	return u, nil
}

// Context is a CUDA context.
type Context struct{ p C.CUcontext }

// PrimaryContext retains the device's primary context (shared with every user of the
// runtime API in this process).
func (d Device) PrimaryContext() (Context, error) {
	if err := loaded(); err != nil {
		return Context{}, err
	}
	var c C.CUcontext
	return Context{c}, check("cuDevicePrimaryCtxRetain", C.gc_cuDevicePrimaryCtxRetain(&c, C.CUdevice(d)))
}

// ReleasePrimaryContext drops a reference taken by PrimaryContext.
func (d Device) ReleasePrimaryContext() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuDevicePrimaryCtxRelease", C.gc_cuDevicePrimaryCtxRelease(C.CUdevice(d)))
}

// SetCurrent binds the context to the calling OS thread. Go code that calls the driver
// must hold its goroutine on one thread (runtime.LockOSThread) or bind before every call.
func (c Context) SetCurrent() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuCtxSetCurrent", C.gc_cuCtxSetCurrent(c.p))
}

// Ptr is a device address.
type Ptr uint64

// Stream is a CUDA stream.
type Stream struct{ p C.CUstream }

// Handle is the stream's driver handle, for libraries that take a cudaStream_t (NCCL).
func (s Stream) Handle() unsafe.Pointer { return unsafe.Pointer(s.p) }

// StreamNonBlocking does not synchronize with the legacy default stream.
const StreamNonBlocking = 1

// NewStream creates a stream in the current context.
func NewStream(flags uint) (Stream, error) {
	if err := loaded(); err != nil {
		return Stream{}, err
	}
	var s C.CUstream
	return Stream{s}, check("cuStreamCreate", C.gc_cuStreamCreate(&s, C.uint(flags)))
}

// Destroy the stream (work already queued still runs).
func (s Stream) Destroy() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuStreamDestroy", C.gc_cuStreamDestroy(s.p))
}

// Synchronize waits for everything queued on the stream.
func (s Stream) Synchronize() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuStreamSynchronize", C.gc_cuStreamSynchronize(s.p))
}

// WaitGEQ, the WaitValue32 flag used here.
const WaitGEQ = 0x0

// WaitValue32 makes the stream wait until the 32-bit word at addr reaches value (flags:
// WaitGEQ compares as (int32)(*addr - value) >= 0, so counters may wrap).
func (s Stream) WaitValue32(addr Ptr, value uint32, flags uint) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuStreamWaitValue32", C.gc_cuStreamWaitValue32(s.p, C.CUdeviceptr(addr), C.uint32_t(value), C.uint(flags)))
}

// WriteValue32 queues a write of value to the word at addr.
func (s Stream) WriteValue32(addr Ptr, value uint32) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuStreamWriteValue32", C.gc_cuStreamWriteValue32(s.p, C.CUdeviceptr(addr), C.uint32_t(value), 0))
}

// Event is a CUDA event.
type Event struct{ p C.CUevent }

// EventDisableTiming makes events cheaper; nothing here times with them.
const EventDisableTiming = 0x2

// NewEvent creates an event in the current context.
func NewEvent(flags uint) (Event, error) {
	if err := loaded(); err != nil {
		return Event{}, err
	}
	var e C.CUevent
	return Event{e}, check("cuEventCreate", C.gc_cuEventCreate(&e, C.uint(flags)))
}

// Record the event on a stream.
func (e Event) Record(s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuEventRecord", C.gc_cuEventRecord(e.p, s.p))
}

// Done reports whether the work before the event's last record has finished.
func (e Event) Done() (bool, error) {
	if err := loaded(); err != nil {
		return false, err
	}
	r := Result(C.gc_cuEventQuery(e.p))
	if r == ErrNotReady {
		return false, nil
	}
	return r == Success, check("cuEventQuery", C.CUresult(r))
}

// WaitEvent makes s wait for the work before e's last record (as of this call); e may be
// destroyed afterwards.
func (s Stream) WaitEvent(e Event) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuStreamWaitEvent", C.gc_cuStreamWaitEvent(s.p, e.p, 0))
}

// Destroy the event.
func (e Event) Destroy() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuEventDestroy", C.gc_cuEventDestroy(e.p))
}

// IPCHandle is a cudaIpcMemHandle_t: an allocation of another process on this node.
type IPCHandle [64]byte

// IPCLazyPeerAccess lets the mapping enable peer access between devices as needed.
const IPCLazyPeerAccess = 0x1

// OpenIPC maps another process's allocation into the current context.
func OpenIPC(h IPCHandle) (Ptr, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	return Ptr(p), check("cuIpcOpenMemHandle", C.gc_cuIpcOpenMemHandle(&p, unsafe.Pointer(&h[0]), IPCLazyPeerAccess))
}

// CloseIPC unmaps an allocation opened with OpenIPC.
func CloseIPC(p Ptr) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuIpcCloseMemHandle", C.gc_cuIpcCloseMemHandle(C.CUdeviceptr(p)))
}

// MemHandle is a physical allocation of the virtual memory API (CUmemGenericAllocationHandle).
type MemHandle uint64

// ImportFD takes another process's physical allocation by the POSIX file descriptor it
// exported (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). The fd stays the caller's to close; the
// handle is released with Release.
func ImportFD(fd int) (MemHandle, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var h C.CUmemGenericAllocationHandle
	return MemHandle(h), check("cuMemImportFromShareableHandle", C.gc_cuMemImportFd(&h, C.int(fd)))
}

// Release drops the handle; the physical memory lives on while a mapping of it remains.
func (h MemHandle) Release() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuMemRelease", C.gc_cuMemRelease(C.CUmemGenericAllocationHandle(h)))
}

// ReserveAddress reserves size bytes of virtual addresses aligned to align (both multiples of
// the allocation granularity).
func ReserveAddress(size, align uint64) (Ptr, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	return Ptr(p), check("cuMemAddressReserve", C.gc_cuMemAddressReserve(&p, C.size_t(size), C.size_t(align)))
}

// FreeAddress gives back a reservation of ReserveAddress (nothing may be mapped in it).
func FreeAddress(p Ptr, size uint64) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuMemAddressFree", C.gc_cuMemAddressFree(C.CUdeviceptr(p), C.size_t(size)))
}

// Map maps the first size bytes of h at p, inside a reservation.
func Map(p Ptr, size uint64, h MemHandle) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuMemMap", C.gc_cuMemMap(C.CUdeviceptr(p), C.size_t(size), C.CUmemGenericAllocationHandle(h)))
}

// Unmap undoes one Map (p and size as mapped).
func Unmap(p Ptr, size uint64) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuMemUnmap", C.gc_cuMemUnmap(C.CUdeviceptr(p), C.size_t(size)))
}

// SetAccess lets dev read and write the mapped range [p, p+size).
func SetAccess(p Ptr, size uint64, dev Device) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuMemSetAccess", C.gc_cuMemSetAccessRW(C.CUdeviceptr(p), C.size_t(size), C.int(dev)))
}

// Alloc allocates n bytes of device memory in the current context.
func Alloc(n int) (Ptr, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	return Ptr(p), check("cuMemAlloc", C.gc_cuMemAlloc(&p, C.size_t(n)))
}

// HostRegister pins b (host memory of this process, page-aligned, e.g. a shared mapping) for
// every context and maps it for the device: stream memory ops and kernels reach it at the
// returned address while the CPU reads and writes it in place.
func HostRegister(b []byte) (Ptr, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	if len(b) == 0 {
		return 0, errors.New("cuda: registering no host memory")
	}
	if err := check("cuMemHostRegister", C.gc_cuMemHostRegister(unsafe.Pointer(&b[0]), C.size_t(len(b)))); err != nil {
		return 0, err
	}
	var d C.CUdeviceptr
	if err := check("cuMemHostGetDevicePointer", C.gc_cuMemHostGetDevicePointer(&d, unsafe.Pointer(&b[0]))); err != nil {
		C.gc_cuMemHostUnregister(unsafe.Pointer(&b[0]))
		return 0, err
	}
	return Ptr(d), nil
}

// HostUnregister undoes HostRegister(b).
func HostUnregister(b []byte) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuMemHostUnregister", C.gc_cuMemHostUnregister(unsafe.Pointer(&b[0])))
}

// AddressRange is the allocation p lies in, as the driver knows it: its base and size.
func AddressRange(p Ptr) (base Ptr, size uint64, err error) {
	if err := loaded(); err != nil {
		return 0, 0, err
	}
	var b C.CUdeviceptr
	var n C.size_t
	err = check("cuMemGetAddressRange", C.gc_cuMemGetAddressRange(&b, &n, C.CUdeviceptr(p)))
	return Ptr(b), uint64(n), err
}

// Free releases memory from Alloc.
func Free(p Ptr) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuMemFree", C.gc_cuMemFree(C.CUdeviceptr(p)))
}

// CopyToHostOn copies len(dst) bytes from src on stream s and waits for it. On a
// non-blocking stream it does not wait for work queued on other streams (copy engines run
// even while kernels elsewhere are stuck).
func (s Stream) CopyToHostOn(dst []byte, src Ptr) error {
	if err := loaded(); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	if err := check("cuMemcpyDtoHAsync", C.gc_cuMemcpyDtoHAsync(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst)), s.p)); err != nil {
		return err
	}
	return s.Synchronize()
}

// CopyToDeviceOn copies src to dst on stream s and waits for it (see CopyToHostOn).
func (s Stream) CopyToDeviceOn(dst Ptr, src []byte) error {
	if err := loaded(); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	if err := check("cuMemcpyHtoDAsync", C.gc_cuMemcpyHtoDAsync(C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src)), s.p)); err != nil {
		return err
	}
	return s.Synchronize()
}

// DeviceByUUID finds the visible device with this UUID.
func DeviceByUUID(uuid [16]byte) (Device, error) {
	n, err := DeviceCount()
	if err != nil {
		return 0, err
	}
	for i := 0; i < n; i++ {
		d, err := DeviceGet(i)
		if err != nil {
			return 0, err
		}
		if u, err := d.UUID(); err == nil && u == uuid {
			return d, nil
		}
	}
	return 0, fmt.Errorf("cuda: no visible device has UUID %x (CUDA_VISIBLE_DEVICES differs between the rank and its sidecar?)", uuid)
}

// Module is a loaded CUDA module (a cubin).
type Module struct{ p C.CUmodule }

// Function is a kernel of a Module.
type Function struct{ p C.CUfunction }

// LoadModule loads a cubin into the current context.
func LoadModule(image []byte) (Module, error) {
	if err := loaded(); err != nil {
		return Module{}, err
	}
	if len(image) == 0 {
		return Module{}, fmt.Errorf("cuda: empty module image")
	}
	img := C.CBytes(image)
	defer C.free(img)
	var m C.CUmodule
	return Module{m}, check("cuModuleLoadData", C.gc_cuModuleLoadData(&m, img))
}

// Handle is the CUmodule, for libraries that set up state in it (nvshmemx_cumodule_init).
func (m Module) Handle() uintptr { return uintptr(unsafe.Pointer(m.p)) }

// Unload the module.
func (m Module) Unload() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("cuModuleUnload", C.gc_cuModuleUnload(m.p))
}

// Function looks a kernel up by its (extern "C") name.
func (m Module) Function(name string) (Function, error) {
	if err := loaded(); err != nil {
		return Function{}, err
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var f C.CUfunction
	return Function{f}, check("cuModuleGetFunction "+name, C.gc_cuModuleGetFunction(&f, m.p, cname))
}

// Args builds a kernel's parameter list: each value is appended with its size, in order.
type Args struct {
	vals  []byte
	sizes []C.int
}

// Ptr appends a device pointer (or any 8-byte unsigned value).
func (a *Args) Ptr(p uint64) *Args { return a.raw(binary.LittleEndian.AppendUint64(nil, p)) }

// I64 appends a 64-bit integer.
func (a *Args) I64(v int64) *Args { return a.raw(binary.LittleEndian.AppendUint64(nil, uint64(v))) }

// I32 appends a 32-bit integer.
func (a *Args) I32(v int32) *Args { return a.raw(binary.LittleEndian.AppendUint32(nil, uint32(v))) }

// Struct appends a struct passed by value, as its bytes (the kernel's layout, little-endian).
func (a *Args) Struct(b []byte) *Args { return a.raw(b) }

func (a *Args) raw(b []byte) *Args {
	a.vals = append(a.vals, b...)
	a.sizes = append(a.sizes, C.int(len(b)))
	return a
}

// Launch enqueues f on s with grid x block threads and shared bytes of dynamic shared memory.
func (f Function) Launch(grid, block [3]int, shared int, s Stream, a *Args) error {
	if err := loaded(); err != nil {
		return err
	}
	var vals *C.char
	var sizes *C.int
	if len(a.sizes) > 0 {
		cv := C.CBytes(a.vals)
		defer C.free(cv)
		cs := C.malloc(C.size_t(len(a.sizes)) * C.size_t(unsafe.Sizeof(C.int(0))))
		defer C.free(cs)
		copy(unsafe.Slice((*C.int)(cs), len(a.sizes)), a.sizes)
		vals, sizes = (*C.char)(cv), (*C.int)(cs)
	}
	return check("cuLaunchKernel", C.gc_launch(f.p, C.uint(grid[0]), C.uint(grid[1]), C.uint(grid[2]),
		C.uint(block[0]), C.uint(block[1]), C.uint(block[2]), C.uint(shared), s.p, vals, sizes, C.int(len(a.sizes))))
}
