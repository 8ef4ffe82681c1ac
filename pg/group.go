package pg

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocomm/gocomm/collectives"
	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/transport"
	"github.com/gocomm/gocomm/wire"
)

// Group is this rank's member of one process group, and the executor of its ops.
//
// Design:
//  1. Collectives run one at a time, in submission order, on the executor goroutine; each
//     takes the next number of the group's sequence (seq), which every rank assigns the same
//     way because every rank submits the group's collectives in the same order. Peers match
//     frames by seq, so one rank's op can never pair with another's different op.
//  2. Point-to-point ops do not take a sequence number and run concurrently with collectives;
//     the transport keeps them ordered per (peer, tag).
//  3. Every op has a deadline (the group's timeout from submission). A collective or p2p op
//     that fails for any reason other than bad input breaks the group: the endpoint tells the
//     peers, fails everything pending, and every later op fails at once with the cause. The
//     executor reports an op's completion only after the endpoint is quiescent, so no reader
//     writes into an op's memory after the client was told the op ended.
//  4. An op holds references on its segments until it completes (package segment, invariant 2).
type Group struct {
	Handle      uint32
	Name        string
	Rank, Size  int
	GlobalRanks []int
	Timeout     time.Duration
	// Slot is the group's stream counter slot (CounterBase), or -1 when the session ran out.
	Slot int
	// Base is where the slot's counters stood when the group got it, per lane (collectives,
	// point to point): the client numbers its CUDA ops base+1, base+2, ... (see Session.slotBase).
	Base [2]uint32

	// last stream value seen per lane, Base before any (written by the session's serve
	// goroutine, read when the group is destroyed)
	last [2]atomic.Uint32

	sess *Session
	log  *slog.Logger

	mu      sync.Mutex
	cond    *sync.Cond
	ep      *transport.Endpoint
	queue   []*op
	closing string // why the group is closing; new ops fail with it
	seq     uint64
	running sync.WaitGroup // the executor, point-to-point ops, device ops in flight
	stats   Stats
	dev     gpu.Group // created by the first CUDA op
	flight  *flight
}

// Stats are a group's counters.
type Stats struct {
	Ops    map[string]uint64
	Errors uint64
	Sent   uint64
	Recv   uint64
	ByRef  uint64 // of Sent, bytes lent to same-host peers by reference
}

type op struct {
	desc     wire.Desc
	bufs     [][]byte
	release  func()
	deadline time.Time
	timeout  time.Duration
	fe       *FlightEntry // its flight recorder entry
}

func newGroup(sess *Session, name string, rank, size int, globalRanks []int, timeout time.Duration) *Group {
	g := &Group{
		Name: name, Rank: rank, Size: size, GlobalRanks: globalRanks, Timeout: timeout,
		sess: sess, log: sess.log,
		stats:  Stats{Ops: map[string]uint64{}},
		flight: newFlight(sess.srv.cfg.TraceSize),
	}
	g.cond = sync.NewCond(&g.mu)
	return g
}

func (g *Group) connect(ep *transport.Endpoint) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ep != nil {
		return fmt.Errorf("%w: group %d is already connected", wire.ErrInvalid, g.Handle)
	}
	if g.closing != "" {
		return fmt.Errorf("group %d: %w", g.Handle, ErrNotFound)
	}
	g.ep = ep
	ep.SetProgress(g.flight.progress)
	ep.OnBreak(g.broke)
	g.running.Add(1)
	go g.execute()
	return nil
}

// broke runs once when the group's endpoint breaks: the flight record is dumped (on a
// failure, not on a destroy) and the client is told at once on its watch stream, so that it
// can act on the failure even if it waits for no op of the group.
func (g *Group) broke(cause error) {
	if errors.Is(cause, transport.ErrClosed) {
		return
	}
	srv := g.sess.srv
	if srv.cfg.DumpOnFailure {
		srv.dumpSoon(g, fmt.Sprintf("group %q broke: %v", g.Name, cause))
	}
	g.sess.notify(Event{Kind: "group_broken", Group: g.Handle, Detail: fmt.Sprintf("group %q (rank %d of %d): %v", g.Name, g.Rank, g.Size, cause)})
}

