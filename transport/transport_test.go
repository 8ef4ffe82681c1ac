package transport

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gocomm/gocomm/wire"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// listen starts n nodes (one per rank, as n sidecars would) and returns them with their addresses.
func listen(t *testing.T, n int) ([]*Node, []string) {
	t.Helper()
	nodes := make([]*Node, n)
	addrs := make([]string, n)
	for r := range nodes {
		node, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quiet(), JoinWait: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { node.Close() })
		nodes[r], addrs[r] = node, node.Addr()
	}
	return nodes, addrs
}

// group joins n nodes to one group.
func group(t *testing.T, n int, secret string) ([]*Node, []*Endpoint) {
	t.Helper()
	nodes, addrs := listen(t, n)
	return nodes, joinAll(t, nodes, addrs, secret)
}

// joinAll joins nodes (rank r at addrs[r]) to one group; the endpoints close at the test's end.
func joinAll(t *testing.T, nodes []*Node, addrs []string, secret string) []*Endpoint {
	t.Helper()
	eps := make([]*Endpoint, len(nodes))
	for r := range nodes {
		ep, err := nodes[r].Join([]byte(secret), r, addrs)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ep.Close)
		eps[r] = ep
	}
	return eps
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

var sigF32 = Signature{Op: 1, DType: wire.Float32, RedOp: wire.Sum, Count: 4, OpName: "all_reduce"}

func TestCollectiveFrames(t *testing.T) {
	_, eps := group(t, 2, "a secret of at least sixteen bytes")
	ctx := ctxT(t)
	a, b := eps[0].Op(0, sigF32), eps[1].Op(0, sigF32)
	// one receive posted before its frame, one after (early path)
	got1 := make([]byte, 16)
	r1 := b.Recv(0, Tag{Step: 0}, copySink{Dst: got1})
	s1 := a.Send(1, Tag{Step: 0}, bytes.Repeat([]byte{1}, 16))
	s2 := a.Send(1, Tag{Step: 1}, bytes.Repeat([]byte{2}, 16))
	for _, r := range []*Request{r1, s1, s2} {
		if err := r.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(50 * time.Millisecond) // let step 1 arrive before its receive
	got2 := make([]byte, 16)
	if err := b.Recv(0, Tag{Step: 1}, copySink{Dst: got2}).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got1, bytes.Repeat([]byte{1}, 16)) || !bytes.Equal(got2, bytes.Repeat([]byte{2}, 16)) {
		t.Fatalf("payloads %v %v", got1, got2)
	}
	if eps[0].BytesSent.Load() != 32 || eps[1].BytesReceived.Load() != 32 {
		t.Fatalf("counters sent %d received %d", eps[0].BytesSent.Load(), eps[1].BytesReceived.Load())
	}
}

func TestSignatureMismatch(t *testing.T) {
	_, eps := group(t, 2, "a secret of at least sixteen bytes")
	ctx := ctxT(t)
	other := sigF32
	other.Count = 5
	eps[0].Op(0, other).Send(1, Tag{}, make([]byte, 20))
	err := eps[1].Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctx)
	if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "count=5") {
		t.Fatalf("Wait = %v, want a mismatch naming count=5", err)
	}
	if eps[1].Broken() == nil {
		t.Fatal("a mismatch must break the group")
	}
}

// TestMovedOn: a peer that skips a collective (sends frames of a later one) fails the
// receive that waits for the skipped one at once, not at timeout (invariant 3).
func TestMovedOn(t *testing.T) {
	_, eps := group(t, 2, "a secret of at least sixteen bytes")
	ctx := ctxT(t)
	r := eps[1].Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)})
	eps[0].Op(1, sigF32).Send(1, Tag{}, make([]byte, 16))
	if err := r.Wait(ctx); !errors.Is(err, ErrMismatch) {
		t.Fatalf("Wait = %v, want ErrMismatch", err)
	}
}

