package pg

import (
	"testing"
	"time"

	"github.com/gocomm/gocomm/transport"
	"github.com/gocomm/gocomm/wire"
)

// TestCloseWaitsForDestroyGroup: the session closes (its client died) while DestroyGroup
// waits for the group's device op. Close did not see that group (DestroyGroup had taken it
// out) and unmapped the ring, into which the group's completion and stream release then
// wrote (a SIGSEGV of the sidecar). Close now waits for DestroyGroup to finish first.
func TestCloseWaitsForDestroyGroup(t *testing.T) {
	eng := &fakeEngine{hang: true}
	var sessions []*Session
	var groups []*Group
	var blobs [][]byte
	for r := 0; r < 2; r++ {
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
		if _, err := sess.AttachDevice([16]byte{byte(r)}); err != nil {
			t.Fatal(err)
		}
		g, blob, err := sess.CreateGroup("g", r, 2, nil, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		sessions, groups, blobs = append(sessions, sess), append(groups, g), append(blobs, blob)
	}
	for r := 0; r < 2; r++ {
		if _, err := sessions[r].ConnectGroup(groups[r].Handle, blobs, []byte("0123456789abcdef0123456789abcdef")); err != nil {
			t.Fatal(err)
		}
	}
	c := attachClient(t, sessions[0])
	seg := uint32(wire.CUDASegment | 1)
	c.registerIPC(seg, 1<<20)
	c.submit(cudaAllReduce(groups[0], seg, 1000, 1)) // never finishes on the fake GPU
	time.Sleep(200 * time.Millisecond)
	destroyed := make(chan error, 1)
	go func() { destroyed <- sessions[0].DestroyGroup(groups[0].Handle) }()
	time.Sleep(200 * time.Millisecond)
	sessions[0].Gone("the training process died")
	select {
	case err := <-destroyed:
		if err != nil {
			t.Fatalf("DestroyGroup: %v", err)
		}
	default:
		t.Fatal("the session closed while DestroyGroup still ran")
	}
}

// TestCloseDropsCompletionsNobodyReads: a client that stopped reading completions (it died)
// with ops queued on a group: the session's Close took a second per queued op, each
// completion waiting for room in the full ring. Once closed, a completion tries once.
func TestCloseDropsCompletionsNobodyReads(t *testing.T) {
	clients, groups := cluster(t, 2, time.Minute)
	c, g := clients[0], groups[0]
	seg, _ := c.segment(4096)
	ar := wire.Desc{Group: g.Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Count: 4,
		Bufs: []wire.BufRef{{Segment: seg, Offset: 0, Length: 16}}}
	const queued = 8
	for i := 0; i < queued; i++ {
		c.submit(ar) // rank 1 never calls: the first waits, the rest queue
	}
	bad := wire.Desc{Group: 9999, Kind: wire.OpBarrier} // refused at once: fills the completion ring
	for i := 0; i < 2000; i++ {
		c.submit(bad)
		if !c.sess.cons.Empty() && i > 1000 { // the sidecar stopped taking records: its completions are stuck
			break
		}
	}
	time.Sleep(200 * time.Millisecond)
	start := time.Now()
	c.sess.Gone("client died")
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("Close with %d queued ops and a full completion ring took %v", queued, took)
	}
}
