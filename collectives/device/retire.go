// Completion: events recorded after each op, the sequencer that raises the p2p done counter
// in submission order, and the poller that retires ops and is the watchdog (group design 3
// and 5).

package device

import (
	"fmt"
	"runtime"
	"time"

	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/cuda"
)

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
	if o.Launched != nil {
		o.Launched() // before the poller can see the op finish
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
			g.pollIdle = true
			g.cond.Wait()
			g.pollIdle = false
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
			for _, f := range retired {
				if w := f.op.w; w != nil && w.ahead > 0 {
					w.ahead-- // design 8: its worker may enqueue another
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
	if g.graph != nil {
		ws = append(ws, g.graph)
	}
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
	if g.graph != nil {
		if o := g.graph.busy; o != nil && match(o) {
			return o
		}
	}
	for _, w := range g.pairs {
		if o := w.busy; o != nil && match(o) {
			return o
		}
	}
	return nil
}
