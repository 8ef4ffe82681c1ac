package pg

import (
	"context"
	"encoding/binary"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/spin"
	"github.com/gocomm/gocomm/wire"
)

// Ops captured in CUDA graphs (docs/decisions/0020).
//
// Design:
//  1. The client registers a captured op once (wire.RecGraphOp): its descriptor and a trigger
//     index t. The op is checked as an eager one would be and its buffers stay pinned (their
//     segments mapped) until the client drops the trigger (wire.RecGraphDrop); the
//     registration is answered by a completion, so a bad op raises at capture.
//  2. A replay's stream writes D[t] = 0, then T[t] = 1, then waits for D[t] == 1. T is a page
//     of host memory of the session's (an arena block the client names in every
//     registration); D is in the counter memory after the stream counters (gpu.TriggerOffset).
//  3. The session's watcher scans the live triggers. Seeing T[t] == 1 it stores T[t] = 0 and
//     hands the op to its group's graph lane (gpu.Op.Graph), whose stream writes D[t] = 1
//     after the op. The next replay's writes are ordered after this replay's wait passed,
//     that is after the watcher cleared T: no trigger is lost or seen twice.
//  4. Every failure lets the replaying stream go on: an op that fails, or fires on a group
//     that is broken or gone, or whose registration could not be kept, has D[t] = 1 written
//     by gpu.Session.ReleaseTriggers; a failure breaks the group, so the client's next call
//     on it raises.
//  5. The watcher spins while a replayed op runs and for the sidecar's spin window after the
//     last fired, then sleeps in steps that double up to watchMaxSleep: a replay after a long
//     idle waits at most that for the watcher.
//  6. A drop marks its op dropped before it replaces the watcher's list. A scan of a list
//     loaded before the drop (its goroutine descheduled meanwhile) skips a dropped op and
//     leaves its T word set: once the drop was read, a set word belongs to the op registered
//     under the same trigger since (a re-captured graph), which the next scan's list holds.
//     Without it the dropped op would fire with its buffers unpinned, fail, write D[t] = 1,
//     and the new graph's replay would go on without its op.

// watchMaxSleep caps the watcher's back-off (design 5).
const watchMaxSleep = 50 * time.Microsecond

// graphOp is one registered op (design 1).
type graphOp struct {
	t       uint32
	g       *Group
	desc    wire.Desc
	ptrs    []uint64
	release func() // unpins the op's buffers
	timeout time.Duration
	dropped atomic.Bool // design 6
}

// triggers is a session's registered graph ops and their watcher.
type triggers struct {
	sess *Session

	mu          sync.Mutex
	page        []byte // T words, host memory shared with the client; nil before any registration
	pageRef     wire.BufRef
	pageRelease func()
	ops         map[uint32]*graphOp
	watching    bool

	live    atomic.Pointer[[]*graphOp] // copy of ops for the watcher's scan (mu to write)
	running atomic.Int64               // fired ops not yet finished (the watcher spins meanwhile)
	stop    chan struct{}              // closed when the session closes
	stopped sync.WaitGroup
}

func newTriggers(sess *Session) *triggers {
	return &triggers{sess: sess, ops: map[uint32]*graphOp{}, stop: make(chan struct{})}
}

// word is T[t] (the page is 4-aligned: registration checks its offset).
func (tr *triggers) word(t uint32) *uint32 {
	return (*uint32)(unsafe.Pointer(&tr.page[4*t]))
}

// register handles a wire.RecGraphOp (design 1), on the session's serve goroutine.
func (tr *triggers) register(p []byte) {
	sess := tr.sess
	if len(p) < wire.GraphOpHeader+wire.DescHeader {
		sess.log.Warn("malformed graph op record", "bytes", len(p))
		return
	}
	le := binary.LittleEndian
	t := le.Uint32(p)
	page := wire.BufRef{Segment: le.Uint32(p[4:]), Offset: le.Uint64(p[8:]), Length: 4 * gpu.TriggerSlots}
	d, err := wire.DecodeDesc(p[wire.GraphOpHeader:])
	if err != nil {
		sess.complete(d.Seq, wire.StatusInvalid, -1, err.Error())
		return
	}
	o, err := tr.check(t, page, d)
	if err != nil {
		sess.complete(d.Seq, wire.StatusInvalid, -1, fmt.Sprintf("%s captured in a CUDA graph: %v", d.Kind, err))
		return
	}
	tr.mu.Lock()
	tr.ops[t] = o
	tr.publish()
	start := !tr.watching
	tr.watching = true
	tr.mu.Unlock()
	if start {
		tr.stopped.Add(1)
		go tr.watch()
	}
	o.g.log.Debug("graph op registered", "trigger", t, "op", d.Kind, "count", d.Count)
	sess.complete(d.Seq, wire.StatusOK, -1, "")
}

