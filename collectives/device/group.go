package device

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/cuda"
	"github.com/gocomm/gocomm/internal/nccl"
	"github.com/gocomm/gocomm/internal/nvshmem"
	"github.com/gocomm/gocomm/wire"
)

// Lanes: collectives and point-to-point ops count on separate counters (as torch's NCCL
// backend keeps them on separate streams), so a blocked recv cannot hold up a collective.
const (
	laneColl = 0
	laneP2P  = 1
)

// PeerLink tags of the engine's control messages.
const (
	tagCollID = 0 // rank 0 -> every rank: the collective communicator's id
	tagPairID = 1 // sender -> receiver: the id of their one-way communicator
)

// group is one rank's member of a group on the device.
//
// Design:
//  1. Collectives run on one worker: a goroutine locked to an OS thread (context current)
//     that enqueues them in submission order on the collective stream: wait for the client's
//     ready counter, the NCCL call(s), write the done counter, record an event. It never
//     waits for the GPU.
//  2. Point-to-point ops run on a worker per (peer, direction), each with its own stream and
//     a two-rank communicator that carries only that direction's messages. NCCL matches a
//     communicator's sends and receives in order and holds a send until its receive is
//     posted, so one communicator for both directions deadlocks when two ranks both send
//     first, which is what batch_isend_irecv does on a backend that does not coalesce (torch
//     coalesces only for its own ProcessGroup class). One direction per communicator never
//     deadlocks, whatever order the ranks post in.
//  3. The p2p done counter must still rise in submission order: a sequencer stream writes it,
//     for op k after waiting for op k's event. Worker streams never wait for each other.
//  4. Communicators are made on first use: rank 0 (for a pair, the sender) makes the unique
//     id and sends it over the group's host links (PeerLink); init gives up at the op's
//     deadline.
//  5. A poller retires ops as their events complete and calls Done; it is also the watchdog:
//     an op past its deadline, whether in flight on the GPU or stuck in a worker's NCCL call,
//     aborts the group.
//  6. Abort cancels the communicators (ncclCommAbort, which also frees a worker stuck in a
//     call), then releases every stream waiting on a counter, the client's and ours, by
//     writing far-ahead values into the counters from a stream that waits for nothing
//     (session invariant 3): nothing stays blocked on a GPU after a failure. Each op's Done is
//     called exactly once, however the abort and the workers interleave.
type group struct {
	s          *session
	rank, size int
	slot       int
	link       gpu.PeerLink
	ready      [2]cuda.Ptr // device addresses of the counters
	done       [2]cuda.Ptr
	scratch    cuda.Ptr // barrier's all_reduce operand

	mu       sync.Mutex
	cond     *sync.Cond
	coll     *worker
	pairs    map[pairKey]*worker
	workers  int // worker goroutines running
	inflight []*flight
	retired  uint64       // rounds of retirements by the poller: wakes sleeping workers to spin again
	events   []cuda.Event // pool (see event)
	broken   error
	aborted  chan struct{} // closed by Abort: wakes a pending communicator init
	closing  bool
	closed   bool // Close is destroying the communicators: Abort must not touch them
	wg       sync.WaitGroup

	floor [2]uint32 // per lane, the last stream value enqueued (the base before any): what a release counts from (mu)

	shmemID *nvshmem.UniqueID // handed over by the client (ShmemID) before the first OpAllToAllV (mu)

	seqMu     sync.Mutex // the p2p done sequencer (design 3)
	seqStream cuda.Stream
	seqNext   uint32
	seqWait   map[uint32]*flight // launched, waiting for their turn
}

type pairKey struct {
	peer int
	send bool
}

// worker enqueues one stream's ops (design 1, 2). queue, busy and comm are guarded by
// group.mu.
type worker struct {
	key    pairKey      // peer -1: the collective worker
	queued atomic.Int64 // len(queue), read without the lock by a spinning worker
	queue  []*dop
	busy   *dop // being enqueued: the watchdog's view of a stuck NCCL call
	comm   nccl.Comm
}

func (w *worker) lane() int {
	if w.key.peer < 0 {
		return laneColl
	}
	return laneP2P
}

// dop is a gpu.Op whose Done runs once.
type dop struct {
	gpu.Op
	once sync.Once
}