// TestUnreadPart: a rank that finished a collective without taking a peer's part of it (the
// ranks disagree on its root, say) finds the mismatch whether the part arrived before it
// said Done or after, and the group breaks (invariant 9).
func TestUnreadPart(t *testing.T) {
	bcast := Signature{Op: 2, DType: wire.Float32, Count: 4, Root: 1, OpName: "broadcast"}
	ours := bcast
	ours.Root = 0
	t.Run("kept early", func(t *testing.T) {
		_, eps := group(t, 2, "a secret of at least sixteen bytes")
		ctx := ctxT(t)
		// rank 1 thinks it is the root and sends; rank 0 thinks so too and takes nothing
		if err := eps[1].Op(0, bcast).Send(0, Tag{}, make([]byte, 16)).Wait(ctx); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			eps[0].mu.Lock()
			n := len(eps[0].early)
			eps[0].mu.Unlock()
			if n > 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(time.Millisecond)
		}
		err := eps[0].Op(0, ours).Done()
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "root=1") ||
			!strings.Contains(err.Error(), "root=0") {
			t.Fatalf("Done = %v, want a mismatch naming both roots", err)
		}
		if eps[0].Broken() == nil {
			t.Fatal("the mismatch must break the group")
		}
	})
	t.Run("arriving after", func(t *testing.T) {
		_, eps := group(t, 2, "a secret of at least sixteen bytes")
		ctx := ctxT(t)
		if err := eps[0].Op(0, ours).Done(); err != nil {
			t.Fatal(err)
		}
		// rank 0 goes on to the next collective; rank 1's part of the first one arrives
		r := eps[0].Op(1, sigF32).Recv(1, Tag{}, copySink{Dst: make([]byte, 16)})
		eps[1].Op(0, bcast).Send(0, Tag{}, make([]byte, 16))
		err := r.Wait(ctx)
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "broadcast(") {
			t.Fatalf("next receive = %v, want the mismatch naming the broadcast", err)
		}
	})
	t.Run("taken parts are no mismatch", func(t *testing.T) {
		_, eps := group(t, 2, "a secret of at least sixteen bytes")
		ctx := ctxT(t)
		for seq := uint64(0); seq < 3; seq++ {
			a, b := eps[0].Op(seq, sigF32), eps[1].Op(seq, sigF32)
			s := a.Send(1, Tag{}, make([]byte, 16))
			time.Sleep(10 * time.Millisecond) // early on the even seqs' second frame
			if err := b.Recv(0, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if err := a.Done(); err != nil {
				t.Fatal(err)
			}
			if err := b.Done(); err != nil {
				t.Fatal(err)
			}
		}
	})
}

func TestWrongSecretIsRejected(t *testing.T) {
	nodes, _ := group(t, 2, "the real secret, sixteen+ bytes")
	impostor, err := nodes[0].Join([]byte("a different secret, 16+ bytes"), 0, []string{nodes[0].Addr(), nodes[1].Addr()})
	if err != nil {
		t.Fatal(err)
	}
	defer impostor.Close()
	err = impostor.Op(0, sigF32).Send(1, Tag{}, make([]byte, 16)).Wait(ctxT(t))
	if !errors.Is(err, ErrPeerLost) {
		t.Fatalf("send with a wrong secret = %v, want the link refused", err)
	}
}

func TestHandshakeRejectsGarbage(t *testing.T) {
	nodes, _ := group(t, 1, "a secret of at least sixteen bytes")
	c, err := net.Dial("tcp", nodes[0].Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(bytes.Repeat([]byte("x"), helloSize))
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("node answered %d bytes to a garbage hello", n)
	}
}

