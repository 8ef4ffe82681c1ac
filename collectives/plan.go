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
