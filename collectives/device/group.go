package device

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/cuda"
	"github.com/gocomm/gocomm/internal/nccl"
	"github.com/gocomm/gocomm/sparse/nvshmem"
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
	tagCollID  = 0 // rank 0 -> every rank: the collective communicator's id
	tagPairID  = 1 // sender -> receiver: the id of their one-way communicator
	tagGraphID = 2 // rank 0 -> every rank: the graph lane's communicator's id
)

// graphPeer is the graph lane worker's key.peer (the collective worker's is -1).
const graphPeer = -2

// group is one rank's member of a group on the device.
//
// Design:
//  1. Collectives run on one worker: a goroutine locked to an OS thread (context current)
//     that enqueues them in submission order on the collective stream: wait for the client's
//     ready counter (unless the CPU already sees it written), the NCCL call(s), write the done
//     counter, record an event. It never waits for the GPU.
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
//     deadline. A pair's communicator is connected right after its init, by a one-byte
//     exchange on a stream of its own that the worker waits for (connectPair): NCCL connects
//     a pair inside its first send or receive call, and that call must not run while the
//     group's streams hold waits for the client's counters (design 9).
//  5. A poller retires ops as their events complete and calls Done; it is also the watchdog:
//     an op past its deadline, whether in flight on the GPU or stuck in a worker's NCCL call,
//     aborts the group. Nothing wakes a thread on an op's way to the GPU: an idle poller is
//     woken when the op flies, or by a timer when a launch runs past watchDelay, and an op
//     wakes its worker only if the worker sleeps (a spinning worker finds it).
//  6. Abort cancels the communicators (ncclCommAbort, which also frees a worker stuck in a
//     call), then releases every stream waiting on a counter, the client's and ours, by
//     storing far-ahead values into the counters from the CPU (session invariant 3): nothing
//     stays blocked on a GPU after a failure. Each op's Done is called exactly once, however
//     the abort and the workers interleave.
//  7. Replays of ops captured in CUDA graphs run on a third kind of worker, the graph lane:
//     its own communicator (made like the collective one) and stream, in the order replays
//     reach the sidecar, which differs from the eager order (docs/decisions/0020). After
//     each it writes the op's trigger word D[t] = 1 on its stream; no stream counter.
//  8. A worker keeps at most session.ahead of its ops enqueued and unfinished (launched, not
//     yet retired by the poller); past that it waits for a retirement. The client submits
//     ops far ahead of the GPU, and each queued op waits on its stream for the client's
//     ready counter: enqueued without bound they would fill the driver's queue, whose next
//     enqueue then blocks the worker. The wait is per worker, so it only ever waits for its
//     own stream's earlier ops, which need nothing enqueued after them: it cannot deadlock.
//  9. Every op that waits on a stream for a client counter is enqueued in the order the client
//     submitted it (its ticket, across workers and lanes), each worker first making its
//     communicator (and a pair's connection) and then waiting for the previous ticket's
//     enqueue. The driver spreads streams over a few hardware queues, and a queue runs what
//     it holds in order: a wait enqueued ahead of the op it waits for, on a stream that
//     shares a queue with that op's, holds the op back for good. With two workers racing, a
//     receive's wait for ready >= k+1 landed before the send k it needed, and a blocking
//     send/recv loop between two GPUs stopped after a dozen pairs. In ticket order, whatever
//     a wait needs was enqueued before it, on whichever queue. Graph replays wait for no
//     counter and take no ticket.
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
	graph    *worker // made by the first graph op (design 7)
	pairs    map[pairKey]*worker
	workers  int // worker goroutines running
	inflight []*flight
	retired  uint64       // rounds of retirements by the poller: wakes sleeping workers to spin again
	pollIdle bool         // the poller waits on cond for an op to fly or a worker to get busy
	events   []cuda.Event // pool (see event)
	broken   error
	aborted  chan struct{} // closed by Abort: wakes a pending communicator init
	closing  bool
	closed   bool // Close is destroying the communicators: Abort must not touch them
	wg       sync.WaitGroup

	floor [2]uint32 // per lane, the last stream value enqueued (the base before any): what a release counts from (mu)

	tickets uint64 // tickets handed out by Enqueue, one per op that waits for a counter (design 9; mu)
	pushed  uint64 // the last ticket whose GPU work is enqueued (mu)

	shm *nvshmem.Member // the group's side of the sparse engine (OpAllToAllV)

	seqMu     sync.Mutex // the p2p done sequencer (design 3)
	seqStream cuda.Stream
	seqNext   uint32
	seqWait   map[uint32]*flight // launched, waiting for their turn
}

// ShmemID implements gpu.Group (nvshmem.Member.ShmemID).
func (g *group) ShmemID(id []byte) ([]byte, error) { return g.shm.ShmemID(id) }

// Rank, Size and Link implement nvshmem.Group.
func (g *group) Rank() int { return g.rank }

func (g *group) Size() int { return g.size }

func (g *group) Link() gpu.PeerLink { return g.link }

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
	ahead  int         // ops enqueued on this worker's stream and not yet retired (design 8)
	idle   bool        // waiting on cond for an op: only then does Enqueue wake it (see group.spin)
	watch  *time.Timer // wakes the watchdog for a launch past watchDelay (the worker's own)
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
	w      *worker // the worker that enqueues it
	ticket uint64  // its place in the enqueue order (design 9); 0: none (graph replays)
	once   sync.Once
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
		off := counterOff(slot, lane)
		g.ready[lane] = s.counters + cuda.Ptr(off)
		g.done[lane] = s.counters + cuda.Ptr(off+4)
	}
	g.shm = s.shmem.Member(g)
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
	if op.Graph {
		if g.graph == nil {
			g.graph = &worker{key: pairKey{peer: graphPeer}}
			g.start(g.graph)
		}
		w = g.graph
		o.w = w
		w.queue = append(w.queue, o)
		w.queued.Add(1)
		if w.idle {
			g.cond.Broadcast()
		}
		g.mu.Unlock()
		return
	}
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
	g.tickets++
	o.w, o.ticket = w, g.tickets
	w.queue = append(w.queue, o)
	w.queued.Add(1)
	if w.idle { // a worker that is not idle finds the op by itself: spinning, or before it waits
		g.cond.Broadcast()
	}
	g.mu.Unlock()
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
	// rank destroys in one global order: the collective communicator, the graph lane's, then
	// the pairs by (sender, receiver). Any other order can deadlock two ranks on two pair
	// communicators.
	key := func(w *worker) [2]int {
		switch {
		case w.key.peer == graphPeer:
			return [2]int{-1, 0}
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
