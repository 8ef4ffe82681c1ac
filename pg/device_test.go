package pg

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/gpu"
	"github.com/gocomm/gocomm/segment"
	"github.com/gocomm/gocomm/transport"
	"github.com/gocomm/gocomm/wire"
)

// fakeEngine stands in for the CUDA/NCCL engine: segments are bookkeeping only, and ops
// complete after a moment, or hang until aborted, or fail, as the test asks.
type fakeEngine struct {
	mu      sync.Mutex
	groups  []*fakeDevGroup
	hang    bool     // new groups' ops never finish (until Abort)
	instant bool     // new groups' ops finish inside Enqueue (benchmarks)
	fail    error    // new groups' ops fail with this
	noNew   error    // NewGroup fails with this
	nvshmem error    // LoadNVSHMEM's answer
	loaded  []string // the paths LoadNCCL was given
}

func (e *fakeEngine) Info() (bool, string, []gpu.Device) { return true, "fake", nil }
func (e *fakeEngine) LoadNCCL(path string) error {
	e.mu.Lock()
	e.loaded = append(e.loaded, path)
	e.mu.Unlock()
	return nil
}
func (e *fakeEngine) LoadNVSHMEM() error { return e.nvshmem }
func (e *fakeEngine) NewUniqueID() ([]byte, error) {
	id := make([]byte, 128)
	_, err := rand.Read(id)
	return id, err
}
func (e *fakeEngine) Check(dt wire.DType, op wire.RedOp) error {
	if op >= wire.BAnd {
		return fmt.Errorf("%w: %s on CUDA tensors", reduce.ErrUnsupported, op)
	}
	return nil
}
func (e *fakeEngine) Attach(_ [16]byte, _ string, released func(slot int)) (gpu.Session, error) {
	return &fakeDevSession{e: e, hook: released, segs: map[uint32]uint64{}, d: map[uint32]uint32{}}, nil
}

type fakeDevSession struct {
	e        *fakeEngine
	hook     func(slot int) // Attach's: called before each release, as the engine does
	mu       sync.Mutex
	segs     map[uint32]uint64
	vmm      map[uint32][]string // RegisterVMM: what each chunk's fd named (/proc/self/fd) when it was called
	released []int               // slots, in the order Release was called
	floors   [][2]uint32         // and the floors they were released from
	d        map[uint32]uint32   // graph trigger words D[t] (gpu.TriggerOffset)
	relTrig  []uint32            // triggers, in the order ReleaseTriggers released them
}

func (s *fakeDevSession) ReleaseTriggers(ts []uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range ts {
		s.d[t] = 1
		s.relTrig = append(s.relTrig, t)
	}
	return nil
}

// setD stands for the replaying stream's write of D[t].
func (s *fakeDevSession) setD(t, v uint32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.d[t] = v
}

func (s *fakeDevSession) getD(t uint32) uint32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.d[t]
}

func (s *fakeDevSession) releasedTriggers() []uint32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]uint32(nil), s.relTrig...)
}

func (s *fakeDevSession) Release(slot int, floor [2]uint32) error {
	if s.hook != nil {
		s.hook(slot)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.released = append(s.released, slot)
	s.floors = append(s.floors, floor)
	return nil
}

func (s *fakeDevSession) releasedFloors() [][2]uint32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][2]uint32(nil), s.floors...)
}

func (s *fakeDevSession) releasedSlots() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int(nil), s.released...)
}

