package pg

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/node"
	"github.com/gocomm/gocomm/ring"
	"github.com/gocomm/gocomm/segment"
	"github.com/gocomm/gocomm/shm"
	"github.com/gocomm/gocomm/wire"
)

// Session is one attached client process: its rings, its segments and its groups.
//
// Its loop (serve) is the only consumer of the submission queue; completions come from many
// goroutines (group executors, point-to-point ops) and are serialized by cmpMu.
type Session struct {
	ID   uint64
	srv  *Server
	pid  int64
	rank int
	log  *slog.Logger

	ringMem *shm.Segment
	cons    *ring.Consumer
	cmpMu   sync.Mutex
	prod    *ring.Producer
	marks   ring.Marks // word i: the handle of the last group whose streams on slot i were released
	reg     *registry

	mu     sync.Mutex
	groups map[uint32]*Group
	// the names of the groups this session destroyed, by handle (the last maxDestroyed, in
	// destroyedOrder): an op the client queued before the destroy fails as aborted, naming it
	destroyed      map[uint32]string
	destroyedOrder []uint32
	closed         bool
	detached       bool          // the client left in order (Detach): its groups say bye, not abort
	events         chan Event    // for the client's watch stream (Events)
	done           chan struct{} // closed when the session ends
	loop           sync.WaitGroup
	// DestroyGroup calls past taking their group out of groups: Close waits for them before
	// it unmaps what their ops and stream releases still touch (Add under mu while !closed)
	destroying sync.WaitGroup

	nccl bool // the client's NCCL is loaded here
	// Sparse is the transport all_to_all_v of this client's CUDA tensors takes.
	Sparse SparseChoice
	// Capabilities are the node's facts and this client's (its NCCL, NVSHMEM), for Attach.
	Capabilities []node.Fact
	device       gpu.Session // set by AttachDevice
	ipcErr       map[uint32]error
	slots        [gpu.CounterSlots]bool
	slotOwner    [gpu.CounterSlots]atomic.Uint32 // the handle of the group on each slot; 0: none
	// slotBase is where each slot's counters stand for its next group, per lane. Counters
	// never go back: a group counts on from past where the slot's last group and its releases
	// left them, so a stream wait of the new group cannot be satisfied by an old value, and a
	// late wait of the old group is still satisfied by the new ones.
	slotBase [gpu.CounterSlots][2]uint32
	devLock  sync.Mutex
	graphs   *triggers // ops captured in CUDA graphs (graph.go)

	// the fd socket (fdchan.go)
	fdToken   FDToken
	vmmMu     sync.Mutex // registrations by fd, and the session's end (fdchan.go, invariant 4)
	vmmClosed bool
	fdConns   []*net.UnixConn
}

// AttachDevice binds the session to the client's GPU (by UUID) and returns the file holding
// the groups' stream counters (gpu.Session.CountersPath).
func (sess *Session) AttachDevice(uuid [16]byte) (string, error) {
	dev := sess.srv.cfg.Device
	if dev == nil {
		return "", fmt.Errorf("%w: this sidecar has no GPU engine", ErrNoDevice)
	}
	if ok, why, _ := dev.Info(); !ok {
		return "", fmt.Errorf("%w: %s", ErrNoDevice, why)
	}
	if !sess.nccl {
		return "", fmt.Errorf("%w: the client's NCCL could not be loaded in the sidecar (see its log)", ErrNoDevice)
	}
	sess.devLock.Lock()
	defer sess.devLock.Unlock()
	if sess.device == nil {
		ds, err := dev.Attach(uuid, sess.srv.cfg.ShmDir, sess.released)
		if err != nil {
			return "", fmt.Errorf("%w: %v", ErrNoDevice, err)
		}
		sess.device = ds
		sess.log.Info("device attached", "uuid", fmt.Sprintf("%x", uuid))
	}
	return sess.device.CountersPath(), nil
}

