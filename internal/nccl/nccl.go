// Package nccl binds the NCCL calls the sidecar's CUDA engine makes, loaded at run time
// (libnccl.so.2; the shim passes the path of the copy torch itself loaded, so one process
// tree runs one NCCL). Same three layers as internal/cuda: a dlsym table, wrappers returning
// Result (which implements error and names itself without the library), typed calls.
package nccl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int ncclResult_t;
typedef void* ncclComm_t;
typedef void* cudaStream_t;
typedef struct { char internal[128]; } ncclUniqueId;

static void* gn_lib;
static ncclResult_t (*p_ncclGetVersion)(int*);
static ncclResult_t (*p_ncclGetUniqueId)(ncclUniqueId*);
static ncclResult_t (*p_ncclCommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
static ncclResult_t (*p_ncclCommSplit)(ncclComm_t, int, int, ncclComm_t*, void*);
static ncclResult_t (*p_ncclCommDestroy)(ncclComm_t);
static ncclResult_t (*p_ncclCommAbort)(ncclComm_t);
static ncclResult_t (*p_ncclCommGetAsyncError)(ncclComm_t, ncclResult_t*);
static const char* (*p_ncclGetErrorString)(ncclResult_t);
static const char* (*p_ncclGetLastError)(ncclComm_t);
static ncclResult_t (*p_ncclAllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
static ncclResult_t (*p_ncclBroadcast)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
static ncclResult_t (*p_ncclReduce)(const void*, void*, size_t, int, int, int, ncclComm_t, cudaStream_t);
static ncclResult_t (*p_ncclAllGather)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t);
static ncclResult_t (*p_ncclReduceScatter)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
static ncclResult_t (*p_ncclSend)(const void*, size_t, int, int, ncclComm_t, cudaStream_t);
static ncclResult_t (*p_ncclRecv)(void*, size_t, int, int, ncclComm_t, cudaStream_t);
static ncclResult_t (*p_ncclAlltoAll)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t);
static ncclResult_t (*p_ncclGroupStart)(void);
static ncclResult_t (*p_ncclGroupEnd)(void);

static int gn_load(const char* path, char* err, int errlen) {
	void* h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
	if (!h) {
		const char* e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		return -1;
	}
#define SYM(var, name) do { *(void**)(&var) = dlsym(h, name); if (!var) { snprintf(err, errlen, "symbol %s missing", name); return -1; } } while (0)
	SYM(p_ncclGetVersion, "ncclGetVersion");
	SYM(p_ncclGetUniqueId, "ncclGetUniqueId");
	SYM(p_ncclCommInitRank, "ncclCommInitRank");
	SYM(p_ncclCommSplit, "ncclCommSplit");
	SYM(p_ncclCommDestroy, "ncclCommDestroy");
	SYM(p_ncclCommAbort, "ncclCommAbort");
	SYM(p_ncclCommGetAsyncError, "ncclCommGetAsyncError");
	SYM(p_ncclGetErrorString, "ncclGetErrorString");
	SYM(p_ncclGetLastError, "ncclGetLastError");
	SYM(p_ncclAllReduce, "ncclAllReduce");
	SYM(p_ncclBroadcast, "ncclBroadcast");
	SYM(p_ncclReduce, "ncclReduce");
	SYM(p_ncclAllGather, "ncclAllGather");
	SYM(p_ncclReduceScatter, "ncclReduceScatter");
	SYM(p_ncclSend, "ncclSend");
	SYM(p_ncclRecv, "ncclRecv");
	SYM(p_ncclGroupStart, "ncclGroupStart");
	SYM(p_ncclGroupEnd, "ncclGroupEnd");
#undef SYM
	// NCCL 2.28 and later: the all-to-all of equal blocks as one collective (optional).
	*(void**)(&p_ncclAlltoAll) = dlsym(h, "ncclAlltoAll");
	gn_lib = h;
	return 0;
}