func TestPointToPoint(t *testing.T) {
	_, eps := group(t, 3, "a secret of at least sixteen bytes")
	ctx := ctxT(t)
	msg := func(b byte) []byte { return bytes.Repeat([]byte{b}, 8) }
	// same (source, tag) arrives in order; other tags do not interfere
	eps[0].SendP2P(2, 7, msg(1))
	eps[0].SendP2P(2, 9, msg(9))
	eps[0].SendP2P(2, 7, msg(2))
	for _, want := range []byte{1, 2} {
		got := make([]byte, 8)
		if err := eps[2].RecvP2P(0, 7, copySink{Dst: got}).Wait(ctx); err != nil || got[0] != want {
			t.Fatalf("tag 7: got %v (%v), want %d", got, err, want)
		}
	}
	got := make([]byte, 8)
	if err := eps[2].RecvP2P(0, 9, copySink{Dst: got}).Wait(ctx); err != nil || got[0] != 9 {
		t.Fatalf("tag 9: got %v (%v)", got, err)
	}
	// any source: the receive reports who sent
	r := eps[2].RecvP2P(-1, 3, copySink{Dst: got})
	eps[1].SendP2P(2, 3, msg(5))
	if err := r.Wait(ctx); err != nil || r.Source() != 1 || got[0] != 5 {
		t.Fatalf("any source: %v from %d (%v)", got, r.Source(), err)
	}
	// wrong size fails the receive only
	eps[1].SendP2P(2, 4, make([]byte, 3))
	if err := eps[2].RecvP2P(1, 4, copySink{Dst: got}).Wait(ctx); !errors.Is(err, ErrMismatch) {
		t.Fatalf("short message = %v, want ErrMismatch", err)
	}
	if eps[2].Broken() != nil {
		t.Fatal("a p2p size mismatch must not break the group")
	}
}

// TestPostedReceiveTakesAnySize: the unmatched-bytes cap bounds what waits for a receive,
// not what a posted receive takes: a message 4x the cap goes straight into a receive
// posted before it arrives, and one of the wrong size fails that receive only.
func TestPostedReceiveTakesAnySize(t *testing.T) {
	const capBytes, msg = 1 << 20, 4 << 20
	nodes, addrs := listen(t, 2)
	nodes[1].unmatchedMax = capBytes
	eps := joinAll(t, nodes, addrs, "a secret of at least sixteen bytes")
	ctx := ctxT(t)
	data := make([]byte, msg)
	for i := range data {
		data[i] = byte(i * 7)
	}
	for round := range 3 {
		got := make([]byte, msg)
		r := eps[1].RecvP2P(0, int64(round), copySink{Dst: got})
		if err := eps[0].SendP2P(1, int64(round), data).Wait(ctx); err != nil {
			t.Fatalf("round %d: send: %v", round, err)
		}
		if err := r.Wait(ctx); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("round %d: receive: %v (bytes equal: %v)", round, err, bytes.Equal(got, data))
		}
	}
	short := eps[1].RecvP2P(0, 9, copySink{Dst: make([]byte, 8)})
	eps[0].SendP2P(1, 9, data)
	if err := short.Wait(ctx); !errors.Is(err, ErrMismatch) {
		t.Fatalf("a %d-byte message into an 8-byte receive = %v, want ErrMismatch", msg, err)
	}
	got := make([]byte, 8)
	r := eps[1].RecvP2P(0, 10, copySink{Dst: got})
	eps[0].SendP2P(1, 10, bytes.Repeat([]byte{5}, 8))
	if err := r.Wait(ctx); err != nil || got[7] != 5 {
		t.Fatalf("after the mismatch: %v %v", got, err)
	}
	if eps[1].Broken() != nil || eps[1].unmatched[0].Load() != 0 {
		t.Fatalf("broken %v, %d bytes charged", eps[1].Broken(), eps[1].unmatched[0].Load())
	}
}

