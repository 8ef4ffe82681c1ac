package collectives

import (
	"context"
	"fmt"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/wire"
)

// AllGather concatenates every rank's in (equal sizes) into out, in rank order. Small inputs
// go directly to every rank; large ones travel a ring in slices.
func AllGather(ctx context.Context, c Comm, in, out []byte) error {
	n, r := c.Size(), c.Rank()
	m := len(in)
	if len(out) != n*m {
		return fmt.Errorf("all_gather: %d bytes in, %d out for %d ranks: %w", m, len(out), n, errSize)
	}
	block := func(i int) []byte { i = mod(i, n); return out[i*m : (i+1)*m] }
	copy(block(r), in)
	if n == 1 || m == 0 {
		return nil
	}
	if m*(n-1) <= directLimit {
		var reqs []Request
		for j := 0; j < n; j++ {
			if j != r {
				reqs = append(reqs, c.Recv(j, Tag{}, CopySink{block(j)}), c.Send(j, Tag{}, in))
			}
		}
		return waitAll(ctx, reqs)
	}
	return ring(ctx, c, n-1, slices(block(r), 1), func(s int) [][]byte { return slices(block(r-s-1), 1) },
		func(_ int, sl []byte) Sink { return CopySink{sl} })
}

// ReduceScatter reduces in (n equal blocks) across the group and leaves block r of the
// result in rank r's out. in is used as scratch. For wire.Avg out holds the sum.
//
// Small: each rank sends block j to rank j, which reduces in rank order. Large: a ring in
// which rank r sends block r-s-1 at step s and reduces block r-s-2 as it arrives, ending with
// block r complete.
func ReduceScatter(ctx context.Context, c Comm, in, out []byte, dt wire.DType, op wire.RedOp) error {
	n, r := c.Size(), c.Rank()
	m := len(out)
	es := dt.Size()
	if es == 0 || m%es != 0 || len(in) != n*m {
		return fmt.Errorf("reduce_scatter: %d bytes in, %d out for %d ranks of %s: %w", len(in), m, n, dt, errSize)
	}
	block := func(i int) []byte { i = mod(i, n); return in[i*m : (i+1)*m] }
	if n == 1 || m == 0 {
		copy(out, block(r))
		return nil
	}
	if m*(n-1) <= directLimit {
		scratch := make([]byte, n*m)
		got := func(j int) []byte { return scratch[j*m : (j+1)*m] }
		var reqs []Request
		for j := 0; j < n; j++ {
			if j != r {
				reqs = append(reqs, c.Recv(j, Tag{}, CopySink{got(j)}), c.Send(j, Tag{}, block(j)))
			}
		}
		if err := waitAll(ctx, reqs); err != nil {
			return err
		}
		copy(got(r), block(r))
		for j := 1; j < n; j++ {
			if err := reduce.Into(dt, op, got(0), got(j)); err != nil {
				return err
			}
		}
		copy(out, got(0))
		return nil
	}
	err := ring(ctx, c, n-1, slices(block(r-1), es), func(s int) [][]byte { return slices(block(r-s-2), es) },
		func(_ int, sl []byte) Sink { return ReduceSink{Acc: sl, DType: dt, Op: op} })
	if err != nil {
		return err
	}
	copy(out, block(r))
	return nil
}

// Gather concatenates every rank's in into root's out (rank order). out is ignored elsewhere.
func Gather(ctx context.Context, c Comm, in, out []byte, root int) error {
	n, r := c.Size(), c.Rank()
	m := len(in)
	if root < 0 || root >= n {
		return fmt.Errorf("gather: root %d in a group of %d", root, n)
	}
	if r != root {
		return waitAll(ctx, []Request{c.Send(root, Tag{}, in)})
	}
	if len(out) != n*m {
		return fmt.Errorf("gather: %d bytes in, %d out for %d ranks: %w", m, len(out), n, errSize)
	}
	copy(out[r*m:], in)
	var recvs []Request
	for j := 0; j < n; j++ {
		if j != r {
			recvs = append(recvs, c.Recv(j, Tag{}, CopySink{out[j*m : (j+1)*m]}))
		}
	}
	return waitAll(ctx, recvs)
}

// Scatter sends block j of root's in to rank j's out. in is ignored elsewhere.
func Scatter(ctx context.Context, c Comm, in, out []byte, root int) error {
	n, r := c.Size(), c.Rank()
	m := len(out)
	if root < 0 || root >= n {
		return fmt.Errorf("scatter: root %d in a group of %d", root, n)
	}
	if r != root {
		return waitAll(ctx, []Request{c.Recv(root, Tag{}, CopySink{out})})
	}
	if len(in) != n*m {
		return fmt.Errorf("scatter: %d bytes in, %d out for %d ranks: %w", len(in), m, n, errSize)
	}
	copy(out, in[r*m:(r+1)*m])
	var sends []Request
	for j := 0; j < n; j++ {
		if j != r {
			sends = append(sends, c.Send(j, Tag{}, in[j*m:(j+1)*m]))
		}
	}
	return waitAll(ctx, sends)
}
