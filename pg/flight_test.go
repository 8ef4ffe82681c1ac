package pg

import (
	"testing"
	"time"

	"github.com/gocomm/gocomm/wire"
)

// TestFlightRing: the recorder keeps the last size ops, oldest first; collectives are
// numbered in submission order whatever their engine, send/recv not; progress counts the
// collectives started and finished.
func TestFlightRing(t *testing.T) {
	f := newFlight(3)
	ar := wire.Desc{Kind: wire.OpAllReduce, DType: wire.Float32, RedOp: wire.Sum, Count: 4, Bufs: []wire.BufRef{{Length: 16}}}
	send := wire.Desc{Kind: wire.OpSend, DType: wire.Float32, Root: 1, Tag: 7, Count: 4}
	var es []*FlightEntry
	for i, d := range []wire.Desc{ar, send, ar, ar, send} {
		d.Seq = uint64(i + 1)
		es = append(es, f.record(&d, "host", time.Second))
	}
	got := f.entries()
	if len(got) != 3 || got[0].ID != 3 || got[2].ID != 5 {
		t.Fatalf("ring holds %+v, want ops 3, 4, 5", got)
	}
	if es[0].Seq != 0 || es[1].Seq != -1 || es[2].Seq != 1 || es[3].Seq != 2 || es[4].Seq != -1 {
		t.Fatalf("seqs %d %d %d %d %d, want 0 -1 1 2 -1", es[0].Seq, es[1].Seq, es[2].Seq, es[3].Seq, es[4].Seq)
	}
	if es[1].P2PSeq != 0 || es[4].P2PSeq != 1 || es[0].P2PSeq != -1 || f.enqueued() != 3 {
		t.Fatalf("p2p seqs %d %d %d, %d collectives enqueued; want 0 1 -1, 3", es[1].P2PSeq, es[4].P2PSeq, es[0].P2PSeq, f.enqueued())
	}
	if es[1].Peer != 1 || es[1].Tag != 7 || es[0].RedOp != "sum" || es[0].Bytes[0] != 16 {
		t.Fatalf("entries %+v %+v", *es[0], *es[1])
	}
	f.start(es[0])
	f.end(es[0], wire.StatusOK, "")
	f.start(es[2])
	if got := f.entries()[0]; got.Launched != nil {
		t.Fatalf("an op not launched shows a launch time: %+v", got)
	}
	f.launched(es[2])
	if got := f.entries()[0]; got.Launched == nil || got.Launched.Before(*got.Start) || got.State != "started" {
		t.Fatalf("a launched op shows %+v, want a launch time after its start", got)
	}
	f.end(es[1], wire.StatusOK, "") // a send: no collective progress
	if s, d := f.progress(); s != 2 || d != 1 {
		t.Fatalf("progress %d, %d; want 2 started, 1 finished", s, d)
	}
	f.end(es[2], wire.StatusTimeout, "timed out")
	if got := f.entries()[0]; got.State != "timed out" || got.End == nil || got.Error != "timed out" {
		t.Fatalf("a timed-out op shows %+v", got)
	}
	if s, d := f.progress(); s != 2 || d != 2 {
		t.Fatalf("progress %d, %d; want 2, 2", s, d)
	}
	off := newFlight(0)
	off.end(off.record(&ar, "host", 0), wire.StatusOK, "")
	if s, d := off.progress(); len(off.entries()) != 0 || s != 1 || d != 1 {
		t.Fatalf("a recorder of size 0 keeps %d entries, progress %d, %d; want none, 1, 1", len(off.entries()), s, d)
	}
}