// TestPeerLoss: when a peer's node dies, a receive that waits on it fails promptly.
func TestPeerLoss(t *testing.T) {
	nodes, eps := group(t, 2, "a secret of at least sixteen bytes")
	ctx := ctxT(t)
	// establish the link from 1 to 0, then kill rank 1's side abruptly
	if err := eps[1].Op(0, sigF32).Send(0, Tag{}, make([]byte, 16)).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := eps[0].Op(0, sigF32).Recv(1, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	r := eps[0].Op(1, sigF32).Recv(1, Tag{}, copySink{Dst: make([]byte, 16)})
	nodes[1].Close()
	eps[1].mu.Lock()
	for _, l := range eps[1].out {
		if l != nil {
			l.mu.Lock()
			if l.conn != nil {
				l.conn.Close() // as a SIGKILL would
			}
			l.mu.Unlock()
		}
	}
	eps[1].mu.Unlock()
	start := time.Now()
	if err := r.Wait(ctx); !errors.Is(err, ErrPeerLost) {
		t.Fatalf("Wait = %v, want ErrPeerLost", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("noticed the loss after %v", el)
	}
}

// TestCloseSaysBye: a peer that leaves on purpose is reported as having left, not aborted.
func TestCloseSaysBye(t *testing.T) {
	_, eps := group(t, 2, "a secret of at least sixteen bytes")
	ctx := ctxT(t)
	if err := eps[1].SendP2P(0, 1, nil).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := eps[0].RecvP2P(1, 1, copySink{}).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	eps[1].Close()
	err := eps[0].RecvP2P(1, 2, copySink{}).Wait(ctx)
	if !errors.Is(err, ErrPeerLost) || !strings.Contains(err.Error(), "left") {
		t.Fatalf("recv from a departed peer = %v", err)
	}
	if b := eps[0].Broken(); b != nil {
		t.Fatalf("a bye broke the group: %v", b)
	}
}

// TestSendToADepartedPeer: data for a peer that said bye (it destroyed its group while this
// rank's op was under way) fails naming the departure, not as a bare broken pipe.
func TestSendToADepartedPeer(t *testing.T) {
	_, eps := group(t, 2, "a secret of at least sixteen bytes")
	ctx := ctxT(t)
	for _, r := range []*Request{ // links both ways, as after any op of the group
		eps[0].Op(0, sigF32).Send(1, Tag{}, make([]byte, 16)),
		eps[1].Op(0, sigF32).Send(0, Tag{}, make([]byte, 16)),
	} {
		if err := r.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	eps[1].Close()
	var err error
	for i := uint64(1); i < 200 && err == nil; i++ { // until the writes reach the closed socket
		err = eps[0].Op(i, sigF32).Send(1, Tag{}, make([]byte, 1<<20)).Wait(ctx)
	}
	if !errors.Is(err, ErrPeerLost) || !strings.Contains(err.Error(), "rank 1 left the group") ||
		!strings.Contains(err.Error(), "(link to rank 1: ") {
		t.Fatalf("send to a departed peer = %v, want it named as left", err)
	}
}

// TestAbortReachesLateJoiner: a rank that breaks the group and leaves at once (the client
// destroys the group on the error) still tells a peer that joined after the break; that
// peer's receive fails with the abort, not at its timeout.
func TestAbortReachesLateJoiner(t *testing.T) {
	const n = 3
	nodes, addrs := listen(t, n)
	secret := []byte("a secret of at least sixteen bytes")
	eps := make([]*Endpoint, n)
	for r := range 2 {
		ep, err := nodes[r].Join(secret, r, addrs)
		if err != nil {
			t.Fatal(err)
		}
		eps[r] = ep
	}
	t.Cleanup(eps[1].Close)
	closed := make(chan struct{})
	go func() {
		eps[0].Break(fmt.Errorf("%w: rank 0 saw a mismatch", ErrAborted))
		eps[0].Close()
		close(closed)
	}()
	time.Sleep(200 * time.Millisecond) // rank 2 joins while rank 0's abort link still dials it
	ep, err := nodes[2].Join(secret, 2, addrs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = ep.Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctx)
	if !errors.Is(err, ErrAborted) || !strings.Contains(err.Error(), "rank 0 saw a mismatch") {
		t.Fatalf("late joiner's receive = %v, want rank 0's abort", err)
	}
	<-closed
}

// deadAddr is an address nobody listens on (dials to it are refused).
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestLateDialerIsToldTheAbort: rank 0 breaks the group (and, in one case, leaves it)
// before rank 1 joins, and its abort frames never reach rank 1 (its address for rank 1 is
// dead). Rank 1's own link to rank 0 is then the only way to learn why: the handshake must
// hand over rank 0's reason, not close the link as a dead peer would.
func TestLateDialerIsToldTheAbort(t *testing.T) {
	for _, leave := range []bool{false, true} {
		t.Run(fmt.Sprintf("left=%v", leave), func(t *testing.T) {
			nodes, addrs := listen(t, 2)
			secret := []byte("a secret of at least sixteen bytes")
			ep0, err := nodes[0].Join(secret, 0, []string{addrs[0], deadAddr(t)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(ep0.Close)
			ep0.Break(fmt.Errorf("%w: rank 0 called all_reduce, rank 2 called all_gather", ErrMismatch))
			if leave {
				ep0.Close()
			}
			ep1, err := nodes[1].Join(secret, 1, addrs)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(ep1.Close)
			ep1.Connect()
			err = ep1.Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctxT(t))
			if !errors.Is(err, ErrAborted) || errors.Is(err, ErrPeerLost) ||
				!strings.Contains(err.Error(), "by rank 0: collective mismatch: rank 0 called all_reduce, rank 2 called all_gather") {
				t.Fatalf("late joiner's receive = %v, want rank 0's abort naming the mismatch", err)
			}
			if b := ep1.Broken(); !errors.Is(b, ErrAborted) {
				t.Fatalf("late joiner broke with %v, want rank 0's abort", b)
			}
		})
	}
}

// fakePeer plays rank 0 of a 2-rank group by hand, so a test can order what a real peer's
// links do: its listener takes rank 1's link, and link() dials rank 1 as rank 0.
type fakePeer struct {
	t      *testing.T
	ln     net.Listener
	secret []byte
}

func newFakePeer(t *testing.T, secret []byte) *fakePeer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return &fakePeer{t: t, ln: ln, secret: secret}
}

// link dials rank 1 at addr as rank 0 and authenticates: rank 1 reads from it from then on.
func (p *fakePeer) link(addr string) net.Conn {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		p.t.Fatal(err)
	}
	p.t.Cleanup(func() { c.Close() })
	if _, err := dialHandshake(c, p.secret, 0, 1, probe{}); err != nil {
		p.t.Fatal(err)
	}
	return c
}

// joinBesideFake joins rank 1 of a two-rank group on a node of its own, rank 0 being a fake
// peer: the endpoint, the fake and the node's address.
func joinBesideFake(t *testing.T) (*Endpoint, *fakePeer, string) {
	t.Helper()
	nodes, addrs := listen(t, 1)
	secret := []byte("a secret of at least sixteen bytes")
	peer := newFakePeer(t, secret)
	ep, err := nodes[0].Join(secret, 1, []string{peer.ln.Addr().String(), addrs[0]})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Close)
	return ep, peer, addrs[0]
}

// refuseLink accepts rank 1's link and closes it unanswered.
func (p *fakePeer) refuseLink() {
	c, err := p.ln.Accept()
	if err != nil {
		p.t.Error(err)
		return
	}
	c.Close()
}

// TestLinkFailureWaitsForTheAbort: rank 0's side of rank 1's link closes before rank 0's
// abort frame reaches rank 1 on rank 0's own link (the order two sockets give no guarantee
// of). Rank 1 must report rank 0's reason, not a lost peer; and when rank 0's link ends
// without an abort (a dead peer) or never comes, rank 1 reports the peer lost, promptly.
func TestLinkFailureWaitsForTheAbort(t *testing.T) {
	const delay = 200 * time.Millisecond // < peerLostGrace
	cases := []struct {
		name      string
		ownLink   bool // rank 0's link to rank 1 is up
		abort     bool // rank 0 sends an abort on it, delay after refusing rank 1's link
		want      error
		within    time.Duration
		notBefore time.Duration
	}{
		{"abort late", true, true, ErrAborted, delay + time.Second, delay},
		{"dead peer", true, false, ErrPeerLost, delay + time.Second, delay},
		{"no link back", false, false, ErrPeerLost, peerLostGrace + time.Second, peerLostGrace},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ep, peer, addr := joinBesideFake(t)
			var own net.Conn
			if tc.ownLink {
				own = peer.link(addr)
			}
			r := ep.Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)})
			start := time.Now()
			ep.Connect()
			peer.refuseLink()
			if own != nil {
				time.Sleep(delay)
				if tc.abort {
					if err := writeAbort(own, "rank 0 saw a mismatch"); err != nil {
						t.Fatal(err)
					}
				}
				own.Close()
			}
			err := r.Wait(ctxT(t))
			took := time.Since(start)
			if !errors.Is(err, tc.want) {
				t.Fatalf("receive = %v, want %v", err, tc.want)
			}
			if tc.abort && !strings.Contains(err.Error(), "by rank 0: rank 0 saw a mismatch") {
				t.Fatalf("receive = %v, want rank 0's reason", err)
			}
			if took < tc.notBefore || took > tc.within {
				t.Fatalf("failed after %v, want between %v and %v", took, tc.notBefore, tc.within)
			}
		})
	}
}

