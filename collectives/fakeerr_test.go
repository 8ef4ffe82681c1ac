package collectives

// Error paths (bad arguments must return errors, never panic or hang), cancellation, and
// a check that the fake transport itself catches what it is meant to catch.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/wire"
)

type fcErrCase struct {
	desc string
	n    int
	run  func(ctx context.Context, c Comm) error
	// fail lists the ranks that must return an error (nil: every rank); the others may
	// succeed, fail, or wait until the op's deadline, but must not panic.
	fail []int
	is   error // if set, their errors must wrap it
}

// fcErrCases builds the table. n is the group size of the cases that do not name their own.
func fcErrCases(rng *rand.Rand) []fcErrCase {
	var cases []fcErrCase
	add := func(c fcErrCase) { cases = append(cases, c) }
	big := directLimit + 4*rng.Intn(1000) // bytes; float32-aligned, large enough for rings
	for _, n := range []int{1, 2, 3, 5} {
		bad := []int{-1, n, n + 7}
		for _, root := range bad {
			add(fcErrCase{desc: fmt.Sprintf("broadcast, root %d", root), n: n, run: func(ctx context.Context, c Comm) error {
				return Broadcast(ctx, c, make([]byte, 10), root)
			}})
			add(fcErrCase{desc: fmt.Sprintf("reduce, root %d", root), n: n, run: func(ctx context.Context, c Comm) error {
				return Reduce(ctx, c, make([]byte, 8), wire.Float32, wire.Sum, root)
			}})
			add(fcErrCase{desc: fmt.Sprintf("gather, root %d", root), n: n, run: func(ctx context.Context, c Comm) error {
				return Gather(ctx, c, make([]byte, 3), make([]byte, 3*n), root)
			}})
			add(fcErrCase{desc: fmt.Sprintf("scatter, root %d", root), n: n, run: func(ctx context.Context, c Comm) error {
				return Scatter(ctx, c, make([]byte, 3*n), make([]byte, 3), root)
			}})
		}
		for _, size := range []int{7, big + 2} {
			add(fcErrCase{desc: fmt.Sprintf("all_reduce, %d bytes of float32", size), n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
				return AllReduce(ctx, c, make([]byte, size), wire.Float32, wire.Sum)
			}})
			add(fcErrCase{desc: fmt.Sprintf("reduce, %d bytes of float32", size), n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
				return Reduce(ctx, c, make([]byte, size), wire.Float32, wire.Sum, 0)
			}})
			add(fcErrCase{desc: fmt.Sprintf("reduce_scatter, out of %d bytes of float32", size), n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
				return ReduceScatter(ctx, c, make([]byte, n*size), make([]byte, size), wire.Float32, wire.Sum)
			}})
		}
		add(fcErrCase{desc: "all_reduce, invalid dtype", n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
			return AllReduce(ctx, c, make([]byte, 8), wire.Invalid, wire.Sum)
		}})
		add(fcErrCase{desc: "all_reduce, unknown dtype", n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
			return AllReduce(ctx, c, make([]byte, 8), wire.DType(200), wire.Sum)
		}})
		add(fcErrCase{desc: "reduce, invalid dtype", n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
			return Reduce(ctx, c, make([]byte, 8), wire.Invalid, wire.Max, 0)
		}})
		add(fcErrCase{desc: "reduce_scatter, invalid dtype", n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
			return ReduceScatter(ctx, c, make([]byte, 8*n), make([]byte, 8), wire.Invalid, wire.Sum)
		}})
		for _, delta := range []int{-1, 1, 4} {
			add(fcErrCase{desc: fmt.Sprintf("reduce_scatter, input %+d bytes off n blocks", delta), n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
				return ReduceScatter(ctx, c, make([]byte, 8*n+delta), make([]byte, 8), wire.Int32, wire.Sum)
			}})
			add(fcErrCase{desc: fmt.Sprintf("all_gather, output %+d bytes off n blocks", delta), n: n, is: errSize, run: func(ctx context.Context, c Comm) error {
				return AllGather(ctx, c, make([]byte, 5), make([]byte, 5*n+delta))
			}})
			add(fcErrCase{desc: fmt.Sprintf("gather, root's output %+d bytes off n blocks", delta), n: n, is: errSize, fail: []int{n - 1}, run: func(ctx context.Context, c Comm) error {
				return Gather(ctx, c, make([]byte, 5), make([]byte, 5*n+delta), n-1)
			}})
			add(fcErrCase{desc: fmt.Sprintf("scatter, root's input %+d bytes off n blocks", delta), n: n, is: errSize, fail: []int{0}, run: func(ctx context.Context, c Comm) error {
				return Scatter(ctx, c, make([]byte, 5*n+delta), make([]byte, 5), 0)
			}})
		}

		// AllToAll: the rank with bad splits must fail; the others may wait for it.
		r0 := rng.Intn(n)
		alltoall := func(desc string, in, out int, inSplits, outSplits func(r int) []int) {
			add(fcErrCase{desc: "all_to_all, " + desc, n: n, is: errSize, fail: []int{r0}, run: func(ctx context.Context, c Comm) error {
				r := c.Rank()
				ins, outs := make([]int, n), make([]int, n)
				for j := range n {
					ins[j], outs[j] = 1, 1
				}
				bufIn, bufOut := n, n
				if r == r0 {
					ins, outs, bufIn, bufOut = inSplits(r), outSplits(r), in, out
				}
				return AllToAll(ctx, c, make([]byte, bufIn), ins, make([]byte, bufOut), outs)
			}})
		}
		ones := func(k int) func(int) []int {
			return func(int) []int {
				s := make([]int, k)
				for i := range s {
					s[i] = 1
				}
				return s
			}
		}
		alltoall("too few splits", n, n, ones(n-1), ones(n))
		alltoall("too many output splits", n, n, ones(n), ones(n+1))
		alltoall("input splits short of the buffer", n+1, n, ones(n), ones(n))
		alltoall("input splits past the buffer", n-1, n, ones(n), ones(n))
		alltoall("output splits short of the buffer", n, n+3, ones(n), ones(n))
		alltoall("output splits past the buffer", n, n-1, ones(n), ones(n))
		if n > 1 {
			alltoall("a negative split", n, n, func(int) []int {
				s := ones(n)(0) // still adds up to the buffer's n bytes
				s[n-1] = -1
				s[0] += 2
				return s
			}, ones(n))
		}
		alltoall("what a rank sends itself differs from what it expects", n, n+1, ones(n), func(r int) []int {
			s := ones(n)(0)
			s[r] = 2
			return s
		})
		if n > 1 {
			add(fcErrCase{desc: "all_to_all, peers disagree on a split", n: n, fail: []int{1}, run: func(ctx context.Context, c Comm) error {
				in, out := make([]int, n), make([]int, n)
				if c.Rank() == 0 {
					in[1] = 5 // rank 1 expects 4
				}
				if c.Rank() == 1 {
					out[0] = 4
				}
				sum := func(s []int) (t int) {
					for _, v := range s {
						t += v
					}
					return t
				}
				return AllToAll(ctx, c, make([]byte, sum(in)), in, make([]byte, sum(out)), out)
			}})
			add(fcErrCase{desc: "all_gather, ranks disagree on the size", n: n, fail: []int{}, run: func(ctx context.Context, c Comm) error {
				m := 100 + c.Rank()
				return AllGather(ctx, c, make([]byte, m), make([]byte, n*m))
			}})
			add(fcErrCase{desc: "broadcast, ranks disagree on the size (large)", n: n, fail: []int{}, run: func(ctx context.Context, c Comm) error {
				return Broadcast(ctx, c, make([]byte, 2*SliceBytes+c.Rank()*SliceBytes/2), 0)
			}})
			// float32 has no bitwise ops; every rank reduces what it receives, so every rank
			// must report it (small: direct exchange; large: ring).
			for _, size := range []int{64, big} {
				add(fcErrCase{desc: fmt.Sprintf("all_reduce, band on %d bytes of float32", size), n: n, is: reduce.ErrUnsupported, run: func(ctx context.Context, c Comm) error {
					return AllReduce(ctx, c, make([]byte, size), wire.Float32, wire.BAnd)
				}})
			}
		}
	}
	return cases
}

