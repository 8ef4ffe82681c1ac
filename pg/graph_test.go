package pg

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/spin"
	"github.com/gocomm/gocomm/wire"
)

// graphClient is a client with a trigger page (an arena segment) and a CUDA segment.
type graphClient struct {
	*client
	page    []byte
	pageSeg uint32
	pageOff uint64
	dev     *fakeDevSession
}

func newGraphClient(t *testing.T, c *client) *graphClient {
	seg, mem := c.segment(3 * 4 * gpu.TriggerSlots)
	const off = 64 // the client's page is somewhere inside an arena segment
	return &graphClient{client: c, page: mem[off : off+4*gpu.TriggerSlots], pageSeg: seg, pageOff: off,
		dev: c.sess.deviceSession().(*fakeDevSession)}
}

// register sends a wire.RecGraphOp for d under trigger t and returns the completion.
func (c *graphClient) register(t uint32, d wire.Desc) done {
	c.t.Helper()
	c.seq++
	d.Seq = c.seq
	p := make([]byte, wire.GraphOpHeader)
	binary.LittleEndian.PutUint32(p, t)
	binary.LittleEndian.PutUint32(p[4:], c.pageSeg)
	binary.LittleEndian.PutUint64(p[8:], c.pageOff)
	c.raw(wire.RecGraphOp, append(p, d.Encode()...))
	r := c.next(5 * time.Second)
	if r.seq != d.Seq {
		c.t.Fatalf("completion for %d, want %d", r.seq, d.Seq)
	}
	return r
}

func (c *graphClient) dropTrigger(t uint32) {
	c.raw(wire.RecGraphDrop, binary.LittleEndian.AppendUint32(nil, t))
}

func (c *graphClient) word(t uint32) *uint32 { return (*uint32)(unsafe.Pointer(&c.page[4*t])) }

// fire does what a replay's stream does: D[t] = 0, T[t] = 1.
func (c *graphClient) fire(t uint32) {
	c.dev.setD(t, 0)
	atomic.StoreUint32(c.word(t), 1)
}

// replayed waits (bounded) for what a replay's stream waits for, D[t] == 1, and checks that
// the watcher cleared T[t].
func (c *graphClient) replayed(t uint32) error {
	deadline := time.Now().Add(5 * time.Second)
	for c.dev.getD(t) != 1 {
		if time.Now().After(deadline) {
			return fmt.Errorf("trigger %d: D never became 1 (T = %d)", t, atomic.LoadUint32(c.word(t)))
		}
		time.Sleep(100 * time.Microsecond)
	}
	if v := atomic.LoadUint32(c.word(t)); v != 0 {
		return fmt.Errorf("trigger %d: T = %d after the replay, want 0", t, v)
	}
	return nil
}

func graphRuns(g *fakeDevGroup) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return fmt.Sprint(g.graph)
}