// copySink writes the payload into Dst.
type copySink struct{ Dst []byte }

func (s copySink) Len() int { return len(s.Dst) }

func (s copySink) Fill(r io.Reader, _ []byte) error {
	_, err := io.ReadFull(r, s.Dst)
	return err
}

func (s copySink) Take(b []byte) error {
	copy(s.Dst, b)
	return nil
}

// holdGrant proxies connections to addr, holding back what the acceptor sends after its
// answer (the grant) until release is closed: the acceptor has taken the link by then, and
// the dialer is still in its handshake.
func holdGrant(t *testing.T, addr string, release <-chan struct{}) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", addr)
			if err != nil {
				c.Close()
				continue
			}
			go func() { io.Copy(up, c); up.Close() }()
			go func() {
				defer c.Close()
				if _, err := io.CopyN(c, up, answerSize); err != nil {
					return
				}
				<-release
				io.Copy(c, up)
			}()
		}
	}()
	return ln.Addr().String()
}

// TestCloseDuringHandshake: a rank that leaves the group while its link to a peer is still
// in the handshake the peer already finished finishes it and says bye, so the peer reads
// the departure as one (its receive from that rank names it left), not as a lost peer; its
// Close waits for that no longer than closeGrace. Where the peer's grant never comes, Close
// returns after closeGrace and the peer finds the link lost.
func TestCloseDuringHandshake(t *testing.T) {
	for _, answers := range []bool{true, false} {
		nodes, addrs := listen(t, 2)
		secret := []byte("a secret of at least sixteen bytes")
		release := make(chan struct{})
		var once sync.Once
		free := func() { once.Do(func() { close(release) }) }
		t.Cleanup(free)
		via := []string{holdGrant(t, addrs[0], release), addrs[1]} // rank 1 dials rank 0 through it
		ep0, err := nodes[0].Join(secret, 0, addrs)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ep0.Close)
		ep1, err := nodes[1].Join(secret, 1, via)
		if err != nil {
			t.Fatal(err)
		}
		ep0.Connect()
		ep1.Connect()                      // as the sidecar does once the group is made
		time.Sleep(100 * time.Millisecond) // rank 0 has taken rank 1's link; rank 1 waits for the grant
		closed := make(chan time.Duration)
		go func() { t0 := time.Now(); ep1.Close(); closed <- time.Since(t0) }()
		if answers {
			time.Sleep(50 * time.Millisecond)
			free()
		}
		if took := <-closed; took > closeGrace+300*time.Millisecond {
			t.Errorf("answers %v: Close took %v, want at most closeGrace (%v)", answers, took, closeGrace)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = ep0.Op(0, sigF32).Recv(1, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctx)
		cancel()
		switch {
		case answers && (!errors.Is(err, ErrPeerLost) || !strings.Contains(err.Error(), "rank 1 left the group")):
			t.Fatalf("receive from a rank that left mid-handshake = %v, want it named as left", err)
		case !answers && !errors.Is(err, ErrPeerLost):
			t.Fatalf("receive from a rank whose handshake never ended = %v, want a lost peer", err)
		}
	}
}

