package device

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/internal/cuda"
	"github.com/gocomm/gocomm/internal/nccl"
	"github.com/gocomm/gocomm/pg"
)

// Lanes: collectives and point-to-point ops run on separate streams and communicators (as
// in torch's NCCL backend), so a blocked recv cannot hold up a collective behind it.
const (
	laneColl = 0
	laneP2P  = 1
)

// group is one rank's member of a group on the device.
//
// Design:
//  1. One executor goroutine (locked to an OS thread, context current) enqueues ops in
//     submission order: wait for the client's ready counter, the NCCL call(s), write the done
//     counter, record an event. It never waits for the GPU.
//  2. A poller retires ops in order per lane as their events complete and calls Done; it is
//     also the watchdog: an op past its deadline aborts the group.
//  3. Abort cancels the communicators (ncclCommAbort), then releases every stream waiting on
//     a counter, the client's and ours, by writing far-ahead values into the counters from a
//     stream that waits for nothing (session invariant 3): nothing stays blocked on a GPU
//     after a failure.
type group struct {
	s          *session
	rank, size int
	ids        [2]nccl.UniqueID
	slot       int
	ready      [2]cuda.Ptr // device addresses of the counters
	done       [2]cuda.Ptr

	mu       sync.Mutex
	cond     *sync.Cond
	queue    []pg.DeviceOp
	inflight [2][]*flight
	broken   error
	closing  bool
	comms    [2]nccl.Comm
	wg       sync.WaitGroup
}

type flight struct {
	op  pg.DeviceOp
	ev  cuda.Event
	val uint32
}

func (s *session) NewGroup(rank, size, slot int, ids [2][]byte) (pg.DeviceGroup, error) {
	if slot < 0 || slot >= pg.CounterSlots {
		return nil, fmt.Errorf("counter slot %d out of range", slot)
	}
	g := &group{s: s, rank: rank, size: size, slot: slot}
	for i := range ids {
		if size > 1 && len(ids[i]) != len(g.ids[i]) {
			return nil, fmt.Errorf("%w: NCCL id %d of %d bytes", pg.ErrInvalid, i, len(ids[i]))
		}
		copy(g.ids[i][:], ids[i])
	}
	for lane := 0; lane < 2; lane++ {
		off := 16*slot + 8*lane
		g.ready[lane] = s.counters + cuda.Ptr(off)
		g.done[lane] = s.counters + cuda.Ptr(off+4)
	}
	g.cond = sync.NewCond(&g.mu)
	started := make(chan error, 1)
	g.wg.Add(2)
	go g.execute(started)
	if err := <-started; err != nil {
		g.wg.Done()
		return nil, err
	}
	go g.poll()
	return g, nil
}

func laneOf(k pg.OpKind) int {
	if k == pg.OpSend || k == pg.OpRecv {
		return laneP2P
	}
	return laneColl
}

// Enqueue implements pg.DeviceGroup.
func (g *group) Enqueue(op pg.DeviceOp) {
	g.mu.Lock()
	if err := g.broken; err != nil || g.closing {
		g.mu.Unlock()
		if err == nil {
			err = errors.New("device group closed")
		}
		op.Done(err)
		return
	}
	g.queue = append(g.queue, op)
	g.cond.Broadcast()
	g.mu.Unlock()
}

// execute is the executor (design 1).
func (g *group) execute(started chan<- error) {
	defer g.wg.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var streams [2]cuda.Stream
	scratch, err := func() (cuda.Ptr, error) {
		if err := g.s.ctx.SetCurrent(); err != nil {
			return 0, err
		}
		for i := range streams {
			s, err := cuda.NewStream(cuda.StreamNonBlocking)
			if err != nil {
				return 0, err
			}
			streams[i] = s
		}
		return cuda.Alloc(256)
	}()
	started <- err
	if err != nil {
		return
	}
	defer func() {
		for _, s := range streams {
			s.Synchronize()
			s.Destroy()
		}
		cuda.Free(scratch)
	}()
	for {
		g.mu.Lock()
		for len(g.queue) == 0 && !g.closing {
			g.cond.Wait()
		}
		if len(g.queue) == 0 {
			g.mu.Unlock()
			return
		}
		op := g.queue[0]
		g.queue = g.queue[1:]
		broken := g.broken
		g.mu.Unlock()
		if broken != nil {
			op.Done(broken)
			continue
		}
		lane := laneOf(op.Desc.Kind)
		if err := g.launch(op, lane, streams[lane], scratch); err != nil {
			op.Done(err)
			g.Abort(err)
		}
	}
}

