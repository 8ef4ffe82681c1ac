// Package nvshmem is the sidecar's sparse engine: the all_to_all_v of Mixture-of-Experts
// layers over NVSHMEM (kernels/sidecar/a2av.cu), one-sided puts and signals between the GPUs
// of one NVLink domain. It holds the process's PE, its bootstrap (the unique id, init once
// every rank agrees) and the kernel's launch and checks; the CUDA engine
// (collectives/device) owns the device, the streams and the op queue and hands it an
// all_to_all_v through Session and Group.
package nvshmem

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/gocomm/gocomm/config"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/cuda"
	"github.com/gocomm/gocomm/internal/dl"
	lib "github.com/gocomm/gocomm/internal/nvshmem"
	"github.com/gocomm/gocomm/kernels"
	"github.com/gocomm/gocomm/wire"
)

// Status: passes the GPU suite on 2 and 4 H200s; the sidecar picks it when its client
// attaches (cmd/pgserver: NVLink topology, GOCOMM_TRANSPORT, the library loads).

// PeerLink tag of the NVSHMEM set-up: every rank -> every rank, whether its PE is ready for
// the heap. (The unique id travels through the torch Store: ShmemID.)
const tagShmemOK = 3

// Session is what the engine needs of the CUDA engine's session (one client's device).
type Session interface {
	// Do runs f on a locked OS thread with the device's context current.
	Do(f func() error) error
}

// Group is what the engine needs of one of the CUDA engine's groups.
type Group interface {
	Rank() int
	Size() int
	// Link is the group's host link (agree's exchange).
	Link() gpu.PeerLink
}

// Engine is a session's NVSHMEM PE, made once, by the first group that runs an all_to_all_v.
type Engine struct {
	s    Session
	log  *slog.Logger
	a2a  config.A2A
	path string // libnvshmem_host.so.3, found next to the client's NCCL (Path)

	mu  sync.Mutex
	sh  *shmem
	err error
}

// New is the engine of session s: path is the library (Path), a2a the sidecar's settings.
func New(s Session, log *slog.Logger, a2a config.A2A, path string) *Engine {
	return &Engine{s: s, log: log, a2a: a2a, path: path}
}

// Member is one group's side of the engine: the unique id its client handed over.
type Member struct {
	e *Engine
	g Group

	mu sync.Mutex
	id *lib.UniqueID // handed over by the client (ShmemID) before the first OpAllToAllV (mu)
}

// Member is g's side of the engine.
func (e *Engine) Member(g Group) *Member { return &Member{e: e, g: g} }

// shmem is this process's NVSHMEM PE and what the a2av kernels need (kernels/sidecar/a2av.cu
// documents the symmetric layout).
//
// Invariants:
//  1. One PE per sidecar, for one group: NVSHMEM's job is fixed at init, so the first group
//     that runs an OpAllToAllV owns it; other groups get an error (their client uses NCCL).
//  2. Symmetric allocations are made in the same order and sizes on every PE (init only).
//  3. The signal words start at 0 on every PE before any PE can signal (zeroed, then a
//     barrier), and epochs start at 1.
type shmem struct {
	member     *Member
	mod        cuda.Module
	a2av       cuda.Function
	meta, msig uintptr
	dsig, over uintptr
	local      uintptr // two words only this PE uses: its blocks' done count and late epoch
	recv       uintptr
	recvBytes  int64
	shape      a2avShape // the launch shape, the same for every op of the group
	epoch      uint64    // of the last op launched on every PE alike
	broken     error     // a launch failed or a kernel gave up: epochs may disagree
}

// Path finds libnvshmem_host.so.3: NVSHMEM_HOME, else the nvidia-nvshmem wheel beside
// the nvidia-nccl wheel the client's NCCL (ncclPath) came from, else the loader's search.
//
// A file found beside the client's NCCL is taken only if dl.Trusted passes it.
func Path(ncclPath string) string {
	if os.Getenv("NVSHMEM_HOME") == "" && filepath.IsAbs(ncclPath) {
		// .../site-packages/nvidia/nccl/lib/libnccl.so.2 -> .../site-packages
		sp := filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(ncclPath))))
		if p := lib.Find(sp); !filepath.IsAbs(p) || dl.Trusted(p) == nil {
			return p
		}
	}
	return lib.Find()
}