// TestLeaverBreaksNothing: a peer that leaves the group in order while this rank has nothing
// for it breaks nothing here, whether its bye came on an open link or its node answered this
// rank's dial that it had left; what needs it later fails naming its departure, and ops of
// the other ranks go on.
func TestLeaverBreaksNothing(t *testing.T) {
	for _, dialedAfter := range []bool{false, true} {
		nodes, addrs := listen(t, 3)
		secret := []byte("a secret of at least sixteen bytes")
		eps := make([]*Endpoint, 3)
		for r := range eps {
			ep, err := nodes[r].Join(secret, r, addrs)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(ep.Close)
			eps[r] = ep
		}
		eps[1].Connect()
		eps[2].Connect()
		if !dialedAfter {
			eps[0].Connect()
			time.Sleep(100 * time.Millisecond) // every link up
		}
		eps[1].Close()
		if dialedAfter {
			eps[0].Connect() // rank 1's node answers the dial: it left
		}
		time.Sleep(peerLostGrace + 300*time.Millisecond)
		if err := eps[0].Broken(); err != nil {
			t.Fatalf("dialed after: %v: a leaver with nothing owed broke the group: %v", dialedAfter, err)
		}
		ctx := ctxT(t)
		if err := eps[0].Op(0, sigF32).Recv(1, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctx); !errors.Is(err, ErrPeerLost) ||
			!strings.Contains(err.Error(), "rank 1 left the group") {
			t.Fatalf("dialed after: %v: receive from the leaver = %v, want it named as left", dialedAfter, err)
		}
		s := eps[0].Op(1, sigF32).Send(2, Tag{}, make([]byte, 16))
		r := eps[2].Op(1, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)})
		for _, q := range []*Request{s, r} {
			if err := q.Wait(ctx); err != nil {
				t.Fatalf("dialed after: %v: ranks 0 and 2 after rank 1 left: %v", dialedAfter, err)
			}
		}
	}
}