// check validates a registration and pins its buffers (and, the first time, the page).
func (tr *triggers) check(t uint32, page wire.BufRef, d wire.Desc) (*graphOp, error) {
	sess := tr.sess
	if t >= gpu.TriggerSlots {
		return nil, fmt.Errorf("%w: trigger %d out of range (%d)", wire.ErrInvalid, t, gpu.TriggerSlots)
	}
	g, err := sess.Group(d.Group)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", wire.ErrInvalid, err)
	}
	if d.Device != wire.DeviceCUDA || !d.Kind.Collective() || d.Kind == wire.OpAllToAllV {
		return nil, fmt.Errorf("%w: only collectives of CUDA tensors on NCCL can be captured", wire.ErrInvalid)
	}
	if err := d.Validate(g.Rank, g.Size); err != nil {
		return nil, err
	}
	if g.Slot < 0 {
		return nil, fmt.Errorf("%w: more than %d groups use CUDA tensors in this process", wire.ErrInvalid, gpu.CounterSlots)
	}
	ds, err := sess.deviceFor(d)
	if err != nil {
		return nil, err
	}
	if err := tr.setPage(page); err != nil {
		return nil, err
	}
	tr.mu.Lock()
	_, taken := tr.ops[t]
	tr.mu.Unlock()
	if taken {
		return nil, fmt.Errorf("%w: trigger %d is already live", wire.ErrInvalid, t)
	}
	ptrs, release, err := sess.resolveCUDA(ds, d.Bufs)
	if err != nil {
		return nil, err
	}
	timeout := g.Timeout
	if d.TimeoutMS > 0 {
		timeout = wire.Millis(d.TimeoutMS)
	}
	return &graphOp{t: t, g: g, desc: d, ptrs: ptrs, release: release, timeout: timeout}, nil
}

// setPage maps the trigger page the first time; later registrations must name the same one.
func (tr *triggers) setPage(page wire.BufRef) error {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if tr.page != nil {
		if page.Segment != tr.pageRef.Segment || page.Offset != tr.pageRef.Offset {
			return fmt.Errorf("%w: trigger page (%d, %d) differs from the session's (%d, %d)", wire.ErrInvalid,
				page.Segment, page.Offset, tr.pageRef.Segment, tr.pageRef.Offset)
		}
		return nil
	}
	if page.Segment&wire.CUDASegment != 0 || page.Offset%4 != 0 {
		return fmt.Errorf("%w: the trigger page must be 4-aligned host memory", wire.ErrInvalid)
	}
	bufs, release, err := tr.sess.reg.resolve([]wire.BufRef{page})
	if err != nil {
		return fmt.Errorf("trigger page: %w", err)
	}
	tr.page, tr.pageRef, tr.pageRelease = bufs[0], page, release
	return nil
}

// publish copies ops for the watcher (mu held).
func (tr *triggers) publish() {
	live := make([]*graphOp, 0, len(tr.ops))
	for _, o := range tr.ops {
		live = append(live, o)
	}
	tr.live.Store(&live)
}

// drop handles a wire.RecGraphDrop: the graph is gone (no replay of it runs: CUDA destroys
// its user object only after its launches finished).
func (tr *triggers) drop(p []byte) {
	if len(p) < 4 {
		return
	}
	t := binary.LittleEndian.Uint32(p)
	tr.mu.Lock()
	o := tr.ops[t]
	delete(tr.ops, t)
	if o != nil {
		o.dropped.Store(true) // before the list changes (design 6)
		tr.publish()
		atomic.StoreUint32(tr.word(t), 0)
	}
	tr.mu.Unlock()
	if o != nil {
		o.release()
		o.g.log.Debug("graph op dropped", "trigger", t)
	}
}

// close stops the watcher and unpins everything (the session closes).
func (tr *triggers) close() {
	close(tr.stop)
	tr.stopped.Wait()
	tr.mu.Lock()
	ops := tr.ops
	tr.ops = map[uint32]*graphOp{}
	tr.publish()
	release := tr.pageRelease
	tr.page, tr.pageRelease = nil, nil
	tr.mu.Unlock()
	for _, o := range ops {
		o.release()
	}
	if release != nil {
		release()
	}
}

// scan fires every live op whose T word is set (design 3); it returns how many fired.
func (tr *triggers) scan() int {
	live := tr.live.Load()
	if live == nil {
		return 0
	}
	n := 0
	for _, o := range *live {
		w := tr.word(o.t)
		if atomic.LoadUint32(w) == 0 || o.dropped.Load() { // dropped: a stale list (design 6)
			continue
		}
		atomic.StoreUint32(w, 0)
		n++
		tr.running.Add(1)
		o.g.replay(tr.sess.deviceSession(), o, func() { tr.running.Add(-1) })
	}
	return n
}