func (o *dop) finish(err error) { o.once.Do(func() { o.Done(err) }) }

type flight struct {
	op  *dop
	ev  cuda.Event
	val uint32
	// check, if set, runs on the poller once the op finished on the GPU (on a stream of the
	// poller's); an error fails the op and aborts the group.
	check func(cuda.Stream) error
}

func (s *session) NewGroup(rank, size, slot int, base [2]uint32, link gpu.PeerLink) (gpu.Group, error) {
	if slot < 0 || slot >= gpu.CounterSlots {
		return nil, fmt.Errorf("counter slot %d out of range", slot)
	}
	g := &group{s: s, rank: rank, size: size, slot: slot, link: link, pairs: map[pairKey]*worker{},
		floor: base, seqNext: base[laneP2P] + 1, seqWait: map[uint32]*flight{}, aborted: make(chan struct{})}
	for lane := 0; lane < 2; lane++ {
		off := 16*slot + 8*lane
		g.ready[lane] = s.counters + cuda.Ptr(off)
		g.done[lane] = s.counters + cuda.Ptr(off+4)
	}
	g.cond = sync.NewCond(&g.mu)
	err := s.do(func() (err error) {
		if g.seqStream, err = cuda.NewStream(cuda.StreamNonBlocking); err != nil {
			return err
		}
		g.scratch, err = cuda.Alloc(256)
		return err
	})
	if err != nil {
		g.release()
		return nil, err
	}
	g.coll = &worker{key: pairKey{peer: -1}}
	g.start(g.coll)
	g.wg.Add(1)
	go g.poll()
	return g, nil
}

// releaseFloor is the floor a release counts from (gpu.Session.Release).
func (g *group) releaseFloor() [2]uint32 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.floor
}

// release frees what NewGroup made, after every goroutine is gone.
func (g *group) release() {
	g.s.do(func() error {
		if g.seqStream != (cuda.Stream{}) {
			g.seqStream.Synchronize()
			g.seqStream.Destroy()
		}
		if g.scratch != 0 {
			cuda.Free(g.scratch)
		}
		for _, ev := range g.events {
			ev.Destroy()
		}
		g.events = nil
		return nil
	})
}

// start runs w's goroutine. Called with g.mu held, or before the group is shared.
func (g *group) start(w *worker) {
	g.workers++
	g.wg.Add(1)
	go g.work(w)
}

// Enqueue implements gpu.Group.
func (g *group) Enqueue(op gpu.Op) {
	o := &dop{Op: op}
	g.mu.Lock()
	if err := g.broken; err != nil || g.closing {
		g.mu.Unlock()
		if err == nil {
			err = errors.New("device group closed")
		}
		o.finish(err)
		return
	}
	w := g.coll
	if k := op.Desc.Kind; k == wire.OpSend || k == wire.OpRecv {
		key := pairKey{peer: int(op.Desc.Root), send: k == wire.OpSend}
		if w = g.pairs[key]; w == nil {
			w = &worker{key: key}
			g.pairs[key] = w
			g.start(w)
		}
	}
	if lane, v := w.lane(), op.Desc.StreamValue; int32(v-g.floor[lane]) > 0 {
		g.floor[lane] = v
	}
	w.queue = append(w.queue, o)
	w.queued.Add(1)
	g.cond.Broadcast()
	g.mu.Unlock()
}

