package device

import (
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/internal/nccl"
	"github.com/gocomm/gocomm/shm"
	"github.com/gocomm/gocomm/wire"
)

// TestNCCLTypes: which reductions run on CUDA tensors, and how they map to NCCL.
func TestNCCLTypes(t *testing.T) {
	for _, tc := range []struct {
		desc  string
		dt    wire.DType
		op    wire.RedOp
		ok    bool
		t     nccl.DataType
		r     nccl.RedOp
		scale int
	}{
		{"float32 sum", wire.Float32, wire.Sum, true, nccl.Float32, nccl.Sum, 1},
		{"bfloat16 avg", wire.BFloat16, wire.Avg, true, nccl.BFloat16, nccl.Avg, 1},
		{"fp8 e4m3 max", wire.Float8E4M3FN, wire.Max, true, nccl.Float8E4M3, nccl.Max, 1},
		{"bool sum is or (max of 0/1)", wire.Bool, wire.Sum, true, nccl.Uint8, nccl.Max, 1},
		{"bool product is and (min of 0/1)", wire.Bool, wire.Product, true, nccl.Uint8, nccl.Min, 1},
		{"complex64 sum as float pairs", wire.Complex64, wire.Sum, true, nccl.Float32, nccl.Sum, 2},
		{"complex128 avg", wire.Complex128, wire.Avg, true, nccl.Float64, nccl.Avg, 2},
		{"complex product", wire.Complex64, wire.Product, false, 0, 0, 0},
		{"int16 (no NCCL type)", wire.Int16, wire.Sum, false, 0, 0, 0},
		{"bitwise and", wire.Int32, wire.BAnd, false, 0, 0, 0},
		{"bool avg", wire.Bool, wire.Avg, false, 0, 0, 0},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			typ, r, k, err := ncclType(tc.dt, tc.op)
			if !tc.ok {
				if !errors.Is(err, reduce.ErrUnsupported) {
					t.Fatalf("ncclType = %v, want ErrUnsupported", err)
				}
				return
			}
			if err != nil || typ != tc.t || r != tc.r || k != tc.scale {
				t.Fatalf("ncclType = %v %v %d %v, want %v %v %d", typ, r, k, err, tc.t, tc.r, tc.scale)
			}
		})
	}
}

// TestNoDriver: without a driver the engine says why and refuses to attach, never crashes.
func TestNoDriver(t *testing.T) {
	e := New(slog.New(slog.NewTextHandler(io.Discard, nil)))
	ok, why, _ := e.Info()
	if ok {
		t.Skip("a CUDA driver is present here")
	}
	if why == "" {
		t.Fatal("no reason given for the missing GPU engine")
	}
	if _, err := e.Attach([16]byte{}, t.TempDir(), nil); err == nil {
		t.Fatal("Attach without a driver succeeded")
	}
}

// The NVSHMEM kernels are one architecture's cubin: auto must not pick NVSHMEM on a node with
// any GPU of another (the module would fail to load at the first all_to_all_v).
func TestArchMatches(t *testing.T) {
	if err := archMatches([]int{90, 90, 90, 90}, 90); err != nil {
		t.Errorf("four H200s: %v", err)
	}
	if err := archMatches(nil, 90); err != nil {
		t.Errorf("no devices: %v", err)
	}
	for _, arch := range [][]int{{80, 80}, {100}, {90, 100}} {
		err := archMatches(arch, 90)
		if err == nil || !strings.Contains(err.Error(), "sm_90") {
			t.Errorf("%v: %v, want an error naming sm_90", arch, err)
		}
	}
}

func TestEqualBlocks(t *testing.T) {
	for _, c := range []struct {
		splits []int64
		size   int
		m      int
		ok     bool
	}{
		{[]int64{4, 4, 4, 4}, 2, 4, true},
		{[]int64{0, 0}, 1, 0, true},
		{[]int64{4, 4, 4, 5}, 2, 0, false},
		{[]int64{3, 4, 4, 4}, 2, 0, false},
		{[]int64{4, 4, 4}, 2, 0, false},
		{nil, 0, 0, false},
	} {
		m, ok := equalBlocks(c.splits, c.size)
		if m != c.m || ok != c.ok {
			t.Errorf("equalBlocks(%v, %d) = %d, %v; want %d, %v", c.splits, c.size, m, ok, c.m, c.ok)
		}
	}
	if !overlap(100, 150, 64) || overlap(100, 164, 64) || overlap(100, 100, 0) {
		t.Error("overlap misjudges byte ranges")
	}
}

