// The workers: each takes its ops in submission order and enqueues them on its stream
// (group design 1 and 2), spinning between ops where the host asked for it.

package device

import (
	"fmt"
	"runtime"
	"time"

	"github.com/gocomm/gocomm/internal/cuda"
	"github.com/gocomm/gocomm/internal/nccl"
	"github.com/gocomm/gocomm/spin"
	"github.com/gocomm/gocomm/wire"
)

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
			w.idle = true
			g.cond.Wait()
			w.idle = false
		}
		for len(w.queue) > 0 && w.ahead >= g.s.ahead && g.broken == nil {
			g.cond.Wait() // design 8: the poller retires one of this stream's ops
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
		watching := false
		if broken == nil {
			w.busy = o
			w.ahead++ // counted before the poller can retire it
			if g.pollIdle {
				// The watchdog watches busy ops, but waking it now would put its thread's
				// wake-up on this op's path to the GPU: a launch that ends within
				// watchDelay never needs it. One timer per worker, reset per op.
				if w.watch == nil {
					w.watch = time.AfterFunc(watchDelay, g.wake)
				} else {
					w.watch.Reset(watchDelay)
				}
				watching = true
			}
		}
		g.mu.Unlock()
		if broken != nil {
			o.finish(broken)
			continue
		}
		err := g.launch(w, o, st)
		if watching {
			w.watch.Stop()
		}
		g.mu.Lock()
		w.busy = nil
		if err != nil {
			w.ahead-- // never flew (an op that failed after flying aborts the group anyway)
		}
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
// GPU. Only on hosts that asked for spinning (Engine.Spin: GOCOMM_SPIN or the sidecar's
// --spin). A worker that went to sleep while a long op ran spins again once the poller
// retires an op: the client's next op usually follows a completion.
//
// The loop yields (runtime.Gosched) only where spinners could crowd out the sidecar's other
// goroutines: more of them, the rings' counted in, than half of GOMAXPROCS (package spin).
// A goroutine locked to its thread yields
// by handing its P to another thread and sleeping until it gets it back, two thread wake-ups
// that put 5-10 us on the next op's path to the GPU.
func (g *group) spin(w *worker) {
	if g.s.spin <= 0 {
		return
	}
	spin.For(g.s.spin, func() bool { return w.queued.Load() != 0 })
}

// launch enqueues one op on w's stream st (design 1-3).
func (g *group) launch(w *worker, o *dop, st cuda.Stream) error {
	d := o.Desc
	if d.Kind == wire.OpAllToAllV {
		// The sparse engine's op, on the collective worker's stream and counters.
		if err := g.awaitTurn(o); err != nil {
			return err
		}
		defer g.turnDone(o)
		if err := g.shm.Launch(&o.Op, st, g.ready[laneColl], g.done[laneColl]); err != nil {
			return err
		}
		return g.record(o, st, func(ps cuda.Stream) error { return g.shm.Check(&o.Op, ps) })
	}
	comm, err := g.commOf(w, o.Deadline) // before the turn: a peer's turn may wait on this init
	if err != nil {
		return err
	}
	if err := g.awaitTurn(o); err != nil {
		return err
	}
	defer g.turnDone(o) // after the p2p sequencer's done write too: a later wait may need it
	ns := nccl.Stream(st.Handle())
	if o.Graph { // design 7: no counters; the trigger word after the op
		if err := enqueueNCCL(comm, o.Op, ns, g.rank, g.size, g.scratch); err != nil {
			return err
		}
		if err := st.WriteValue32(g.s.trigger(o.Trigger), 1); err != nil {
			return err
		}
		return g.record(o, st, nil)
	}
	lane := w.lane()
	// An op the client called with its stream idle usually finds ready already written by the
	// time it gets here: the stream wait's driver call (1.4-1.7 us) is then left out of the
	// op's path to the GPU. Where it is not yet written the stream waits for it.
	if !g.s.readyReached(g.slot, lane, d.StreamValue) {
		if err := st.WaitValue32(g.ready[lane], d.StreamValue, cuda.WaitGEQ); err != nil {
			return err
		}
	}
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

// watchDelay is how long a worker's launch may run before it wakes an idle watchdog.
const watchDelay = time.Millisecond

// wake wakes whatever waits on g.cond (the watchdog, for a launch that takes long).
func (g *group) wake() {
	g.mu.Lock()
	g.cond.Broadcast()
	g.mu.Unlock()
}

// awaitTurn waits until every op with an earlier ticket has its GPU work enqueued (design 9),
// or the group broke.
func (g *group) awaitTurn(o *dop) error {
	if o.ticket == 0 {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for g.pushed+1 < o.ticket && g.broken == nil {
		g.cond.Wait()
	}
	return g.broken
}

// turnDone passes the turn to the next ticket.
func (g *group) turnDone(o *dop) {
	if o.ticket == 0 {
		return
	}
	g.mu.Lock()
	if o.ticket > g.pushed {
		g.pushed = o.ticket
	}
	g.cond.Broadcast()
	g.mu.Unlock()
}
