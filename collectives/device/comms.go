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