// Each counter slot has a mark word in the ring's header.
var _ [ring.MarkWords - gpu.CounterSlots]struct{}

// released marks slot's group as let go in the ring (ring.Marks) before the device session
// writes a release to the slot's counters (gpu.Engine.Attach's hook). A release means the
// group broke, refused an op or is being destroyed: the client checks the mark at every call
// and refuses once it names its group. Its streams see the release only after the mark is
// stored, so a client thread whose stream was let go (an op whose sync returned with its
// work not done) sees the mark at its next call, even before the failure's completion or
// the watch stream's event reaches it.
func (sess *Session) released(slot int) {
	if h := sess.slotOwner[slot].Load(); h != 0 {
		sess.marks.Set(slot, h)
	}
}

func (sess *Session) deviceSession() gpu.Session {
	sess.devLock.Lock()
	defer sess.devLock.Unlock()
	return sess.device
}

// registerIPC maps a client allocation (wire.RecIPC). A failure is remembered and reported by the
// first op that names the segment.
func (sess *Session) registerIPC(p []byte) {
	if len(p) != 80 {
		sess.log.Warn("malformed IPC record", "bytes", len(p))
		return
	}
	le := binary.LittleEndian
	seg, size := le.Uint32(p), le.Uint64(p[8:])
	var h [64]byte
	copy(h[:], p[16:80])
	ds := sess.deviceSession()
	err := fmt.Errorf("%w: segment %#x registered before the device was attached", wire.ErrInvalid, seg)
	if ds != nil {
		if seg&wire.CUDASegment == 0 {
			err = fmt.Errorf("%w: CUDA segment id %#x lacks the CUDA bit", wire.ErrInvalid, seg)
		} else {
			start := time.Now()
			err = ds.RegisterIPC(seg, h, size)
			sess.log.Debug("CUDA allocation mapped", "segment", seg, "bytes", size, "took", time.Since(start))
		}
	}
	sess.devLock.Lock()
	if err != nil {
		if sess.ipcErr == nil {
			sess.ipcErr = map[uint32]error{}
		}
		sess.ipcErr[seg] = err
		sess.log.Warn("CUDA allocation not mapped", "segment", seg, "err", err)
	} else {
		delete(sess.ipcErr, seg)
	}
	sess.devLock.Unlock()
}

func (sess *Session) dropIPC(p []byte) {
	if len(p) < 4 {
		return
	}
	seg := binary.LittleEndian.Uint32(p)
	if ds := sess.deviceSession(); ds != nil {
		if err := ds.DropIPC(seg); err != nil {
			sess.log.Debug("drop CUDA segment", "segment", seg, "err", err)
		}
	}
}

// CUDASegments counts the client's CUDA allocations the device engine has mapped (none
// before AttachDevice).
func (sess *Session) CUDASegments() segment.Stats {
	if ds := sess.deviceSession(); ds != nil {
		return ds.Segments()
	}
	return segment.Stats{}
}

// Event is something the client hears of on its watch stream.
type Event struct {
	Kind   string // "group_broken"
	Group  uint32
	Detail string
}

// Events delivers the session's events (a group broke) to the client's watch stream.
func (sess *Session) Events() <-chan Event { return sess.events }

// notify queues an event for the watch stream; with nobody reading, events beyond the
// queue's room are dropped (the ops' own completions still say what happened).
func (sess *Session) notify(e Event) {
	select {
	case sess.events <- e:
	default:
	}
}

// Detach is the client leaving in order: its groups end with a bye, so peers that still
// wait for it fail as it left, and the session closes.
func (sess *Session) Detach(reason string) {
	sess.mu.Lock()
	sess.detached = true
	sess.mu.Unlock()
	sess.Close(reason)
}