// TestGraphOpReplays: a registered op runs on the graph lane once per trigger, eager ops
// between replays keep their own counters, and a dropped trigger is registered again for a
// new op (what a re-captured graph does).
func TestGraphOpReplays(t *testing.T) {
	eng := &fakeEngine{}
	clients, groups := deviceCluster(t, 2, 5*time.Second, eng)
	seg := uint32(wire.CUDASegment | 1)
	gcs := make([]*graphClient, len(clients))
	for r, c := range clients {
		c.registerIPC(seg, 1<<20)
		gcs[r] = newGraphClient(t, c)
		if d := gcs[r].register(3, cudaAllReduce(groups[r], seg, 1000, 0)); d.status != wire.StatusOK {
			t.Fatalf("rank %d: registration: %+v", r, d)
		}
		if d := gcs[r].register(5, cudaAllReduce(groups[r], seg, 10, 0)); d.status != wire.StatusOK {
			t.Fatalf("rank %d: registration: %+v", r, d)
		}
	}
	for i := 0; i < 4; i++ {
		for _, tr := range []uint32{3, 5} {
			for _, c := range gcs {
				c.fire(tr)
			}
			for r, c := range gcs {
				if err := c.replayed(tr); err != nil {
					t.Fatalf("rank %d replay %d: %v", r, i, err)
				}
			}
		}
		for r, c := range clients { // an eager op between replays
			c.submit(cudaAllReduce(groups[r], seg, 100, uint64(i+1)))
		}
		for r, c := range clients {
			if d := c.next(5 * time.Second); d.status != wire.StatusOK {
				t.Fatalf("rank %d eager op %d: %+v", r, i, d)
			}
		}
	}
	for i := range clients {
		if got := graphRuns(eng.group(i)); got != "[3 5 3 5 3 5 3 5]" {
			t.Fatalf("rank %d: graph lane ran %s", i, got)
		}
		if got := eng.group(i).runList(); got != "[1 2 3 4]" {
			t.Fatalf("rank %d: eager ops ran as %s", i, got)
		}
	}
	// a live trigger cannot be registered twice; dropped, it can
	c, g := gcs[0], groups[0]
	if d := c.register(3, cudaAllReduce(g, seg, 8, 0)); d.status != wire.StatusInvalid || !strings.Contains(d.msg, "already live") {
		t.Fatalf("second registration of a live trigger: %+v", d)
	}
	c.dropTrigger(3)
	if d := c.register(3, cudaAllReduce(g, seg, 8, 0)); d.status != wire.StatusOK {
		t.Fatalf("registration after the drop: %+v", d)
	}
	c.fire(3)
	if err := c.replayed(3); err != nil {
		t.Fatal(err)
	}
	// a dropped trigger is not watched: its op does not run
	c.dropTrigger(5)
	c.submit(cudaAllReduce(g, seg, 8, 5)) // the drop is read before this op
	if d := c.next(5 * time.Second); d.status != wire.StatusOK {
		t.Fatalf("eager op: %+v", d)
	}
	runs := graphRuns(eng.group(0))
	c.dev.setD(5, 0)
	atomic.StoreUint32(c.word(5), 1)
	time.Sleep(20 * time.Millisecond)
	if got := graphRuns(eng.group(0)); got != runs || c.dev.getD(5) != 0 {
		t.Fatalf("a dropped trigger fired: runs %s -> %s, D = %d", runs, got, c.dev.getD(5))
	}
}

// TestStaleScanSkipsDroppedOp: a watcher's scan of the list it loaded before a drop (its
// goroutine descheduled meanwhile) neither fires the dropped op nor clears the trigger's word,
// which belongs to the op registered under that trigger since (design 6).
func TestStaleScanSkipsDroppedOp(t *testing.T) {
	tr := newTriggers(nil)
	tr.page = make([]byte, 4*8)
	released := false
	tr.ops[5] = &graphOp{t: 5, g: &Group{log: slog.New(slog.DiscardHandler)}, release: func() { released = true }}
	tr.publish()
	stale := tr.live.Load() // what the descheduled watcher holds
	var rec [4]byte
	binary.LittleEndian.PutUint32(rec[:], 5)
	tr.drop(rec[:])
	if !released {
		t.Fatal("the drop did not unpin the op's buffers")
	}
	atomic.StoreUint32(tr.word(5), 1) // a replay of the graph captured since
	tr.live.Store(stale)
	if n := tr.scan(); n != 0 {
		t.Fatalf("a scan of the stale list fired %d op(s)", n)
	}
	if atomic.LoadUint32(tr.word(5)) != 1 {
		t.Fatal("a scan of the stale list cleared the live op's trigger word")
	}
}

// TestGraphOpRefused: a registration the sidecar cannot keep is answered with the reason
// (the client raises at capture) and watches nothing.
func TestGraphOpRefused(t *testing.T) {
	eng := &fakeEngine{}
	clients, groups := deviceCluster(t, 1, 5*time.Second, eng)
	seg := uint32(wire.CUDASegment | 1)
	clients[0].registerIPC(seg, 1<<20)
	c, g := newGraphClient(t, clients[0]), groups[0]
	send := wire.Desc{Group: g.Handle, Kind: wire.OpSend, DType: wire.Float32, Device: wire.DeviceCUDA, Root: 0, Count: 1,
		Bufs: []wire.BufRef{{Segment: seg, Length: 4}}}
	for _, tc := range []struct {
		desc string
		t    uint32
		d    wire.Desc
		want string
	}{
		{"point to point", 1, send, "only collectives"},
		{"unregistered segment", 1, cudaAllReduce(g, wire.CUDASegment|9, 10, 0), "not registered"},
		{"trigger out of range", gpu.TriggerSlots, cudaAllReduce(g, seg, 10, 0), "out of range"},
		{"bitwise op", 1, func() wire.Desc { d := cudaAllReduce(g, seg, 10, 0); d.RedOp = wire.BXor; return d }(), "bxor"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			if d := c.register(tc.t, tc.d); d.status != wire.StatusInvalid || !strings.Contains(d.msg, tc.want) {
				t.Fatalf("completion %+v, want invalid containing %q", d, tc.want)
			}
		})
	}
	if d := c.register(1, cudaAllReduce(g, seg, 10, 0)); d.status != wire.StatusOK {
		t.Fatalf("registration: %+v", d)
	}
	c.pageOff += 4 // every registration names the session's one page
	if d := c.register(2, cudaAllReduce(g, seg, 10, 0)); d.status != wire.StatusInvalid || !strings.Contains(d.msg, "differs") {
		t.Fatalf("registration with another page: %+v", d)
	}
}