// work is a worker's goroutine (design 1, 2).
func (g *group) work(w *worker) {
	defer g.wg.Done()
	defer func() {
		g.mu.Lock()
		g.workers--
		g.cond.Broadcast()
		g.mu.Unlock()
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st, err := func() (cuda.Stream, error) {
		if err := g.s.ctx.SetCurrent(); err != nil {
			return cuda.Stream{}, err
		}
		return cuda.NewStream(cuda.StreamNonBlocking)
	}()
	if err != nil {
		g.Abort(fmt.Errorf("device stream: %w", err))
		return
	}
	defer func() {
		st.Synchronize()
		st.Destroy()
		g.mu.Lock()
		broken := g.broken != nil
		g.mu.Unlock()
		if broken {
			// done writes that were queued behind the abort ran when the streams drained
			// and may have set done below what Abort released: release again.
			g.seqStream.Synchronize()
			if err := g.s.Release(g.slot, g.releaseFloor()); err != nil {
				g.s.log.Error("could not release the streams of an aborted group", "err", err)
			}
		}
	}()
	for {
		g.spin(w)
		g.mu.Lock()
		retired := g.retired
		for len(w.queue) == 0 && !g.closing && g.broken == nil && (g.s.spin <= 0 || g.retired == retired) {
			g.cond.Wait()
		}
		if len(w.queue) == 0 {
			stop := g.closing || g.broken != nil
			g.mu.Unlock()
			if stop {
				return
			}
			continue // an op retired: spin for the client's next one (see spin)
		}
		o := w.queue[0]
		w.queue = w.queue[1:]
		w.queued.Add(-1)
		broken := g.broken
		if broken == nil {
			w.busy = o
			g.cond.Broadcast() // the watchdog watches busy ops
		}
		g.mu.Unlock()
		if broken != nil {
			o.finish(broken)
			continue
		}
		err := g.launch(w, o, st)
		g.mu.Lock()
		w.busy = nil
		g.mu.Unlock()
		if err != nil {
			err = fmt.Errorf("%s: %w", o.Desc.Kind, err)
			o.finish(err)
			g.Abort(err)
		}
	}
}

// spin polls for w's next op for a while before the worker sleeps: waking a goroutine locked
// to its thread takes the scheduler tens of microseconds, more than a whole small op on the
// GPU. Only on hosts that asked for spinning (Engine.Spin, the sidecar's --spin). A worker
// that went to sleep while a long op ran spins again once the poller retires an op: the
// client's next op usually follows a completion.
func (g *group) spin(w *worker) {
	if g.s.spin <= 0 {
		return
	}
	end := time.Now().Add(g.s.spin)
	for i := 0; w.queued.Load() == 0; i++ {
		if i&63 == 63 {
			if time.Now().After(end) {
				return
			}
			runtime.Gosched()
		}
	}
}

// commOf returns w's communicator, making it on first use (design 4).
func (g *group) commOf(w *worker, deadline time.Time) (nccl.Comm, error) {
	g.mu.Lock()
	c, broken := w.comm, g.broken
	g.mu.Unlock()
	if broken != nil {
		return nccl.Comm{}, broken // never hand out a communicator Abort has freed
	}
	if c.Valid() {
		return c, nil
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	go func() {
		select {
		case <-g.aborted:
			cancel()
		case <-ctx.Done():
		}
	}()
	n, rank, leader, tag := g.size, g.rank, 0, tagCollID
	if w.key.peer >= 0 {
		n, rank, leader, tag = 2, 1, w.key.peer, tagPairID
		if w.key.send {
			rank, leader = 0, g.rank
		}
	}
	start := time.Now()
	var id nccl.UniqueID
	if leader == g.rank {
		var err error
		if id, err = nccl.NewUniqueID(); err != nil {
			return nccl.Comm{}, err
		}
		peers := []int{w.key.peer}
		if w.key.peer < 0 {
			peers = peers[:0]
			for p := 0; p < g.size; p++ {
				if p != g.rank {
					peers = append(peers, p)
				}
			}
		}
		for _, p := range peers {
			if err := g.link.Send(ctx, p, tag, id[:]); err != nil {
				return nccl.Comm{}, fmt.Errorf("send the NCCL id to rank %d: %w", p, err)
			}
		}
	} else {
		b, err := g.link.Recv(ctx, leader, tag, len(id))
		if err != nil {
			return nccl.Comm{}, fmt.Errorf("NCCL id from rank %d: %w", leader, err)
		}
		copy(id[:], b)
	}
	type result struct {
		c   nccl.Comm
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := g.s.ctx.SetCurrent(); err != nil {
			ch <- result{err: err}
			return
		}
		c, err := nccl.InitRank(n, id, rank)
		ch <- result{c, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			return nccl.Comm{}, fmt.Errorf("NCCL communicator init: %w", r.err)
		}
		g.mu.Lock()
		w.comm = r.c
		broken := g.broken
		g.mu.Unlock()
		if broken != nil { // Abort ran while this init did and could not cancel it
			r.c.Abort()
			return nccl.Comm{}, broken
		}
		g.s.log.Info("NCCL communicator ready", "group_rank", g.rank, "peer", w.key.peer, "send", w.key.send,
			"ranks", n, "took", time.Since(start))
		return r.c, nil
	case <-ctx.Done():
		go func() { // the init goes on without us: free what it makes
			if r := <-ch; r.err == nil {
				r.c.Abort()
			}
		}()
		select {
		case <-g.aborted:
			return nccl.Comm{}, errors.New("NCCL communicator init: the group was aborted")
		default:
		}
		return nccl.Comm{}, fmt.Errorf("%w: NCCL communicator init: a peer did not join before the deadline", gpu.ErrTimeout)
	}
}

// launch enqueues one op on w's stream st (design 1-3).
func (g *group) launch(w *worker, o *dop, st cuda.Stream) error {
	d := o.Desc
	if d.Kind == wire.OpAllToAllV {
		if err := g.launchA2AV(o, st); err != nil {
			return err
		}
		return g.record(o, st, func(ps cuda.Stream) error { return g.checkA2AV(o, ps) })
	}
	comm, err := g.commOf(w, o.Deadline)
	if err != nil {
		return err
	}
	lane := w.lane()
	if err := st.WaitValue32(g.ready[lane], d.StreamValue, cuda.WaitGEQ); err != nil {
		return err
	}
	ns := nccl.Stream(st.Handle())
	if lane == laneColl {
		if err := enqueueNCCL(comm, o.Op, ns, g.rank, g.size, g.scratch); err != nil {
			return err
		}
		if err := st.WriteValue32(g.done[lane], d.StreamValue); err != nil {
			return err
		}
	} else {
		n := int(d.Count) * d.DType.Size()
		if w.key.send {
			err = comm.Send(uintptr(o.Ptrs[0]), n, nccl.Uint8, 1, ns)
		} else {
			err = comm.Recv(uintptr(o.Ptrs[0]), n, nccl.Uint8, 0, ns)
		}
		if err != nil {
			return err
		}
	}
	if lane == laneP2P {
		f, err := g.recorded(o, st, nil)
		if err != nil {
			return err
		}
		return g.sequence(f)
	}
	return g.record(o, st, nil)
}

// recorded is o's flight, with an event recorded after it on st.
func (g *group) recorded(o *dop, st cuda.Stream, check func(cuda.Stream) error) (*flight, error) {
	ev, err := g.event()
	if err != nil {
		return nil, err
	}
	if err := ev.Record(st); err != nil {
		g.recycle(ev)
		return nil, err
	}
	return &flight{op: o, ev: ev, val: o.Desc.StreamValue, check: check}, nil
}

// record hands a launched collective to the poller (see recorded).
func (g *group) record(o *dop, st cuda.Stream, check func(cuda.Stream) error) error {
	f, err := g.recorded(o, st, check)
	if err != nil {
		return err
	}
	g.fly(f)
	return nil
}

// event returns an event from the group's pool, or a new one (creating one per op costs
// microseconds under MPS).
func (g *group) event() (cuda.Event, error) {
	g.mu.Lock()
	if n := len(g.events); n > 0 {
		ev := g.events[n-1]
		g.events = g.events[:n-1]
		g.mu.Unlock()
		return ev, nil
	}
	g.mu.Unlock()
	return cuda.NewEvent(cuda.EventDisableTiming)
}

// recycle returns an event whose last record completed (or was never made) to the pool.
func (g *group) recycle(ev cuda.Event) {
	g.mu.Lock()
	if len(g.events) < 256 {
		g.events = append(g.events, ev)
		ev = cuda.Event{}
	}
	g.mu.Unlock()
	if ev != (cuda.Event{}) {
		ev.Destroy()
	}
}

// fly hands a launched op to the poller.
func (g *group) fly(f *flight) {
	g.mu.Lock()
	if err := g.broken; err != nil {
		g.mu.Unlock()
		f.op.finish(err) // Abort already ran: nobody would retire it
		return
	}
	g.inflight = append(g.inflight, f)
	g.cond.Broadcast()
	g.mu.Unlock()
}

// sequence writes the p2p done counter in submission order (design 3): f's op has been
// enqueued on its worker's stream and f.ev recorded after it. Every op whose turn has come
// gets a wait for its event and its done write on the sequencer stream, then flies with an
// event recorded there (so it retires once done is written).
func (g *group) sequence(f *flight) error {
	var ready []*flight
	var failed *flight
	var err error
	g.seqMu.Lock()
	g.seqWait[f.val] = f
	for {
		f, ok := g.seqWait[g.seqNext]
		if !ok {
			break
		}
		delete(g.seqWait, g.seqNext)
		g.seqNext++
		err = g.seqStream.WaitEvent(f.ev)
		if err == nil {
			err = g.seqStream.WriteValue32(g.done[laneP2P], f.val)
		}
		if err == nil {
			err = f.ev.Record(g.seqStream)
		}
		if err != nil {
			failed = f
			break
		}
		ready = append(ready, f)
	}
	g.seqMu.Unlock()
	// Done and fly run without seqMu: a failing op's Done breaks the group, and Abort takes
	// seqMu.
	for _, f := range ready {
		g.fly(f)
	}
	if failed != nil {
		failed.op.finish(err)
		return err
	}
	return nil
}

// poll retires finished ops and enforces deadlines (design 5).
func (g *group) poll() {
	defer g.wg.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := g.s.ctx.SetCurrent(); err != nil {
		g.Abort(err)
	}
	var checks cuda.Stream // for flights' checks, made on first use
	defer func() {
		if checks != (cuda.Stream{}) {
			checks.Destroy()
		}
	}()
	for {
		g.mu.Lock()
		for len(g.inflight) == 0 && !g.anyBusy() && !(g.closing && g.workers == 0) {
			g.cond.Wait()
		}
		if len(g.inflight) == 0 && g.closing && g.workers == 0 {
			g.mu.Unlock()
			return
		}
		flights := append([]*flight(nil), g.inflight...)
		now := time.Now()
		late := g.busyWhere(func(o *dop) bool { return now.After(o.Deadline) })
		g.mu.Unlock()
		if late != nil {
			g.Abort(fmt.Errorf("%w: %s was still being enqueued (in NCCL) at its deadline; a peer never posted its side",
				gpu.ErrTimeout, late.Desc.Kind))
		}
		var retired []*flight
		for _, f := range flights {
			done, err := f.ev.Done()
			switch {
			case err != nil:
				g.Abort(fmt.Errorf("%s: %w", f.op.Desc.Kind, err))
			case done:
				retired = append(retired, f)
			case now.After(f.op.Deadline):
				g.Abort(fmt.Errorf("%w: %s did not finish on the GPU before its deadline", gpu.ErrTimeout, f.op.Desc.Kind))
			}
		}
		if len(retired) > 0 {
			g.mu.Lock()
			keep := g.inflight[:0]
			for _, f := range g.inflight {
				if !contains(retired, f) {
					keep = append(keep, f)
				}
			}
			g.inflight = keep
			g.retired++
			g.cond.Broadcast() // sleeping workers spin again
			g.mu.Unlock()
			for _, f := range retired {
				g.recycle(f.ev)
				var err error
				if f.check != nil {
					if checks == (cuda.Stream{}) {
						checks, err = cuda.NewStream(cuda.StreamNonBlocking)
					}
					if err == nil {
						err = f.check(checks)
					}
				}
				f.op.finish(err)
				if err != nil {
					g.Abort(err)
				}
			}
			continue
		}
		time.Sleep(20 * time.Microsecond)
	}
}

func contains(fs []*flight, f *flight) bool {
	for _, x := range fs {
		if x == f {
			return true
		}
	}
	return false
}

// allWorkers lists the collective worker and the pair workers (g.mu held).
func (g *group) allWorkers() []*worker {
	ws := []*worker{g.coll}
	for _, w := range g.pairs {
		ws = append(ws, w)
	}
	return ws
}

func (g *group) anyBusy() bool { return g.busyWhere(func(*dop) bool { return true }) != nil }

// busyWhere returns an op a worker is enqueueing for which match is true, or nil (g.mu held).
// The poller asks every few microseconds: it walks the workers without building a list.
func (g *group) busyWhere(match func(*dop) bool) *dop {
	if o := g.coll.busy; o != nil && match(o) {
		return o
	}
	for _, w := range g.pairs {
		if o := w.busy; o != nil && match(o) {
			return o
		}
	}
	return nil
}

// Abort implements gpu.Group (design 6).
func (g *group) Abort(cause error) {
	g.mu.Lock()
	if g.broken != nil || g.closed {
		g.mu.Unlock()
		return
	}
	g.broken = cause
	close(g.aborted)
	var ops []*dop
	var comms []nccl.Comm
	for _, w := range g.allWorkers() {
		ops = append(ops, w.queue...)
		w.queue = nil
		w.queued.Store(0)
		if w.busy != nil {
			ops = append(ops, w.busy)
		}
		if w.comm.Valid() {
			comms = append(comms, w.comm)
		}
		w.comm = nccl.Comm{}
	}
	flights := g.inflight
	g.inflight = nil
	floor := g.floor
	g.cond.Broadcast()
	g.mu.Unlock()
	// Release the streams first, then abort: kernels held behind a ready counter then run
	// and see NCCL's abort flag, instead of starting after their communicator was freed.
	if err := g.s.Release(g.slot, floor); err != nil {
		g.s.log.Error("could not release the streams waiting on an aborted group", "err", err)
	}
	for _, c := range comms {
		c.Abort()
	}
	g.seqMu.Lock()
	for v, f := range g.seqWait {
		flights = append(flights, f)
		delete(g.seqWait, v)
	}
	g.seqMu.Unlock()
	for _, f := range flights {
		f.op.finish(cause)
	}
	for _, o := range ops {
		o.finish(cause)
	}
}

// Close implements gpu.Group: it waits for queued work, then frees the communicators.
func (g *group) Close() error {
	g.mu.Lock()
	g.closing = true
	g.cond.Broadcast()
	g.mu.Unlock()
	g.wg.Wait()
	g.mu.Lock()
	ws := g.allWorkers()
	broken := g.broken
	g.closed = true
	g.mu.Unlock()
	g.release()
	if broken != nil {
		return nil // the communicators were aborted
	}
	// ncclCommDestroy waits for the communicator's other ranks to destroy it too, so every
	// rank destroys in one global order: the collective communicator, then the pairs by
	// (sender, receiver). Any other order can deadlock two ranks on two pair communicators.
	key := func(w *worker) [2]int {
		switch {
		case w.key.peer < 0:
			return [2]int{-1, -1}
		case w.key.send:
			return [2]int{g.rank, w.key.peer}
		}
		return [2]int{w.key.peer, g.rank}
	}
	slices.SortFunc(ws, func(a, b *worker) int {
		ka, kb := key(a), key(b)
		return cmp.Or(cmp.Compare(ka[0], kb[0]), cmp.Compare(ka[1], kb[1]))
	})
	var errs []error
	for _, w := range ws {
		if w.comm.Valid() {
			errs = append(errs, w.comm.Destroy())
		}
	}
	return errors.Join(errs...)
}

// ncclType maps a dtype (and op) to NCCL's; count is scaled for types NCCL sees as pairs.
func ncclType(dt wire.DType, op wire.RedOp) (nccl.DataType, nccl.RedOp, int, error) {
	rop := map[wire.RedOp]nccl.RedOp{wire.Sum: nccl.Sum, wire.Avg: nccl.Avg, wire.Product: nccl.Prod,
		wire.Min: nccl.Min, wire.Max: nccl.Max}
	r, ok := rop[op]
	if !ok {
		return 0, 0, 0, fmt.Errorf("%w: %s on CUDA tensors (NCCL has no bitwise reductions)", reduce.ErrUnsupported, op)
	}
	switch dt {
	case wire.Bool:
		// bool as uint8: or for sum/max, and for product/min
		if op == wire.Sum || op == wire.Max {
			return nccl.Uint8, nccl.Max, 1, nil
		}
		if op == wire.Product || op == wire.Min {
			return nccl.Uint8, nccl.Min, 1, nil
		}
	case wire.Uint8:
		return nccl.Uint8, r, 1, nil
	case wire.Int8:
		return nccl.Int8, r, 1, nil
	case wire.Int32:
		return nccl.Int32, r, 1, nil
	case wire.Uint32:
		return nccl.Uint32, r, 1, nil
	case wire.Int64:
		return nccl.Int64, r, 1, nil
	case wire.Uint64:
		return nccl.Uint64, r, 1, nil
	case wire.Float16:
		return nccl.Float16, r, 1, nil
	case wire.BFloat16:
		return nccl.BFloat16, r, 1, nil
	case wire.Float32:
		return nccl.Float32, r, 1, nil
	case wire.Float64:
		return nccl.Float64, r, 1, nil
	case wire.Float8E4M3FN:
		return nccl.Float8E4M3, r, 1, nil
	case wire.Float8E5M2:
		return nccl.Float8E5M2, r, 1, nil
	case wire.Complex64, wire.Complex128:
		if op == wire.Sum || op == wire.Avg {
			t := nccl.Float32
			if dt == wire.Complex128 {
				t = nccl.Float64
			}
			return t, r, 2, nil
		}
	}
	return 0, 0, 0, fmt.Errorf("%w: %s of %s on CUDA tensors", reduce.ErrUnsupported, op, dt)
}

// Check reports whether a reduction can run on CUDA tensors (what ncclType accepts).
func Check(dt wire.DType, op wire.RedOp) error {
	_, _, _, err := ncclType(dt, op)
	return err
}

// enqueueNCCL issues the NCCL calls of one op on stream st.
func enqueueNCCL(c nccl.Comm, op gpu.Op, st nccl.Stream, rank, size int, scratch cuda.Ptr) error {
	d := op.Desc
	p := op.Ptrs
	es := d.DType.Size()
	u := func(x uint64) uintptr { return uintptr(x) }
	switch d.Kind {
	case wire.OpAllReduce:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.AllReduce(u(p[0]), u(p[0]), int(d.Count)*k, t, r, st)
	case wire.OpReduce:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.Reduce(u(p[0]), u(p[0]), int(d.Count)*k, t, r, int(d.Root), st)
	case wire.OpReduceScatter:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.ReduceScatter(u(p[0]), u(p[1]), int(d.Count)*k, t, r, st)
	case wire.OpBroadcast:
		return c.Broadcast(u(p[0]), u(p[0]), int(d.Count)*es, nccl.Uint8, int(d.Root), st)
	case wire.OpAllGather:
		return c.AllGather(u(p[0]), u(p[1]), int(d.Count)*es, nccl.Uint8, st)
	case wire.OpBarrier:
		return c.AllReduce(uintptr(scratch), uintptr(scratch), 1, nccl.Float32, nccl.Sum, st)
	case wire.OpAllToAll:
		return grouped(func() error {
			var inOff, outOff uint64
			for j := 0; j < size; j++ {
				in, out := uint64(d.Splits[j])*uint64(es), uint64(d.Splits[size+j])*uint64(es)
				if err := c.Send(u(p[0]+inOff), int(in), nccl.Uint8, j, st); err != nil {
					return err
				}
				if err := c.Recv(u(p[1]+outOff), int(out), nccl.Uint8, j, st); err != nil {
					return err
				}
				inOff, outOff = inOff+in, outOff+out
			}
			return nil
		})
	case wire.OpGather:
		m := int(d.Count) * es
		return grouped(func() error {
			if err := c.Send(u(p[0]), m, nccl.Uint8, int(d.Root), st); err != nil {
				return err
			}
			if rank == int(d.Root) {
				for j := 0; j < size; j++ {
					if err := c.Recv(u(p[1])+uintptr(j*m), m, nccl.Uint8, j, st); err != nil {
						return err
					}
				}
			}
			return nil
		})
	case wire.OpScatter:
		m := int(d.Count) * es
		return grouped(func() error {
			if rank == int(d.Root) {
				for j := 0; j < size; j++ {
					if err := c.Send(u(p[1])+uintptr(j*m), m, nccl.Uint8, j, st); err != nil {
						return err
					}
				}
			}
			return c.Recv(u(p[0]), m, nccl.Uint8, int(d.Root), st)
		})
	}
	return fmt.Errorf("%w: %s on CUDA tensors", wire.ErrInvalid, d.Kind)
}

// grouped runs f between ncclGroupStart and ncclGroupEnd.
func grouped(f func() error) error {
	if err := nccl.GroupStart(); err != nil {
		return err
	}
	err := f()
	return errors.Join(err, nccl.GroupEnd())
}