// TestAnySourceReceiveWhenPeersLeave: a receive from any rank waits while some rank is left
// to send (a leaver alone does not fail it), and fails, naming why, once every other rank
// left; one posted after that fails at once.
func TestAnySourceReceiveWhenPeersLeave(t *testing.T) {
	_, eps := group(t, 3, "a secret of at least sixteen bytes")
	for _, ep := range eps {
		ep.Connect()
	}
	time.Sleep(100 * time.Millisecond) // every link up
	ctx := ctxT(t)
	got := make([]byte, 8)
	first := eps[0].RecvP2P(-1, 4, copySink{Dst: got})
	eps[1].Close()
	time.Sleep(peerLostGrace + 300*time.Millisecond)
	if err := eps[2].SendP2P(0, 4, bytes.Repeat([]byte{7}, 8)).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := first.Wait(ctx); err != nil || first.Source() != 2 || got[0] != 7 {
		t.Fatalf("any source with rank 2 still there: %v from %d (%v)", got, first.Source(), err)
	}
	second := eps[0].RecvP2P(-1, 5, copySink{Dst: got})
	eps[2].Close()
	wait, cancel := context.WithTimeout(ctx, peerLostGrace+5*time.Second)
	defer cancel()
	if err := second.Wait(wait); !errors.Is(err, ErrPeerLost) || !strings.Contains(err.Error(), "every other rank left") {
		t.Fatalf("any source once every rank left = %v, want it named", err)
	}
	if err := eps[0].RecvP2P(-1, 6, copySink{Dst: got}).Wait(ctx); !strings.Contains(fmt.Sprint(err), "every other rank left") {
		t.Fatalf("any source posted after = %v", err)
	}
	if err := eps[0].Broken(); err != nil {
		t.Fatalf("leavers broke the group: %v", err)
	}
}

// TestCloseWhileDialRetries: a rank that leaves while its dial to a peer is retrying (the
// peer has not joined the group yet: ranks create a group at different times) lets that dial
// go on, at most closeGrace, and carries its bye. The peer, joining in the grace, hears that
// the rank left even after the rank's node is gone (its process exited), and breaks nothing;
// one that never joins costs Close closeGrace, no more.
func TestCloseWhileDialRetries(t *testing.T) {
	for _, joins := range []bool{true, false} {
		nodes, addrs := listen(t, 2)
		secret := []byte("a secret of at least sixteen bytes")
		ep0, err := nodes[0].Join(secret, 0, addrs)
		if err != nil {
			t.Fatal(err)
		}
		ep0.Connect()                     // rank 1's node answers: not joined yet
		time.Sleep(50 * time.Millisecond) // the dial is between retries
		closed := make(chan time.Duration)
		go func() { t0 := time.Now(); ep0.Close(); closed <- time.Since(t0) }()
		if !joins {
			if took := <-closed; took > closeGrace+300*time.Millisecond {
				t.Fatalf("Close took %v with a peer that never joined, want at most closeGrace (%v)", took, closeGrace)
			}
			continue
		}
		time.Sleep(50 * time.Millisecond)
		ep1, err := nodes[1].Join(secret, 1, addrs)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ep1.Close)
		ep1.Connect()
		if took := <-closed; took > closeGrace+300*time.Millisecond {
			t.Fatalf("Close took %v, want at most closeGrace (%v)", took, closeGrace)
		}
		nodes[0].Close() // rank 0's process is gone: a dial to it is refused
		time.Sleep(peerLostGrace + 300*time.Millisecond)
		if err := ep1.Broken(); err != nil {
			t.Fatalf("a rank that left while dialing broke the group: %v", err)
		}
		err = ep1.Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctxT(t))
		if !errors.Is(err, ErrPeerLost) || !strings.Contains(err.Error(), "rank 0 left the group") {
			t.Fatalf("receive from the rank that left = %v, want it named as left", err)
		}
	}
}

