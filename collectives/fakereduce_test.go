package collectives

// Randomized tests of AllReduce, Reduce and ReduceScatter on the fake transport, against the
// reference of fakeref_test.go.

import (
	"context"
	"fmt"
	"math/rand"
	"testing"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/wire"
)

// Which dtype/op pairs a size runs for.
const (
	fcEveryOp   = iota // every supported op of every dtype
	fcOneOp            // every dtype, one random op (the size matters, not the op)
	fcBigDTypes        // only the dtypes of fcBigFor (large buffers are slow)
)

type fcSize struct {
	name  string
	elems int // elements of the unit that picks the path (see fcReduceSizes)
	which int
}

// fcReduceSizes returns the sizes that hit every path of a reducing collective whose unit
// (the whole buffer, or one rank's block) of elems elements of es bytes is exchanged
// directly while elems*es*(n-1) <= directLimit, and otherwise goes round a ring or chain cut
// into parts pieces (the ring's chunks, or 1), each pipelined in SliceBytes slices.
func fcReduceSizes(rng *rand.Rand, n, es, parts int) []fcSize {
	sizes := []fcSize{
		{"empty", 0, fcEveryOp},
		{"one element", 1, fcEveryOp},
		{"odd count", 2*rng.Intn(400) + 3, fcEveryOp},
	}
	if n >= 3 {
		sizes = append(sizes, fcSize{"fewer elements than ranks", n - 1, fcEveryOp})
	}
	if n == 1 {
		return append(sizes, fcSize{"large, odd", 100001, fcBigDTypes})
	}
	limit := directLimit / ((n - 1) * es) // the most elements exchanged directly
	perSlice := SliceBytes / es
	sizes = append(sizes,
		fcSize{"largest direct (at directLimit)", limit, fcOneOp},
		fcSize{"smallest ring (one element over directLimit)", limit + 1, fcOneOp},
	)
	if !testing.Short() {
		sizes = append(sizes, fcSize{"ring, odd, under one slice per part", limit + 2*rng.Intn(1000) + 1, fcOneOp})
	}
	// Every part a little over SliceBytes, and not a multiple of it.
	return append(sizes, fcSize{"parts over SliceBytes, odd", parts*(perSlice+perSlice/8) + 2*rng.Intn(500) + 1, fcBigDTypes})
}

// fcBigFor returns the dtypes that run the large sizes in group size number gi: every dtype
// gets a turn (starting at a random one), larger groups fewer as their buffers are larger.
func fcBigFor(base int64, gi int) []wire.DType {
	counts := []int{2, 3, 2, 1, 1, 1} // per entry of fcGroupSizes; 10 >= len(fcDTypes)
	if testing.Short() {
		counts = []int{1, 1, 1, 0, 0, 0}
	}
	start := int(uint64(base) % uint64(len(fcDTypes)))
	for _, c := range counts[:gi] {
		start += c
	}
	var out []wire.DType
	for j := range counts[gi] {
		out = append(out, fcDTypes[(start+j)%len(fcDTypes)])
	}
	return out
}

// fcSupportedOps lists the ops reduce.Check accepts for dt.
func fcSupportedOps(dt wire.DType) []wire.RedOp {
	var ops []wire.RedOp
	for _, op := range fcOps {
		if reduce.Check(dt, op) == nil {
			ops = append(ops, op)
		}
	}
	return ops
}

// fcReduceCase is one run of a reducing collective.
type fcReduceCase struct {
	n     int
	dt    wire.DType
	op    wire.RedOp
	size  fcSize
	index int // position among the cases of its group size, to spread roots
}

func (c fcReduceCase) name() string {
	return fmt.Sprintf("n=%d/%s/%s/%s", c.n, c.dt, c.op, c.size.name)
}

// fcReduceCases expands the size table over group sizes, dtypes and ops.
func fcReduceCases(base int64, rng *rand.Rand, parts func(n int) int) []fcReduceCase {
	var cases []fcReduceCase
	for gi, n := range fcGroupSizes {
		big := fcBigFor(base, gi)
		index := 0
		for dti, dt := range fcDTypes {
			ops := fcSupportedOps(dt)
			for _, size := range fcReduceSizes(rng, n, dt.Size(), parts(n)) {
				var run []wire.RedOp
				switch size.which {
				case fcEveryOp:
					run = ops
				case fcOneOp:
					// -short: three dtypes per group size, so the boundary sizes of every
					// dtype are still met over the group sizes.
					if !testing.Short() || (int(uint64(base)%9)+3*gi+len(fcDTypes)-dti)%len(fcDTypes) < 3 {
						run = []wire.RedOp{ops[rng.Intn(len(ops))]}
					}
				case fcBigDTypes:
					for _, b := range big {
						if b == dt {
							run = []wire.RedOp{ops[rng.Intn(len(ops))]}
						}
					}
				}
				for _, op := range run {
					cases = append(cases, fcReduceCase{n: n, dt: dt, op: op, size: size, index: index})
					index++
				}
			}
		}
	}
	return cases
}

func (c fcReduceCase) desc(what string, bytes int, seed int64) string {
	return fmt.Sprintf("%s of %d %s elements (%d bytes), %s, %s (seed %d)", what, c.size.elems, c.dt, bytes, c.op, c.size.name, seed)
}

