package collectives

// Randomized tests of the data-movement collectives (Broadcast, AllGather, Gather, Scatter,
// AllToAll) and of Barrier on the fake transport. Results must match byte for byte, inputs
// must come back untouched, and every root is tried.

import (
	"bytes"
	"context"
	"fmt"
	"math/rand"
	"sync/atomic"
	"testing"
	"time"
)

type fcMoveSize struct {
	name  string
	bytes int
}

// fcMoveSizes returns sizes in bytes for a collective that exchanges m bytes per peer directly
// while m*(n-1) <= directLimit and otherwise passes them along in SliceBytes slices; big is the
// size of its large case (more than SliceBytes, not a multiple of it).
func fcMoveSizes(rng *rand.Rand, n, big int) []fcMoveSize {
	sizes := []fcMoveSize{
		{"empty", 0},
		{"one byte", 1},
		{"odd, small", 2*rng.Intn(500) + 3},
	}
	if n > 1 {
		limit := directLimit / (n - 1)
		sizes = append(sizes,
			fcMoveSize{"largest direct (at directLimit)", limit},
			fcMoveSize{"one byte over directLimit", limit + 1},
			fcMoveSize{"over directLimit, odd", limit + 2*rng.Intn(5000) + 1},
		)
	}
	if testing.Short() && n > 3 {
		return sizes
	}
	return append(sizes, fcMoveSize{"large, odd", big + 2*rng.Intn(5000) + 1})
}

// fcFlatSizes returns sizes for Gather and Scatter, which have a single path.
func fcFlatSizes(rng *rand.Rand, n int) []fcMoveSize {
	sizes := []fcMoveSize{
		{"empty", 0},
		{"one byte", 1},
		{"odd, small", 2*rng.Intn(500) + 3},
		{"odd, medium", 2*rng.Intn(50000) + 1001},
	}
	if testing.Short() && n > 3 {
		return sizes
	}
	return append(sizes, fcMoveSize{"large, odd", SliceBytes + 2*rng.Intn(5000) + 1})
}

// fcUnchanged reports an input buffer that a collective modified.
func fcUnchanged(t *testing.T, desc, what string, got, orig []byte) {
	t.Helper()
	if d := fcFirstDiff(got, orig); d != "" {
		t.Errorf("%s: %s was modified: %s", desc, what, d)
	}
}

func TestRandBroadcast(t *testing.T) {
	base := fcBaseSeed(t)
	rng := rand.New(rand.NewSource(base))
	for _, n := range fcGroupSizes {
		for _, size := range fcMoveSizes(rng, n, 2*SliceBytes+SliceBytes/3) {
			for root := range n {
				t.Run(fmt.Sprintf("n=%d/%s/root=%d", n, size.name, root), func(t *testing.T) {
					t.Parallel()
					seed := fcCaseSeed(base, t.Name())
					rng := rand.New(rand.NewSource(seed))
					want := fcRandBytes(rng, size.bytes)
					bufs := make([][]byte, n)
					for r := range n {
						bufs[r] = fcRandBytes(rng, size.bytes)
					}
					copy(bufs[root], want)
					desc := fmt.Sprintf("broadcast of %d bytes from root %d (seed %d)", size.bytes, root, seed)
					if !fcRunOK(t, desc, n, seed, func(ctx context.Context, c Comm) error {
						return Broadcast(ctx, c, bufs[c.Rank()], root)
					}) {
						return
					}
					for r := range n {
						if d := fcFirstDiff(bufs[r], want); d != "" {
							t.Errorf("%s: rank %d: %s", desc, r, d)
						}
					}
				})
			}
		}
	}
}

