package pg

import (
	"os"
	"path/filepath"
	"sync"
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
	clients, groups := deviceCluster(t, 2, time.Minute, &fakeEngine{hang: true})
	c := clients[0]
	seg := uint32(wire.CUDASegment | 1)
	c.registerIPC(seg, 1<<20)
	c.submit(cudaAllReduce(groups[0], seg, 1000, 1)) // never finishes on the fake GPU
	time.Sleep(200 * time.Millisecond)
	destroyed := make(chan error, 1)
	go func() { destroyed <- c.sess.DestroyGroup(groups[0].Handle) }()
	// DestroyGroup has begun (it takes the group out as it counts itself in destroying) and
	// waits for the op that never finishes
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := c.sess.Group(groups[0].Handle); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("DestroyGroup never began")
		}
	}
	time.Sleep(100 * time.Millisecond)
	c.sess.Gone("the training process died") // returns once DestroyGroup is done with the ring
	select {
	case err := <-destroyed:
		if err != nil {
			t.Fatalf("DestroyGroup: %v", err)
		}
	case <-time.After(5 * time.Second): // only the goroutine's send can lag behind Gone
		t.Fatal("DestroyGroup did not return")
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

// TestAllocDuringCloseLeavesNoSegment: segments allocated while their session closes (the
// client's AllocSegment rpc racing its own end) are all unmapped and unlinked: none is added
// after the session emptied its table.
func TestAllocDuringCloseLeavesNoSegment(t *testing.T) {
	dir := t.TempDir()
	node, err := transport.Listen(transport.Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(Config{Version: "test", ShmDir: dir}, node, quietLog())
	defer func() { srv.Shutdown("test over"); node.Close() }()
	for round := range 20 {
		sess, err := srv.Attach(int64(os.Getpid()), 0, 64<<10, "")
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					if _, _, _, err := sess.AllocSegment(4096); err != nil {
						return
					}
				}
			}()
		}
		time.Sleep(time.Duration(round%5) * time.Millisecond)
		sess.Close("test")
		wg.Wait()
		left, _ := filepath.Glob(filepath.Join(dir, "gocomm-seg-*"))
		if len(left) > 0 {
			t.Fatalf("round %d: %d segment files left after the session closed", round, len(left))
		}
	}
}