// Open opens the host library at path (Path; "": the loader's search), without NVSHMEM's
// environment or init: that waits for the first all_to_all_v, collectively.
func Open(path string) error {
	if path == "" {
		path = lib.Find()
	}
	return lib.Load(path)
}

// shmemFor returns the session's PE, making it with m's ranks on first use (collective:
// every rank of the group calls it from its first OpAllToAllV, on its collective worker's
// thread).
func (e *Engine) shmemFor(m *Member, deadline time.Time) (*shmem, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.sh != nil {
		if e.sh.member != m {
			return nil, fmt.Errorf("%w: NVSHMEM serves one group per process and another group already uses it", wire.ErrInvalid)
		}
		if e.sh.broken != nil {
			return nil, e.sh.broken
		}
		return e.sh, nil
	}
	if e.err != nil {
		return nil, e.err
	}
	sh, err := m.initShmem(e.path, deadline)
	if err != nil {
		e.err = fmt.Errorf("NVSHMEM: %w", err)
		return nil, e.err
	}
	e.sh = sh
	return sh, nil
}

// loadShmem sets what NVSHMEM reads from the environment (where the user did not) and loads
// the library: no NCCL of its own (it would build communicators for its teams), no remote
// transports (one node), no NVLink SHARP, the loopback interface for the unique-id
// bootstrap (read when the id is made), and a heap that holds the receive buffer of
// recvBytes (config.A2A.RecvBytes: the most one all_to_all_v can deliver to a rank).
func loadShmem(path string, recvBytes int64) error {
	for k, v := range map[string]string{
		"NVSHMEM_DISABLE_NCCL":              "1",
		"NVSHMEM_REMOTE_TRANSPORT":          "none",
		"NVSHMEM_DISABLE_NVLS":              "1",
		"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
		"NVSHMEM_SYMMETRIC_SIZE":            strconv.FormatInt(recvBytes+(64<<20), 10),
	} {
		if os.Getenv(k) == "" {
			os.Setenv(k, v)
		}
	}
	return lib.Load(path)
}

// ShmemID is gpu.Group's ShmemID: the unique id of the group's NVSHMEM bootstrap, which
// the client carries from rank 0 to the others through the torch Store. Rank 0 makes it
// (its process is the bootstrap's root) and every other rank hands rank 0's in; initShmem
// uses it.
func (m *Member) ShmemID(id []byte) ([]byte, error) {
	var u lib.UniqueID
	rank := m.g.Rank()
	switch {
	case rank == 0 && len(id) != 0:
		return nil, fmt.Errorf("%w: rank 0 makes the NVSHMEM unique id, it was sent one", wire.ErrInvalid)
	case rank == 0:
		if err := loadShmem(m.e.path, m.e.a2a.RecvBytes); err != nil {
			return nil, fmt.Errorf("NVSHMEM: %w", err)
		}
		var err error
		if u, err = lib.NewUniqueID(); err != nil {
			return nil, fmt.Errorf("NVSHMEM: %w", err)
		}
	case len(id) != len(u):
		return nil, fmt.Errorf("%w: an NVSHMEM unique id of %d bytes, want %d", wire.ErrInvalid, len(id), len(u))
	default:
		copy(u[:], id)
	}
	m.mu.Lock()
	m.id = &u
	m.mu.Unlock()
	return u[:], nil
}