// nextSleep is the watcher's back-off after sleeping cur (design 5).
func nextSleep(cur time.Duration) time.Duration {
	return min(max(2*cur, time.Microsecond), watchMaxSleep)
}

// watch is the watcher goroutine (design 5). Its sleeps are nanosleep on its own thread
// with a 1 us timer slack: Go's timers overshoot sleeps this short by up to a millisecond.
// While it polls without sleeping it counts itself a spinner (package spin) and yields its
// P only where spin.Enter says so: on its locked thread a yield costs two thread wake-ups,
// on the path of the replay it polls for.
func (tr *triggers) watch() {
	defer tr.stopped.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const prSetTimerSlack = 29
	syscall.Syscall(syscall.SYS_PRCTL, prSetTimerSlack, 1000, 0) //nolint:errcheck // a coarser sleep is all it costs
	spinFor := tr.sess.srv.cfg.Spin
	last := time.Now()
	var sleep time.Duration
	counted, yield := false, false
	defer func() {
		if counted {
			spin.Exit()
		}
	}()
	for i := 0; ; i++ {
		if tr.scan() > 0 {
			last, sleep = time.Now(), 0
			continue
		}
		if i&63 == 0 {
			select {
			case <-tr.stop:
				return
			default:
			}
		}
		running := tr.running.Load() > 0
		if running {
			last = time.Now()
		}
		if running || (sleep == 0 && time.Since(last) < spinFor) {
			if !counted {
				counted, yield = true, spin.Enter()
			}
			if yield && i&63 == 63 {
				runtime.Gosched()
			}
			continue
		}
		if counted {
			counted = false
			spin.Exit()
		}
		sleep = nextSleep(sleep)
		ts := syscall.NsecToTimespec(int64(sleep))
		syscall.Nanosleep(&ts, nil) //nolint:errcheck // woken early by a signal: scan again
	}
}

// replay runs a fired graph op on the group's graph lane (design 3, 4); done is called once
// when it finished or failed.
func (g *Group) replay(ds gpu.Session, o *graphOp, done func()) {
	d := &o.desc
	fe := g.flight.record(d, "nccl graph", o.timeout)
	fail := func(status int32, msg string) {
		g.releaseTrigger(ds, o.t, msg)
		g.flight.end(fe, status, msg)
		g.count(d.Kind, true)
		done()
	}
	g.mu.Lock()
	if g.ep == nil || g.closing != "" {
		why := g.closing
		if why == "" {
			why = "group is not connected"
		}
		g.mu.Unlock()
		fail(wire.StatusAborted, fmt.Sprintf("replay of %s on group %q: %s", d.Kind, g.Name, why))
		return
	}
	ep := g.ep
	if err := ep.Broken(); err != nil {
		g.mu.Unlock()
		fail(wire.StatusBroken, fmt.Sprintf("replay of %s on group %q: the group is broken: %v", d.Kind, g.Name, err))
		return
	}
	if ds == nil {
		g.mu.Unlock()
		fail(wire.StatusInternal, fmt.Sprintf("replay of %s on group %q: no device", d.Kind, g.Name))
		return
	}
	if err := g.makeDevice(ds); err != nil {
		g.mu.Unlock()
		msg := fmt.Sprintf("replay of %s on group %q: %v", d.Kind, g.Name, err)
		g.deviceFailed(ep, msg)
		fail(wire.StatusInternal, msg)
		return
	}
	dev := g.dev
	g.running.Add(1)
	g.mu.Unlock()
	g.flight.start(fe)
	dev.Enqueue(gpu.Op{Desc: d, Ptrs: o.ptrs, Deadline: time.Now().Add(o.timeout), Graph: true, Trigger: o.t,
		Launched: func() { g.flight.launched(fe) },
		Done: func(err error) {
			defer g.running.Done()
			if err == nil {
				g.flight.end(fe, wire.StatusOK, "")
				g.count(d.Kind, false)
				done()
				return
			}
			status, msg := g.failure(context.Background(), d, 0, o.timeout, err)
			msg = "replay of " + msg
			ep.Break(breakCause(status, msg, err))
			g.log.Warn("graph op failed", "trigger", o.t, "status", status, "err", msg)
			fail(status, msg)
		}})
}

// releaseTrigger lets the stream replaying trigger t go on after its op failed (design 4).
func (g *Group) releaseTrigger(ds gpu.Session, t uint32, why string) {
	if ds == nil {
		return
	}
	if err := ds.ReleaseTriggers([]uint32{t}); err != nil {
		g.log.Error("could not release the stream replaying a graph op", "trigger", t, "after", why, "err", err)
	}
}