func (s *fakeDevSession) CountersPath() string { return "/dev/shm/fake-counters" }
func (s *fakeDevSession) RegisterIPC(seg uint32, _ [64]byte, size uint64) error {
	if size == 7 {
		return errors.New("cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.segs[seg] = size
	return nil
}

// RegisterVMM records the file each fd names; a chunk of 7 x 2 MiB stands for one the driver
// refuses.
func (s *fakeDevSession) RegisterVMM(seg uint32, fds []int, sizes []uint64) error {
	var total uint64
	names := make([]string, len(fds))
	for i, fd := range fds {
		if sizes[i] == 7<<21 {
			return errors.New("cuMemMap: CUDA_ERROR_INVALID_VALUE")
		}
		total += sizes[i]
		names[i], _ = os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.segs[seg]; dup {
		return fmt.Errorf("%w: CUDA segment %d registered twice", wire.ErrInvalid, seg)
	}
	s.segs[seg] = total
	if s.vmm == nil {
		s.vmm = map[uint32][]string{}
	}
	s.vmm[seg] = names
	return nil
}
func (s *fakeDevSession) DropIPC(seg uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.segs, seg)
	return nil
}
func (s *fakeDevSession) Segments() segment.Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return segment.Stats{Live: len(s.segs), Mapped: len(s.segs)}
}
func (s *fakeDevSession) Resolve(refs []wire.BufRef) ([]uint64, func(), error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ptrs := make([]uint64, len(refs))
	for i, r := range refs {
		size, ok := s.segs[r.Segment]
		if !ok {
			return nil, nil, fmt.Errorf("%w: CUDA segment %#x is not registered", wire.ErrInvalid, r.Segment)
		}
		if r.Offset+r.Length > size {
			return nil, nil, fmt.Errorf("%w: outside CUDA segment", wire.ErrInvalid)
		}
		ptrs[i] = 0x1000 + r.Offset
	}
	return ptrs, func() {}, nil
}

// NewGroup exchanges a random id from rank 0 over link, as the real engine does for its
// communicators; the group's ops complete only once it arrived.
func (s *fakeDevSession) NewGroup(rank, size, slot int, base [2]uint32, link gpu.PeerLink) (gpu.Group, error) {
	s.e.mu.Lock()
	defer s.e.mu.Unlock()
	if s.e.noNew != nil {
		return nil, s.e.noNew
	}
	g := &fakeDevGroup{s: s, hang: s.e.hang, fail: s.e.fail, slot: slot, base: base, joined: make(chan struct{})}
	go func() {
		defer close(g.joined)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if rank == 0 {
			g.id = make([]byte, 128)
			rand.Read(g.id)
			for p := 1; p < size; p++ {
				if err := link.Send(ctx, p, 0, g.id); err != nil {
					g.idErr = err
				}
			}
			return
		}
		g.id, g.idErr = link.Recv(ctx, 0, 0, 128)
	}()
	s.e.groups = append(s.e.groups, g)
	return g, nil
}
func (s *fakeDevSession) Close() error { return nil }

type fakeDevGroup struct {
	s       *fakeDevSession
	mu      sync.Mutex
	hang    bool
	fail    error
	slot    int
	base    [2]uint32 // where the slot's counters stood (NewGroup)
	pending []gpu.Op
	broken  error
	ran     []uint32 // stream values, in the order ops ran
	graph   []uint32 // triggers of graph ops, in the order they ran
	joined  chan struct{}
	id      []byte // rank 0's, over the gpu.PeerLink
	idErr   error
	shmemID []byte // what ShmemID was handed
}

func (g *fakeDevGroup) Enqueue(op gpu.Op) {
	g.mu.Lock()
	if g.broken != nil {
		err := g.broken
		g.mu.Unlock()
		op.Done(err)
		return
	}
	if op.Graph {
		g.graph = append(g.graph, op.Trigger)
		done := op.Done
		op.Done = func(err error) {
			if err == nil { // the graph lane's stream writes D[t] = 1 after the op
				g.s.setD(op.Trigger, 1)
			}
			done(err)
		}
	} else {
		g.ran = append(g.ran, op.Desc.StreamValue)
	}
	if g.hang {
		g.pending = append(g.pending, op)
		g.mu.Unlock()
		return
	}
	if g.s.e.instant {
		g.mu.Unlock()
		op.Done(nil)
		return
	}
	fail := g.fail
	g.mu.Unlock()
	go func() {
		<-g.joined
		time.Sleep(time.Millisecond)
		op.Done(cmp.Or(fail, g.idErr))
	}()
}

func (g *fakeDevGroup) Abort(cause error) {
	g.mu.Lock()
	if g.broken != nil {
		g.mu.Unlock()
		return
	}
	g.broken = cause
	pending := g.pending
	g.pending = nil
	g.mu.Unlock()
	for _, op := range pending {
		op.Done(cause)
	}
}

func (g *fakeDevGroup) Close() error { return nil }

// ShmemID: rank 0 (empty id) gets "new", the others have theirs kept.
func (g *fakeDevGroup) ShmemID(id []byte) ([]byte, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(id) == 0 {
		id = []byte("new")
	}
	g.shmemID = id
	return id, nil
}

func (e *fakeEngine) group(i int) *fakeDevGroup {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.groups[i]
}

func (g *fakeDevGroup) runList() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return fmt.Sprint(g.ran)
}

