package pg

import (
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gocomm/gocomm/ring"
	"github.com/gocomm/gocomm/shm"
	"github.com/gocomm/gocomm/transport"
	"github.com/gocomm/gocomm/wire"
)

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// client is a Go stand-in for the Python shim: it maps the session's ring and segments and
// speaks the descriptor protocol.
type client struct {
	t    *testing.T
	sess *Session
	prod *ring.Producer
	cons *ring.Consumer
	segs map[uint32][]byte
	seq  uint64
}

func newClient(t *testing.T, srv *Server, rank int) *client {
	t.Helper()
	sess, err := srv.Attach(1, rank, 64<<10, "")
	if err != nil {
		t.Fatal(err)
	}
	return attachClient(t, sess)
}

// attachClient maps a session's ring as its client would.
func attachClient(t *testing.T, sess *Session) *client {
	t.Helper()
	mem, err := shm.Open(sess.RingPath())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	sub, cmp, err := ring.Open(mem.Data)
	if err != nil {
		t.Fatal(err)
	}
	return &client{t: t, sess: sess, prod: ring.NewProducer(sub), cons: ring.NewConsumer(cmp), segs: map[uint32][]byte{}}
}

func (c *client) segment(bytes uint64) (uint32, []byte) {
	id, path, _, err := c.sess.AllocSegment(bytes)
	if err != nil {
		c.t.Fatal(err)
	}
	mem, err := shm.Open(path)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { mem.Close() })
	c.segs[id] = mem.Data
	return id, mem.Data
}

func (c *client) submit(d wire.Desc) uint64 {
	c.seq++
	d.Seq = c.seq
	if err := c.prod.Write(time.Now().Add(5*time.Second), time.Microsecond, wire.RecOp, 0, d.Encode()); err != nil {
		c.t.Fatal(err)
	}
	return d.Seq
}

func (c *client) raw(typ uint16, b []byte) {
	if err := c.prod.Write(time.Now().Add(5*time.Second), time.Microsecond, typ, 0, b); err != nil {
		c.t.Fatal(err)
	}
}

type done struct {
	seq    uint64
	status int32
	source int32
	msg    string
}

// decodeDone reads a completion record's payload.
func decodeDone(p []byte) done {
	return done{binary.LittleEndian.Uint64(p), int32(binary.LittleEndian.Uint32(p[8:])),
		int32(binary.LittleEndian.Uint32(p[12:])), string(p[16:])}
}

func (c *client) next(timeout time.Duration) done {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		rec, ok, err := c.cons.Next()
		if err != nil {
			c.t.Fatal(err)
		}
		if !ok {
			c.cons.Wait(0, 50*time.Millisecond)
			continue
		}
		d := decodeDone(rec.Payload)
		c.cons.Release()
		return d
	}
	c.t.Fatalf("no completion within %v", timeout)
	return done{}
}

// cluster starts n servers (sidecars) in this process with one session and one connected
// group each.
func cluster(t *testing.T, n int, timeout time.Duration) ([]*client, []*Group) {
	t.Helper()
	clients := make([]*client, n)
	groups := make([]*Group, n)
	blobs := make([][]byte, n)
	for r := 0; r < n; r++ {
		var srv *Server
		node, err := transport.Listen(transport.Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quietLog(),
			Locate: func(b []byte) (int, uint64, uint64, bool) { return srv.Locate(b) }, ProbeOwnProcess: true})
		if err != nil {
			t.Fatal(err)
		}
		srv = NewServer(Config{Version: "test", ShmDir: t.TempDir(), TraceSize: 16}, node, quietLog())
		t.Cleanup(func() { srv.Shutdown("test over"); node.Close() })
		clients[r] = newClient(t, srv, r)
		g, blob, err := clients[r].sess.CreateGroup("g", r, n, nil, timeout)
		if err != nil {
			t.Fatal(err)
		}
		groups[r], blobs[r] = g, blob
	}
	secret := []byte("0123456789abcdef0123456789abcdef")
	for r := 0; r < n; r++ {
		if _, err := clients[r].sess.ConnectGroup(groups[r].Handle, blobs, secret); err != nil {
			t.Fatal(err)
		}
	}
	return clients, groups
}