// comm returns the lane's communicator, creating it on first use (every rank's first op of
// the lane takes part). Init waits for the peers; a peer that never comes makes the op
// time out and the group break, with the init left behind.
func (g *group) comm(lane int, deadline time.Time) (nccl.Comm, error) {
	g.mu.Lock()
	c := g.comms[lane]
	g.mu.Unlock()
	if c.Valid() {
		return c, nil
	}
	type result struct {
		c   nccl.Comm
		err error
	}
	ch := make(chan result, 1)
	ctx := g.s.ctx
	start := time.Now()
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := ctx.SetCurrent(); err != nil {
			ch <- result{err: err}
			return
		}
		c, err := nccl.InitRank(g.size, g.ids[lane], g.rank)
		ch <- result{c, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			return nccl.Comm{}, fmt.Errorf("NCCL communicator init: %w", r.err)
		}
		g.mu.Lock()
		g.comms[lane] = r.c
		g.mu.Unlock()
		g.s.log.Info("NCCL communicator ready", "lane", lane, "rank", g.rank, "size", g.size, "took", time.Since(start))
		return r.c, nil
	case <-time.After(time.Until(deadline)):
		return nccl.Comm{}, fmt.Errorf("%w: NCCL communicator init: a peer did not join before the deadline", pg.ErrTimeout)
	}
}

// launch enqueues one op on its lane's stream (design 1).
func (g *group) launch(op pg.DeviceOp, lane int, s cuda.Stream, scratch cuda.Ptr) error {
	d := op.Desc
	comm, err := g.comm(lane, op.Deadline)
	if err != nil {
		return err
	}
	if err := s.WaitValue32(g.ready[lane], d.StreamValue, cuda.WaitGEQ); err != nil {
		return err
	}
	if err := enqueueNCCL(comm, op, nccl.Stream(s.Handle()), g.rank, g.size, scratch); err != nil {
		return fmt.Errorf("%s: %w", d.Kind, err)
	}
	if err := s.WriteValue32(g.done[lane], d.StreamValue); err != nil {
		return err
	}
	ev, err := cuda.NewEvent(cuda.EventDisableTiming)
	if err != nil {
		return err
	}
	if err := ev.Record(s); err != nil {
		ev.Destroy()
		return err
	}
	g.mu.Lock()
	g.inflight[lane] = append(g.inflight[lane], &flight{op: op, ev: ev, val: d.StreamValue})
	g.cond.Broadcast()
	g.mu.Unlock()
	return nil
}

// poll retires finished ops and enforces deadlines (design 2).
func (g *group) poll() {
	defer g.wg.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := g.s.ctx.SetCurrent(); err != nil {
		g.Abort(err)
	}
	for {
		g.mu.Lock()
		for len(g.inflight[0]) == 0 && len(g.inflight[1]) == 0 && !g.closing {
			g.cond.Wait()
		}
		if len(g.inflight[0]) == 0 && len(g.inflight[1]) == 0 && len(g.queue) == 0 {
			g.mu.Unlock()
			return
		}
		heads := [2]*flight{}
		for lane := range heads {
			if len(g.inflight[lane]) > 0 {
				heads[lane] = g.inflight[lane][0]
			}
		}
		g.mu.Unlock()
		progress := false
		for lane, f := range heads {
			if f == nil {
				continue
			}
			done, err := f.ev.Done()
			switch {
			case err != nil:
				g.Abort(fmt.Errorf("%s: %w", f.op.Desc.Kind, err))
			case done:
				g.mu.Lock()
				if len(g.inflight[lane]) > 0 && g.inflight[lane][0] == f {
					g.inflight[lane] = g.inflight[lane][1:]
				}
				g.mu.Unlock()
				f.ev.Destroy()
				f.op.Done(nil)
				progress = true
			case time.Now().After(f.op.Deadline):
				g.Abort(fmt.Errorf("%w: %s did not finish on the GPU before its deadline", pg.ErrTimeout, f.op.Desc.Kind))
			}
		}
		if !progress {
			time.Sleep(20 * time.Microsecond)
		}
	}
}

// Abort implements pg.DeviceGroup (design 3).
func (g *group) Abort(cause error) {
	g.mu.Lock()
	if g.broken != nil {
		g.mu.Unlock()
		return
	}
	g.broken = cause
	comms := g.comms
	queue := g.queue
	g.queue = nil
	var flights []*flight
	for lane := range g.inflight {
		flights = append(flights, g.inflight[lane]...)
		g.inflight[lane] = nil
	}
	g.cond.Broadcast()
	g.mu.Unlock()
	for _, c := range comms {
		if c.Valid() {
			c.Abort()
		}
	}
	if err := g.s.release(g.slot); err != nil {
		g.s.log.Error("could not release the streams waiting on an aborted group", "err", err)
	}
	for _, f := range flights {
		f.op.Done(cause)
	}
	for _, op := range queue {
		op.Done(cause)
	}
}

// Close implements pg.DeviceGroup: it waits for queued work, then frees the communicators.
func (g *group) Close() error {
	g.mu.Lock()
	g.closing = true
	g.cond.Broadcast()
	g.mu.Unlock()
	g.wg.Wait()
	g.mu.Lock()
	comms, broken := g.comms, g.broken
	g.mu.Unlock()
	if broken != nil {
		return nil // the communicators were aborted
	}
	var errs []error
	for _, c := range comms {
		if c.Valid() {
			errs = append(errs, c.Destroy())
		}
	}
	return errors.Join(errs...)
}