// initShmem makes this process PE rank of the group's size (invariants 1-3).
func (m *Member) initShmem(path string, deadline time.Time) (*shmem, error) {
	rb := m.e.a2a.RecvBytes
	rank, size := m.g.Rank(), m.g.Size()
	if err := loadShmem(path, rb); err != nil {
		return nil, err
	}
	m.mu.Lock()
	idp := m.id
	m.mu.Unlock()
	if idp == nil {
		return nil, fmt.Errorf("%w: no unique id for this group's bootstrap (the client hands it over, ShmemID, before the first all_to_all_v)", wire.ErrInvalid)
	}
	id := *idp
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	sh := &shmem{member: m, recvBytes: rb, shape: a2avShapeOf(size, m.e.a2a)}
	cubin, err := kernels.Cubin("a2av")
	if err != nil {
		return nil, err
	}
	if sh.mod, err = cuda.LoadModule(cubin); err != nil {
		return nil, err
	}
	if sh.a2av, err = sh.mod.Function("gocomm_a2av"); err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { // init is collective and has no deadline of its own
		done <- m.e.s.Do(func() error { return lib.Init(id, rank, size) })
	}()
	select {
	case err := <-done:
		if err != nil {
			return nil, err
		}
	case <-ctx.Done():
		return nil, fmt.Errorf("%w: NVSHMEM init: a peer did not join before the deadline", gpu.ErrTimeout)
	}
	var local error
	if pe, n := lib.MyPE(), lib.NPEs(); pe != rank || n != size {
		local = fmt.Errorf("init made PE %d of %d, want %d of %d", pe, n, rank, size)
	} else {
		local = lib.ModuleInit(sh.mod.Handle())
	}
	// The heap calls below are collective with no deadline: go on only if every PE got here.
	if err := agree(ctx, m.g, local); err != nil {
		return nil, err
	}
	n := int64(size)
	small := []struct {
		p     *uintptr
		bytes int64
	}{{&sh.meta, 2 * n * (n + 2) * 8}, {&sh.msig, 2 * n * 8}, {&sh.dsig, n * 8}, {&sh.over, n * 8}, {&sh.local, 2 * 8}}
	for _, a := range small {
		if *a.p, err = lib.Malloc(int(a.bytes)); err != nil {
			return nil, err
		}
	}
	if sh.recv, err = lib.Malloc(int(rb)); err != nil {
		return nil, err
	}
	zs, err := cuda.NewStream(cuda.StreamNonBlocking)
	if err != nil {
		return nil, err
	}
	defer zs.Destroy()
	for _, a := range small {
		if err := zs.CopyToDeviceOn(cuda.Ptr(*a.p), make([]byte, a.bytes)); err != nil {
			return nil, err
		}
	}
	if err := lib.BarrierAll(); err != nil {
		return nil, err
	}
	m.e.log.Info("NVSHMEM ready", "pe", rank, "pes", size, "recv_bytes", rb)
	return sh, nil
}

// agree tells every rank of g whether this one is ready (local == nil) and returns an error
// unless all are.
func agree(ctx context.Context, g Group, local error) error {
	rank, size, link := g.Rank(), g.Size(), g.Link()
	ok := []byte{1}
	if local != nil {
		ok[0] = 0
	}
	for p := 0; p < size; p++ {
		if p != rank {
			if err := link.Send(ctx, p, tagShmemOK, ok); err != nil {
				return errors.Join(local, err)
			}
		}
	}
	if local != nil {
		return local
	}
	for p := 0; p < size; p++ {
		if p == rank {
			continue
		}
		b, err := link.Recv(ctx, p, tagShmemOK, 1)
		if err != nil {
			return err
		}
		if b[0] != 1 {
			return fmt.Errorf("rank %d could not set up its NVSHMEM PE (its log says why)", p)
		}
	}
	return nil
}