func f32s(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

func putF32s(b []byte, v []float32) {
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
}

// TestAllReduceThroughSessions drives two sidecars end to end: descriptors in, completions
// out, data through the segments.
func TestAllReduceThroughSessions(t *testing.T) {
	const n, count = 3, 100_000 // large enough for the ring algorithm
	clients, groups := cluster(t, n, 10*time.Second)
	var wg sync.WaitGroup
	for r := 0; r < n; r++ {
		seg, mem := clients[r].segment(count * 4)
		v := make([]float32, count)
		for i := range v {
			v[i] = float32(r*count + i)
		}
		putF32s(mem, v)
		clients[r].submit(wire.Desc{Group: groups[r].Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Avg,
			Count: count, Bufs: []wire.BufRef{{Segment: seg, Length: count * 4}}})
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			if d := clients[r].next(10 * time.Second); d.status != wire.StatusOK {
				t.Errorf("rank %d: status %d: %s", r, d.status, d.msg)
			}
			got := f32s(mem[:count*4])
			for i, x := range got {
				want := float32(i) + float32(count) // mean over ranks of r*count+i
				if math.Abs(float64(x-want)) > 1e-3*float64(want)+1e-3 {
					t.Errorf("rank %d: element %d = %v, want %v", r, i, x, want)
					return
				}
			}
		}(r)
	}
	wg.Wait()
	for r := 0; r < n; r++ {
		if st := groups[r].Stats(); st.ByRef == 0 || st.ByRef > st.Sent {
			t.Errorf("rank %d: %d of %d bytes sent by reference; same-host sidecars should lend segments", r, st.ByRef, st.Sent)
		}
	}
}