// Gone is the client going away without Detach (it died, or its sidecar is being killed):
// every group of the session is aborted, so each peer fails at once naming this rank,
// instead of taking it for an orderly leave; then the session closes.
func (sess *Session) Gone(reason string) {
	sess.mu.Lock()
	detached := sess.detached
	sess.mu.Unlock()
	if !detached {
		sess.Abort(0, reason)
	}
	sess.Close(reason)
}

// ClientPID is the client process's pid, as it said at Attach.
func (sess *Session) ClientPID() int64 { return sess.pid }

// RingPath is the file holding the session's rings (the client unlinks it once mapped).
func (sess *Session) RingPath() string { return sess.ringMem.Path }

// RingBytes is the size of the ring file.
func (sess *Session) RingBytes() int { return len(sess.ringMem.Data) }

// Done is closed when the session has ended.
func (sess *Session) Done() <-chan struct{} { return sess.done }

// AllocSegment creates a shared-memory segment for host tensors.
func (sess *Session) AllocSegment(bytes uint64) (id uint32, path string, size uint64, err error) {
	if sess.isClosed() {
		return 0, "", 0, fmt.Errorf("session %d: %w", sess.ID, ErrNotFound)
	}
	return sess.reg.alloc(bytes)
}

// FreeSegment releases a segment once its ops are done.
func (sess *Session) FreeSegment(id uint32) error { return sess.reg.free(id) }

// CreateGroup creates this rank's member of a group. It is not usable until ConnectGroup.
func (sess *Session) CreateGroup(name string, rank, size int, globalRanks []int, timeout time.Duration) (*Group, []byte, error) {
	if size < 1 || rank < 0 || rank >= size {
		return nil, nil, fmt.Errorf("%w: rank %d in a group of %d", wire.ErrInvalid, rank, size)
	}
	if len(globalRanks) != 0 && len(globalRanks) != size {
		return nil, nil, fmt.Errorf("%w: %d global ranks for a group of %d", wire.ErrInvalid, len(globalRanks), size)
	}
	if timeout <= 0 {
		timeout = 30 * time.Minute
	}
	g := newGroup(sess, name, rank, size, globalRanks, timeout)
	sess.mu.Lock()
	if sess.closed {
		sess.mu.Unlock()
		return nil, nil, fmt.Errorf("session %d: %w", sess.ID, ErrNotFound)
	}
	g.Slot = -1
	for i := range sess.slots {
		if !sess.slots[i] {
			sess.slots[i], g.Slot, g.Base = true, i, sess.slotBase[i]
			break
		}
	}
	for lane, b := range g.Base {
		g.last[lane].Store(b)
	}
	sess.srv.addGroup(g)
	sess.groups[g.Handle] = g
	if g.Slot >= 0 {
		sess.slotOwner[g.Slot].Store(g.Handle)
	}
	sess.mu.Unlock()
	g.log = sess.log.With("group", g.Handle, "name", name, "grank", rank, "gsize", size)
	g.log.Info("group created", "timeout", timeout, "counter_slot", g.Slot)
	return g, sess.srv.bootstrapBlob(), nil
}

// ConnectGroup wires a group to its peers: blobs[i] is what rank i's CreateGroup returned.
func (sess *Session) ConnectGroup(handle uint32, blobs [][]byte, secret []byte) (string, error) {
	g, err := sess.Group(handle)
	if err != nil {
		return "", err
	}
	if len(blobs) != g.Size {
		return "", fmt.Errorf("%w: %d bootstrap blobs for a group of %d", wire.ErrInvalid, len(blobs), g.Size)
	}
	peers := make([]string, len(blobs))
	for i, b := range blobs {
		var bs bootstrap
		if err := json.Unmarshal(b, &bs); err != nil || bs.Addr == "" {
			return "", fmt.Errorf("%w: bootstrap blob of rank %d: %v", wire.ErrInvalid, i, err)
		}
		peers[i] = bs.Addr
	}
	ep, err := sess.srv.node.Join(secret, g.Rank, peers)
	if err != nil {
		return "", fmt.Errorf("%w: %v", wire.ErrInvalid, err)
	}
	if err := g.connect(ep); err != nil {
		ep.Close()
		return "", err
	}
	// Dial every peer now: a peer whose sidecar dies is then seen at once (its link to us
	// closes), also before the group's first op.
	ep.Connect()
	g.log.Info("group connected", "transport", "tcp", "peers", peers)
	return "tcp", nil
}