func TestRandErrors(t *testing.T) {
	base := fcBaseSeed(t)
	rng := rand.New(rand.NewSource(base))
	cases := fcErrCases(rng)
	// Some ranks wait for the deadline, so the cases all run at once rather than a few at a
	// time as parallel subtests would.
	outcomes := make([]fcOutcome, len(cases))
	seeds := make([]int64, len(cases))
	var wg sync.WaitGroup
	for i, c := range cases {
		seeds[i] = fcCaseSeed(base, fmt.Sprintf("%s/n=%d/%s", t.Name(), c.n, c.desc))
		wg.Add(1)
		go func() {
			defer wg.Done()
			outcomes[i] = fcRun(c.n, seeds[i], 300*time.Millisecond, nil, c.run)
		}()
	}
	wg.Wait()
	for i, c := range cases {
		t.Run(fmt.Sprintf("n=%d/%s", c.n, c.desc), func(t *testing.T) {
			o := outcomes[i]
			desc := fmt.Sprintf("%s, group of %d (seed %d)", c.desc, c.n, seeds[i])
			for _, b := range o.bugs {
				if strings.Contains(b, "panicked") {
					t.Errorf("%s: %s", desc, b)
				}
			}
			fail := c.fail
			if fail == nil {
				for r := range c.n {
					fail = append(fail, r)
				}
			}
			for _, r := range fail {
				switch err := o.errs[r]; {
				case err == nil:
					t.Errorf("%s: rank %d returned no error", desc, r)
				case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
					t.Errorf("%s: rank %d waited (until it was cancelled) instead of failing: %v", desc, r, err)
				case c.is != nil && !errors.Is(err, c.is):
					t.Errorf("%s: rank %d: %v does not wrap %v", desc, r, err, c.is)
				}
			}
			if len(fail) == 0 && !o.failed() {
				t.Errorf("%s: every rank succeeded", desc)
			}
		})
	}
}

