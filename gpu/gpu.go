// Package gpu is the seam between the sidecar's sessions (pg) and its GPU engine
// (collectives/device): what pg asks of the engine and the types both pass across.
package gpu

import (
	"context"
	"errors"
	"time"

	"github.com/gocomm/gocomm/segment"
	"github.com/gocomm/gocomm/wire"
)

// Engine is the GPU half of the sidecar. Package collectives/device implements it
// with the CUDA driver and NCCL; cmd/pgserver wires it in where the driver loads, and pg
// runs without one (CPU tensors only) everywhere else, tests included.
type Engine interface {
	// Info says whether GPUs can be used, and if not why; and which devices there are.
	Info() (available bool, detail string, devices []Device)
	// LoadNCCL loads the NCCL library the client uses (its path; "" for the default).
	LoadNCCL(path string) error
	// LoadNVSHMEM loads the NVSHMEM host library that goes with the client's NCCL (the
	// nvidia-nvshmem wheel beside it, or NVSHMEM_HOME); nil when the NVSHMEM engine can run.
	LoadNVSHMEM() error
	// Check says whether a reduction of dtype by op can run on the device.
	Check(dt wire.DType, op wire.RedOp) error
	// Attach binds a session to the device with this UUID; its counter memory is a file it
	// makes in dir (Session.CountersPath). released, where not nil, is called
	// with the slot before any release of a slot's counters (Session.Release, and the releases
	// the engine makes itself when it aborts a group) writes them: whoever made the session learns
	// of a release before any stream it lets go can run on.
	Attach(uuid [16]byte, dir string, released func(slot int)) (Session, error)
}

// Device describes one GPU.
type Device struct {
	Index int
	Name  string
	UUID  [16]byte
}

// Session is one client's use of its device.
type Session interface {
	// CountersPath is the file holding the session's counter memory (CounterMemBytes of
	// shared host memory, zeroed, registered for the device in the engine's process): the
	// client maps it, registers it for its own streams and unlinks it, to order its streams
	// against the engine's (see NewGroup) and to wait for graph ops (TriggerOffset). Being
	// host memory, a release is a CPU store that no stream can hold up.
	CountersPath() string
	// RegisterIPC maps an allocation of the client (CUDA IPC handle) as segment seg.
	RegisterIPC(seg uint32, handle [64]byte, size uint64) error
	// RegisterVMM maps, as segment seg, an allocation of the client made of physical chunks
	// (cuMemCreate, torch's expandable segments) that lie back to back in its address space:
	// fds[i] is chunk i's POSIX file descriptor (exported by the client, passed over the fd
	// socket), sizes[i] its length. The fds stay the caller's to close. DropIPC drops it too.
	RegisterVMM(seg uint32, fds []int, sizes []uint64) error
	// DropIPC unmaps a segment the client says is gone, once no op holds it.
	DropIPC(seg uint32) error
	// Segments counts the client's allocations registered and mapped here.
	Segments() segment.Stats
	// Resolve bounds-checks each (seg, offset, length) and returns the device addresses,
	// holding the segments mapped until release is called.
	Resolve(refs []wire.BufRef) (ptrs []uint64, release func(), err error)
	// NewGroup makes this rank's member of a group on the device. slot names the group's
	// counters (see CounterSlots): before its k-th collective the client's stream writes
	// ready = k; the engine's stream waits for that, runs the op and writes done = k, and the
	// client's stream waits for done >= k when the op's work is waited on. Point-to-point ops
	// count on the second pair. link carries the engine's own messages to the group's other
	// ranks (communicator ids), over the group's host links.
	// base is where the slot's counters stand, per lane: the client's first op of a lane
	// has value base+1.
	NewGroup(rank, size, slot int, base [2]uint32, link PeerLink) (Group, error)
	// Release lets every stream waiting on slot's counters go on: it writes ready = done =
	// floor + ReleaseAhead on both lanes, floor being the last stream value the group saw per
	// lane (or its base). Writing from the floor, not from what the counters hold, makes a
	// second release write the same values (waits compare cyclically, so pushing twice could
	// put the counters behind again) and covers ready values the sidecar never saw. The
	// client's stream waits for each op it submitted, so an op refused before any device
	// group of the slot exists must still be let through (the group is broken, the op failed).
	Release(slot int, floor [2]uint32) error
	// ReleaseTriggers stores D[t] = 1 for each trigger t (TriggerOffset): a replaying
	// stream waiting for a graph op that failed, or that a broken group will not run, goes on.
	ReleaseTriggers(ts []uint32) error
	Close() error
}

// PeerLink carries a device group's control messages (a few bytes: communicator ids) to
// and from the group's other ranks. Messages of one (peer, tag) arrive in the order sent.
type PeerLink interface {
	Send(ctx context.Context, peer, tag int, b []byte) error
	// Recv returns the next message of n bytes from peer under tag.
	Recv(ctx context.Context, peer, tag, n int) ([]byte, error)
}

// Op is one op for the device engine: a validated descriptor and its buffers'
// device addresses (wire.Desc.Validate's roles).
type Op struct {
	Desc     *wire.Desc
	Ptrs     []uint64
	Deadline time.Time
	// Graph: the op is a replay of an op captured in a CUDA graph. It runs on the group's
	// graph lane (its own communicator and stream, in the order replays reach it) without
	// the stream counters, and the lane's stream writes D[Trigger] = 1 after it.
	Graph   bool
	Trigger uint32
	// Launched, where set, is called once the op's GPU work is queued on the engine's
	// stream (not for an op that failed before that).
	Launched func()
	// Done is called once, when the op finished on the GPU or failed.
	Done func(err error)
}

// Group runs one group's device ops in submission order on its own streams.
type Group interface {
	Enqueue(op Op)
	// ShmemID takes the group's NVSHMEM unique id, which the client carries between the
	// ranks through the torch Store: rank 0 gets a new one (id empty), every other rank hands
	// in rank 0's. The group's NVSHMEM PE is made with it at its first wire.OpAllToAllV.
	ShmemID(id []byte) ([]byte, error)
	// Abort fails everything pending, cancels what runs (ncclCommAbort) and releases the
	// client's waiting streams; the group stays broken.
	Abort(cause error)
	Close() error
}

// Errors of device ops.
var (
	// ErrNoDevice: the op needs a GPU this sidecar does not have (or was not given).
	ErrNoDevice = errors.New("no CUDA device attached")
	// ErrTimeout: an op did not finish before its deadline.
	ErrTimeout = errors.New("deadline exceeded")
)

// Counter slots live in a shared host-memory file the engine makes per session and both
// processes register for the device (docs/decisions/0004-stream-counters.md): a release is
// then a CPU store, which no stream stuck on a counter can hold up. Slot i is four u32 words
// at 16*i: collective ready, collective done, p2p ready, p2p done.
const (
	CounterBytes = 4096
	CounterSlots = CounterBytes / 16
	// ReleaseAhead is how far past a group's last seen stream value a release puts its
	// counters: 2^30, plus 2^24 for ready values a client wrote that the sidecar never read
	// (descriptors still in the ring when their group went away).
	ReleaseAhead = 1<<30 + 1<<24
)

// Graph op triggers (docs/decisions/0020): D[t], the word a replay's stream waits for, is
// the u32 at TriggerOffset + 4*t of the counter memory; T[t], the word it writes, is in a
// host page the client names (wire.RecGraphOp).
const (
	TriggerSlots    = 1024
	TriggerOffset   = CounterBytes
	CounterMemBytes = CounterBytes + 4*TriggerSlots
)