// Broken returns why the group is unusable, or nil.
func (g *Group) Broken() error {
	g.mu.Lock()
	ep, closing := g.ep, g.closing
	g.mu.Unlock()
	if closing != "" {
		return errors.New(closing)
	}
	if ep == nil {
		return nil
	}
	return ep.Broken()
}

// Stats returns a copy of the group's counters.
func (g *Group) Stats() Stats {
	g.mu.Lock()
	defer g.mu.Unlock()
	s := g.stats
	s.Ops = make(map[string]uint64, len(g.stats.Ops))
	for k, v := range g.stats.Ops {
		s.Ops[k] = v
	}
	if g.ep != nil {
		s.Sent, s.Recv, s.ByRef = g.ep.BytesSent.Load(), g.ep.BytesReceived.Load(), g.ep.BytesByRef.Load()
	}
	return s
}

// Abort breaks the group with reason; pending and later ops fail.
func (g *Group) Abort(reason string) {
	g.mu.Lock()
	ep := g.ep
	g.mu.Unlock()
	if ep != nil {
		ep.Break(fmt.Errorf("%w: %s (rank %d)", transport.ErrAborted, reason, g.Rank))
	}
}

// reject fails a descriptor that did not validate. A collective that one rank cannot run
// leaves its peers waiting, so the group is broken at once: they fail now, not at timeout.
// A refused collective breaks the group (its peers would wait for it); so does a refused
// CUDA op of any kind, because the client's stream counter already counts it and the
// engine's streams must not wait for a value nobody writes.
// floor is, per lane, the last stream value seen (the base where none was).
func (g *Group) floor() [2]uint32 { return [2]uint32{g.last[0].Load(), g.last[1].Load()} }

// releaseStreams lets the client's streams waiting on the group's counters go on (see
// gpu.Session.Release).
func (g *Group) releaseStreams(why string) {
	ds := g.sess.deviceSession()
	if ds == nil || g.Slot < 0 {
		return
	}
	if err := ds.Release(g.Slot, g.floor()); err != nil {
		g.log.Error("could not release the client's streams", "after", why, "err", err)
	}
}

// noteStream records a CUDA op's stream value (its client already wrote it as ready, or
// will): the next group on the slot counts on from past it. Only the serve goroutine calls it.
// The client counts each lane up by one per op, in ring order: a value at or below the last
// would be waited for by no stream write of its own (and a duplicate would displace its twin
// in the device engine's p2p sequencer), and the sequencer writes send/recv values one by
// one, so a skipped one would park every later send and recv. Either is refused (the error),
// which breaks the group and releases its streams.
func (g *Group) noteStream(d *wire.Desc) error {
	lane := 0 // collectives count on the first pair of counters, send/recv on the second
	if !d.Kind.Collective() {
		lane = 1
	}
	v, last := d.StreamValue, g.last[lane].Load()
	ahead := int32(v - last) // wraps with the counters
	if ahead > 0 {
		g.last[lane].Store(v)
	}
	switch {
	case ahead <= 0:
		return fmt.Errorf("%w: stream value %d of a CUDA %s is not past the group's last, %d", wire.ErrInvalid, v, d.Kind, last)
	case lane == 1 && ahead != 1:
		return fmt.Errorf("%w: stream value %d of a CUDA %s skips send/recv values after %d", wire.ErrInvalid, v, d.Kind, last)
	}
	return nil
}

func (g *Group) reject(d wire.Desc, err error) {
	// Break and release first: when the client sees the failure, both have happened.
	defer g.sess.complete(d.Seq, wire.StatusInvalid, -1, err.Error())
	engine := "host"
	if d.Device == wire.DeviceCUDA {
		engine = "nccl"
	}
	g.flight.end(g.flight.record(&d, engine, 0), wire.StatusInvalid, err.Error())
	g.count(d.Kind, true)
	if d.Kind.Collective() || d.Device == wire.DeviceCUDA {
		g.mu.Lock()
		ep, dev := g.ep, g.dev
		g.mu.Unlock()
		if ep != nil {
			ep.Break(fmt.Errorf("%w: rank %d refused its %s: %v", transport.ErrAborted, g.Rank, d.Kind, err))
		}
		if d.Device == wire.DeviceCUDA && (dev == nil || ep == nil) {
			// The client's stream waits for this op's done count. A device group releases
			// its streams when the break aborts it; without one, release them here.
			g.releaseStreams("a refused op")
		}
	}
}