// TestRandCancel runs collectives with one rank missing and cancels them: the ranks that need
// the missing rank's data must return the context's error, and none may hang.
func TestRandCancel(t *testing.T) {
	base := fcBaseSeed(t)
	type cancelCase struct {
		name string
		run  func(ctx context.Context, c Comm, absent int) error
		must func(r, absent, n int) bool // ranks that cannot finish without the absent rank
	}
	all := func(r, absent, n int) bool { return true }
	root0 := func(r, absent, n int) bool { return r == (absent+1)%n }
	cases := []cancelCase{}
	for _, size := range []int{40, 3 * SliceBytes} {
		cases = append(cases,
			cancelCase{fmt.Sprintf("all_reduce %d bytes", size), func(ctx context.Context, c Comm, _ int) error {
				return AllReduce(ctx, c, make([]byte, size), wire.Float32, wire.Sum)
			}, all},
			cancelCase{fmt.Sprintf("reduce_scatter %d bytes", size), func(ctx context.Context, c Comm, _ int) error {
				return ReduceScatter(ctx, c, make([]byte, c.Size()*size), make([]byte, size), wire.Int64, wire.Max)
			}, all},
			cancelCase{fmt.Sprintf("all_gather %d bytes", size), func(ctx context.Context, c Comm, _ int) error {
				return AllGather(ctx, c, make([]byte, size), make([]byte, c.Size()*size))
			}, all},
			cancelCase{fmt.Sprintf("broadcast %d bytes from the missing rank", size), func(ctx context.Context, c Comm, absent int) error {
				return Broadcast(ctx, c, make([]byte, size), absent)
			}, all},
			cancelCase{fmt.Sprintf("reduce %d bytes", size), func(ctx context.Context, c Comm, absent int) error {
				return Reduce(ctx, c, make([]byte, size), wire.Float64, wire.Sum, (absent+1)%c.Size())
			}, root0},
			cancelCase{fmt.Sprintf("gather %d bytes", size), func(ctx context.Context, c Comm, absent int) error {
				return Gather(ctx, c, make([]byte, size), make([]byte, c.Size()*size), (absent+1)%c.Size())
			}, root0},
			cancelCase{fmt.Sprintf("scatter %d bytes from the missing rank", size), func(ctx context.Context, c Comm, absent int) error {
				return Scatter(ctx, c, nil, make([]byte, size), absent)
			}, all},
			cancelCase{fmt.Sprintf("all_to_all %d bytes each", size), func(ctx context.Context, c Comm, absent int) error {
				n := c.Size()
				s := make([]int, n)
				for j := range s {
					s[j] = size / n
				}
				return AllToAll(ctx, c, make([]byte, n*(size/n)), s, make([]byte, n*(size/n)), s)
			}, all},
		)
	}
	cases = append(cases, cancelCase{"barrier", func(ctx context.Context, c Comm, _ int) error { return Barrier(ctx, c) }, all})
	for _, n := range []int{2, 3, 5, 8} {
		for _, cc := range cases {
			t.Run(fmt.Sprintf("n=%d/%s", n, cc.name), func(t *testing.T) {
				t.Parallel()
				seed := fcCaseSeed(base, t.Name())
				absent := rand.New(rand.NewSource(seed)).Intn(n)
				var ranks []int
				for r := range n {
					if r != absent {
						ranks = append(ranks, r)
					}
				}
				ctx, cancel := context.WithCancel(context.Background())
				time.AfterFunc(20*time.Millisecond, cancel)
				done := make(chan fcOutcome, 1)
				go func() {
					done <- fcRunCtx(ctx, n, seed, ranks, func(ctx context.Context, c Comm) error {
						return cc.run(ctx, c, absent)
					})
				}()
				desc := fmt.Sprintf("%s, group of %d without rank %d (seed %d)", cc.name, n, absent, seed)
				select {
				case o := <-done:
					for _, b := range o.bugs {
						if strings.Contains(b, "panicked") {
							t.Errorf("%s: %s", desc, b)
						}
					}
					for _, r := range ranks {
						if err := o.errs[r]; cc.must(r, absent, n) && !errors.Is(err, context.Canceled) {
							t.Errorf("%s: rank %d returned %v, want the context's error", desc, r, err)
						}
					}
				case <-time.After(20 * time.Second):
					t.Fatalf("%s: ranks still running 20s after the cancellation", desc)
				}
			})
		}
	}
}