func TestRandAllGather(t *testing.T) {
	base := fcBaseSeed(t)
	rng := rand.New(rand.NewSource(base))
	for _, n := range fcGroupSizes {
		for _, size := range fcMoveSizes(rng, n, SliceBytes+SliceBytes/8) {
			t.Run(fmt.Sprintf("n=%d/%s", n, size.name), func(t *testing.T) {
				t.Parallel()
				seed := fcCaseSeed(base, t.Name())
				rng := rand.New(rand.NewSource(seed))
				m := size.bytes
				ins, orig, outs := make([][]byte, n), make([][]byte, n), make([][]byte, n)
				// In place (torch's all_gather_into_tensor on a view): in is block r of out.
				inPlace := rng.Intn(2) == 0
				var want []byte
				for r := range n {
					orig[r] = fcRandBytes(rng, m)
					outs[r] = fcRandBytes(rng, n*m)
					ins[r] = bytes.Clone(orig[r])
					if inPlace {
						ins[r] = outs[r][r*m : (r+1)*m]
						copy(ins[r], orig[r])
					}
					want = append(want, orig[r]...)
				}
				desc := fmt.Sprintf("all_gather of %d bytes per rank, in place %v (seed %d)", m, inPlace, seed)
				if !fcRunOK(t, desc, n, seed, func(ctx context.Context, c Comm) error {
					return AllGather(ctx, c, ins[c.Rank()], outs[c.Rank()])
				}) {
					return
				}
				for r := range n {
					if d := fcFirstDiff(outs[r], want); d != "" {
						t.Errorf("%s: rank %d: %s", desc, r, d)
					}
					fcUnchanged(t, desc, fmt.Sprintf("rank %d's input", r), ins[r], orig[r])
				}
			})
		}
	}
}

// fcMaybeNil returns nil or m random bytes: where a buffer is ignored, callers may pass either.
func fcMaybeNil(rng *rand.Rand, m int) []byte {
	if rng.Intn(2) == 0 {
		return nil
	}
	return fcRandBytes(rng, m)
}

func TestRandGather(t *testing.T) {
	base := fcBaseSeed(t)
	rng := rand.New(rand.NewSource(base))
	for _, n := range fcGroupSizes {
		for _, size := range fcFlatSizes(rng, n) {
			for root := range n {
				t.Run(fmt.Sprintf("n=%d/%s/root=%d", n, size.name, root), func(t *testing.T) {
					t.Parallel()
					seed := fcCaseSeed(base, t.Name())
					rng := rand.New(rand.NewSource(seed))
					m := size.bytes
					ins, orig, outs, outs0 := make([][]byte, n), make([][]byte, n), make([][]byte, n), make([][]byte, n)
					inPlace := rng.Intn(2) == 0 // the root's in is its block of out
					var want []byte
					for r := range n {
						orig[r] = fcRandBytes(rng, m)
						ins[r] = bytes.Clone(orig[r])
						outs[r] = fcMaybeNil(rng, n*m)
						if r == root {
							outs[r] = fcRandBytes(rng, n*m)
							if inPlace {
								ins[r] = outs[r][r*m : (r+1)*m]
								copy(ins[r], orig[r])
							}
						}
						outs0[r] = bytes.Clone(outs[r])
						want = append(want, orig[r]...)
					}
					desc := fmt.Sprintf("gather of %d bytes per rank to root %d, in place %v (seed %d)", m, root, inPlace, seed)
					if !fcRunOK(t, desc, n, seed, func(ctx context.Context, c Comm) error {
						return Gather(ctx, c, ins[c.Rank()], outs[c.Rank()], root)
					}) {
						return
					}
					if d := fcFirstDiff(outs[root], want); d != "" {
						t.Errorf("%s: root: %s", desc, d)
					}
					for r := range n {
						fcUnchanged(t, desc, fmt.Sprintf("rank %d's input", r), ins[r], orig[r])
						if r != root {
							fcUnchanged(t, desc, fmt.Sprintf("rank %d's output (ignored off the root)", r), outs[r], outs0[r])
						}
					}
				})
			}
		}
	}
}

