// Package device runs collectives on GPUs for the sidecar: NCCL directly on the client's
// memory (CUDA IPC), ordered against the client's streams by counters in host memory that
// both processes map and register for the device.
// It implements gpu.Engine; cmd/pgserver wires it in where the driver loads.
package device

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gocomm/gocomm/config"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/cuda"
	"github.com/gocomm/gocomm/internal/nccl"
	"github.com/gocomm/gocomm/kernels"
	"github.com/gocomm/gocomm/segment"
	"github.com/gocomm/gocomm/shm"
	"github.com/gocomm/gocomm/sparse/nvshmem"
	"github.com/gocomm/gocomm/wire"
)

// Engine is the sidecar's GPU engine.
type Engine struct {
	mu          sync.Mutex // guards nvshmemPath: clients attach concurrently
	nvshmemPath string     // libnvshmem_host.so.3 (nvshmem.Path), set by LoadNCCL
	arch        []int      // each device's compute capability, major*10 + minor
	// Spin is how long a device worker polls for its next op before sleeping (see
	// group.spin); zero never spins.
	Spin time.Duration
	// Ahead is the most ops a worker keeps enqueued on its stream unfinished (group design
	// 8; config.Config.Ahead). Zero or less: config's default.
	Ahead int
	// A2A sizes and shapes the NVSHMEM all-to-all (config.A2A; cmd/pgserver sets it from
	// the environment before any client attaches).
	A2A     config.A2A
	log     *slog.Logger
	err     error // why there is no GPU engine, or nil
	devices []gpu.Device
}

// New loads the driver and lists the devices; a machine without a driver gets an engine
// whose Info says why and whose every call fails.
func New(log *slog.Logger) *Engine {
	e := &Engine{log: log, A2A: config.Defaults().A2A}
	if e.err = cuda.Load(); e.err != nil {
		return e
	}
	n, err := cuda.DeviceCount()
	if err != nil {
		e.err = err
		return e
	}
	if n == 0 {
		e.err = fmt.Errorf("cuda: no visible devices")
		return e
	}
	for i := 0; i < n; i++ {
		d, err := cuda.DeviceGet(i)
		if err != nil {
			e.err = err
			return e
		}
		name, _ := d.Name()
		uuid, _ := d.UUID()
		e.devices = append(e.devices, gpu.Device{Index: i, Name: name, UUID: uuid})
		major, _ := d.Attribute(cuda.AttrComputeCapabilityMajor)
		minor, _ := d.Attribute(cuda.AttrComputeCapabilityMinor)
		e.arch = append(e.arch, major*10+minor)
	}
	return e
}

// Info implements gpu.Engine.
func (e *Engine) Info() (bool, string, []gpu.Device) {
	if e.err != nil {
		return false, e.err.Error(), nil
	}
	return true, fmt.Sprintf("%d device(s)", len(e.devices)), e.devices
}

// Arch implements node.Devices: each device's compute capability, or why there are none.
func (e *Engine) Arch() ([]int, error) {
	if e.err != nil {
		return nil, e.err
	}
	return e.arch, nil
}

// MPS implements node.Devices: the driver's CU_DEVICE_ATTRIBUTE_MPS_ENABLED of device 0
// (this process's contexts go through an MPS server).
func (e *Engine) MPS() (bool, error) {
	if e.err != nil {
		return false, e.err
	}
	d, err := cuda.DeviceGet(0)
	if err != nil {
		return false, err
	}
	on, err := d.Attribute(cuda.AttrMPSEnabled)
	if err != nil {
		return false, fmt.Errorf("MPS attribute: %w", err)
	}
	return on != 0, nil
}

// LoadNCCL implements gpu.Engine.
func (e *Engine) LoadNCCL(path string) error {
	if e.err != nil {
		return e.err
	}
	if err := nccl.Load(path); err != nil {
		return err
	}
	e.mu.Lock()
	e.nvshmemPath = nvshmem.Path(path)
	e.mu.Unlock()
	return nil
}

// LoadNVSHMEM implements gpu.Engine: it checks that the NVSHMEM kernels were built for
// these GPUs and opens the host library (no NVSHMEM init; that waits for the first
// all_to_all_v, collectively).
func (e *Engine) LoadNVSHMEM() error {
	if e.err != nil {
		return e.err
	}
	if err := archMatches(e.arch, kernels.Arch); err != nil {
		return err
	}
	e.mu.Lock()
	path := e.nvshmemPath
	e.mu.Unlock()
	return nvshmem.Open(path)
}

