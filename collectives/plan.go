package collectives

import (
	"context"
	"errors"
)

// SliceBytes is the unit of pipelining: forwarding algorithms (ring, chain) pass data on slice
// by slice, so a rank forwards slice j while slice j+1 is still arriving.
const SliceBytes = 1 << 20

// directLimit: below this many bytes moved per rank, a one-round direct exchange beats the
// 2(n-1) latency hops of a ring.
const directLimit = 512 << 10

// bounds splits n bytes (whole elements of es bytes) into parts nearly equal pieces and
// returns the parts+1 offsets. Pieces differ by at most one element; trailing pieces may be
// empty when there are fewer elements than parts.
func bounds(n, parts, es int) []int {
	elems := n / es
	b := make([]int, parts+1)
	for i := 0; i <= parts; i++ {
		b[i] = (elems * i / parts) * es
	}
	b[parts] = n
	return b
}

// slices cuts b into pieces of at most SliceBytes (rounded down to whole elements).
func slices(b []byte, es int) [][]byte {
	step := max(SliceBytes/es*es, es)
	out := make([][]byte, 0, (len(b)+step-1)/step)
	for off := 0; off < len(b); off += step {
		out = append(out, b[off:min(off+step, len(b))])
	}
	return out
}

func mod(a, n int) int { return ((a % n) + n) % n }

// waitAll waits for every request; it returns the first error (they all keep waiting, so
// no request is left running against memory the caller is about to reuse).
func waitAll(ctx context.Context, reqs []Request) error {
	var errs []error
	for _, r := range reqs {
		if err := r.Wait(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

var errSize = errors.New("buffer sizes do not fit the collective")

// ring runs the pipelined ring that all-reduce, all-gather and reduce-scatter share: rank r
// sends the slices of first to r+1 at step 0; at step s (0 <= s < steps) it receives the
// slices of chunk(s) from r-1 into sink(s, slice), and forwards each slice, as soon as it has
// landed, to r+1 at step s+1. All receives are posted up front, so slices of later steps that
// arrive early land in place. A slice is forwarded only after it arrived, which is what keeps
// a buffer from being sent and overwritten at once.
func ring(ctx context.Context, c Comm, steps int, first [][]byte, chunk func(s int) [][]byte, sink func(s int, b []byte) Sink) error {
	n, r := c.Size(), c.Rank()
	next, prev := mod(r+1, n), mod(r-1, n)
	recvs := make([][]Request, steps)
	for s := 0; s < steps; s++ {
		for j, sl := range chunk(s) {
			recvs[s] = append(recvs[s], c.Recv(prev, Tag{uint32(s), uint32(j)}, sink(s, sl)))
		}
	}
	var sends []Request
	for j, sl := range first {
		sends = append(sends, c.Send(next, Tag{0, uint32(j)}, sl))
	}
	for s := 0; s < steps; s++ {
		sl := chunk(s)
		for j, req := range recvs[s] {
			if err := req.Wait(ctx); err != nil {
				waitAll(ctx, sends)
				return err
			}
			if s+1 < steps {
				sends = append(sends, c.Send(next, Tag{uint32(s + 1), uint32(j)}, sl[j]))
			}
		}
	}
	return waitAll(ctx, sends)
}