func (g *fakeDevGroup) isBroken() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.broken != nil
}

// deviceCluster is cluster() with a fake GPU engine per sidecar and every client attached
// to its device.
func deviceCluster(t *testing.T, n int, timeout time.Duration, eng *fakeEngine) ([]*client, []*Group) {
	t.Helper()
	clients := make([]*client, n)
	groups := make([]*Group, n)
	blobs := make([][]byte, n)
	for r := 0; r < n; r++ {
		node, err := transport.Listen(transport.Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quietLog()})
		if err != nil {
			t.Fatal(err)
		}
		srv := NewServer(Config{Version: "test", ShmDir: t.TempDir(), Device: eng}, node, quietLog())
		t.Cleanup(func() { srv.Shutdown("test over"); node.Close() })
		sess, err := srv.Attach(1, r, 64<<10, "/fake/libnccl.so.2")
		if err != nil {
			t.Fatal(err)
		}
		c := attachClient(t, sess)
		if p, err := sess.AttachDevice([16]byte{byte(r)}); err != nil || p != "/dev/shm/fake-counters" {
			t.Fatalf("AttachDevice = %q, %v", p, err)
		}
		g, blob, err := sess.CreateGroup("g", r, n, nil, timeout)
		if err != nil {
			t.Fatal(err)
		}
		clients[r], groups[r], blobs[r] = c, g, blob
	}
	for r := 0; r < n; r++ {
		if _, err := clients[r].sess.ConnectGroup(groups[r].Handle, blobs, []byte("0123456789abcdef0123456789abcdef")); err != nil {
			t.Fatal(err)
		}
	}
	return clients, groups
}

// registerIPC sends a wire.RecIPC record for segment seg of size bytes.
func (c *client) registerIPC(seg uint32, size uint64) {
	b := make([]byte, 80)
	binary.LittleEndian.PutUint32(b, seg)
	binary.LittleEndian.PutUint64(b[8:], size)
	c.raw(wire.RecIPC, b)
}

// dropIPC sends a wire.RecIPCDrop record for segment seg.
func (c *client) dropIPC(seg uint32) {
	b := make([]byte, 4)
	binary.LittleEndian.PutUint32(b, seg)
	c.raw(wire.RecIPCDrop, b)
}

func cudaAllReduce(g *Group, seg uint32, count, value uint64) wire.Desc {
	return wire.Desc{Group: g.Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Device: wire.DeviceCUDA,
		Count: count, StreamValue: uint32(value), Bufs: []wire.BufRef{{Segment: seg, Length: count * 4}}}
}

