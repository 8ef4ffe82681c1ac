// One collective's messages on the endpoint: the Comm view an algorithm runs on (OpComm),
// and the matching of its receives against what arrived early.

package transport

import (
	"fmt"
	"io"
)

// Op binds a collective's sequence number and signature to the endpoint, giving the
// messages its algorithm sends and receives.
func (ep *Endpoint) Op(seq uint64, sig Signature) *OpComm {
	return &OpComm{ep: ep, seq: seq, sig: sig}
}

// Tag names one message of a collective: the algorithm step and the slice within it.
type Tag struct {
	Step, Slice uint32
}

// Sink takes the payload of one received message.
type Sink interface {
	// Len is the payload length the receiver expects; a different length is an error.
	Len() int
	// Fill reads exactly Len() bytes from r. It runs on the endpoint's reader and may use
	// scratch (at least 64 KiB) as it likes.
	Fill(r io.Reader, scratch []byte) error
	// Take consumes a payload that arrived before the receive was posted.
	Take(b []byte) error
}

// OpComm is one rank's side of one collective on the endpoint.
type OpComm struct {
	ep  *Endpoint
	seq uint64
	sig Signature
}

func (c *OpComm) Rank() int { return c.ep.rank }

func (c *OpComm) Size() int { return c.ep.size }

func (c *OpComm) what(t Tag) string {
	return fmt.Sprintf("%s #%d step %d slice %d", c.sig.OpName, c.seq, t.Step, t.Slice)
}

func (c *OpComm) Send(to int, t Tag, data []byte) *Request {
	f := frame{kind: kindColl, sig: c.sig, seq: c.seq, step: t.Step, slice: t.Slice, length: uint64(len(data))}
	return c.ep.send(to, f, data, c.what(t))
}

func (c *OpComm) Recv(from int, t Tag, s Sink) *Request {
	ep := c.ep
	r := newRequest(from, c.what(t))
	r.sink, r.sig = s, c.sig
	if from < 0 || from >= ep.size || from == ep.rank {
		r.finish(fmt.Errorf("recv from rank %d in a group of %d", from, ep.size))
		return r
	}
	key := collKey{src: from, seq: c.seq, step: t.Step, slice: t.Slice}
	if !ep.lockOpen(r) {
		return r
	}
	if e := ep.early[key]; e != nil {
		delete(ep.early, key)
		ep.mu.Unlock()
		r.finish(takeColl(r, from, e))
		return r
	}
	if ep.lastSeq[from] > c.seq+1 {
		ep.mu.Unlock()
		r.finish(fmt.Errorf("%w: rank %d moved past %s without sending its part", ErrMismatch, from, c.sig.OpName))
		return r
	}
	if ep.left[from] {
		ep.mu.Unlock()
		r.finish(leftError(from))
		return r
	}
	ep.posted[key] = r
	ep.mu.Unlock()
	return r
}

// Done tells the endpoint that this rank finished the collective (invariant 9): a frame of
// it, or of an earlier one, that no receive took is a mismatch, which breaks the endpoint
// and is returned. Call it once the collective's receives all finished without error.
func (c *OpComm) Done() error {
	ep := c.ep
	ep.mu.Lock()
	if c.seq+1 > ep.done {
		ep.done = c.seq + 1
	}
	ep.doneSigs[c.seq%uint64(len(ep.doneSigs))] = c.sig
	var left []*early
	for k, e := range ep.early {
		if k.seq <= c.seq {
			delete(ep.early, k)
			left = append(left, e)
		}
	}
	if len(left) == 0 {
		ep.mu.Unlock()
		return nil
	}
	first := left[0]
	for _, e := range left {
		if e.f.seq < first.f.seq || (e.f.seq == first.f.seq && e.src < first.src) {
			first = e
		}
	}
	err := ep.unreadLocked(first.src, &first.f)
	ep.mu.Unlock()
	for _, e := range left {
		e.release() // outside mu: an ack is a send
	}
	ep.Break(err)
	return err
}

// checkColl compares an arriving frame with the receive it matched.
func checkColl(r *Request, from int, f *frame) error {
	if !f.sig.equal(r.sig) {
		return fmt.Errorf("%w: rank %d called %s, this rank called %s", ErrMismatch, from,
			describe(named(f.sig, r.sig)), describe(r.sig))
	}
	if f.length != uint64(r.sink.Len()) {
		return fmt.Errorf("%w: rank %d sent %d bytes for %s, this rank expects %d", ErrMismatch, from,
			f.length, r.what, r.sink.Len())
	}
	return nil
}

func takeColl(r *Request, from int, e *early) error {
	if err := checkColl(r, from, &e.f); err != nil {
		e.release()
		return err
	}
	return e.take(r.sink)
}