func TestRandScatter(t *testing.T) {
	base := fcBaseSeed(t)
	rng := rand.New(rand.NewSource(base))
	for _, n := range fcGroupSizes {
		for _, size := range fcFlatSizes(rng, n) {
			for root := range n {
				t.Run(fmt.Sprintf("n=%d/%s/root=%d", n, size.name, root), func(t *testing.T) {
					t.Parallel()
					seed := fcCaseSeed(base, t.Name())
					rng := rand.New(rand.NewSource(seed))
					m := size.bytes
					ins, orig, outs := make([][]byte, n), make([][]byte, n), make([][]byte, n)
					inPlace := rng.Intn(2) == 0 // the root's out is its block of in
					for r := range n {
						ins[r] = fcMaybeNil(rng, n*m)
						if r == root {
							ins[r] = fcRandBytes(rng, n*m)
						}
						orig[r] = bytes.Clone(ins[r])
						outs[r] = fcRandBytes(rng, m)
						if r == root && inPlace {
							outs[r] = ins[r][r*m : (r+1)*m]
						}
					}
					desc := fmt.Sprintf("scatter of %d bytes per rank from root %d, in place %v (seed %d)", m, root, inPlace, seed)
					if !fcRunOK(t, desc, n, seed, func(ctx context.Context, c Comm) error {
						return Scatter(ctx, c, ins[c.Rank()], outs[c.Rank()], root)
					}) {
						return
					}
					for r := range n {
						if d := fcFirstDiff(outs[r], orig[root][r*m:(r+1)*m]); d != "" {
							t.Errorf("%s: rank %d: %s", desc, r, d)
						}
						fcUnchanged(t, desc, fmt.Sprintf("rank %d's input", r), ins[r], orig[r])
					}
				})
			}
		}
	}
}

// fcSplitCase is a traffic matrix for AllToAll: bytes[i][j] is what rank i sends rank j.
type fcSplitCase struct {
	name  string
	bytes func(rng *rand.Rand, n int) [][]int
}

func fcMatrix(n int, f func(i, j int) int) [][]int {
	s := make([][]int, n)
	for i := range s {
		s[i] = make([]int, n)
		for j := range s[i] {
			s[i][j] = f(i, j)
		}
	}
	return s
}

var fcSplitCases = []fcSplitCase{
	{"all empty", func(rng *rand.Rand, n int) [][]int {
		return fcMatrix(n, func(i, j int) int { return 0 })
	}},
	{"uneven, small, some empty", func(rng *rand.Rand, n int) [][]int {
		return fcMatrix(n, func(i, j int) int {
			if rng.Intn(3) == 0 {
				return 0
			}
			return 1 + rng.Intn(300)
		})
	}},
	{"uneven, large, some empty", func(rng *rand.Rand, n int) [][]int {
		return fcMatrix(n, func(i, j int) int {
			if rng.Intn(4) == 0 {
				return 0
			}
			if testing.Short() {
				return rng.Intn(40 << 10)
			}
			return rng.Intn(400 << 10)
		})
	}},
	{"every size class", func(rng *rand.Rand, n int) [][]int {
		big := SliceBytes
		if testing.Short() {
			big = 100 << 10
		}
		return fcMatrix(n, func(i, j int) int {
			return []int{0, 1, rng.Intn(1000), big + 2*rng.Intn(1000) + 1}[rng.Intn(4)]
		})
	}},
	{"one rank sends everything to one other", func(rng *rand.Rand, n int) [][]int {
		a, b := rng.Intn(n), rng.Intn(n)
		for n > 1 && a == b {
			b = rng.Intn(n)
		}
		big := SliceBytes + 2*rng.Intn(100000) + 1
		return fcMatrix(n, func(i, j int) int {
			if i == a && j == b {
				return big
			}
			return 0
		})
	}},
	{"one rank sends to all, nobody else sends", func(rng *rand.Rand, n int) [][]int {
		a := rng.Intn(n)
		return fcMatrix(n, func(i, j int) int {
			if i == a {
				return rng.Intn(100000)
			}
			return 0
		})
	}},
	{"one rank receives from all, nothing else moves", func(rng *rand.Rand, n int) [][]int {
		b := rng.Intn(n)
		return fcMatrix(n, func(i, j int) int {
			if j == b {
				return 1 + rng.Intn(100000)
			}
			return 0
		})
	}},
	{"each rank keeps its own data only", func(rng *rand.Rand, n int) [][]int {
		return fcMatrix(n, func(i, j int) int {
			if i == j {
				return rng.Intn(10000)
			}
			return 0
		})
	}},
}

