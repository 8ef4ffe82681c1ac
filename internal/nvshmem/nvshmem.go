// Package nvshmem binds the NVSHMEM host calls the sidecar needs, loaded at run time from
// libnvshmem_host.so.3 (the nvidia-nvshmem wheel torch ships, or NVSHMEM_HOME) so that
// pgserver builds and starts where there is none.
//
// Three layers, as in internal/cuda: a C table of pointers filled by dlsym (only the
// prototypes used, no NVSHMEM headers); thin wrappers returning Status; the typed calls.
//
// Init uses the unique-id bootstrap through the library's exported entry points:
// nvshmemx_init_attr is a static inline in NVSHMEM's header that calls a symbol the shared
// library does not export, so Init fills the attribute struct itself and calls
// nvshmemx_hostlib_init_attr, as nvshmem4py does. The struct layouts below were checked with
// offsetof against the 3.4.5 headers:
//
//	nvshmemx_uniqueid_t     128 bytes: int version (0x10080), then opaque
//	nvshmemx_init_attr_t    144 bytes: int version (0x10090) @0, void* mpi_comm @8,
//	                        args @16 { int version (0x10080) @16, uid_args @24 { int version
//	                        (0x10018) @24, id* @32, int myrank @40, int nranks @44 }, pad }
//
// Every host call needs the GPU's context current on the calling OS thread (the library
// links the CUDA runtime statically and binds to the current context at init).
package nvshmem

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void* CUmodule;
static void* gs_lib;
static int (*p_get_uniqueid)(void*);
static int (*p_set_attr_uniqueid_args)(int, int, const void*, void*);
static int (*p_hostlib_init_attr)(unsigned int, void*);
static void (*p_hostlib_finalize)(void);
static int (*p_my_pe)(void);
static int (*p_n_pes)(void);
static void* (*p_malloc)(size_t);
static void (*p_free)(void*);
static void* (*p_ptr)(const void*, int);
static void (*p_barrier_all)(void);
static int (*p_cumodule_init)(CUmodule);
static int (*p_cumodule_finalize)(CUmodule);

static int gs_load(const char* path, char* err, int errlen) {
	void* h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
	if (!h) {
		const char* e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		return -1;
	}
#define SYM(var, name) do { *(void**)(&var) = dlsym(h, name); if (!var) { snprintf(err, errlen, "symbol %s missing", name); return -1; } } while (0)
	SYM(p_get_uniqueid, "nvshmemx_get_uniqueid");
	SYM(p_set_attr_uniqueid_args, "nvshmemx_set_attr_uniqueid_args");
	SYM(p_hostlib_init_attr, "nvshmemx_hostlib_init_attr");
	SYM(p_hostlib_finalize, "nvshmemx_hostlib_finalize");
	SYM(p_my_pe, "nvshmem_my_pe");
	SYM(p_n_pes, "nvshmem_n_pes");
	SYM(p_malloc, "nvshmem_malloc");
	SYM(p_free, "nvshmem_free");
	SYM(p_ptr, "nvshmem_ptr");
	SYM(p_barrier_all, "nvshmem_barrier_all");
	SYM(p_cumodule_init, "nvshmemx_cumodule_init");
	SYM(p_cumodule_finalize, "nvshmemx_cumodule_finalize");
#undef SYM
	gs_lib = h;
	return 0;
}
static int gs_get_uniqueid(void* id) { return p_get_uniqueid(id); }
// gs_init fills the attribute struct (versions as the inline nvshmemx_init_attr writes them)
// in C memory that outlives the call, and initialises with the unique-id bootstrap.
static int gs_init(const void* id, int rank, int nranks) {
	static unsigned char uid[128];
	static unsigned char attr[144];
	memcpy(uid, id, sizeof uid);
	memset(attr, 0, sizeof attr);
	*(int*)(attr + 0) = (1 << 16) + 144;
	*(int*)(attr + 16) = (1 << 16) + 128;
	*(int*)(attr + 24) = (1 << 16) + 24;
	int r = p_set_attr_uniqueid_args(rank, nranks, uid, attr);
	if (r != 0) return r;
	return p_hostlib_init_attr(1u << 3, attr); // NVSHMEMX_INIT_WITH_UNIQUEID
}
static void gs_finalize(void) { p_hostlib_finalize(); }
static int gs_my_pe(void) { return p_my_pe(); }
static int gs_n_pes(void) { return p_n_pes(); }
static uintptr_t gs_malloc(size_t n) { return (uintptr_t)p_malloc(n); }
static void gs_free(uintptr_t p) { p_free((void*)p); }
static uintptr_t gs_ptr(uintptr_t p, int pe) { return (uintptr_t)p_ptr((const void*)p, pe); }
static void gs_barrier_all(void) { p_barrier_all(); }
static int gs_cumodule_init(uintptr_t m) { return p_cumodule_init((CUmodule)m); }
static int gs_cumodule_finalize(uintptr_t m) { return p_cumodule_finalize((CUmodule)m); }
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"github.com/gocomm/gocomm/internal/dl"
)

// ErrNotLoaded: libnvshmem_host.so.3 is not (or could not be) loaded.
var ErrNotLoaded = errors.New("nvshmem: host library not loaded")

// Status is an NVSHMEM return code; every non-zero value is an error.
type Status int32