// TestDeviceOps: CUDA descriptors reach the device engine in order, with their stream
// values, and complete; bad ones are refused with the reason.
func TestDeviceOps(t *testing.T) {
	eng := &fakeEngine{}
	clients, groups := deviceCluster(t, 2, 5*time.Second, eng)
	seg := uint32(wire.CUDASegment | 1)
	for r := range clients {
		clients[r].registerIPC(seg, 1<<20)
	}
	for k := uint64(1); k <= 5; k++ {
		for r := range clients {
			clients[r].submit(cudaAllReduce(groups[r], seg, 1000, k))
		}
		for r := range clients {
			if d := clients[r].next(5 * time.Second); d.status != wire.StatusOK {
				t.Fatalf("rank %d op %d: %+v", r, k, d)
			}
		}
	}
	for i := range clients {
		if got := eng.group(i).runList(); got != "[1 2 3 4 5]" {
			t.Fatalf("device ops ran as %v", got)
		}
	}
	if a, b := eng.group(0).id, eng.group(1).id; len(a) != 128 || !bytes.Equal(a, b) {
		t.Fatalf("the id rank 0 sent over the gpu.PeerLink did not arrive: %x vs %x", a[:8], b[:min(8, len(b))])
	}
	c, g := clients[0], groups[0]
	for _, tc := range []struct {
		desc string
		d    wire.Desc
		want string
	}{
		{"unregistered segment", cudaAllReduce(g, wire.CUDASegment|9, 10, 6), "not registered"},
		{"past the end of the allocation", cudaAllReduce(g, seg, 1<<19, 7), "outside CUDA segment"},
		{"bitwise op", func() wire.Desc { d := cudaAllReduce(g, seg, 10, 8); d.RedOp = wire.BXor; return d }(), "bxor"},
		{"recv from any rank", wire.Desc{Group: g.Handle, Kind: wire.OpRecv, DType: wire.Float32, Device: wire.DeviceCUDA, Root: -1, Count: 1,
			StreamValue: 1, Bufs: []wire.BufRef{{Segment: seg, Length: 4}}}, "any rank"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			c.submit(tc.d)
			if d := c.next(5 * time.Second); d.status != wire.StatusInvalid || !strings.Contains(d.msg, tc.want) {
				t.Fatalf("completion %+v, want invalid containing %q", d, tc.want)
			}
		})
	}
	// a segment the engine could not map: the op names why
	c.registerIPC(wire.CUDASegment|7, 7)
	c.submit(wire.Desc{Group: g.Handle, Kind: wire.OpSend, DType: wire.Uint8, Device: wire.DeviceCUDA, Root: 1, Count: 4,
		StreamValue: 2, Bufs: []wire.BufRef{{Segment: wire.CUDASegment | 7, Length: 4}}})
	if d := c.next(5 * time.Second); d.status != wire.StatusInvalid || !strings.Contains(d.msg, "CUDA_ERROR_INVALID_VALUE") {
		t.Fatalf("op on an unmapped segment: %+v", d)
	}
	// a refused CUDA op breaks the group (the client's counter already counted it)
	if g.Broken() == nil {
		t.Fatal("the group survived a refused CUDA op")
	}
}

// TestStreamValuesChecked: a CUDA op whose stream value repeats or goes back (on either lane),
// or skips a send/recv value, is refused naming it, and breaks the group (the device engine
// never parks it); the ops before it are not refused.
func TestStreamValuesChecked(t *testing.T) {
	seg := uint32(wire.CUDASegment | 1)
	p2p := func(g *Group, value uint32) wire.Desc {
		return wire.Desc{Group: g.Handle, Kind: wire.OpSend, DType: wire.Uint8, Device: wire.DeviceCUDA, Root: 1, Count: 4,
			StreamValue: value, Bufs: []wire.BufRef{{Segment: seg, Length: 4}}}
	}
	for _, tc := range []struct {
		name   string
		good   func(*Group) []wire.Desc
		bad    func(*Group) wire.Desc
		reason string
	}{
		{"repeated collective value", func(g *Group) []wire.Desc { return []wire.Desc{cudaAllReduce(g, seg, 10, 1)} },
			func(g *Group) wire.Desc { return cudaAllReduce(g, seg, 10, 1) }, "not past the group's last, 1"},
		{"collective value gone back", func(g *Group) []wire.Desc {
			return []wire.Desc{cudaAllReduce(g, seg, 10, 1), cudaAllReduce(g, seg, 10, 3)}
		}, func(g *Group) wire.Desc { return cudaAllReduce(g, seg, 10, 2) }, "not past the group's last, 3"},
		{"repeated send value", func(g *Group) []wire.Desc { return []wire.Desc{p2p(g, 1)} },
			func(g *Group) wire.Desc { return p2p(g, 1) }, "not past the group's last, 1"},
		{"skipped send value", func(g *Group) []wire.Desc { return []wire.Desc{p2p(g, 1)} },
			func(g *Group) wire.Desc { return p2p(g, 3) }, "skips send/recv values after 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eng := &fakeEngine{}
			clients, groups := deviceCluster(t, 2, 5*time.Second, eng)
			c, g := clients[0], groups[0]
			c.registerIPC(seg, 1<<20)
			good := tc.good(g)
			for _, d := range good {
				c.submit(d)
			}
			c.submit(tc.bad(g))
			refused := 0 // the ops before it may finish or fail with the break, not be refused
			for range len(good) + 1 {
				if d := c.next(5 * time.Second); d.status == wire.StatusInvalid {
					refused++
					if !strings.Contains(d.msg, tc.reason) {
						t.Fatalf("completion %+v, want invalid containing %q", d, tc.reason)
					}
				}
			}
			if refused != 1 {
				t.Fatalf("%d ops refused, want the bad one", refused)
			}
			if g.Broken() == nil {
				t.Fatal("the group survived")
			}
		})
	}
}