// ncclType maps a dtype (and op) to NCCL's; count is scaled for types NCCL sees as pairs.
func ncclType(dt reduce.DType, op reduce.Op) (nccl.DataType, nccl.RedOp, int, error) {
	rop := map[reduce.Op]nccl.RedOp{reduce.Sum: nccl.Sum, reduce.Avg: nccl.Avg, reduce.Product: nccl.Prod,
		reduce.Min: nccl.Min, reduce.Max: nccl.Max}
	r, ok := rop[op]
	if !ok {
		return 0, 0, 0, fmt.Errorf("%w: %s on CUDA tensors (NCCL has no bitwise reductions)", reduce.ErrUnsupported, op)
	}
	switch dt {
	case reduce.Bool:
		// bool as uint8: or for sum/max, and for product/min
		if op == reduce.Sum || op == reduce.Max {
			return nccl.Uint8, nccl.Max, 1, nil
		}
		if op == reduce.Product || op == reduce.Min {
			return nccl.Uint8, nccl.Min, 1, nil
		}
	case reduce.Uint8:
		return nccl.Uint8, r, 1, nil
	case reduce.Int8:
		return nccl.Int8, r, 1, nil
	case reduce.Int32:
		return nccl.Int32, r, 1, nil
	case reduce.Uint32:
		return nccl.Uint32, r, 1, nil
	case reduce.Int64:
		return nccl.Int64, r, 1, nil
	case reduce.Uint64:
		return nccl.Uint64, r, 1, nil
	case reduce.Float16:
		return nccl.Float16, r, 1, nil
	case reduce.BFloat16:
		return nccl.BFloat16, r, 1, nil
	case reduce.Float32:
		return nccl.Float32, r, 1, nil
	case reduce.Float64:
		return nccl.Float64, r, 1, nil
	case reduce.Float8E4M3FN:
		return nccl.Float8E4M3, r, 1, nil
	case reduce.Float8E5M2:
		return nccl.Float8E5M2, r, 1, nil
	case reduce.Complex64, reduce.Complex128:
		if op == reduce.Sum || op == reduce.Avg {
			t := nccl.Float32
			if dt == reduce.Complex128 {
				t = nccl.Float64
			}
			return t, r, 2, nil
		}
	}
	return 0, 0, 0, fmt.Errorf("%w: %s of %s on CUDA tensors", reduce.ErrUnsupported, op, dt)
}

// Check reports whether a reduction can run on CUDA tensors (what ncclType accepts).
func Check(dt reduce.DType, op reduce.Op) error {
	_, _, _, err := ncclType(dt, op)
	return err
}

// enqueueNCCL issues the NCCL calls of one op on stream st.
func enqueueNCCL(c nccl.Comm, op pg.DeviceOp, st nccl.Stream, rank, size int, scratch cuda.Ptr) error {
	d := op.Desc
	p := op.Ptrs
	es := d.DType.Size()
	u := func(x uint64) uintptr { return uintptr(x) }
	switch d.Kind {
	case pg.OpAllReduce:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.AllReduce(u(p[0]), u(p[0]), int(d.Count)*k, t, r, st)
	case pg.OpReduce:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.Reduce(u(p[0]), u(p[0]), int(d.Count)*k, t, r, int(d.Root), st)
	case pg.OpReduceScatter:
		t, r, k, err := ncclType(d.DType, d.RedOp)
		if err != nil {
			return err
		}
		return c.ReduceScatter(u(p[0]), u(p[1]), int(d.Count)*k, t, r, st)
	case pg.OpBroadcast:
		return c.Broadcast(u(p[0]), u(p[0]), int(d.Count)*es, nccl.Uint8, int(d.Root), st)
	case pg.OpAllGather:
		return c.AllGather(u(p[0]), u(p[1]), int(d.Count)*es, nccl.Uint8, st)
	case pg.OpBarrier:
		return c.AllReduce(uintptr(scratch), uintptr(scratch), 1, nccl.Float32, nccl.Sum, st)
	case pg.OpAllToAll:
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
	case pg.OpGather:
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
	case pg.OpScatter:
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
	case pg.OpSend:
		return c.Send(u(p[0]), int(d.Count)*es, nccl.Uint8, int(d.Root), st)
	case pg.OpRecv:
		return c.Recv(u(p[0]), int(d.Count)*es, nccl.Uint8, int(d.Root), st)
	}
	return fmt.Errorf("%w: %s on CUDA tensors", pg.ErrInvalid, d.Kind)
}

// grouped runs f between ncclGroupStart and ncclGroupEnd.
func grouped(f func() error) error {
	if err := nccl.GroupStart(); err != nil {
		return err
	}
	err := f()
	return errors.Join(err, nccl.GroupEnd())
}