func TestRandAllToAll(t *testing.T) {
	base := fcBaseSeed(t)
	for _, n := range fcGroupSizes {
		for _, sc := range fcSplitCases {
			t.Run(fmt.Sprintf("n=%d/%s", n, sc.name), func(t *testing.T) {
				t.Parallel()
				seed := fcCaseSeed(base, t.Name())
				rng := rand.New(rand.NewSource(seed))
				s := sc.bytes(rng, n)
				ins, orig, outs := make([][]byte, n), make([][]byte, n), make([][]byte, n)
				inSplits, outSplits := make([][]int, n), make([][]int, n)
				for r := range n {
					inSplits[r], outSplits[r] = make([]int, n), make([]int, n)
					in, out := 0, 0
					for j := range n {
						inSplits[r][j], outSplits[r][j] = s[r][j], s[j][r]
						in += s[r][j]
						out += s[j][r]
					}
					orig[r] = fcRandBytes(rng, in)
					ins[r] = bytes.Clone(orig[r])
					outs[r] = fcRandBytes(rng, out)
				}
				desc := fmt.Sprintf("all_to_all with splits %v (seed %d)", s, seed)
				if !fcRunOK(t, desc, n, seed, func(ctx context.Context, c Comm) error {
					r := c.Rank()
					return AllToAll(ctx, c, ins[r], inSplits[r], outs[r], outSplits[r])
				}) {
					return
				}
				for r := range n {
					var want []byte
					for j := range n {
						off := 0
						for k := range r {
							off += s[j][k]
						}
						want = append(want, orig[j][off:off+s[j][r]]...)
					}
					if d := fcFirstDiff(outs[r], want); d != "" {
						t.Errorf("%s: rank %d: %s", desc, r, d)
					}
					fcUnchanged(t, desc, fmt.Sprintf("rank %d's input", r), ins[r], orig[r])
				}
			})
		}
	}
}

func TestRandBarrier(t *testing.T) {
	base := fcBaseSeed(t)
	rounds := 25
	if testing.Short() {
		rounds = 8
	}
	for _, n := range fcGroupSizes {
		t.Run(fmt.Sprintf("n=%d", n), func(t *testing.T) {
			t.Parallel()
			seed := fcCaseSeed(base, t.Name())
			rng := rand.New(rand.NewSource(seed))
			for round := range rounds {
				// Each rank waits a random time before it enters; in some rounds one rank is
				// much later than the rest.
				delays := make([]time.Duration, n)
				for r := range delays {
					if rng.Intn(2) == 0 {
						delays[r] = time.Duration(rng.Intn(500)) * time.Microsecond
					}
				}
				if round%2 == 1 {
					delays[rng.Intn(n)] = 3 * time.Millisecond
				}
				var entered atomic.Int32
				early := make([]int32, n)
				desc := fmt.Sprintf("barrier round %d, delays %v (seed %d)", round, delays, seed)
				if !fcRunOK(t, desc, n, seed+int64(round), func(ctx context.Context, c Comm) error {
					time.Sleep(delays[c.Rank()])
					entered.Add(1)
					err := Barrier(ctx, c)
					early[c.Rank()] = entered.Load()
					return err
				}) {
					return
				}
				for r, k := range early {
					if k != int32(n) {
						t.Errorf("%s: rank %d left the barrier when %d of %d ranks had entered", desc, r, k, n)
					}
				}
			}
		})
	}
}