func (g *Group) submit(o *op) {
	o.fe = g.flight.record(&o.desc, "host", o.timeout)
	g.mu.Lock()
	if g.ep == nil || g.closing != "" {
		why := "group is not connected"
		if g.closing != "" {
			why = g.closing
		}
		g.mu.Unlock()
		g.finish(o, wire.StatusAborted, -1, fmt.Sprintf("%s on group %q: %s", o.desc.Kind, g.Name, why))
		return
	}
	if !o.desc.Kind.Collective() {
		// Post now, in submission order: the transport keeps (peer, tag) order only for
		// what reaches it in order. Only the waiting happens on another goroutine.
		g.running.Add(1)
		ep := g.ep
		g.mu.Unlock()
		g.flight.start(o.fe)
		go g.p2p(o, g.postP2P(ep, o))
		return
	}
	g.queue = append(g.queue, o)
	g.cond.Signal()
	g.mu.Unlock()
}

// close fails what is queued, waits for running ops and leaves the group. Device ops get a
// grace period to finish on the GPU; then the device group is aborted, which releases them.
func (g *Group) close(reason string) {
	g.mu.Lock()
	if g.closing == "" {
		g.closing = reason
	}
	q := g.queue
	g.queue = nil
	ep, dev := g.ep, g.dev
	g.cond.Broadcast()
	g.mu.Unlock()
	if ep != nil {
		ep.Break(fmt.Errorf("%w: %s", transport.ErrClosed, reason))
	}
	for _, o := range q {
		g.finish(o, wire.StatusAborted, -1, fmt.Sprintf("%s on group %q: %s", o.desc.Kind, g.Name, reason))
	}
	idle := make(chan struct{})
	go func() { g.running.Wait(); close(idle) }()
	select {
	case <-idle:
	case <-time.After(5 * time.Second):
		if dev != nil {
			dev.Abort(fmt.Errorf("%w: %s", transport.ErrClosed, reason))
		}
		<-idle
	}
	if dev != nil {
		if err := dev.Close(); err != nil {
			g.log.Warn("closing the device group", "err", err)
		}
	}
	if ep != nil {
		ep.Close()
	}
	g.log.Info("group closed", "reason", reason)
}

// ctlTagBase puts the device engine's control messages (gpu.PeerLink) in a tag space of their
// own: client tags are 32-bit.
const ctlTagBase = int64(1) << 40

// peerLink is the device engine's gpu.PeerLink over the group's host links.
type peerLink struct{ ep *transport.Endpoint }

func (l peerLink) Send(ctx context.Context, peer, tag int, b []byte) error {
	return l.ep.SendP2P(peer, ctlTagBase+int64(tag), b).Wait(ctx)
}

func (l peerLink) Recv(ctx context.Context, peer, tag, n int) ([]byte, error) {
	b := make([]byte, n)
	if err := l.ep.RecvP2P(peer, ctlTagBase+int64(tag), collectives.CopySink{Dst: b}).Wait(ctx); err != nil {
		return nil, err
	}
	return b, nil
}

