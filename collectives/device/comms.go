// Communicator setup: one collective communicator per group, one two-rank communicator per
// (peer, direction) for point-to-point, made on first use from a unique id that the rank
// making it sends over the group's host links (group design 2 and 4).

package device

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/cuda"
	"github.com/gocomm/gocomm/internal/nccl"
)

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
	if w.key.peer == graphPeer {
		tag = tagGraphID
	}
	if w.key.peer >= 0 {
		n, rank, leader, tag = 2, 1, w.key.peer, tagPairID
		if w.key.send {
			rank, leader = 0, g.rank
		}
	}
	start := time.Now()
	id, err := g.exchangeID(ctx, w.key.peer, leader, tag)
	if err != nil {
		return nccl.Comm{}, err
	}
	type result struct {
		c   nccl.Comm
		err error
	}
	ch := make(chan result, 1)
	made := make(chan nccl.Comm, 1) // a pair's communicator, before its connection is made
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := g.s.ctx.SetCurrent(); err != nil {
			ch <- result{err: err}
			return
		}
		c, err := nccl.InitRank(n, id, rank)
		if err == nil && w.key.peer >= 0 {
			made <- c
			err = connectPair(ctx, c, w.key.send, g.scratch+pairScratch)
		}
		ch <- result{c, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			if r.c.Valid() {
				r.c.Abort()
			}
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
			select {
			case c := <-made: // a pair's connection may wait for the peer: the abort frees it
				c.Abort()
				<-ch
			case r := <-ch:
				if r.c.Valid() {
					r.c.Abort()
				}
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

// exchangeID gives the communicator's unique id to every rank that joins it: the leader
// makes it and sends it to the peer (peer >= 0) or to every other rank; the others receive it.
func (g *group) exchangeID(ctx context.Context, peer, leader, tag int) (nccl.UniqueID, error) {
	var id nccl.UniqueID
	if leader == g.rank {
		var err error
		if id, err = nccl.NewUniqueID(); err != nil {
			return id, err
		}
		peers := []int{peer}
		if peer < 0 {
			peers = peers[:0]
			for p := 0; p < g.size; p++ {
				if p != g.rank {
					peers = append(peers, p)
				}
			}
		}
		for _, p := range peers {
			if err := g.link.Send(ctx, p, tag, id[:]); err != nil {
				return id, fmt.Errorf("send the NCCL id to rank %d: %w", p, err)
			}
		}
	} else {
		b, err := g.link.Recv(ctx, leader, tag, len(id))
		if err != nil {
			return id, fmt.Errorf("NCCL id from rank %d: %w", leader, err)
		}
		copy(id[:], b)
	}
	return id, nil
}

// pairScratch is where in the group's scratch buffer a pair's connecting exchange lands (the
// barrier's all_reduce uses its first word).
const pairScratch = 128

// connectPair makes a new two-rank communicator's connection with a one-byte exchange on a
// stream of its own, and waits for it, before any op is queued on it (group design 4). NCCL
// connects a pair inside its first send or receive call; made there, the connection stalled
// for good with both directions of a pair starting at once (a send then a receive, as a
// blocking send/recv loop posts them), while the other worker's wait for the client's ready
// counter was queued (docs/decisions/0037). Made here, before the worker's turn (design 9),
// no wait of the group is queued on the pair's behalf yet, and a connection that waits for
// the peer's matching op never holds up this rank's other tickets.
func connectPair(ctx context.Context, c nccl.Comm, send bool, buf cuda.Ptr) error {
	st, err := cuda.NewStream(cuda.StreamNonBlocking)
	if err != nil {
		return err
	}
	defer st.Destroy()
	ns := nccl.Stream(st.Handle())
	if send {
		err = c.Send(uintptr(buf), 1, nccl.Uint8, 1, ns)
	} else {
		err = c.Recv(uintptr(buf), 1, nccl.Uint8, 0, ns)
	}
	if err != nil {
		return fmt.Errorf("connecting the pair: %w", err)
	}
	ev, err := cuda.NewEvent(cuda.EventDisableTiming)
	if err != nil {
		return err
	}
	defer ev.Destroy()
	if err := ev.Record(st); err != nil {
		return err
	}
	for {
		done, err := ev.Done()
		if err != nil || done {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("connecting the pair: %w", ctx.Err())
		case <-time.After(20 * time.Microsecond):
		}
	}
}