// archMatches says why kernels compiled for sm_<want> cannot run on every device of arch
// (compute capabilities, major*10 + minor), or nil: a cubin runs on its own architecture only.
func archMatches(arch []int, want int) error {
	for i, a := range arch {
		if a != want {
			return fmt.Errorf("the kernels are built for sm_%d and GPU %d is sm_%d", want, i, a)
		}
	}
	return nil
}

// Check implements gpu.Engine.
func (e *Engine) Check(dt wire.DType, op wire.RedOp) error { return Check(dt, op) }

// Attach implements gpu.Engine.
func (e *Engine) Attach(uuid [16]byte, dir string, released func(slot int)) (gpu.Session, error) {
	if e.err != nil {
		return nil, e.err
	}
	dev, err := cuda.DeviceByUUID(uuid)
	if err != nil {
		return nil, err
	}
	ctx, err := dev.PrimaryContext()
	if err != nil {
		return nil, err
	}
	ahead := e.Ahead
	if ahead <= 0 {
		ahead = config.Defaults().Ahead
	}
	s := &session{
		log: e.log, spin: e.Spin, ahead: ahead, a2a: e.A2A, dev: dev, ctx: ctx, released: released,
		segs: segment.New[ipcSeg]("CUDA segment"),
	}
	e.mu.Lock()
	s.shmem = nvshmem.New(s, e.log, e.A2A, e.nvshmemPath)
	e.mu.Unlock()
	// Counters live in shared host memory (gpu.Session.CountersPath): zeroed by the file's
	// creation, reached by streams at their registered address and by the CPU in place.
	mem, err := shm.Create(dir, "gocomm-counters", gpu.CounterMemBytes)
	if err != nil {
		dev.ReleasePrimaryContext()
		return nil, fmt.Errorf("stream counters: %w", err)
	}
	err = s.do(func() (err error) {
		s.counters, err = cuda.HostRegister(mem.Data)
		return err
	})
	if err != nil {
		mem.Close()
		dev.ReleasePrimaryContext()
		return nil, fmt.Errorf("stream counters: %w", err)
	}
	s.counterMem = mem
	return s, nil
}

// session is one client's device: its context, its IPC-mapped allocations, its counters.
//
// Invariants:
//  1. Every driver call runs on a locked OS thread with the device's context current (do,
//     or a group's executor thread).
//  2. A segment stays mapped while an op that resolved it may still run: ops hold a
//     reference until their Done, and DropIPC unmaps only when the last is released.
//  3. The counters are written by streams only, except on a release, when the CPU stores them
//     in place (counterMem): no stream, copy or driver call, so nothing a blocked stream holds
//     up (a stream waiting on a counter can hold up every stream sharing its hardware queue,
//     docs/decisions/0004-stream-counters.md) can keep a release from landing.
//  4. released (Attach's hook) is called with a slot before every write of a release to its
//     counters, so the session's owner knows before any stream let go runs on.
type session struct {
	log        *slog.Logger
	spin       time.Duration
	ahead      int
	a2a        config.A2A
	dev        cuda.Device
	ctx        cuda.Context
	counterMem *shm.Segment // the counters' shared host pages (gpu.Session.CountersPath)
	counters   cuda.Ptr     // their device address, registered in this process
	relMu      sync.Mutex
	released   func(slot int)  // invariant 4; nil: no one is told
	shmem      *nvshmem.Engine // the sparse engine: the NVSHMEM PE, made by the first OpAllToAllV

	segs *segment.Table[ipcSeg]
}

// ipcSeg is a client's allocation mapped by CUDA IPC or, where chunks is set, made of
// physical chunks (cuMemCreate: torch's expandable segments) imported by file descriptor and
// mapped back to back in a reservation of the session's own (RegisterVMM).
type ipcSeg struct {
	s      *session
	ptr    cuda.Ptr
	size   uint64
	chunks []uint64 // each chunk's length, mapped in order from ptr; nil for CUDA IPC
}

func (g ipcSeg) Size() uint64 { return g.size }

func (g ipcSeg) Close() error { return g.s.do(g.unmap) }