// TestTurns: ops enqueue their GPU work in ticket order (group design 9), whichever worker
// reaches its turn first, and a broken group releases every waiter.
func TestTurns(t *testing.T) {
	g := &group{}
	g.cond = sync.NewCond(&g.mu)
	const n = 8
	ops := make([]*dop, n)
	for i := range ops {
		ops[i] = &dop{ticket: uint64(i + 1)}
	}
	var mu sync.Mutex
	var order []uint64
	var wg sync.WaitGroup
	for i := n - 1; i >= 0; i-- { // the last ticket asks first
		wg.Add(1)
		go func(o *dop) {
			defer wg.Done()
			if err := g.awaitTurn(o); err != nil {
				t.Errorf("ticket %d: %v", o.ticket, err)
				return
			}
			mu.Lock()
			order = append(order, o.ticket)
			mu.Unlock()
			g.turnDone(o)
		}(ops[i])
		time.Sleep(time.Millisecond)
	}
	wg.Wait()
	for i, tk := range order {
		if tk != uint64(i+1) {
			t.Fatalf("enqueue order %v, want 1..%d", order, n)
		}
	}
	if err := g.awaitTurn(&dop{}); err != nil { // no ticket: no wait
		t.Fatal(err)
	}
	// a waiter whose predecessor never comes is released by the group breaking
	errc := make(chan error, 1)
	go func() { errc <- g.awaitTurn(&dop{ticket: n + 2}) }()
	time.Sleep(time.Millisecond)
	g.mu.Lock()
	g.broken = errors.New("peer lost")
	g.cond.Broadcast()
	g.mu.Unlock()
	select {
	case err := <-errc:
		if err == nil || err.Error() != "peer lost" {
			t.Fatalf("released with %v, want the group's error", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a broken group left a waiter waiting")
	}
}

// TestReleaseStoresInPlace: a release is a CPU store into the shared counter file, seen
// through another mapping of it (the client's), after the session's hook ran; nothing else in
// the slot's neighbourhood changes.
func TestReleaseStoresInPlace(t *testing.T) {
	mem, err := shm.Create(t.TempDir(), "counters", gpu.CounterMemBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	peer, err := shm.Open(mem.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	word := func(off int) uint32 { return binary.LittleEndian.Uint32(peer.Data[off:]) }
	var hooked []int
	s := &session{counterMem: mem, released: func(slot int) {
		if word(16*slot) != 0 {
			t.Errorf("slot %d written before its hook ran", slot)
		}
		hooked = append(hooked, slot)
	}}
	high := uint32(1<<32 - 3) // wraps past 2^32 when released
	if err := s.Release(7, [2]uint32{5, high}); err != nil {
		t.Fatal(err)
	}
	want := []uint32{5 + gpu.ReleaseAhead, 5 + gpu.ReleaseAhead, high + gpu.ReleaseAhead, high + gpu.ReleaseAhead}
	for i, w := range want {
		if got := word(16*7 + 4*i); got != w {
			t.Errorf("slot 7 word %d = %d, want %d", i, got, w)
		}
	}
	for _, off := range []int{16 * 6, 16*6 + 12, 16 * 8} {
		if got := word(off); got != 0 {
			t.Errorf("word at %d = %d, want 0 (another slot)", off, got)
		}
	}
	if len(hooked) != 1 || hooked[0] != 7 {
		t.Errorf("hook calls %v, want [7]", hooked)
	}
	if err := s.Release(gpu.CounterSlots, [2]uint32{}); err == nil {
		t.Error("a slot out of range was released")
	}
	if err := s.ReleaseTriggers([]uint32{0, gpu.TriggerSlots - 1}); err != nil {
		t.Fatal(err)
	}
	if word(gpu.TriggerOffset) != 1 || word(gpu.TriggerOffset+4*(gpu.TriggerSlots-1)) != 1 || word(gpu.TriggerOffset+4) != 0 {
		t.Error("ReleaseTriggers did not store D[t] = 1 for exactly the triggers named")
	}
	if err := s.ReleaseTriggers([]uint32{gpu.TriggerSlots}); err == nil {
		t.Error("a trigger out of range was released")
	}
}

// TestReadyReached: the CPU's check of a ready counter compares as the stream's
// CU_STREAM_WAIT_VALUE_GEQ wait does, across the wrap at 2^32, at the slot and lane's word.
func TestReadyReached(t *testing.T) {
	for _, tc := range []struct {
		counter, v uint32
		want       bool
	}{
		{5, 5, true}, {6, 5, true}, {4, 5, false}, {0, 0, true},
		{2, 1<<32 - 2, true},                    // the counter wrapped past v
		{1<<32 - 2, 2, false},                   // v wrapped, the counter not yet
		{5 + gpu.ReleaseAhead, 5 + 1<<20, true}, // a release lets every pending value through
	} {
		if got := reached(tc.counter, tc.v); got != tc.want {
			t.Errorf("reached(%d, %d) = %v, want %v", tc.counter, tc.v, got, tc.want)
		}
	}
	mem, err := shm.Create(t.TempDir(), "counters", gpu.CounterMemBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	s := &session{counterMem: mem}
	// slot 3's p2p ready word: the fourth slot's third u32 (gpu.CounterSlots' layout)
	binary.LittleEndian.PutUint32(mem.Data[3*16+2*4:], 9)
	if !s.readyReached(3, laneP2P, 9) || s.readyReached(3, laneP2P, 10) || s.readyReached(3, laneColl, 1) || s.readyReached(4, laneP2P, 1) {
		t.Error("readyReached did not read slot 3's p2p ready word alone")
	}
}
