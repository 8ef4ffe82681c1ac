package pg

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gocomm/gocomm/transport"
	"github.com/gocomm/gocomm/wire"
)

// TestBreakKeepsTheKind: an op's failure breaks its group with a cause that the group's other
// ops, failing by the break, map to the same status (peer lost, timeout, aborted, mismatch),
// not to an internal error, and whose text is the first op's.
func TestBreakKeepsTheKind(t *testing.T) {
	g := &Group{Name: "g", Rank: 0, Size: 2}
	d := &wire.Desc{Kind: wire.OpAllReduce}
	expired, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	for _, c := range []struct {
		ctx  context.Context
		err  error
		want int32
	}{
		{context.Background(), fmt.Errorf("send to 1: %w: rank 1 left the group", transport.ErrPeerLost), wire.StatusPeerLost},
		{expired, context.DeadlineExceeded, wire.StatusTimeout},
		{context.Background(), fmt.Errorf("%w: rank 1 aborted", transport.ErrAborted), wire.StatusAborted},
		{context.Background(), fmt.Errorf("%w: 8 bytes, want 16", transport.ErrMismatch), wire.StatusMismatch},
	} {
		status, msg := g.failure(c.ctx, d, 3, time.Second, c.err)
		if status != c.want {
			t.Fatalf("%v: first op's status %d, want %d", c.err, status, c.want)
		}
		cause := breakCause(status, msg, c.err)
		if cause.Error() != msg {
			t.Fatalf("cause %q, want the first op's words %q", cause, msg)
		}
		// another op of the group, failing with the break's cause before its own deadline
		if other, _ := g.failure(context.Background(), d, 4, time.Second, cause); other != c.want {
			t.Fatalf("%v: the other op's status %d, want %d", c.err, other, c.want)
		}
		if errors.Is(cause, transport.ErrClosed) {
			t.Fatalf("%v: the cause reads as a close", c.err)
		}
	}
}

// TestOpAfterDestroyIsAborted: an op the client queued on a group just before destroying it
// (the destroy comes by rpc, the op by the ring, so the destroy may arrive first) fails as
// aborted, naming the group, not as an invalid descriptor; an op on a group that never
// existed is still invalid.
func TestOpAfterDestroyIsAborted(t *testing.T) {
	clients, groups := cluster(t, 1, 5*time.Second)
	c, g := clients[0], groups[0]
	if err := c.sess.DestroyGroup(g.Handle); err != nil {
		t.Fatal(err)
	}
	c.submit(wire.Desc{Group: g.Handle, Kind: wire.OpBarrier})
	d := c.next(5 * time.Second)
	if d.status != wire.StatusAborted || !strings.Contains(d.msg, "destroyed") || !strings.Contains(d.msg, g.Name) {
		t.Fatalf("completion %+v, want aborted naming group %q as destroyed", d, g.Name)
	}
	c.submit(wire.Desc{Group: g.Handle + 100, Kind: wire.OpBarrier})
	if d := c.next(5 * time.Second); d.status != wire.StatusInvalid {
		t.Fatalf("completion %+v on a group that never was, want invalid", d)
	}
}