// unmap runs with the context current (invariant 1).
func (g ipcSeg) unmap() error {
	if g.chunks == nil {
		return cuda.CloseIPC(g.ptr)
	}
	return unmapChunks(g.ptr, g.chunks, g.size)
}

// unmapChunks unmaps the chunks mapped from p on and frees the reservation of reserved
// bytes there; the physical memory goes once the client released it too.
func unmapChunks(p cuda.Ptr, chunks []uint64, reserved uint64) error {
	var errs []error
	off := uint64(0)
	for _, n := range chunks {
		errs = append(errs, cuda.Unmap(p+cuda.Ptr(off), n))
		off += n
	}
	errs = append(errs, cuda.FreeAddress(p, reserved))
	return errors.Join(errs...)
}

// Do implements nvshmem.Session (do).
func (s *session) Do(f func() error) error { return s.do(f) }

// do runs f on a locked thread with the context current (invariant 1).
func (s *session) do(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := s.ctx.SetCurrent(); err != nil {
		return err
	}
	return f()
}

func (s *session) CountersPath() string { return s.counterMem.Path }

// store writes v to the u32 counter word at byte offset off (invariant 3).
func (s *session) store(off int, v uint32) {
	atomic.StoreUint32((*uint32)(unsafe.Pointer(&s.counterMem.Data[off])), v)
}

// counterOff is the byte offset of slot's ready counter on lane in the counter memory; its
// done counter follows at +4 (gpu.CounterSlots).
func counterOff(slot, lane int) int { return 16*slot + 8*lane }

// readyReached says whether slot's ready counter on lane has reached v, read by the CPU in
// place, compared as a stream's wait for it compares (CU_STREAM_WAIT_VALUE_GEQ: int32(ready -
// v) >= 0, so values wrap). The client's stream writes ready behind a memory fence
// (cuStreamWriteValue32 without NO_MEMORY_BARRIER), so where the CPU sees it the op is
// ordered after everything a stream wait for it would have ordered it after.
func (s *session) readyReached(slot, lane int, v uint32) bool {
	return reached(atomic.LoadUint32((*uint32)(unsafe.Pointer(&s.counterMem.Data[counterOff(slot, lane)]))), v)
}

// reached compares a counter with a stream value as CU_STREAM_WAIT_VALUE_GEQ does.
func reached(counter, v uint32) bool { return int32(counter-v) >= 0 }

// Release implements gpu.Session: ready = done = floor + gpu.ReleaseAhead on both lanes
// of the slot, stored by the CPU (invariant 3). The values depend on floor only, so releasing
// again writes them again (which also undoes done writes that ran after the first release).
func (s *session) Release(slot int, floor [2]uint32) error {
	if slot < 0 || slot >= gpu.CounterSlots {
		return fmt.Errorf("counter slot %d out of range", slot)
	}
	s.relMu.Lock()
	defer s.relMu.Unlock()
	if s.released != nil {
		s.released(slot) // invariant 4
	}
	for lane, f := range floor {
		far := f + gpu.ReleaseAhead
		s.store(counterOff(slot, lane), far)
		s.store(counterOff(slot, lane)+4, far)
	}
	return nil
}

// ReleaseTriggers implements gpu.Session: D[t] = 1, stored by the CPU (invariant 3).
func (s *session) ReleaseTriggers(ts []uint32) error {
	s.relMu.Lock()
	defer s.relMu.Unlock()
	for _, t := range ts {
		if t >= gpu.TriggerSlots {
			return fmt.Errorf("trigger %d out of range", t)
		}
		s.store(gpu.TriggerOffset+4*int(t), 1)
	}
	return nil
}

// trigger is the device address of D[t].
func (s *session) trigger(t uint32) cuda.Ptr {
	return s.counters + cuda.Ptr(gpu.TriggerOffset+4*int(t))
}