// ShmemID hands a group's NVSHMEM unique id over (gpu.Group.ShmemID): the client carries
// it from rank 0 to the other ranks through the torch Store.
func (sess *Session) ShmemID(handle uint32, id []byte) ([]byte, error) {
	g, err := sess.Group(handle)
	if err != nil {
		return nil, err
	}
	ds := sess.deviceSession()
	if ds == nil {
		return nil, fmt.Errorf("%w: the session has not attached its device", ErrNoDevice)
	}
	return g.shmemID(ds, id)
}

// Group returns one of the session's groups.
func (sess *Session) Group(handle uint32) (*Group, error) {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	if g := sess.groups[handle]; g != nil {
		return g, nil
	}
	return nil, fmt.Errorf("group %d: %w", handle, ErrNotFound)
}

// Groups of the session.
func (sess *Session) Groups() []*Group {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	out := make([]*Group, 0, len(sess.groups))
	for _, g := range sess.groups {
		out = append(out, g)
	}
	return out
}

// DestroyGroup ends a group: pending ops fail, links close.
func (sess *Session) DestroyGroup(handle uint32) error {
	sess.mu.Lock()
	g := sess.groups[handle]
	delete(sess.groups, handle)
	if g != nil { // Close clears groups when it sets closed: here the session is open
		sess.destroying.Add(1)
		defer sess.destroying.Done()
		if sess.destroyed == nil {
			sess.destroyed = map[uint32]string{}
		}
		sess.destroyed[handle] = g.Name
		sess.destroyedOrder = append(sess.destroyedOrder, handle)
		if len(sess.destroyedOrder) > maxDestroyed {
			delete(sess.destroyed, sess.destroyedOrder[0])
			sess.destroyedOrder = sess.destroyedOrder[1:]
		}
	}
	sess.mu.Unlock()
	if g == nil {
		return fmt.Errorf("group %d: %w", handle, ErrNotFound)
	}
	g.close("group destroyed")
	sess.srv.dropGroup(g)
	if g.Slot < 0 {
		return nil
	}
	// Let every stream still waiting on the slot go on (ops refused while the group closed
	// never reached the engine), then hand the slot on past anything that release wrote.
	g.releaseStreams("destroying the group")
	f := g.floor()
	sess.mu.Lock()
	for lane := range f {
		sess.slotBase[g.Slot][lane] = f[lane] + slotAdvance
	}
	sess.slots[g.Slot] = false
	sess.slotOwner[g.Slot].Store(0)
	sess.mu.Unlock()
	return nil
}

// Abort breaks one group (handle != 0) or all of them with reason.
func (sess *Session) Abort(handle uint32, reason string) error {
	if handle != 0 {
		g, err := sess.Group(handle)
		if err != nil {
			return err
		}
		g.Abort(reason)
		return nil
	}
	for _, g := range sess.Groups() {
		g.Abort(reason)
	}
	return nil
}

// Close ends the session: every group is destroyed (their pending ops fail), the loop stops,
// segments and rings are released.
func (sess *Session) Close(reason string) {
	sess.mu.Lock()
	if sess.closed {
		sess.mu.Unlock()
		return
	}
	sess.closed = true
	groups := make([]*Group, 0, len(sess.groups))
	for _, g := range sess.groups {
		groups = append(groups, g)
	}
	clear(sess.groups)
	sess.mu.Unlock()
	for _, g := range groups {
		g.close(reason)
		sess.srv.dropGroup(g)
	}
	sess.destroying.Wait()
	sess.loop.Wait()
	sess.graphs.close()
	sess.cmpMu.Lock()
	sess.prod = nil // no completion touches the ring after this
	sess.cmpMu.Unlock()
	sess.closeFDConns() // before the device session goes: no registration maps after this
	var errDev error
	if ds := sess.deviceSession(); ds != nil {
		errDev = ds.Close()
	}
	errs := errors.Join(errDev, sess.reg.closeAll(), sess.ringMem.Close())
	sess.srv.dropSession(sess)
	close(sess.done)
	sess.log.Info("session closed", "reason", reason, "err", errs)
}