// submitDevice hands a resolved CUDA op to the group's device engine, creating the device
// group on first use. A device op's failure breaks the whole group (design 3), and a broken
// group aborts its device work, so peers on either engine fail instead of hanging.
func (g *Group) submitDevice(ds gpu.Session, o *op, ptrs []uint64) {
	o.fe = g.flight.record(&o.desc, "nccl", o.timeout)
	g.mu.Lock()
	if g.ep == nil || g.closing != "" {
		why := cmp.Or(g.closing, "group is not connected")
		closing := g.closing != ""
		g.mu.Unlock()
		if !closing { // a closing group's streams are released when it is destroyed
			g.releaseStreams("an op on a group that is not connected")
		}
		g.finish(o, wire.StatusAborted, -1, fmt.Sprintf("%s on group %q: %s", o.desc.Kind, g.Name, why))
		return
	}
	if g.Slot < 0 {
		g.mu.Unlock()
		g.finish(o, wire.StatusInvalid, -1, fmt.Sprintf("%s on group %q: more than %d groups use CUDA tensors in this process", o.desc.Kind, g.Name, gpu.CounterSlots))
		return
	}
	if err := g.makeDevice(ds); err != nil {
		ep := g.ep
		g.mu.Unlock()
		msg := fmt.Sprintf("%s on group %q: %v", o.desc.Kind, g.Name, err)
		g.deviceFailed(ep, msg)
		g.finish(o, wire.StatusInternal, -1, msg)
		return
	}
	dev, ep := g.dev, g.ep
	g.running.Add(1)
	g.mu.Unlock()
	d := &o.desc
	g.flight.start(o.fe)
	fe := o.fe
	dev.Enqueue(gpu.Op{Desc: d, Ptrs: ptrs, Deadline: o.deadline, Launched: func() { g.flight.launched(fe) }, Done: func(err error) {
		defer g.running.Done()
		if err == nil {
			g.finish(o, wire.StatusOK, -1, "")
			return
		}
		status, msg := g.failure(context.Background(), d, uint64(d.StreamValue), o.timeout, err)
		ep.Break(breakCause(status, msg, err))
		g.finish(o, status, -1, msg)
	}})
}

// makeDevice makes the group's device member if it has none (g.mu held, the group
// connected, with a counter slot). After a failure the caller unlocks g.mu and calls
// deviceFailed.
func (g *Group) makeDevice(ds gpu.Session) error {
	if g.dev != nil {
		return nil
	}
	start := time.Now()
	dev, err := ds.NewGroup(g.Rank, g.Size, g.Slot, g.Base, peerLink{g.ep})
	g.log.Info("device group created", "took", time.Since(start), "err", err)
	if err != nil {
		return err
	}
	g.dev = dev
	g.ep.OnBreak(func(cause error) {
		if !errors.Is(cause, transport.ErrClosed) { // a destroy gives device ops their grace period (close)
			dev.Abort(cause)
		}
	})
	return nil
}

// deviceFailed breaks the group after its device member could not be made (g.mu not held):
// the peers' device members wait for this one.
func (g *Group) deviceFailed(ep *transport.Endpoint, msg string) {
	ep.Break(fmt.Errorf("%w: %s", transport.ErrAborted, msg))
	g.releaseStreams("a failed device group")
}

// shmemID hands the group's NVSHMEM unique id to its device member (gpu.Group.ShmemID),
// making the member first if no CUDA op has yet.
func (g *Group) shmemID(ds gpu.Session, id []byte) ([]byte, error) {
	g.mu.Lock()
	switch {
	case g.ep == nil || g.closing != "":
		g.mu.Unlock()
		return nil, fmt.Errorf("%w: group %q: %s", wire.ErrInvalid, g.Name, cmp.Or(g.closing, "not connected"))
	case g.Slot < 0:
		g.mu.Unlock()
		return nil, fmt.Errorf("%w: group %q: more than %d groups use CUDA tensors in this process", wire.ErrInvalid, g.Name, gpu.CounterSlots)
	}
	if err := g.makeDevice(ds); err != nil {
		ep := g.ep
		g.mu.Unlock()
		err = fmt.Errorf("NVSHMEM unique id on group %q: %w", g.Name, err)
		g.deviceFailed(ep, err.Error())
		return nil, err
	}
	dev := g.dev
	g.mu.Unlock()
	return dev.ShmemID(id)
}

// execute runs the collectives of the group in order (design 1).
func (g *Group) execute() {
	defer g.running.Done()
	for {
		g.mu.Lock()
		for len(g.queue) == 0 && g.closing == "" {
			g.cond.Wait()
		}
		if len(g.queue) == 0 {
			g.mu.Unlock()
			return
		}
		o := g.queue[0]
		g.queue = g.queue[1:]
		seq := g.seq
		g.seq++
		ep := g.ep
		g.mu.Unlock()
		g.runCollective(ep, seq, o)
	}
}

