package pg

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/gocomm/gocomm/wire"
)

// TestClientGoneAbortsItsGroups: a session whose client went without Detach (it died)
// aborts its groups, so a peer waiting in a collective fails at once naming the rank (not
// at its 30 s timeout), and the peer's client hears of the break on its watch events.
func TestClientGoneAbortsItsGroups(t *testing.T) {
	clients, groups := cluster(t, 2, 30*time.Second)
	clients[0].submit(wire.Desc{Group: groups[0].Handle, Kind: wire.OpBarrier})
	start := time.Now()
	clients[1].sess.Gone("the training process (pid 7) went away without leaving the group")
	d := clients[0].next(5 * time.Second)
	if (d.status != wire.StatusAborted && d.status != wire.StatusBroken) || !strings.Contains(d.msg, "rank 1") || !strings.Contains(d.msg, "pid 7") {
		t.Fatalf("completion %+v, want an abort naming rank 1 and its process", d)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("the peer failed after %v", el)
	}
	select {
	case e := <-clients[0].sess.Events():
		if e.Kind != "group_broken" || e.Group != groups[0].Handle || !strings.Contains(e.Detail, "rank 1") {
			t.Fatalf("event %+v, want group_broken of the group naming rank 1", e)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("no group_broken event for the client")
	}
}

// TestDetachSaysBye: a client that leaves in order makes its groups say bye: a peer
// waiting for it fails as it left (peer lost, "left the group"), not with an abort.
func TestDetachSaysBye(t *testing.T) {
	clients, groups := cluster(t, 2, 30*time.Second)
	for r := range clients { // the links up first
		clients[r].submit(wire.Desc{Group: groups[r].Handle, Kind: wire.OpBarrier})
	}
	for r := range clients {
		if d := clients[r].next(5 * time.Second); d.status != wire.StatusOK {
			t.Fatalf("rank %d: %+v", r, d)
		}
	}
	clients[0].submit(wire.Desc{Group: groups[0].Handle, Kind: wire.OpBarrier})
	clients[1].sess.Detach("client closed")
	d := clients[0].next(5 * time.Second)
	if d.status != wire.StatusPeerLost || !strings.Contains(d.msg, "rank 1 left the group") {
		t.Fatalf("completion %+v, want rank 1 reported as having left", d)
	}
}

// TestFlightRecordOfATimeout: after an op timed out, the record shows it (seq, state,
// sizes) after the completed ones, and the peer's progress as its heartbeats told.
func TestFlightRecordOfATimeout(t *testing.T) {
	clients, groups := cluster(t, 2, 1500*time.Millisecond)
	segs := make([]uint32, 2)
	for r := range clients {
		segs[r], _ = clients[r].segment(4096)
	}
	ar := func(r int) {
		clients[r].submit(wire.Desc{Group: groups[r].Handle, Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum,
			Count: 16, Bufs: []wire.BufRef{{Segment: segs[r], Length: 64}}})
	}
	for i := 0; i < 2; i++ {
		ar(0)
		ar(1)
		for r := range clients {
			if d := clients[r].next(5 * time.Second); d.status != wire.StatusOK {
				t.Fatalf("rank %d: %+v", r, d)
			}
		}
	}
	time.Sleep(2200 * time.Millisecond) // idle links: rank 1's heartbeats tell its progress
	ar(0)                               // rank 1 never calls it
	if d := clients[0].next(5 * time.Second); d.status != wire.StatusTimeout {
		t.Fatalf("completion %+v, want a timeout", d)
	}
	b, err := json.Marshal(clients[0].sess.srv.FlightRecord("test"))
	if err != nil {
		t.Fatal(err)
	}
	var rec FlightRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		t.Fatal(err)
	}
	if len(rec.Groups) != 1 || len(rec.Groups[0].Ops) != 3 {
		t.Fatalf("record %s, want one group with 3 ops", b)
	}
	g := rec.Groups[0]
	ops := g.Ops
	if ops[0].State != "completed" || ops[1].State != "completed" || ops[2].State != "timed out" ||
		ops[2].Seq != 2 || ops[2].Op != "all_reduce" || ops[2].Bytes[0] != 64 || ops[2].End == nil || g.Broken == "" {
		t.Fatalf("record %s, want two completed all_reduces and seq 2 timed out, the group broken", b)
	}
	// rank 1 finished seq 1 and started nothing after: its heartbeats (each second, with
	// the default 5 s limit) said so
	if len(g.Peers) != 1 || g.Peers[0].Rank != 1 || g.Peers[0].LastStarted != 1 || g.Peers[0].LastFinished != 1 || g.Peers[0].HeardAgo < 0 {
		t.Fatalf("peers %+v, want rank 1 last started and finished seq 1, heard", g.Peers)
	}
}