func (sess *Session) isClosed() bool {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	return sess.closed
}

// serve consumes the submission queue until the session closes.
func (sess *Session) serve() {
	sess.loop.Add(1)
	defer sess.loop.Done()
	for !sess.isClosed() {
		rec, ok, err := sess.cons.Next()
		if err != nil {
			sess.log.Error("submission ring corrupt; no more ops from this client", "err", err)
			sess.complete(^uint64(0), wire.StatusInternal, -1, err.Error())
			for !sess.isClosed() {
				time.Sleep(100 * time.Millisecond)
			}
			return
		}
		if !ok {
			sess.cons.Wait(sess.srv.cfg.Spin, 100*time.Millisecond)
			continue
		}
		switch rec.Type {
		case wire.RecOp:
			sess.submit(rec.Payload)
		case wire.RecIPC:
			sess.registerIPC(rec.Payload)
		case wire.RecIPCDrop:
			sess.dropIPC(rec.Payload)
		case wire.RecGraphOp:
			sess.graphs.register(rec.Payload)
		case wire.RecGraphDrop:
			sess.graphs.drop(rec.Payload)
		default:
			seq := uint64(0)
			if len(rec.Payload) >= 8 {
				seq = binary.LittleEndian.Uint64(rec.Payload)
			}
			sess.complete(seq, wire.StatusInvalid, -1, fmt.Sprintf("unknown record type %d", rec.Type))
		}
		sess.cons.Release()
	}
}

// submit validates one descriptor and hands it to its group. Nothing in the descriptor is
// trusted: a bad one is answered with an invalid completion and the loop goes on.
func (sess *Session) submit(payload []byte) {
	d, err := wire.DecodeDesc(payload)
	if err != nil && (d.Device != wire.DeviceCUDA || len(payload) < wire.DescHeader) {
		sess.complete(d.Seq, wire.StatusInvalid, -1, err.Error())
		return
	}
	g, gerr := sess.Group(d.Group)
	if gerr != nil {
		sess.mu.Lock()
		name, gone := sess.destroyed[d.Group]
		sess.mu.Unlock()
		if gone { // queued before the destroy, which the control plane brought first
			sess.complete(d.Seq, wire.StatusAborted, -1, fmt.Sprintf("%s on group %q: group destroyed", d.Kind, name))
			return
		}
		sess.complete(d.Seq, wire.StatusInvalid, -1, fmt.Sprintf("%v: %v", wire.ErrInvalid, gerr))
		return
	}
	if d.Device == wire.DeviceCUDA {
		if serr := g.noteStream(&d); err == nil {
			err = serr
		}
	}
	if err == nil {
		err = d.Validate(g.Rank, g.Size)
	}
	if err != nil { // a CUDA op's group must let the client's stream past it (reject)
		g.reject(d, err)
		return
	}
	timeout := g.Timeout
	if d.TimeoutMS > 0 {
		timeout = wire.Millis(d.TimeoutMS)
	}
	deadline := time.Now().Add(timeout)
	if d.Device == wire.DeviceCUDA {
		sess.submitDevice(g, d, deadline, timeout)
		return
	}
	if d.Reduces() {
		if err := reduce.Check(d.DType, d.RedOp); err != nil {
			g.reject(d, fmt.Errorf("%w: %v", wire.ErrInvalid, err))
			return
		}
	}
	bufs, release, err := sess.reg.resolve(d.Bufs)
	if err != nil {
		g.reject(d, err)
		return
	}
	g.submit(&op{desc: d, bufs: bufs, release: release, deadline: deadline, timeout: timeout})
}