// TestDeparturesAreBounded: a node remembers at most goneMax groups it left (the oldest are
// forgotten), so that making and destroying groups all along does not grow it; the latest
// are still answered as left.
func TestDeparturesAreBounded(t *testing.T) {
	defer func(m int) { goneMax = m }(goneMax)
	goneMax = 8
	nodes, addrs := listen(t, 1)
	var last [16]byte
	for i := range 3 * goneMax {
		ep, err := nodes[0].Join([]byte(fmt.Sprintf("a secret of at least sixteen bytes %d", i)), 0, addrs)
		if err != nil {
			t.Fatal(err)
		}
		last = ep.id
		ep.Close()
	}
	n := nodes[0]
	n.mu.Lock()
	kept, order := len(n.gone), len(n.left)
	n.mu.Unlock()
	if kept != goneMax || order != goneMax {
		t.Fatalf("%d departures kept (%d in order), want %d", kept, order, goneMax)
	}
	if _, _, _, err := n.answerLink(last); !errors.Is(err, errLeft) {
		t.Fatalf("the latest group left is answered %v, want errLeft", err)
	}
}

// TestLeaverFramesBeforeItsDeparture: rank 0 sends rank 1 a message and leaves; rank 1's
// dial to it is answered "left" before rank 1 read the message (and the bye behind it) off
// rank 0's own link. Rank 1's receive from any rank (its only peer left) takes the message
// rather than failing for a departure the message preceded, and one posted after the bye
// fails naming it.
func TestLeaverFramesBeforeItsDeparture(t *testing.T) {
	ep, peer, addr := joinBesideFake(t)
	own := peer.link(addr)
	got := make([]byte, 1<<16)
	r := ep.RecvP2P(-1, 3, copySink{Dst: got})
	ep.Connect()
	c, err := peer.ln.Accept() // rank 1's dial: rank 0's node says it left
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, helloSize)); err != nil {
		t.Fatal(err)
	}
	ans := make([]byte, answerSize)
	ans[32] = statusLeft
	c.Write(ans)
	c.Close()
	time.Sleep(200 * time.Millisecond) // < peerLostGrace
	select {
	case <-r.done:
		t.Fatalf("the receive ended before the leaver's link did: %v", r.Wait(ctxT(t)))
	default:
	}
	// what rank 0 wrote before it left, read only now
	msg := bytes.Repeat([]byte{9}, len(got))
	hdr, bye := make([]byte, frameHeader), make([]byte, frameHeader)
	(&frame{kind: kindP2P, seq: 3, length: uint64(len(msg))}).encode(hdr)
	(&frame{kind: kindBye}).encode(bye)
	if _, err := own.Write(append(append(hdr, msg...), bye...)); err != nil {
		t.Fatal(err)
	}
	if err := r.Wait(ctxT(t)); err != nil || r.Source() != 0 || !bytes.Equal(got, msg) {
		t.Fatalf("receive from any rank = %v from %d", err, r.Source())
	}
	if err := ep.RecvP2P(-1, 4, copySink{Dst: got}).Wait(ctxT(t)); !strings.Contains(fmt.Sprint(err), "every other rank left") {
		t.Fatalf("any source posted after the bye = %v", err)
	}
	if err := ep.Broken(); err != nil {
		t.Fatalf("the leaver broke the group: %v", err)
	}
}