func (g *Group) runCollective(ep *transport.Endpoint, seq uint64, o *op) {
	d := &o.desc
	g.flight.start(o.fe)
	if err := ep.Broken(); err != nil {
		g.finish(o, wire.StatusBroken, -1, fmt.Sprintf("%s #%d on group %q: the group is broken: %v", d.Kind, seq, g.Name, err))
		return
	}
	ctx, cancel := context.WithDeadline(context.Background(), o.deadline)
	defer cancel()
	sig := transport.Signature{Op: uint8(d.Kind), DType: d.DType, RedOp: d.RedOp, Count: d.Count, OpName: d.Kind.String()}
	switch d.Kind {
	case wire.OpBroadcast, wire.OpReduce, wire.OpGather, wire.OpScatter:
		sig.Root = d.Root
	case wire.OpAllToAll:
		sig.Count = 0 // splits differ per rank; the transport checks each pair's length
	}
	comm := ep.Op(seq, sig)
	err := runHost(ctx, hostComm{comm}, d, o.bufs)
	if err == nil {
		err = comm.Done() // a peer's part this rank ran without: a mismatch
	}
	if err != nil {
		status, msg := g.failure(ctx, d, seq, o.timeout, err)
		ep.Break(breakCause(status, msg, err))
		ep.Quiesce(time.Second)
		g.finish(o, status, -1, msg)
		return
	}
	g.finish(o, wire.StatusOK, -1, "")
}

// p2pReq is a posted send or receive.
type p2pReq interface {
	Wait(context.Context) error
	Source() int
}

func (g *Group) postP2P(ep *transport.Endpoint, o *op) p2pReq {
	d := &o.desc
	if d.Kind == wire.OpSend {
		return ep.SendP2P(int(d.Root), int64(d.Tag), o.bufs[0])
	}
	return ep.RecvP2P(int(d.Root), int64(d.Tag), collectives.CopySink{Dst: o.bufs[0]})
}

// p2p waits for one posted send or recv (design 2).
func (g *Group) p2p(o *op, req p2pReq) {
	defer g.running.Done()
	d := &o.desc
	g.mu.Lock()
	ep := g.ep
	g.mu.Unlock()
	ctx, cancel := context.WithDeadline(context.Background(), o.deadline)
	defer cancel()
	err := req.Wait(ctx)
	switch {
	case err == nil:
		g.finish(o, wire.StatusOK, req.Source(), "")
	case errors.Is(err, transport.ErrMismatch) && ctx.Err() == nil && !errors.As(err, new(broke)):
		// the message was the wrong size: it was consumed, nothing stays posted (a request
		// that another op's mismatch failed, by breaking the group, takes the next case)
		g.finish(o, wire.StatusMismatch, -1, fmt.Sprintf("%s on group %q: %v", d.Kind, g.Name, err))
	default:
		status, msg := g.failure(ctx, d, 0, o.timeout, err)
		ep.Break(breakCause(status, msg, err))
		ep.Quiesce(time.Second)
		g.finish(o, status, -1, msg)
	}
}

// failure names what went wrong for the client and picks the status.
func (g *Group) failure(ctx context.Context, d *wire.Desc, seq uint64, timeout time.Duration, err error) (int32, string) {
	what := fmt.Sprintf("%s #%d", d.Kind, seq)
	if !d.Kind.Collective() {
		what = fmt.Sprintf("%s (peer %d, tag %d)", d.Kind, d.Root, d.Tag)
	}
	where := fmt.Sprintf("on group %q (rank %d of %d)", g.Name, g.Rank, g.Size)
	switch {
	case ctx.Err() != nil && errors.Is(err, context.DeadlineExceeded), errors.Is(err, ErrTimeout):
		return wire.StatusTimeout, fmt.Sprintf("%s %s timed out after %v: %v", what, where, timeout, err)
	case errors.Is(err, transport.ErrMismatch):
		return wire.StatusMismatch, fmt.Sprintf("%s %s: %v", what, where, err)
	case errors.Is(err, transport.ErrPeerLost):
		return wire.StatusPeerLost, fmt.Sprintf("%s %s: %v", what, where, err)
	case errors.Is(err, transport.ErrAborted), errors.Is(err, transport.ErrClosed),
		errors.Is(err, transport.ErrProtocol), errors.Is(err, transport.ErrUnmatchedMax):
		return wire.StatusAborted, fmt.Sprintf("%s %s: %v", what, where, err)
	case errors.Is(err, reduce.ErrUnsupported):
		return wire.StatusInvalid, fmt.Sprintf("%s %s: %v", what, where, err)
	default:
		return wire.StatusInternal, fmt.Sprintf("%s %s: %v", what, where, err)
	}
}