static ncclResult_t gn_version(int* v) { return p_ncclGetVersion(v); }
static ncclResult_t gn_unique_id(void* id) { return p_ncclGetUniqueId((ncclUniqueId*)id); }
static ncclResult_t gn_init_rank(ncclComm_t* c, int n, const void* id, int r) {
	ncclUniqueId u; memcpy(&u, id, sizeof u); return p_ncclCommInitRank(c, n, u, r);
}
static ncclResult_t gn_split(ncclComm_t c, int color, int key, ncclComm_t* out) { return p_ncclCommSplit(c, color, key, out, NULL); }
static ncclResult_t gn_destroy(ncclComm_t c) { return p_ncclCommDestroy(c); }
static ncclResult_t gn_abort(ncclComm_t c) { return p_ncclCommAbort(c); }
static ncclResult_t gn_async_error(ncclComm_t c, ncclResult_t* r) { return p_ncclCommGetAsyncError(c, r); }
static const char* gn_error_string(ncclResult_t r) { return p_ncclGetErrorString(r); }
static const char* gn_last_error(ncclComm_t c) { return p_ncclGetLastError(c); }
// Buffers cross as uintptr_t: device addresses are not Go pointers, so they become void* only in C.
static ncclResult_t gn_all_reduce(uintptr_t s, uintptr_t r, size_t n, int dt, int op, ncclComm_t c, cudaStream_t st) { return p_ncclAllReduce((const void*)s, (void*)r, n, dt, op, c, st); }
static ncclResult_t gn_broadcast(uintptr_t s, uintptr_t r, size_t n, int dt, int root, ncclComm_t c, cudaStream_t st) { return p_ncclBroadcast((const void*)s, (void*)r, n, dt, root, c, st); }
static ncclResult_t gn_reduce(uintptr_t s, uintptr_t r, size_t n, int dt, int op, int root, ncclComm_t c, cudaStream_t st) { return p_ncclReduce((const void*)s, (void*)r, n, dt, op, root, c, st); }
static ncclResult_t gn_all_gather(uintptr_t s, uintptr_t r, size_t n, int dt, ncclComm_t c, cudaStream_t st) { return p_ncclAllGather((const void*)s, (void*)r, n, dt, c, st); }
static ncclResult_t gn_reduce_scatter(uintptr_t s, uintptr_t r, size_t n, int dt, int op, ncclComm_t c, cudaStream_t st) { return p_ncclReduceScatter((const void*)s, (void*)r, n, dt, op, c, st); }
static ncclResult_t gn_send(uintptr_t s, size_t n, int dt, int peer, ncclComm_t c, cudaStream_t st) { return p_ncclSend((const void*)s, n, dt, peer, c, st); }
static ncclResult_t gn_recv(uintptr_t r, size_t n, int dt, int peer, ncclComm_t c, cudaStream_t st) { return p_ncclRecv((void*)r, n, dt, peer, c, st); }
static int gn_has_all_to_all(void) { return p_ncclAlltoAll != NULL; }
static ncclResult_t gn_all_to_all(uintptr_t s, uintptr_t r, size_t n, int dt, ncclComm_t c, cudaStream_t st) { return p_ncclAlltoAll((const void*)s, (void*)r, n, dt, c, st); }
static ncclResult_t gn_group_start(void) { return p_ncclGroupStart(); }
static ncclResult_t gn_group_end(void) { return p_ncclGroupEnd(); }
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/gocomm/gocomm/internal/dl"
)

// ErrNotLoaded: libnccl is not (or could not be) loaded.
var ErrNotLoaded = errors.New("nccl: library not loaded")

var lib = dl.New("nccl", "libnccl.so.2", ErrNotLoaded)

// Load opens libnccl from path ("" means "libnccl.so.2" through the loader's search). The
// first successful load wins; a later call with another path reports which copy is in use.
func Load(path string) error {
	return lib.Load(path, func(path string) string {
		var buf [512]C.char
		cpath := C.CString(path)
		defer C.free(unsafe.Pointer(cpath))
		if C.gn_load(cpath, &buf[0], C.int(len(buf))) != 0 {
			return C.GoString(&buf[0])
		}
		return ""
	})
}

func loaded() error { return lib.Loaded() }

// Result is ncclResult_t.
type Result int32