func (s *session) RegisterIPC(seg uint32, handle [64]byte, size uint64) error {
	if s.segs.Has(seg) {
		return fmt.Errorf("%w: CUDA segment %d registered twice", wire.ErrInvalid, seg)
	}
	var p cuda.Ptr
	err := s.do(func() (err error) {
		p, err = cuda.OpenIPC(cuda.IPCHandle(handle))
		if err != nil {
			return err
		}
		// the size is the client's word; the driver knows the allocation's real extent
		base, n, err := cuda.AddressRange(p)
		if err == nil {
			err = segment.CheckExtent("CUDA segment", seg, size, uint64(p), uint64(base), n)
		}
		if err != nil {
			cuda.CloseIPC(p)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("map the client's allocation (segment %d, %d bytes): %w", seg, size, err)
	}
	g := ipcSeg{s: s, ptr: p, size: size}
	if err := s.segs.Add(seg, g); err != nil {
		g.Close()
		return err
	}
	return nil
}

// vmmAlign aligns a reservation for chunks, whose lengths must be multiples of it: 2 MiB, the
// allocation granularity of CUDA GPUs (torch's chunks are 2 MiB and 20 MiB), so that every
// chunk's place in the reservation is aligned as cuMemMap requires.
const vmmAlign = 2 << 20

// maxVMMBytes bounds one segment's reservation (a client's word; far above any GPU's memory).
const maxVMMBytes = 1 << 42

// RegisterVMM implements gpu.Session: each chunk is imported (cuMemImportFromShareableHandle),
// mapped at its place in a reservation of the sum of their lengths, and its handle released
// at once (the mapping keeps the memory); then the range is made readable and writable by
// the session's device. Any failure undoes what was mapped and frees the reservation. The
// driver refuses a length larger than the chunk it imported.
func (s *session) RegisterVMM(seg uint32, fds []int, sizes []uint64) error {
	if s.segs.Has(seg) {
		return fmt.Errorf("%w: CUDA segment %d registered twice", wire.ErrInvalid, seg)
	}
	if len(fds) == 0 || len(fds) != len(sizes) {
		return fmt.Errorf("%w: CUDA segment %d: %d chunks, %d lengths", wire.ErrInvalid, seg, len(fds), len(sizes))
	}
	var total uint64
	for i, n := range sizes {
		if n == 0 || n%vmmAlign != 0 || n > maxVMMBytes-total {
			return fmt.Errorf("%w: CUDA segment %d: chunk %d of %d bytes is not a multiple of 2 MiB, or the segment is too large",
				wire.ErrInvalid, seg, i, n)
		}
		total += n
	}
	var p cuda.Ptr
	err := s.do(func() (err error) {
		if p, err = cuda.ReserveAddress(total, vmmAlign); err != nil {
			return err
		}
		off := uint64(0)
		for i, fd := range fds {
			h, err := cuda.ImportFD(fd)
			if err == nil {
				err = cuda.Map(p+cuda.Ptr(off), sizes[i], h)
				if rerr := h.Release(); rerr != nil {
					s.log.Warn("release an imported chunk's handle", "segment", seg, "chunk", i, "err", rerr)
				}
			}
			if err != nil {
				unmapChunks(p, sizes[:i], total)
				return fmt.Errorf("chunk %d of %d: %w", i, len(fds), err)
			}
			off += sizes[i]
		}
		if err := cuda.SetAccess(p, total, s.dev); err != nil {
			unmapChunks(p, sizes, total)
			return err
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("map the client's chunks (segment %d, %d bytes in %d chunks): %w", seg, total, len(fds), err)
	}
	g := ipcSeg{s: s, ptr: p, size: total, chunks: append([]uint64(nil), sizes...)}
	if err := s.segs.Add(seg, g); err != nil {
		g.Close()
		return err
	}
	return nil
}

func (s *session) DropIPC(seg uint32) error { return s.segs.Drop(seg) }

func (s *session) Segments() segment.Stats { return s.segs.Stats() }

// Resolve implements gpu.Session: the segment table bounds-checks each buffer; an empty
// buffer names no memory (NCCL never touches it: ptr 0).
func (s *session) Resolve(refs []wire.BufRef) ([]uint64, func(), error) {
	segs, release, err := s.segs.Resolve(refs, true)
	if err != nil {
		return nil, nil, err
	}
	ptrs := make([]uint64, len(refs))
	for i, r := range refs {
		if r.Length > 0 {
			ptrs[i] = uint64(segs[i].ptr) + r.Offset
		}
	}
	return ptrs, release, nil
}

func (s *session) Close() error {
	segs := s.segs.Take()
	return s.do(func() error {
		for _, g := range segs {
			g.unmap()
		}
		if err := cuda.HostUnregister(s.counterMem.Data); err != nil {
			s.log.Warn("could not unregister the stream counters", "err", err)
		}
		s.counterMem.Close()
		return s.dev.ReleasePrimaryContext()
	})
}