// TestGraphOpFailureReleases: a replay whose op fails lets the replaying stream go on
// (D[t] = 1 by ReleaseTriggers) and breaks the group; later replays on the broken group are
// let through at once, and the next eager op raises.
func TestGraphOpFailureReleases(t *testing.T) {
	eng := &fakeEngine{fail: errors.New("NCCL: unhandled cuda error")}
	clients, groups := deviceCluster(t, 1, 5*time.Second, eng)
	seg := uint32(wire.CUDASegment | 1)
	clients[0].registerIPC(seg, 1<<20)
	c, g := newGraphClient(t, clients[0]), groups[0]
	if d := c.register(7, cudaAllReduce(g, seg, 10, 0)); d.status != wire.StatusOK {
		t.Fatalf("registration: %+v", d)
	}
	for i := 0; i < 3; i++ {
		c.fire(7)
		if err := c.replayed(7); err != nil {
			t.Fatalf("replay %d: %v", i, err)
		}
	}
	if got := fmt.Sprint(c.dev.releasedTriggers()); got != "[7 7 7]" {
		t.Fatalf("released triggers %s, want [7 7 7]", got)
	}
	if got := graphRuns(eng.group(0)); got != "[7]" { // only the first reached the engine
		t.Fatalf("graph lane ran %s", got)
	}
	if err := g.Broken(); err == nil || !strings.Contains(err.Error(), "unhandled cuda error") {
		t.Fatalf("group after the failed replay: %v", err)
	}
	c.submit(cudaAllReduce(g, seg, 10, 1))
	if d := c.next(5 * time.Second); d.status == wire.StatusOK || !strings.Contains(d.msg, "unhandled cuda error") {
		t.Fatalf("eager op on the broken group: %+v", d)
	}
	// a destroyed group's triggers are let through too
	if err := c.sess.DestroyGroup(g.Handle); err != nil {
		t.Fatal(err)
	}
	c.fire(7)
	if err := c.replayed(7); err != nil {
		t.Fatalf("replay after the group was destroyed: %v", err)
	}
}

// TestWatcherBackoff: the watcher's sleeps double from 1 us up to the cap.
func TestWatcherBackoff(t *testing.T) {
	var got []time.Duration
	s := time.Duration(0)
	for i := 0; i < 9; i++ {
		s = nextSleep(s)
		got = append(got, s)
	}
	want := "[1µs 2µs 4µs 8µs 16µs 32µs 50µs 50µs 50µs]"
	if fmt.Sprint(got) != want {
		t.Fatalf("back-off %v, want %s", got, want)
	}
}

// The watcher counts itself a spinner while it polls without sleeping, and out once it
// sleeps or stops, so that the sidecar's spinners together never hold every P.
func TestWatcherCountsItsSpin(t *testing.T) {
	base := spin.Spinning()
	tr := newTriggers(&Session{srv: &Server{cfg: Config{Spin: 100 * time.Millisecond}}})
	tr.stopped.Add(1)
	go tr.watch()
	waitFor := func(want int, within time.Duration) {
		t.Helper()
		end := time.Now().Add(within)
		for spin.Spinning() != want {
			if time.Now().After(end) {
				t.Fatalf("spinners %d, want %d", spin.Spinning(), want)
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitFor(base+1, 50*time.Millisecond) // polling: counted in
	waitFor(base, 2*time.Second)         // past its spin, sleeping: counted out
	tr.running.Add(1)                    // a replay in flight: it polls again
	waitFor(base+1, time.Second)
	close(tr.stop)
	tr.stopped.Wait()
	if n := spin.Spinning(); n != base {
		t.Fatalf("spinners %d after the watcher stopped, want %d", n, base)
	}
}