// fcPlace returns a copy of b that starts a random number of elements of es bytes into a
// larger allocation, as a view into a tensor does, so kernels see addresses that are aligned
// to the element only.
func fcPlace(rng *rand.Rand, b []byte, es int) []byte {
	off := rng.Intn(8) * es
	c := make([]byte, off+len(b))[off:]
	copy(c, b)
	return c
}

func TestRandAllReduce(t *testing.T) {
	base := fcBaseSeed(t)
	rng := rand.New(rand.NewSource(base))
	for _, c := range fcReduceCases(base, rng, func(n int) int { return n }) {
		t.Run(c.name(), func(t *testing.T) {
			t.Parallel()
			seed := fcCaseSeed(base, t.Name())
			rng := rand.New(rand.NewSource(seed))
			n, dt, op := c.n, c.dt, c.op
			ins := make([][]byte, n)
			bufs := make([][]byte, n)
			for r := range n {
				ins[r] = fcGen(rng, dt, op, c.size.elems)
				bufs[r] = fcPlace(rng, ins[r], dt.Size())
			}
			desc := c.desc("all_reduce", len(ins[0]), seed)
			ok := fcRunOK(t, desc, n, seed, func(ctx context.Context, cm Comm) error {
				r := cm.Rank()
				if err := AllReduce(ctx, cm, bufs[r], dt, op); err != nil {
					return err
				}
				return reduce.Finish(dt, op, bufs[r], n)
			})
			if !ok {
				return
			}
			for r := 1; r < n; r++ {
				if d := fcFirstDiff(bufs[0], bufs[r]); d != "" {
					t.Errorf("%s: ranks 0 and %d ended with different bytes: %s", desc, r, d)
				}
			}
			if err := fcCheckReduced(dt, op, ins, 0, bufs[0]); err != nil {
				t.Errorf("%s: %v", desc, err)
			}
		})
	}
}

func TestRandReduce(t *testing.T) {
	base := fcBaseSeed(t)
	rng := rand.New(rand.NewSource(base))
	for _, c := range fcReduceCases(base, rng, func(int) int { return 1 }) {
		// Roots rotate over the cases, so every size meets every root; large buffers try two.
		roots := []int{(c.index + int(base&0xff)) % c.n}
		if c.size.which == fcBigDTypes && c.n > 1 {
			roots = append(roots, (roots[0]+1+rng.Intn(c.n-1))%c.n)
		}
		for _, root := range roots {
			t.Run(fmt.Sprintf("%s/root=%d", c.name(), root), func(t *testing.T) {
				t.Parallel()
				seed := fcCaseSeed(base, t.Name())
				rng := rand.New(rand.NewSource(seed))
				n, dt, op := c.n, c.dt, c.op
				ins := make([][]byte, n)
				bufs := make([][]byte, n)
				for r := range n {
					ins[r] = fcGen(rng, dt, op, c.size.elems)
					bufs[r] = fcPlace(rng, ins[r], dt.Size())
				}
				desc := c.desc(fmt.Sprintf("reduce to root %d", root), len(ins[0]), seed)
				ok := fcRunOK(t, desc, n, seed, func(ctx context.Context, cm Comm) error {
					r := cm.Rank()
					if err := Reduce(ctx, cm, bufs[r], dt, op, root); err != nil {
						return err
					}
					if r != root { // other ranks' buffers are scratch
						return nil
					}
					return reduce.Finish(dt, op, bufs[r], n)
				})
				if !ok {
					return
				}
				if err := fcCheckReduced(dt, op, ins, 0, bufs[root]); err != nil {
					t.Errorf("%s: root: %v", desc, err)
				}
			})
		}
	}
}

func TestRandReduceScatter(t *testing.T) {
	base := fcBaseSeed(t)
	rng := rand.New(rand.NewSource(base))
	for _, c := range fcReduceCases(base, rng, func(int) int { return 1 }) {
		t.Run(c.name(), func(t *testing.T) {
			t.Parallel()
			seed := fcCaseSeed(base, t.Name())
			rng := rand.New(rand.NewSource(seed))
			n, dt, op := c.n, c.dt, c.op
			m := c.size.elems * dt.Size() // bytes per block
			inPlace := rng.Intn(2) == 0   // out is block r of in, as with a view of the input
			ins := make([][]byte, n)
			bufs := make([][]byte, n)
			outs := make([][]byte, n)
			for r := range n {
				ins[r] = fcGen(rng, dt, op, n*c.size.elems)
				bufs[r] = fcPlace(rng, ins[r], dt.Size())
				outs[r] = fcPlace(rng, fcRandBytes(rng, m), dt.Size())
				if inPlace {
					outs[r] = bufs[r][r*m : (r+1)*m]
				}
			}
			desc := c.desc(fmt.Sprintf("reduce_scatter (in place %v), per block,", inPlace), m, seed)
			ok := fcRunOK(t, desc, n, seed, func(ctx context.Context, cm Comm) error {
				r := cm.Rank()
				if err := ReduceScatter(ctx, cm, bufs[r], outs[r], dt, op); err != nil {
					return err
				}
				return reduce.Finish(dt, op, outs[r], n)
			})
			if !ok {
				return
			}
			for r := range n {
				if err := fcCheckReduced(dt, op, ins, r*c.size.elems, outs[r]); err != nil {
					t.Errorf("%s: rank %d: %v", desc, r, err)
				}
			}
		})
	}
}