func (s Status) Error() string {
	switch s {
	case -1:
		return "NVSHMEMX_ERROR_INVALID_VALUE"
	case -2:
		return "NVSHMEMX_ERROR_OUT_OF_MEMORY"
	case -3:
		return "NVSHMEMX_ERROR_NOT_SUPPORTED"
	case -4:
		return "NVSHMEMX_ERROR_SYMMETRY"
	case -5:
		return "NVSHMEMX_ERROR_GPU_NOT_SELECTED"
	case -6:
		return "NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED"
	case -7:
		return "NVSHMEMX_ERROR_INTERNAL"
	case -8:
		return "NVSHMEMX_ERROR_SENTINEL"
	}
	return fmt.Sprintf("NVSHMEM status %d", int32(s))
}

func check(what string, r C.int) error {
	if r == 0 {
		return nil
	}
	return fmt.Errorf("nvshmem: %s: %w", what, Status(r))
}

// LibraryName is the host library's file name.
const LibraryName = "libnvshmem_host.so.3"

// Find returns where the host library is: $NVSHMEM_HOME/lib, then the nvidia-nvshmem wheel
// next to each Python path given (site-packages directories), else the bare name for the
// dynamic loader's own search.
func Find(sitePackages ...string) string {
	var cands []string
	if home := os.Getenv("NVSHMEM_HOME"); home != "" {
		cands = append(cands, filepath.Join(home, "lib", LibraryName))
	}
	for _, sp := range sitePackages {
		cands = append(cands, filepath.Join(sp, "nvidia", "nvshmem", "lib", LibraryName))
	}
	for _, c := range cands {
		if _, err := os.Stat(c); err == nil {
			return c
		}
	}
	return LibraryName
}

var lib = dl.New("nvshmem", LibraryName, ErrNotLoaded)

// Load opens the host library at path ("" for LibraryName through the loader's search),
// once; a later call with another path fails.
func Load(path string) error {
	return lib.Load(path, func(path string) string {
		var buf [512]C.char
		cpath := C.CString(path)
		defer C.free(unsafe.Pointer(cpath))
		if C.gs_load(cpath, &buf[0], C.int(len(buf))) != 0 {
			return C.GoString(&buf[0])
		}
		return ""
	})
}

func loaded() error { return lib.Loaded() }

// UniqueID is the bootstrap id rank 0 makes and every PE initialises with.
type UniqueID [128]byte

// NewUniqueID makes a bootstrap id; the calling process must then be PE 0 of the job (the
// id names a listener it starts).
func NewUniqueID() (UniqueID, error) {
	var id UniqueID
	if err := loaded(); err != nil {
		return id, err
	}
	p := C.malloc(C.size_t(len(id)))
	defer C.free(p)
	C.memset(p, 0, C.size_t(len(id)))
	if err := check("nvshmemx_get_uniqueid", C.gs_get_uniqueid(p)); err != nil {
		return id, err
	}
	copy(id[:], C.GoBytes(p, C.int(len(id))))
	return id, nil
}

// Init makes this process PE rank of nranks with the unique-id bootstrap (collective; the
// GPU's context must be current on this thread). Options are read from the environment
// (NVSHMEM_SYMMETRIC_SIZE, NVSHMEM_DISABLE_NCCL, ...), so set them first.
func Init(id UniqueID, rank, nranks int) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("nvshmemx_hostlib_init_attr", C.gs_init(unsafe.Pointer(&id[0]), C.int(rank), C.int(nranks)))
}

// Finalize ends this PE.
func Finalize() error {
	if err := loaded(); err != nil {
		return err
	}
	C.gs_finalize()
	return nil
}

// MyPE and NPEs are this PE's number and the job's size (-1 before the library is loaded).
func MyPE() int {
	if loaded() != nil {
		return -1
	}
	return int(C.gs_my_pe())
}

// NPEs: see MyPE.
func NPEs() int {
	if loaded() != nil {
		return -1
	}
	return int(C.gs_n_pes())
}

// Malloc allocates n bytes of the symmetric heap (collective: every PE, same sizes, same
// order); 0 when the heap is too small (NVSHMEM_SYMMETRIC_SIZE).
func Malloc(n int) (uintptr, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	p := uintptr(C.gs_malloc(C.size_t(n)))
	if p == 0 && n > 0 {
		return 0, fmt.Errorf("nvshmem: nvshmem_malloc(%d) failed: the symmetric heap is too small "+
			"(raise NVSHMEM_SYMMETRIC_SIZE, or gocomm's heap option)", n)
	}
	return p, nil
}

// Free releases a symmetric allocation (collective).
func Free(p uintptr) {
	if loaded() == nil {
		C.gs_free(C.uintptr_t(p))
	}
}

// Ptr is the address through which this PE reaches symmetric address p on PE pe by plain
// loads and stores (NVLink), or 0 when it cannot (or the library is not loaded).
func Ptr(p uintptr, pe int) uintptr {
	if loaded() != nil {
		return 0
	}
	return uintptr(C.gs_ptr(C.uintptr_t(p), C.int(pe)))
}

// BarrierAll waits for every PE (host side).
func BarrierAll() error {
	if err := loaded(); err != nil {
		return err
	}
	C.gs_barrier_all()
	return nil
}

// ModuleInit sets up NVSHMEM's device state in a module loaded with cuModuleLoadData (its
// CUmodule handle); ModuleFinalize before unloading it.
func ModuleInit(module uintptr) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("nvshmemx_cumodule_init", C.gs_cumodule_init(C.uintptr_t(module)))
}

// ModuleFinalize undoes ModuleInit.
func ModuleFinalize(module uintptr) error {
	if err := loaded(); err != nil {
		return err
	}
	return check("nvshmemx_cumodule_finalize", C.gs_cumodule_finalize(C.uintptr_t(module)))
}