// NCCL results.
const (
	Success            Result = 0
	UnhandledCudaError Result = 1
	SystemError        Result = 2
	InternalError      Result = 3
	InvalidArgument    Result = 4
	InvalidUsage       Result = 5
	RemoteError        Result = 6
	InProgress         Result = 7
)

var names = [...]string{"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
	"ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress"}

func (r Result) Error() string {
	if r >= 0 && int(r) < len(names) {
		return names[r]
	}
	return fmt.Sprintf("ncclResult %d", int32(r))
}

func check(what string, r C.ncclResult_t) error {
	if Result(r) == Success {
		return nil
	}
	return fmt.Errorf("nccl: %s: %w", what, Result(r))
}

// Version is NCCL's version code, e.g. 22809 for 2.28.9.
func Version() (int, error) {
	if err := loaded(); err != nil {
		return 0, err
	}
	var v C.int
	return int(v), check("ncclGetVersion", C.gn_version(&v))
}

// UniqueID bootstraps a communicator; rank 0 makes it and hands it to the others.
type UniqueID [128]byte

// NewUniqueID makes a bootstrap id (it starts NCCL's bootstrap listener in this process).
func NewUniqueID() (UniqueID, error) {
	var id UniqueID
	if err := loaded(); err != nil {
		return id, err
	}
	return id, check("ncclGetUniqueId", C.gn_unique_id(unsafe.Pointer(&id[0])))
}

// Comm is a communicator.
type Comm struct{ p C.ncclComm_t }

// InitRank joins rank of an nranks communicator on the current CUDA device (blocking).
func InitRank(nranks int, id UniqueID, rank int) (Comm, error) {
	if err := loaded(); err != nil {
		return Comm{}, err
	}
	var c C.ncclComm_t
	return Comm{c}, check("ncclCommInitRank", C.gn_init_rank(&c, C.int(nranks), unsafe.Pointer(&id[0]), C.int(rank)))
}

// Split makes a communicator of the ranks passing the same color (ordered by key); a rank
// passing color -1 (NCCL_SPLIT_NOCOLOR) takes part in the call and gets no communicator.
func (c Comm) Split(color, key int) (Comm, error) {
	if err := loaded(); err != nil {
		return Comm{}, err
	}
	var out C.ncclComm_t
	return Comm{out}, check("ncclCommSplit", C.gn_split(c.p, C.int(color), C.int(key), &out))
}

// Valid reports whether the communicator exists (Split with no color returns none).
func (c Comm) Valid() bool { return c.p != nil }

// Destroy frees the communicator after its queued work completes.
func (c Comm) Destroy() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("ncclCommDestroy", C.gn_destroy(c.p))
}

// Abort frees the communicator at once, cancelling its queued and running work; it is what
// the watchdog calls on a timeout or a peer's death.
func (c Comm) Abort() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("ncclCommAbort", C.gn_abort(c.p))
}

// AsyncError returns an error the communicator hit in the background (a peer failure, a
// network error), or nil.
func (c Comm) AsyncError() error {
	if err := loaded(); err != nil {
		return err
	}
	var r C.ncclResult_t
	if err := check("ncclCommGetAsyncError", C.gn_async_error(c.p, &r)); err != nil {
		return err
	}
	if Result(r) == Success || Result(r) == InProgress {
		return nil
	}
	return fmt.Errorf("nccl: %w: %s", Result(r), C.GoString(C.gn_last_error(c.p)))
}

// DataType is ncclDataType_t.
type DataType int32

// NCCL data types.
const (
	Int8 DataType = iota
	Uint8
	Int32
	Uint32
	Int64
	Uint64
	Float16
	Float32
	Float64
	BFloat16
	Float8E4M3
	Float8E5M2
)

// RedOp is ncclRedOp_t.
type RedOp int32

// NCCL reduction ops.
const (
	Sum RedOp = iota
	Prod
	Max
	Min
	Avg
)

// Stream is a cudaStream_t (the sidecar's, from internal/cuda).
type Stream unsafe.Pointer