// TestDropAfterOpWaitsForIt: the client drops a segment (torch freed it) right after the
// last op naming it; the op still runs on it (serve resolved the op's segments before it read
// the drop), and the session's counts follow the drops.
func TestDropAfterOpWaitsForIt(t *testing.T) {
	eng := &fakeEngine{}
	clients, groups := deviceCluster(t, 2, 5*time.Second, eng)
	seg := uint32(wire.CUDASegment | 1)
	for r := range clients {
		clients[r].registerIPC(seg, 1<<20)
		clients[r].registerIPC(seg+1, 1<<20)
		clients[r].submit(cudaAllReduce(groups[r], seg, 1000, 1))
		clients[r].dropIPC(seg)
	}
	for r := range clients {
		if d := clients[r].next(5 * time.Second); d.status != wire.StatusOK {
			t.Fatalf("rank %d: op before the drop of its segment: %+v", r, d)
		}
	}
	for r, c := range clients {
		deadline := time.Now().Add(5 * time.Second)
		for c.sess.CUDASegments().Live != 1 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if st := c.sess.CUDASegments(); st.Live != 1 {
			t.Fatalf("rank %d: %+v after one of two segments was dropped", r, st)
		}
	}
	// the dropped segment is gone for later ops
	c, g := clients[0], groups[0]
	c.submit(cudaAllReduce(g, seg, 10, 2))
	if d := c.next(5 * time.Second); d.status != wire.StatusInvalid || !strings.Contains(d.msg, "not registered") {
		t.Fatalf("op on a dropped segment: %+v", d)
	}
}

// TestRefusedFirstCUDAOpReleasesStream: the client's stream waits for the done count of
// every CUDA op it submitted. One refused before the group has a device member (bad
// segment, a descriptor the decoder refuses, a device group that cannot be made) must
// still let the stream past and break the group, or the
// caller's GPU waits forever (seen on the device when the decoder refused all_to_all_v's
// five buffers).
func TestRefusedFirstCUDAOpReleasesStream(t *testing.T) {
	for _, tc := range []struct {
		name  string
		noNew error // the engine cannot make device groups
		send  func(c *client, g *Group)
		want  string
	}{
		{"no device group", errors.New("cuStreamCreate: out of memory"), func(c *client, g *Group) {
			c.registerIPC(wire.CUDASegment|1, 1<<20)
			c.submit(cudaAllReduce(g, wire.CUDASegment|1, 10, 1))
		}, "out of memory"},
		{"unregistered segment", nil, func(c *client, g *Group) { c.submit(cudaAllReduce(g, wire.CUDASegment|9, 10, 1)) }, "not registered"},
		{"undecodable descriptor", nil, func(c *client, g *Group) {
			d := cudaAllReduce(g, wire.CUDASegment|1, 1, 1)
			d.Bufs = make([]wire.BufRef, 9)
			c.seq++
			d.Seq = c.seq
			c.raw(wire.RecOp, d.Encode())
		}, "buffers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clients, groups := deviceCluster(t, 2, 5*time.Second, &fakeEngine{noNew: tc.noNew})
			c, g := clients[0], groups[0]
			tc.send(c, g)
			if d := c.next(5 * time.Second); d.status == wire.StatusOK || !strings.Contains(d.msg, tc.want) {
				t.Fatalf("completion %+v, want invalid containing %q", d, tc.want)
			}
			ds := c.sess.deviceSession().(*fakeDevSession)
			if got := ds.releasedSlots(); len(got) != 1 || got[0] != g.Slot {
				t.Fatalf("released slots %v, want [%d]", got, g.Slot)
			}
			// the client refuses its next op from this mark, which it sees before any stream
			// the release let go runs on
			if m := c.sess.marks.Get(g.Slot); m != g.Handle {
				t.Fatalf("slot %d's mark is %d, want the group's handle %d", g.Slot, m, g.Handle)
			}
			if g.Broken() == nil {
				t.Fatal("the group survived a refused CUDA op")
			}
		})
	}
}

