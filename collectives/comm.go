// Package collectives holds the collective algorithms of the host engine (CPU tensors): ring,
// chain and direct exchanges over a Comm, which a transport implements. Algorithms work on
// flat byte buffers; dtype matters only where they reduce.
//
// Every rank of a group must pick the same algorithm for the same call: choices depend only
// on the op's signature (sizes, dtype, root) and the group size, never on local state.
package collectives

import (
	"context"
	"io"
)

// Tag names one message of a collective: the algorithm step and the slice within it. The
// op's sequence number and signature are bound into the Comm by the caller.
type Tag struct {
	Step, Slice uint32
}

// Request completes when a send's buffer may be reused or a receive's data has landed.
type Request interface {
	Wait(ctx context.Context) error
}

// Sink takes the payload of one received message.
type Sink interface {
	// Len is the payload length the receiver expects; a different length is an error.
	Len() int
	// Fill reads exactly Len() bytes from r. It runs on the transport's reader and may use
	// scratch (at least 64 KiB) as it likes.
	Fill(r io.Reader, scratch []byte) error
	// Take consumes a payload that arrived before the receive was posted.
	Take(b []byte) error
}

// Comm is one rank's view of a group for the duration of one collective.
type Comm interface {
	Rank() int
	Size() int
	// Send queues data for rank to. data must stay untouched until the request completes.
	Send(to int, t Tag, data []byte) Request
	// Recv posts a receive from rank from.
	Recv(from int, t Tag, s Sink) Request
}
