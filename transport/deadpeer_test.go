package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// liveGroup joins n nodes with the given peer timeout to one group and connects every link.
func liveGroup(t *testing.T, n int, peerTimeout time.Duration) []*Endpoint {
	t.Helper()
	nodes := make([]*Node, n)
	addrs := make([]string, n)
	for r := range nodes {
		node, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quiet(), JoinWait: 2 * time.Second, PeerTimeout: peerTimeout})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { node.Close() })
		nodes[r], addrs[r] = node, node.Addr()
	}
	return joinAll(t, nodes, addrs, "a secret of at least sixteen bytes")
}

// TestHeartbeatsKeepIdleLinksAlive: links that carry no op for several peer timeouts stay
// up (heartbeats), and each side learns the other's progress from them.
func TestHeartbeatsKeepIdleLinksAlive(t *testing.T) {
	const timeout = 500 * time.Millisecond
	eps := liveGroup(t, 2, timeout)
	eps[0].SetProgress(func() (uint64, uint64) { return 8, 7 })
	eps[1].SetProgress(func() (uint64, uint64) { return 3, 3 })
	for _, ep := range eps {
		ep.Connect()
	}
	time.Sleep(4 * timeout)
	for r, ep := range eps {
		if err := ep.Broken(); err != nil {
			t.Fatalf("rank %d broke on idle links: %v", r, err)
		}
	}
	p := eps[1].Peers()[0]
	if p.Started != 8 || p.Finished != 7 || time.Since(p.Heard) > timeout {
		t.Fatalf("rank 1 heard of rank 0: %+v, want started 8, finished 7, heard within %v", p, timeout)
	}
	if p := eps[0].Peers()[1]; p.Started != 3 || p.Finished != 3 {
		t.Fatalf("rank 0 heard of rank 1: %+v, want 3, 3", p)
	}
	if err := eps[0].Op(0, sigF32).Send(1, Tag{}, make([]byte, 16)).Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if err := eps[1].Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)}).Wait(ctxT(t)); err != nil {
		t.Fatalf("an op after the idle time: %v", err)
	}
}

// TestSilentPeerIsLost: a peer whose link stays open but carries nothing, not even a
// heartbeat (a stopped sidecar, a host whose traffic is dropped), breaks the group as lost,
// naming it, within the peer timeout.
func TestSilentPeerIsLost(t *testing.T) {
	const timeout = 600 * time.Millisecond
	secret := []byte("a secret of at least sixteen bytes")
	fake := newFakePeer(t, secret)
	node, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quiet(), JoinWait: 2 * time.Second, PeerTimeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Close() })
	ep, err := node.Join(secret, 1, []string{fake.ln.Addr().String(), node.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Close)
	fake.link(node.Addr()) // authenticated, then silent
	r := ep.Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: make([]byte, 16)})
	start := time.Now()
	err = r.Wait(ctxT(t))
	if !errors.Is(err, ErrPeerLost) || !strings.Contains(err.Error(), "rank 0: nothing came from it") {
		t.Fatalf("recv from a silent peer = %v, want it lost, named", err)
	}
	if el := time.Since(start); el > timeout {
		t.Fatalf("gave the silent peer up after %v, more than the peer timeout %v", el, timeout)
	}
}

// TestLeaverFailsSendsWaitingForItsAck: a send by reference finishes on the receiver's ack;
// a receiver that leaves (bye) acks nothing more, so its pending sends fail at once instead
// of at their deadline, and sends to other peers wait on.
func TestLeaverFailsSendsWaitingForItsAck(t *testing.T) {
	_, eps := group(t, 3, "a secret of at least sixteen bytes")
	ep := eps[0]
	toLeaver, toOther := newRequest(1, "by reference to 1"), newRequest(2, "by reference to 2")
	ep.mu.Lock()
	ep.acks[ackKey{1, 1}] = toLeaver
	ep.acks[ackKey{2, 2}] = toOther
	ep.mu.Unlock()
	ep.failPostedFrom(1)
	if err := toLeaver.Wait(ctxT(t)); !errors.Is(err, ErrPeerLost) || !strings.Contains(err.Error(), "rank 1 left") {
		t.Fatalf("send waiting for the leaver's ack = %v, want it failed, naming rank 1", err)
	}
	select {
	case <-toOther.done:
		t.Fatalf("a send to another peer failed too: %v", toOther.err)
	default:
	}
}

// TestEndingPeerFailsDialersAtOnce: rank 1's sidecar is ending (its training process died
// after it made its member of the group, before it joined): rank 0, dialing it for the
// group, breaks at once naming rank 1, instead of retrying until that sidecar is gone and
// then while its connections are refused.
func TestEndingPeerFailsDialersAtOnce(t *testing.T) {
	nodes, addrs := listen(t, 2)
	nodes[1].Ending()
	ep, err := nodes[0].Join([]byte("a secret of at least sixteen bytes"), 0, addrs)
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	start := time.Now()
	err = ep.SendP2P(1, 1, make([]byte, 8)).Wait(ctxT(t))
	if !errors.Is(err, ErrAborted) || !strings.Contains(err.Error(), "rank 1") || !strings.Contains(err.Error(), "never joined") {
		t.Fatalf("send failed with %v, want rank 1's sidecar ending", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("broke after %v, want at once", took)
	}
}

// TestRefSendAfterBreak: a by-reference send that reaches the wire after the endpoint broke
// fails with the break's cause at once. Break finishes the acks it finds; one registered
// after it would wait for an ack no peer sends, until the op's deadline (a survivor of a
// killed sidecar once raised only after its 60 s timeout).
func TestRefSendAfterBreak(t *testing.T) {
	nodes, eps := group(t, 2, "0123456789abcdef")
	nodes[0].locate = func([]byte) (int, uint64, uint64, bool) { return 3, 1, 0, true }
	cause := fmt.Errorf("%w: the test broke it", ErrAborted)
	eps[0].Break(cause)
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	go io.Copy(io.Discard, b) //nolint:errcheck // drains whatever the write puts on the pipe
	m := &outMsg{f: frame{kind: kindColl}, data: make([]byte, refMin), req: newRequest(1, "a test send")}
	l := &outLink{ep: eps[0], to: 1}
	if err := l.write(a, make([]byte, frameHeader+refTrailer), m, true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := m.req.Wait(ctx); !errors.Is(err, ErrAborted) || !strings.Contains(err.Error(), "the test broke it") {
		t.Fatalf("the send after the break ended with %v, want the break's cause at once", err)
	}
}