// TestFakeCommChecks makes sure the fake transport reports what it exists to catch.
func TestFakeCommChecks(t *testing.T) {
	seed := fcBaseSeed(t)
	ctx := context.Background()
	hasBug := func(o fcOutcome, want string) bool {
		for _, b := range o.bugs {
			if strings.Contains(b, want) {
				return true
			}
		}
		return false
	}
	t.Run("tag sent twice", func(t *testing.T) {
		o := fcRun(2, seed, 5*time.Second, nil, func(ctx context.Context, c Comm) error {
			var reqs []Request
			for range 2 {
				if c.Rank() == 0 {
					reqs = append(reqs, c.Send(1, Tag{3, 4}, []byte{1}))
				} else {
					reqs = append(reqs, c.Recv(0, Tag{3, 4}, CopySink{make([]byte, 1)}))
				}
			}
			return waitAll(ctx, reqs)
		})
		if !hasBug(o, "tag sent twice in one op: 0->1 step 3 slice 4") || !hasBug(o, "receive posted twice") {
			t.Errorf("not reported: %s", o)
		}
	})
	t.Run("message never received", func(t *testing.T) {
		o := fcRun(3, seed, 5*time.Second, nil, func(ctx context.Context, c Comm) error {
			if c.Rank() == 2 {
				return c.Send(0, Tag{1, 0}, []byte{1, 2}).Wait(ctx)
			}
			return nil
		})
		if !hasBug(o, "message 2->0 step 1 slice 0 (2 bytes) was sent but never received") {
			t.Errorf("not reported: %s", o)
		}
	})
	t.Run("receive never matched", func(t *testing.T) {
		o := fcRun(2, seed, 5*time.Second, nil, func(ctx context.Context, c Comm) error {
			if c.Rank() == 1 {
				c.Recv(0, Tag{}, CopySink{make([]byte, 1)})
			}
			return nil
		})
		if !hasBug(o, "receive 0->1 step 0 slice 0 was posted but no message matched it") || !hasBug(o, "rank 1 returned before its recv") {
			t.Errorf("not reported: %s", o)
		}
	})
	t.Run("deadlock", func(t *testing.T) {
		start := time.Now()
		o := fcRun(3, seed, time.Minute, nil, func(ctx context.Context, c Comm) error {
			if c.Rank() == 0 {
				return nil
			}
			return c.Recv(0, Tag{5, 6}, CopySink{make([]byte, 1)}).Wait(ctx)
		})
		if !hasBug(o, "deadlock") || !hasBug(o, "receive 0->2 step 5 slice 6 was posted but no message matched it") || !errors.Is(o.errs[1], context.Canceled) {
			t.Errorf("not reported: %s", o)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("deadlock seen after %v", d)
		}
	})
	t.Run("length mismatch", func(t *testing.T) {
		for i := range 20 { // both delivery paths
			o := fcRun(2, seed+int64(i), 5*time.Second, nil, func(ctx context.Context, c Comm) error {
				if c.Rank() == 0 {
					return c.Send(1, Tag{}, make([]byte, 5)).Wait(ctx)
				}
				return c.Recv(0, Tag{}, CopySink{make([]byte, 4)}).Wait(ctx)
			})
			if err := o.errs[1]; err == nil || !strings.Contains(err.Error(), "has 5 bytes, the receive expects 4") {
				t.Fatalf("rank 1 got %v", err)
			}
		}
	})
	t.Run("send to a rank outside the group", func(t *testing.T) {
		o := fcRun(2, seed, 5*time.Second, nil, func(ctx context.Context, c Comm) error {
			return c.Send(c.Rank(), Tag{}, nil).Wait(ctx)
		})
		if o.errs[0] == nil || !hasBug(o, "no such peer") {
			t.Errorf("not reported: %s", o)
		}
	})
	t.Run("panic", func(t *testing.T) {
		o := fcRun(2, seed, 5*time.Second, nil, func(ctx context.Context, c Comm) error {
			if c.Rank() == 1 {
				var s []byte
				_ = s[3]
			}
			return nil
		})
		if o.errs[1] == nil || !hasBug(o, "rank 1 panicked") {
			t.Errorf("not reported: %s", o)
		}
	})
	t.Run("sender writes before its send completed", func(t *testing.T) {
		f := newFcFabric(2, seed)
		data := []byte{1, 2, 3}
		m := &fcMsg{key: fcKey{0, 1, Tag{}}, data: data, snap: bytes.Clone(data), mode: fcInline, sent: f.newReq("send")}
		data[1] = 7
		f.arrive(m)
		if len(f.bugs) != 1 || !strings.Contains(f.bugs[0], "the sender wrote into the buffer of 0->1") {
			t.Errorf("not reported: %q", f.bugs)
		}
	})
	t.Run("cancelled wait", func(t *testing.T) {
		f := newFcFabric(2, seed)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if err := (&fcComm{f, 1}).Recv(0, Tag{}, CopySink{}).Wait(cctx); !errors.Is(err, context.Canceled) {
			t.Errorf("Wait on a cancelled context returned %v", err)
		}
	})
	t.Run("every delivery path", func(t *testing.T) {
		for _, mode := range []fcMode{fcEager, fcInline, fcRef} {
			for _, recvFirst := range []bool{true, false} {
				for _, size := range []int{0, 1, 100, 3*fcScratchBytes + 17} {
					f := newFcFabric(2, seed)
					f.pLate = 0
					f.modes = [3]float64{}
					f.modes[mode] = 1
					fills, takes, refs := fcFills.Load(), fcTakes.Load(), fcRefTakes.Load()
					c0, c1 := &fcComm{f, 0}, &fcComm{f, 1}
					want := fcRandBytes(rand.New(rand.NewSource(seed)), size)
					got := make([]byte, size)
					var recv, send Request
					if recvFirst {
						recv = c1.Recv(0, Tag{1, 2}, CopySink{got})
						send = c0.Send(1, Tag{1, 2}, want)
					} else {
						send = c0.Send(1, Tag{1, 2}, want)
						if mode != fcEager && send.(*fcReq).isDone() == (mode == fcRef) {
							t.Errorf("mode %d: an early send completed=%v before its receive was posted", mode, mode != fcRef)
						}
						recv = c1.Recv(0, Tag{1, 2}, CopySink{got})
					}
					if err := waitAll(ctx, []Request{send, recv}); err != nil {
						t.Fatal(err)
					}
					f.busy.Wait()
					if !bytes.Equal(got, want) {
						t.Errorf("mode %d, recvFirst=%v, %d bytes: payload corrupted", mode, recvFirst, size)
					}
					switch {
					case mode == fcRef && fcRefTakes.Load() == refs,
						mode != fcRef && recvFirst && fcFills.Load() == fills,
						!recvFirst && fcTakes.Load() == takes:
						t.Errorf("mode %d, recvFirst=%v, %d bytes: the expected delivery path was not taken", mode, recvFirst, size)
					}
				}
			}
		}
	})
}