// TestMalformedDescriptors: every bad descriptor gets an error completion and the sidecar
// keeps serving the client.
func TestMalformedDescriptors(t *testing.T) {
	clients, groups := cluster(t, 1, 5*time.Second)
	c, g := clients[0], groups[0]
	seg, _ := c.segment(4096)
	cases := []struct {
		desc string
		send func()
		want string
	}{
		{"garbage bytes", func() { c.raw(wire.RecOp, []byte{9, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3}) }, "header"},
		{"unknown record type", func() { c.raw(99, make([]byte, 8)) }, "record type 99"},
		{"unknown group", func() {
			c.submit(wire.Desc{Group: 999, Kind: wire.OpBarrier})
		}, "group 999"},
		{"buffer outside its segment", func() {
			c.submit(wire.Desc{Group: g.Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Count: 4,
				Bufs: []wire.BufRef{{Segment: seg, Offset: 4090, Length: 16}}})
		}, "outside segment"},
		{"offset overflow", func() {
			c.submit(wire.Desc{Group: g.Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Count: 4,
				Bufs: []wire.BufRef{{Segment: seg, Offset: math.MaxUint64 - 4, Length: 16}}})
		}, "outside segment"},
		{"unknown segment", func() {
			c.submit(wire.Desc{Group: g.Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Count: 1,
				Bufs: []wire.BufRef{{Segment: 77, Length: 4}}})
		}, "segment 77"},
		{"max on complex (host engine)", func() {
			c.submit(wire.Desc{Group: g.Handle, Kind: wire.OpAllReduce, DType: wire.Complex64, RedOp: wire.Max, Count: 1,
				Bufs: []wire.BufRef{{Segment: seg, Length: 8}}})
		}, "complex64"},
		{"cuda op without a device", func() {
			c.submit(wire.Desc{Group: g.Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Device: wire.DeviceCUDA,
				Count: 1, StreamValue: 1, Bufs: []wire.BufRef{{Segment: wire.CUDASegment | 1, Length: 4}}})
		}, "never attached its GPU"},
		{"length that does not match the count", func() {
			c.submit(wire.Desc{Group: g.Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Count: 2,
				Bufs: []wire.BufRef{{Segment: seg, Length: 4}}})
		}, "want 8"},
	}
	for _, tc := range cases {
		t.Run(tc.desc, func(t *testing.T) {
			tc.send()
			d := c.next(5 * time.Second)
			if d.status != wire.StatusInvalid || !strings.Contains(d.msg, tc.want) {
				t.Fatalf("completion %+v, want invalid containing %q", d, tc.want)
			}
		})
	}
	// A refused collective breaks its group on purpose (peers must not wait for it); the
	// sidecar still serves: a new group works.
	g2, blob, err := c.sess.CreateGroup("g2", 0, 1, nil, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.sess.ConnectGroup(g2.Handle, [][]byte{blob}, []byte("another secret of enough bytes!!")); err != nil {
		t.Fatal(err)
	}
	seq := c.submit(wire.Desc{Group: g2.Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Count: 1,
		Bufs: []wire.BufRef{{Segment: seg, Length: 4}}})
	if d := c.next(5 * time.Second); d.seq != seq || d.status != wire.StatusOK {
		t.Fatalf("valid op after bad ones: %+v", d)
	}
}

// TestMismatchFailsEveryRank: ranks calling different collectives all get an error well
// before the timeout.
func TestMismatchFailsEveryRank(t *testing.T) {
	const n = 3
	timeout := 20 * time.Second
	clients, groups := cluster(t, n, timeout)
	start := time.Now()
	for r := 0; r < n; r++ {
		count := uint64(10)
		if r == 1 {
			count = 12
		}
		seg, _ := clients[r].segment(4096)
		clients[r].submit(wire.Desc{Group: groups[r].Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum,
			Count: count, Bufs: []wire.BufRef{{Segment: seg, Length: count * 4}}})
	}
	for r := 0; r < n; r++ {
		d := clients[r].next(timeout)
		if d.status == wire.StatusOK {
			t.Errorf("rank %d: mismatched all_reduce succeeded", r)
		}
		t.Logf("rank %d: status %d: %s", r, d.status, d.msg)
	}
	if el := time.Since(start); el > timeout/2 {
		t.Fatalf("errors took %v", el)
	}
}

// TestTimeout: a collective that a peer never joins fails with a timeout naming the peer,
// and later ops fail at once.
func TestTimeout(t *testing.T) {
	clients, groups := cluster(t, 2, 500*time.Millisecond)
	seg, _ := clients[0].segment(4096)
	clients[0].submit(wire.Desc{Group: groups[0].Handle, Kind: wire.OpBarrier})
	d := clients[0].next(5 * time.Second)
	if d.status != wire.StatusTimeout || !strings.Contains(d.msg, "rank 1") {
		t.Fatalf("completion %+v, want a timeout naming rank 1", d)
	}
	clients[0].submit(wire.Desc{Group: groups[0].Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum,
		Count: 1, Bufs: []wire.BufRef{{Segment: seg, Length: 4}}})
	if d := clients[0].next(time.Second); d.status != wire.StatusBroken {
		t.Fatalf("op after a timeout: %+v, want broken", d)
	}
	if err := groups[0].Broken(); err == nil {
		t.Fatal("group not reported broken")
	}
}

func TestRegistryBounds(t *testing.T) {
	r := newRegistry(t.TempDir())
	id, _, size, err := r.alloc(5000)
	if err != nil {
		t.Fatal(err)
	}
	if size != 8192 {
		t.Fatalf("size %d, want a whole number of pages", size)
	}
	for _, tc := range []struct {
		desc string
		ref  wire.BufRef
		ok   bool
	}{
		{"whole segment", wire.BufRef{Segment: id, Offset: 0, Length: size}, true},
		{"empty at the end", wire.BufRef{Segment: id, Offset: size, Length: 0}, true},
		{"one past the end", wire.BufRef{Segment: id, Offset: 1, Length: size}, false},
		{"offset past the end", wire.BufRef{Segment: id, Offset: size + 1, Length: 0}, false},
		{"wrapping length", wire.BufRef{Segment: id, Offset: 8, Length: math.MaxUint64 - 4}, false},
		{"unknown segment", wire.BufRef{Segment: id + 1, Offset: 0, Length: 1}, false},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			_, release, err := r.resolve([]wire.BufRef{tc.ref})
			if tc.ok != (err == nil) {
				t.Fatalf("resolve = %v, want ok=%v", err, tc.ok)
			}
			if err == nil {
				release()
			} else if !errors.Is(err, wire.ErrInvalid) {
				t.Fatalf("error %v is not wire.ErrInvalid", err)
			}
		})
	}
	// a segment freed while an op holds it stays mapped until the op releases it
	bufs, release, err := r.resolve([]wire.BufRef{{Segment: id, Offset: 0, Length: 8}})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.free(id); err != nil {
		t.Fatal(err)
	}
	bufs[0][0] = 1 // would fault if unmapped
	if _, _, err := r.resolve([]wire.BufRef{{Segment: id, Offset: 0, Length: 8}}); err == nil {
		t.Fatal("resolved a freed segment")
	}
	release()
	if err := r.free(id); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second free = %v", err)
	}
}
