package collectives

import (
	"context"
	"fmt"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/wire"
)

// AllReduce reduces buf across the group in place; every rank ends with the same bytes. For
// wire.Avg it leaves the sum (the caller applies reduce.Finish).
//
// Small buffers use a direct exchange (one round; each rank reduces all inputs in rank order).
// Large ones use a ring: reduce-scatter then all-gather over n chunks, pipelined in slices.
// Each chunk's value is computed by one rank and copied to the others, so results are
// identical on every rank in both algorithms.
func AllReduce(ctx context.Context, c Comm, buf []byte, dt wire.DType, op wire.RedOp) error {
	es := dt.Size()
	if es == 0 || len(buf)%es != 0 {
		return fmt.Errorf("all_reduce: %d bytes of %s: %w", len(buf), dt, errSize)
	}
	n := c.Size()
	switch {
	case n == 1 || len(buf) == 0:
		return nil
	case len(buf)*(n-1) <= directLimit || len(buf)/es < n:
		return directAllReduce(ctx, c, buf, dt, op)
	default:
		return ringAllReduce(ctx, c, buf, dt, op)
	}
}

func directAllReduce(ctx context.Context, c Comm, buf []byte, dt wire.DType, op wire.RedOp) error {
	n, r := c.Size(), c.Rank()
	scratch := make([]byte, len(buf)*n)
	in := func(j int) []byte { return scratch[j*len(buf) : (j+1)*len(buf)] }
	var recvs, sends []Request
	for j := 0; j < n; j++ {
		if j != r {
			recvs = append(recvs, c.Recv(j, Tag{}, CopySink{in(j)}))
			sends = append(sends, c.Send(j, Tag{}, buf))
		}
	}
	if err := waitAll(ctx, recvs); err != nil {
		waitAll(ctx, sends)
		return err
	}
	copy(in(r), buf)
	acc := in(0)
	for j := 1; j < n; j++ {
		if err := reduce.Into(dt, op, acc, in(j)); err != nil {
			waitAll(ctx, sends)
			return err
		}
	}
	if err := waitAll(ctx, sends); err != nil {
		return err
	}
	copy(buf, acc)
	return nil
}

// ringAllReduce: at step s (0 <= s < 2(n-1)) rank r sends chunk r-s to r+1 and receives chunk
// r-s-1 from r-1; steps before n-1 reduce what arrives, later steps copy it. Every slice
// received at step s is forwarded at step s+1, so slices stream around the ring.
func ringAllReduce(ctx context.Context, c Comm, buf []byte, dt wire.DType, op wire.RedOp) error {
	n, r := c.Size(), c.Rank()
	es := dt.Size()
	b := bounds(len(buf), n, es)
	chunk := func(i int) [][]byte { i = mod(i, n); return slices(buf[b[i]:b[i+1]], es) }
	return ring(ctx, c, 2*(n-1), chunk(r), func(s int) [][]byte { return chunk(r - s - 1) },
		func(s int, sl []byte) Sink {
			if s < n-1 {
				return ReduceSink{Acc: sl, DType: dt, Op: op}
			}
			return CopySink{sl}
		})
}