// Launch enqueues an OpAllToAllV on st (the collective worker's stream), after the
// client's ready counter reaches the op's stream value, and has st write it to done then:
// one kernel that exchanges the rows and writes the client's output. It runs on the
// collective worker's thread (the device's context current).
func (m *Member) Launch(o *gpu.Op, st cuda.Stream, ready, done cuda.Ptr) error {
	d := o.Desc
	sh, err := m.e.shmemFor(m, o.Deadline)
	if err != nil {
		return err
	}
	row := int64(d.Count)
	capacity := min(int64(d.Bufs[2].Length), sh.recvBytes) / row
	if err := st.WaitValue32(ready, d.StreamValue, cuda.WaitGEQ); err != nil {
		return err
	}
	epoch := sh.epoch + 1
	var sym [48]byte // struct A2avSym: meta, msig, dsig, over, recv, local
	for i, p := range []uintptr{sh.meta, sh.msig, sh.dsig, sh.over, sh.recv, sh.local} {
		binary.LittleEndian.PutUint64(sym[8*i:], uint64(p))
	}
	p := o.Ptrs
	inRows := int64(d.Bufs[0].Length) / row
	timeout := max(time.Until(o.Deadline), time.Millisecond)
	shape := sh.shape
	args := new(cuda.Args).Ptr(p[0]).Ptr(p[1]).Ptr(p[2]).Ptr(p[3]).Ptr(p[4]).Struct(sym[:]).I64(capacity).I64(row).
		I64(inRows).Ptr(epoch).Ptr(uint64(timeout.Nanoseconds())).I32(shape.direct)
	err = sh.a2av.Launch([3]int{m.g.Size() * shape.blocksPer, 1, 1}, [3]int{shape.threads, 1, 1}, 0, st, args)
	if err != nil {
		sh.broken = fmt.Errorf("NVSHMEM all_to_all_v launch failed, the PEs' epochs may disagree: %w", err)
		return err
	}
	sh.epoch = epoch
	return st.WriteValue32(done, d.StreamValue)
}

// a2avShape is how gocomm_a2av is launched: B blocks per destination (blocksPer), threads
// per block, and whether NVLink peers are written with the kernel's own stores (direct) or
// NVSHMEM's block put.
type a2avShape struct {
	blocksPer, threads int
	direct             int32
}

// a2avShapeOf is the launch shape for a group of n. Every PE of a group must use the same B
// (their counts are compared against epoch x B), so it depends on the group size and the
// sidecar's settings only (c: GOCOMM_A2AV_BLOCKS in all, GOCOMM_A2AV_THREADS,
// GOCOMM_A2AV_DIRECT), which every rank's sidecar must share (the kernel does not compare B
// across PEs; a launcher's environment is inherited by all). About 128 blocks in all by
// default: one block moved ~25 GB/s over NVLink on H200, and 128 blocks stay resident on any
// GPU of 16+ SMs; all blocks must fit on the GPU at once, or they wait for each other until
// the timeout. Fewer blocks than destinations still give each destination one.
func a2avShapeOf(n int, c config.A2A) a2avShape {
	direct := int32(0)
	if c.Direct {
		direct = 1
	}
	return a2avShape{blocksPer: max(1, c.Blocks/n), threads: c.Threads, direct: direct}
}

// Status bits of the a2av kernel (kernels/sidecar/a2av.cu).
const (
	a2avOverflow = 1
	a2avInvalid  = 2
	a2avRowSize  = 4
	a2avLate     = 8
)

// Check reads a finished OpAllToAllV's status word on st. A kernel that gave up waiting
// breaks the group (and the PE: epochs disagree now); the other reports are the caller's to
// see in out_splits and are only logged here.
func (m *Member) Check(o *gpu.Op, st cuda.Stream) error {
	var b [4]byte
	if err := st.CopyToHostOn(b[:], cuda.Ptr(o.Ptrs[4])); err != nil {
		return err
	}
	s := binary.LittleEndian.Uint32(b[:])
	if s&a2avLate != 0 {
		m.e.mu.Lock()
		if sh := m.e.sh; sh != nil {
			sh.broken = fmt.Errorf("%w: an NVSHMEM all_to_all_v gave up waiting for a peer", gpu.ErrTimeout)
		}
		m.e.mu.Unlock()
		return fmt.Errorf("%w: all_to_all_v: a peer did not take part before the deadline", gpu.ErrTimeout)
	}
	if s != 0 {
		m.e.log.Warn("all_to_all_v reported", "overflow", s&a2avOverflow != 0, "invalid_splits", s&a2avInvalid != 0,
			"row_size_mismatch", s&a2avRowSize != 0)
	}
	return nil
}