func (c Comm) enqueue(what string, r C.ncclResult_t) error {
	if err := check(what, r); err != nil {
		if msg := C.GoString(C.gn_last_error(c.p)); msg != "" {
			return fmt.Errorf("%w: %s", err, msg)
		}
		return err
	}
	return nil
}

// AllReduce queues recv = reduce(send) over the communicator on stream (in place if equal).
func (c Comm) AllReduce(send, recv uintptr, count int, dt DataType, op RedOp, s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	return c.enqueue("ncclAllReduce", C.gn_all_reduce(C.uintptr_t(send), C.uintptr_t(recv), C.size_t(count), C.int(dt), C.int(op), c.p, C.cudaStream_t(s)))
}

// Broadcast queues root's send into every rank's recv.
func (c Comm) Broadcast(send, recv uintptr, count int, dt DataType, root int, s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	return c.enqueue("ncclBroadcast", C.gn_broadcast(C.uintptr_t(send), C.uintptr_t(recv), C.size_t(count), C.int(dt), C.int(root), c.p, C.cudaStream_t(s)))
}

// Reduce queues the reduction of send into root's recv.
func (c Comm) Reduce(send, recv uintptr, count int, dt DataType, op RedOp, root int, s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	return c.enqueue("ncclReduce", C.gn_reduce(C.uintptr_t(send), C.uintptr_t(recv), C.size_t(count), C.int(dt), C.int(op), C.int(root), c.p, C.cudaStream_t(s)))
}

// AllGather queues the gathering of every rank's count elements into recv.
func (c Comm) AllGather(send, recv uintptr, count int, dt DataType, s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	return c.enqueue("ncclAllGather", C.gn_all_gather(C.uintptr_t(send), C.uintptr_t(recv), C.size_t(count), C.int(dt), c.p, C.cudaStream_t(s)))
}

// ReduceScatter queues the reduction of send, leaving count elements of block rank in recv.
func (c Comm) ReduceScatter(send, recv uintptr, count int, dt DataType, op RedOp, s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	return c.enqueue("ncclReduceScatter", C.gn_reduce_scatter(C.uintptr_t(send), C.uintptr_t(recv), C.size_t(count), C.int(dt), C.int(op), c.p, C.cudaStream_t(s)))
}

// Send queues count elements to peer (pair with the peer's Recv; group several with
// GroupStart/GroupEnd).
func (c Comm) Send(send uintptr, count int, dt DataType, peer int, s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	return c.enqueue("ncclSend", C.gn_send(C.uintptr_t(send), C.size_t(count), C.int(dt), C.int(peer), c.p, C.cudaStream_t(s)))
}

// Recv queues count elements from peer.
func (c Comm) Recv(recv uintptr, count int, dt DataType, peer int, s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	return c.enqueue("ncclRecv", C.gn_recv(C.uintptr_t(recv), C.size_t(count), C.int(dt), C.int(peer), c.p, C.cudaStream_t(s)))
}

// HasAllToAll says whether the loaded NCCL has ncclAlltoAll (2.28 and later).
func HasAllToAll() bool { return loaded() == nil && C.gn_has_all_to_all() != 0 }

// AllToAll queues the exchange of equal blocks: count elements of send to each rank, count
// from each into recv (rank order). send and recv must not overlap. Only where HasAllToAll.
func (c Comm) AllToAll(send, recv uintptr, count int, dt DataType, s Stream) error {
	if err := loaded(); err != nil {
		return err
	}
	if C.gn_has_all_to_all() == 0 {
		return errors.New("nccl: this NCCL has no ncclAlltoAll (2.28 and later)")
	}
	return c.enqueue("ncclAlltoAll", C.gn_all_to_all(C.uintptr_t(send), C.uintptr_t(recv), C.size_t(count), C.int(dt), c.p, C.cudaStream_t(s)))
}

// GroupStart and GroupEnd fuse the calls between them (send/recv pairs of an all-to-all).
func GroupStart() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("ncclGroupStart", C.gn_group_start())
}

// GroupEnd ends a group started by GroupStart.
func GroupEnd() error {
	if err := loaded(); err != nil {
		return err
	}
	return check("ncclGroupEnd", C.gn_group_end())
}