// deviceFor is the device engine's session for a CUDA op d: an error where the client never
// attached its GPU, or the engine cannot reduce d's type with d's op.
func (sess *Session) deviceFor(d wire.Desc) (gpu.Session, error) {
	ds := sess.deviceSession()
	if ds == nil {
		return nil, fmt.Errorf("%w: %w: the client never attached its GPU", wire.ErrInvalid, ErrNoDevice)
	}
	if d.Reduces() {
		if err := sess.srv.cfg.Device.Check(d.DType, d.RedOp); err != nil {
			return nil, fmt.Errorf("%w: %v", wire.ErrInvalid, err)
		}
	}
	return ds, nil
}

// resolveCUDA maps an op's CUDA buffer refs to addresses in the sidecar; where a buffer's
// registration failed (its mapping, or the driver's check of its claimed size), the error
// says why instead of naming an unknown segment.
func (sess *Session) resolveCUDA(ds gpu.Session, refs []wire.BufRef) ([]uint64, func(), error) {
	ptrs, release, err := ds.Resolve(refs)
	if err != nil {
		sess.devLock.Lock()
		for _, b := range refs {
			if why := sess.ipcErr[b.Segment]; why != nil {
				err = fmt.Errorf("%w: %v", wire.ErrInvalid, why)
			}
		}
		sess.devLock.Unlock()
	}
	return ptrs, release, err
}

// submitDevice checks a CUDA op against the device engine and hands it to the group.
func (sess *Session) submitDevice(g *Group, d wire.Desc, deadline time.Time, timeout time.Duration) {
	ds, err := sess.deviceFor(d)
	if err != nil {
		g.reject(d, err)
		return
	}
	if d.Kind == wire.OpRecv && d.Root < 0 {
		g.reject(d, fmt.Errorf("%w: recv from any rank is not supported for CUDA tensors (NCCL has no wildcard receive)", wire.ErrInvalid))
		return
	}
	ptrs, release, err := sess.resolveCUDA(ds, d.Bufs)
	if err != nil {
		g.reject(d, err)
		return
	}
	g.submitDevice(ds, &op{desc: d, release: release, deadline: deadline, timeout: timeout}, ptrs)
}

// complete posts a completion. If the client stops reading, it waits for room until the
// session closes.
func (sess *Session) complete(seq uint64, status int32, source int, msg string) {
	const maxMsg = 4096
	if len(msg) > maxMsg {
		msg = msg[:maxMsg]
	}
	payload := wire.EncodeDone(seq, status, int32(source), msg)
	// A client usually submits its next op soon after one completes. If serve stopped
	// spinning while this op ran (an op longer than Spin), wake it now, so that it spins
	// again by then: woken by the submission itself, a sleeping loop costs the op its wake-up
	// (measured: 1 GiB all_reduce alone +215 us with a 2 ms spin, none with 20 ms).
	sess.cmpMu.Lock()
	defer sess.cmpMu.Unlock()
	if sess.srv.cfg.Spin > 0 && sess.prod != nil { // prod nil: the rings may be unmapped
		sess.cons.Nudge()
	}
	for sess.prod != nil {
		// a closed session's client reads no more: one try, no wait for room (waiting a
		// second a completion held Close up by that much per queued op)
		wait := time.Second
		if sess.isClosed() {
			wait = 0
		}
		err := sess.prod.Write(time.Now().Add(wait), 20*time.Microsecond, wire.RecDone, 0, payload)
		if err == nil {
			return
		}
		if !errors.Is(err, ring.ErrFull) || sess.isClosed() {
			sess.log.Warn("completion dropped", "seq", seq, "err", err)
			return
		}
	}
}