// TestReusedSlotCountsOn: a slot's counters never go back. Destroying a group releases
// its slot from the group's floor (the last stream value per lane, or the base), and the
// next group on the slot starts past what that release wrote on both lanes, so none of its
// stream waits reads an old value as done; the engine's group is told the base.
func TestReusedSlotCountsOn(t *testing.T) {
	eng := &fakeEngine{}
	clients, groups := deviceCluster(t, 2, 5*time.Second, eng)
	seg := uint32(wire.CUDASegment | 1)
	for k := uint64(1); k <= 3; k++ {
		for r := range clients {
			if k == 1 {
				clients[r].registerIPC(seg, 1<<20)
			}
			clients[r].submit(cudaAllReduce(groups[r], seg, 10, k))
		}
		for r := range clients {
			if d := clients[r].next(5 * time.Second); d.status != wire.StatusOK {
				t.Fatalf("rank %d op %d: %+v", r, k, d)
			}
		}
	}
	if b := eng.group(0).base; b != [2]uint32{} {
		t.Fatalf("a fresh slot's group got base %v, want zeros", b)
	}
	blobs := make([][]byte, 2)
	again := make([]*Group, 2)
	for r, c := range clients {
		if err := c.sess.DestroyGroup(groups[r].Handle); err != nil {
			t.Fatal(err)
		}
		g, blob, err := c.sess.CreateGroup("g2", r, 2, nil, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		// released from the floor (3 on the collective lane, the base 0 on the unused
		// p2p lane), then handed on past what that release wrote, on both lanes
		ds := c.sess.deviceSession().(*fakeDevSession)
		if f := ds.releasedFloors(); len(f) != 1 || f[0] != [2]uint32{3, 0} {
			t.Fatalf("rank %d: destroy released from %v, want one release from [3 0]", r, f)
		}
		want := [2]uint32{3 + slotAdvance, 0 + slotAdvance}
		if g.Slot != groups[r].Slot || g.Base != want {
			t.Fatalf("rank %d: the next group got slot %d base %v, want slot %d base %v", r, g.Slot, g.Base, groups[r].Slot, want)
		}
		// the destroy marked the slot with the old group's handle, which the new one's is not
		if m := c.sess.marks.Get(g.Slot); m != groups[r].Handle || m == g.Handle {
			t.Fatalf("rank %d: slot %d's mark is %d, want the destroyed group's %d (the new one is %d)",
				r, g.Slot, m, groups[r].Handle, g.Handle)
		}
		again[r], blobs[r] = g, blob
	}
	// a secret of its own, as every group gets from the shim: under the first group's, a
	// rank that dials before its peer joined is refused there as a group that peer left
	for r, c := range clients {
		if _, err := c.sess.ConnectGroup(again[r].Handle, blobs, []byte("fedcba9876543210fedcba9876543210")); err != nil {
			t.Fatal(err)
		}
	}
	for r, c := range clients {
		c.submit(cudaAllReduce(again[r], seg, 10, uint64(again[r].Base[0])+1))
	}
	for r, c := range clients {
		if d := c.next(5 * time.Second); d.status != wire.StatusOK {
			t.Fatalf("rank %d, first op of the second group: %+v", r, d)
		}
	}
	if b := eng.group(2).base; b != again[0].Base && b != again[1].Base {
		t.Fatalf("the engine's group got base %v, want %v", b, again[0].Base)
	}
}

// TestDeviceFailureBreaksEveryRank: a device op that fails on one rank breaks the group;
// the peer's hung device op is aborted (its streams released) instead of waiting forever.
func TestDeviceFailureBreaksEveryRank(t *testing.T) {
	eng := &fakeEngine{hang: true}
	clients, groups := deviceCluster(t, 2, 20*time.Second, eng)
	seg := uint32(wire.CUDASegment | 1)
	for r := range clients {
		clients[r].registerIPC(seg, 1<<20)
	}
	// rank 1's op hangs on the GPU (its device group is made first, hanging); rank 0's group
	// is made next and fails its op, as the engine's watchdog would report a timeout
	clients[1].submit(cudaAllReduce(groups[1], seg, 100, 1))
	time.Sleep(50 * time.Millisecond)
	eng.mu.Lock()
	eng.hang, eng.fail = false, fmt.Errorf("%w: all_reduce did not finish on the GPU", ErrTimeout)
	eng.mu.Unlock()
	start := time.Now()
	clients[0].submit(cudaAllReduce(groups[0], seg, 100, 1))
	d0 := clients[0].next(5 * time.Second)
	d1 := clients[1].next(5 * time.Second)
	if d0.status != wire.StatusTimeout {
		t.Fatalf("rank 0: %+v, want a timeout", d0)
	}
	if d1.status == wire.StatusOK || !strings.Contains(d1.msg, "rank 0") {
		t.Fatalf("rank 1: %+v, want a failure naming rank 0", d1)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Fatalf("rank 1 failed after %v", el)
	}
	if !eng.group(0).isBroken() {
		t.Fatal("rank 1's device group was not aborted")
	}
}

// The sparse transport is chosen per client at attach: the chooser gets the engine's NVSHMEM
// loader only for a client with NCCL, its answer reaches the session and Info, and its
// error refuses the client.
func TestAttachChoosesSparse(t *testing.T) {
	noLib := errors.New("libnvshmem_host.so.3: not found")
	forced := errors.New("GOCOMM_TRANSPORT=nvshmem, but NVSHMEM cannot run here")
	for _, tc := range []struct {
		name    string
		device  bool
		nccl    string
		lib     error
		want    string
		refused bool
	}{
		{"NVSHMEM loads", true, "/fake/libnccl.so.2", nil, "nvshmem", false},
		{"NVSHMEM missing", true, "/fake/libnccl.so.2", noLib, "nccl", false},
		{"CPU client", true, "", nil, "nccl", false},
		{"no GPU engine", false, "/fake/libnccl.so.2", nil, "nccl", false},
		{"forced where it cannot run", true, "/fake/libnccl.so.2", forced, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node, err := transport.Listen(transport.Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quietLog()})
			if err != nil {
				t.Fatal(err)
			}
			defer node.Close()
			called := false
			cfg := Config{Version: "test", ShmDir: t.TempDir(), Sparse: func(load func() error) (SparseChoice, error) {
				called = true
				err := load()
				switch {
				case errors.Is(err, forced):
					return SparseChoice{}, err
				case err != nil:
					return SparseChoice{Engine: "nccl", Reason: "NVSHMEM cannot run: " + err.Error()}, nil
				}
				return SparseChoice{Engine: "nvshmem", Reason: "all GPUs NVLink-connected"}, nil
			}}
			if tc.device {
				cfg.Device = &fakeEngine{nvshmem: tc.lib}
			}
			srv := NewServer(cfg, node, quietLog())
			defer srv.Shutdown("test over")
			if e := engine(srv, "sparse"); !strings.Contains(e.Detail, "when a client attaches") {
				t.Errorf("before any attach: sparse %q", e.Detail)
			}
			sess, err := srv.Attach(1, 0, 64<<10, tc.nccl)
			if tc.refused {
				if err == nil || !errors.Is(err, forced) {
					t.Fatalf("Attach = %v, want the chooser's error", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer sess.Close("test over")
			if sess.Sparse.Engine != tc.want {
				t.Errorf("session transport %q (%s), want %q", sess.Sparse.Engine, sess.Sparse.Reason, tc.want)
			}
			if wantCalled := tc.device && tc.nccl != ""; called != wantCalled {
				t.Errorf("chooser called %v, want %v", called, wantCalled)
			}
			if e := engine(srv, "sparse"); !strings.HasPrefix(e.Detail, tc.want+": ") {
				t.Errorf("Info sparse %q, want %s", e.Detail, tc.want)
			}
		})
	}
}

func engine(srv *Server, name string) Engine {
	for _, e := range srv.Engines() {
		if e.Name == name {
			return e
		}
	}
	return Engine{}
}

// TestShmemIDReachesTheDeviceGroup: the NVSHMEM unique id a client hands over (carried
// between ranks through the torch Store) reaches its group's device member, which is made
// for it when no CUDA op of the group has run yet, and the group's CUDA ops still run after;
// an unknown group or a session with no device is refused.
func TestShmemIDReachesTheDeviceGroup(t *testing.T) {
	eng := &fakeEngine{}
	clients, groups := deviceCluster(t, 2, 5*time.Second, eng)
	id, err := clients[0].sess.ShmemID(groups[0].Handle, nil)
	if err != nil || string(id) != "new" {
		t.Fatalf("rank 0 ShmemID = %q, %v", id, err)
	}
	if back, err := clients[1].sess.ShmemID(groups[1].Handle, id); err != nil || string(back) != "new" {
		t.Fatalf("rank 1 ShmemID = %q, %v", back, err)
	}
	for i := range groups {
		if got := string(eng.group(i).shmemID); got != "new" {
			t.Fatalf("device group %d holds id %q", i, got)
		}
	}
	seg := uint32(wire.CUDASegment | 1)
	for r := range clients {
		clients[r].registerIPC(seg, 1<<20)
		clients[r].submit(cudaAllReduce(groups[r], seg, 1000, 1))
	}
	for r := range clients {
		if d := clients[r].next(5 * time.Second); d.status != wire.StatusOK {
			t.Fatalf("rank %d's op after ShmemID: %+v", r, d)
		}
	}
	if n := len(eng.groups); n != 2 {
		t.Fatalf("%d device groups, want the 2 ShmemID made", n)
	}
	if _, err := clients[0].sess.ShmemID(9999, nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("ShmemID on an unknown group: %v, want ErrNotFound", err)
	}

	node, err := transport.Listen(transport.Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(Config{Version: "test", ShmDir: t.TempDir()}, node, quietLog())
	t.Cleanup(func() { srv.Shutdown("test over"); node.Close() })
	sess, err := srv.Attach(1, 0, 64<<10, "")
	if err != nil {
		t.Fatal(err)
	}
	g, _, err := sess.CreateGroup("cpu", 0, 1, nil, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sess.ShmemID(g.Handle, nil); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("ShmemID without a device: %v, want ErrNoDevice", err)
	}
}

// TestAttachRefusesUntrustedNCCL: an NCCL path the client names is loaded only if it is a
// private file of root or this user; one writable by others is refused and the loader's
// search taken instead.
func TestAttachRefusesUntrustedNCCL(t *testing.T) {
	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	good := filepath.Join(dir, "libnccl.so.2")
	bad := filepath.Join(dir, "open", "libnccl.so.2")
	os.WriteFile(good, nil, 0o644)
	os.Mkdir(filepath.Dir(bad), 0o755)
	os.WriteFile(bad, nil, 0o644)
	os.Chmod(bad, 0o666)
	for _, tc := range []struct{ named, want string }{{good, good}, {bad, ncclSoname}} {
		eng := &fakeEngine{}
		node, err := transport.Listen(transport.Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quietLog()})
		if err != nil {
			t.Fatal(err)
		}
		srv := NewServer(Config{Version: "test", ShmDir: t.TempDir(), Device: eng}, node, quietLog())
		if _, err := srv.Attach(1, 0, 64<<10, tc.named); err != nil {
			t.Fatal(err)
		}
		srv.Shutdown("test over")
		node.Close()
		if len(eng.loaded) != 1 || eng.loaded[0] != tc.want {
			t.Errorf("client named %s: loaded %v, want %s", tc.named, eng.loaded, tc.want)
		}
	}
}
