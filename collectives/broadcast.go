package collectives

import (
	"context"
	"fmt"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/wire"
)

// Broadcast copies root's buf to every rank's buf. Small buffers go straight from the root to
// each rank; large ones flow down a chain (root, root+1, ...) in slices, so every link carries
// the buffer once.
func Broadcast(ctx context.Context, c Comm, buf []byte, root int) error {
	n, r := c.Size(), c.Rank()
	if root < 0 || root >= n {
		return fmt.Errorf("broadcast: root %d in a group of %d", root, n)
	}
	if n == 1 || len(buf) == 0 {
		return nil
	}
	if len(buf)*(n-1) <= directLimit || n == 2 {
		if r != root {
			return waitAll(ctx, []Request{c.Recv(root, Tag{}, CopySink{buf})})
		}
		var sends []Request
		for j := 0; j < n; j++ {
			if j != root {
				sends = append(sends, c.Send(j, Tag{}, buf))
			}
		}
		return waitAll(ctx, sends)
	}
	v := mod(r-root, n) // position in the chain
	next, prev := mod(r+1, n), mod(r-1, n)
	parts := slices(buf, 1)
	var sends []Request
	if v == 0 {
		for j, sl := range parts {
			sends = append(sends, c.Send(next, Tag{0, uint32(j)}, sl))
		}
		return waitAll(ctx, sends)
	}
	recvs := make([]Request, len(parts))
	for j, sl := range parts {
		recvs[j] = c.Recv(prev, Tag{0, uint32(j)}, CopySink{sl})
	}
	for j, req := range recvs {
		if err := req.Wait(ctx); err != nil {
			waitAll(ctx, sends)
			return err
		}
		if v < n-1 {
			sends = append(sends, c.Send(next, Tag{0, uint32(j)}, parts[j]))
		}
	}
	return waitAll(ctx, sends)
}

// Reduce reduces buf across the group into root's buf. Other ranks' buf is used as scratch
// and left undefined (the shim copies results back on the root only). For wire.Avg the
// root is left with the sum.
//
// Small buffers: each rank sends to the root, which reduces in rank order. Large: a chain
// towards the root (root+n-1 -> ... -> root+1 -> root), each rank reducing what arrives into
// its own buffer and passing each slice on as soon as it is reduced.
func Reduce(ctx context.Context, c Comm, buf []byte, dt wire.DType, op wire.RedOp, root int) error {
	n, r := c.Size(), c.Rank()
	es := dt.Size()
	if es == 0 || len(buf)%es != 0 {
		return fmt.Errorf("reduce: %d bytes of %s: %w", len(buf), dt, errSize)
	}
	if root < 0 || root >= n {
		return fmt.Errorf("reduce: root %d in a group of %d", root, n)
	}
	if n == 1 || len(buf) == 0 {
		return nil
	}
	if len(buf)*(n-1) <= directLimit {
		if r != root {
			return waitAll(ctx, []Request{c.Send(root, Tag{}, buf)})
		}
		scratch := make([]byte, len(buf)*n)
		in := func(j int) []byte { return scratch[j*len(buf) : (j+1)*len(buf)] }
		var recvs []Request
		for j := 0; j < n; j++ {
			if j != r {
				recvs = append(recvs, c.Recv(j, Tag{}, CopySink{in(j)}))
			}
		}
		if err := waitAll(ctx, recvs); err != nil {
			return err
		}
		copy(in(r), buf)
		for j := 1; j < n; j++ {
			if err := reduce.Into(dt, op, in(0), in(j)); err != nil {
				return err
			}
		}
		copy(buf, in(0))
		return nil
	}
	v := mod(r-root, n)
	toward, from := mod(r-1, n), mod(r+1, n)
	parts := slices(buf, es)
	var sends []Request
	if v == n-1 {
		for j, sl := range parts {
			sends = append(sends, c.Send(toward, Tag{0, uint32(j)}, sl))
		}
		return waitAll(ctx, sends)
	}
	recvs := make([]Request, len(parts))
	for j, sl := range parts {
		recvs[j] = c.Recv(from, Tag{0, uint32(j)}, ReduceSink{Acc: sl, DType: dt, Op: op})
	}
	for j, req := range recvs {
		if err := req.Wait(ctx); err != nil {
			waitAll(ctx, sends)
			return err
		}
		if v > 0 {
			sends = append(sends, c.Send(toward, Tag{0, uint32(j)}, parts[j]))
		}
	}
	return waitAll(ctx, sends)
}