// broke is the error an op's failure breaks its group with: failure's words (which hold the
// op's error) and that error's kind, so the group's other ops fail as what it was (a peer
// lost, a timeout, an abort), not as internal errors.
type broke struct {
	msg string
	err error
}

func (b broke) Error() string { return b.msg }
func (b broke) Unwrap() error { return b.err }

// breakCause is what failure's status and msg of err break a group with.
func breakCause(status int32, msg string, err error) error {
	if status == wire.StatusTimeout { // a deadline of this op's context: the others' are not past
		err = ErrTimeout
	}
	return broke{msg: msg, err: err}
}

func (g *Group) finish(o *op, status int32, source int, msg string) {
	if o.fe != nil {
		g.flight.end(o.fe, status, msg)
	}
	o.release()
	g.count(o.desc.Kind, status != wire.StatusOK)
	if status != wire.StatusOK && status != wire.StatusAborted {
		g.log.Warn("op failed", "seq", o.desc.Seq, "status", status, "err", msg)
	}
	g.sess.complete(o.desc.Seq, status, source, msg)
}

func (g *Group) count(k wire.OpKind, failed bool) {
	g.mu.Lock()
	g.stats.Ops[k.String()]++
	if failed {
		g.stats.Errors++
	}
	g.mu.Unlock()
}

// runHost runs a validated host-memory collective. bufs follow wire.Desc.Validate's roles.
func runHost(ctx context.Context, c collectives.Comm, d *wire.Desc, bufs [][]byte) error {
	root := int(d.Root)
	n := c.Size()
	isRoot := c.Rank() == root
	finish := func(b []byte) error { return reduce.Finish(d.DType, d.RedOp, b, n) }
	switch d.Kind {
	case wire.OpAllReduce:
		if err := collectives.AllReduce(ctx, c, bufs[0], d.DType, d.RedOp); err != nil {
			return err
		}
		return finish(bufs[0])
	case wire.OpBroadcast:
		return collectives.Broadcast(ctx, c, bufs[0], root)
	case wire.OpReduce:
		if err := collectives.Reduce(ctx, c, bufs[0], d.DType, d.RedOp, root); err != nil || !isRoot {
			return err
		}
		return finish(bufs[0])
	case wire.OpAllGather:
		return collectives.AllGather(ctx, c, bufs[0], bufs[1])
	case wire.OpReduceScatter:
		if err := collectives.ReduceScatter(ctx, c, bufs[0], bufs[1], d.DType, d.RedOp); err != nil {
			return err
		}
		return finish(bufs[1])
	case wire.OpAllToAll:
		es := int64(d.DType.Size())
		in := make([]int, n)
		out := make([]int, n)
		for i := 0; i < n; i++ {
			in[i], out[i] = int(d.Splits[i]*es), int(d.Splits[n+i]*es)
		}
		return collectives.AllToAll(ctx, c, bufs[0], in, bufs[1], out)
	case wire.OpGather:
		var out []byte
		if isRoot {
			out = bufs[1]
		}
		return collectives.Gather(ctx, c, bufs[0], out, root)
	case wire.OpScatter:
		var in []byte
		if isRoot {
			in = bufs[1]
		}
		return collectives.Scatter(ctx, c, in, bufs[0], root)
	case wire.OpBarrier:
		return collectives.Barrier(ctx, c)
	}
	return fmt.Errorf("%w: %s is not a collective", wire.ErrInvalid, d.Kind)
}
