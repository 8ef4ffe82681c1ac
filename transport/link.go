package transport

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/gocomm/gocomm/shm"
)

// refMin: payloads at least this large go by reference on same-host links; below it the
// ack's round trip costs more than copying through the socket.
const refMin = 64 << 10

// refTrailer follows a kindRef header: where the payload lies in the sender's memory.
//
//	0 u32 pid   4 u32 fd   8 u64 inode   16 u64 offset   24 u64 id (echoed by the ack)
const refTrailer = 32

// payload is the body of an arriving data frame: inline bytes still on the connection, or
// (by reference) the bytes in the sender's segment plus the ack that releases them.
type payload struct {
	conn io.Reader
	ref  []byte
	ack  func()
}

// discard drops a payload nobody will take.
func (p payload) discard(n uint64) error {
	if p.ref != nil {
		p.ack()
		return nil
	}
	_, err := io.CopyN(io.Discard, p.conn, int64(n))
	return err
}

// earlyCost is what an early frame is charged besides its inline bytes (its bookkeeping),
// so that many empty frames are bounded too.
const earlyCost = 128

// keep turns a payload into an early frame: inline bytes are copied off the connection,
// referenced bytes stay where they are until taken. The frame is charged to its sender's
// unmatched bytes first; over the node's cap, nothing is read and the error is
// ErrUnmatchedMax.
func (p payload) keep(ep *Endpoint, f *frame, from int) (*early, error) {
	cost := int64(earlyCost)
	if p.ref == nil {
		cost += int64(f.length)
	}
	held := &ep.unmatched[from]
	if n := held.Add(cost); n > ep.node.unmatchedMax {
		held.Add(-cost)
		return nil, fmt.Errorf("%w: rank %d sent %d more bytes while %d it sent earlier wait for receives that match them; the cap is %d (GOCOMM_UNMATCHED_BYTES_MAX)",
			ErrUnmatchedMax, from, f.length, n-cost, ep.node.unmatchedMax)
	}
	e := &early{f: *f, src: from, data: p.ref, ack: p.ack, held: held, cost: cost}
	if p.ref == nil {
		e.data = make([]byte, f.length)
		if _, err := io.ReadFull(p.conn, e.data); err != nil {
			e.release()
			return nil, err
		}
	}
	return e, nil
}

// liveConn is an inbound link read with a deadline that every read pushes on: a peer that
// sends nothing, not even a heartbeat, for limit is given up (os.ErrDeadlineExceeded). The
// limit is silenceLimit of the peer timeout, so that the ranks hear of the break within it.
type liveConn struct {
	net.Conn
	limit time.Duration
}

func (c liveConn) Read(b []byte) (int, error) {
	c.SetReadDeadline(time.Now().Add(c.limit))
	return c.Conn.Read(b)
}

// linkError says why a link to or from a peer failed; silence past the peer timeout is
// named as such, since the connection itself never reports it.
func (ep *Endpoint) linkError(dir string, peer int, err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		limit := ep.node.peerTimeout
		if dir == "came from" {
			limit = limit * silenceLimit / 5
		}
		return fmt.Errorf("%w: rank %d: nothing %s it for %v (no heartbeat: its sidecar is stopped or its host unreachable)",
			ErrPeerLost, peer, dir, limit)
	}
	word := "from"
	if dir == "went to" {
		word = "to"
	}
	return fmt.Errorf("%w: link %s rank %d: %v", ErrPeerLost, word, peer, err)
}

// reader runs for one inbound link: it matches frames to receives until the link closes.
//
// refPID is the process the link's dialer proved it can lend segments of (the handshake's
// same-host probe); 0 where the link was granted no references, and a frame by reference
// on it breaks the group: the peer holds the secret but breaks the protocol.
func (ep *Endpoint) reader(from int, raw net.Conn, refPID int) {
	defer ep.readers.Done()
	defer close(ep.inEnded[from]) // once any Break of this reader happened (lost, invariant 7)
	defer raw.Close()
	conn := liveConn{raw, ep.node.peerTimeout * silenceLimit / 5}
	hdr := make([]byte, frameHeader)
	trailer := make([]byte, refTrailer)
	scratch := make([]byte, 256<<10)
	for {
		f, err := readFrame(conn, hdr)
		if err != nil {
			ep.mu.Lock()
			left, broken := ep.left[from], ep.broken != nil
			ep.mu.Unlock()
			if !left && !broken {
				ep.Break(ep.linkError("came from", from, err))
			}
			return
		}
		if f.kind == kindBeat {
			ep.mu.Lock()
			ep.peerSeen[from] = PeerProgress{Started: f.seq, Finished: f.sig.Count, Heard: time.Now()}
			ep.mu.Unlock()
			continue
		}
		ep.BytesReceived.Add(f.length)
		p := payload{conn: conn}
		if f.ref && refPID == 0 {
			ep.Break(fmt.Errorf("%w: rank %d sent a frame by reference on a link that did not negotiate references", ErrProtocol, from))
			return
		}
		if f.ref {
			if p, err = ep.resolveRef(from, &f, conn, trailer, refPID); errors.Is(err, ErrProtocol) {
				ep.Break(fmt.Errorf("rank %d: %w", from, err))
				return
			} else if err != nil {
				ep.Break(ep.linkError("came from", from, err))
				return
			}
		}
		switch f.kind {
		case kindColl:
			err = ep.deliverColl(from, &f, p, scratch)
		case kindP2P:
			err = ep.deliverP2P(from, &f, p, scratch)
		case kindAck:
			ep.mu.Lock()
			r := ep.acks[ackKey{from, f.seq}]
			delete(ep.acks, ackKey{from, f.seq})
			ep.mu.Unlock()
			if r != nil {
				r.finish(nil)
			}
		case kindAbort:
			var msg []byte
			msg, err = readReason(conn, f.length)
			ep.Break(fmt.Errorf("%w by rank %d: %s", ErrAborted, from, msg))
		case kindBye:
			ep.mu.Lock()
			ep.left[from] = true
			ep.mu.Unlock()
			ep.failPostedFrom(from)
			return
		}
		if errors.Is(err, ErrUnmatchedMax) {
			ep.Break(err)
			drain(raw, abortGrace)
			return
		}
		if err != nil {
			ep.Break(ep.linkError("came from", from, err))
			return
		}
	}
}

// drain reads an inbound link dry until its peer closes it or limit passes. Closing a link
// with bytes unread resets it, and the reset can reach the peer before the abort frame on
// this rank's own link to it: the peer would report a lost link instead of the reason. The
// peer closes the link once the abort arrived.
func drain(c net.Conn, limit time.Duration) {
	c.SetReadDeadline(time.Now().Add(limit))
	io.Copy(io.Discard, c)
}

// resolveRef reads a reference's trailer and finds the bytes in the sender's segment,
// mapping the segment on first use. The reference must name pid, the process the link's
// handshake probed.
func (ep *Endpoint) resolveRef(from int, f *frame, conn io.Reader, trailer []byte, pid int) (payload, error) {
	if _, err := io.ReadFull(conn, trailer); err != nil {
		return payload{}, err
	}
	le := binary.LittleEndian
	key := mapKey{pid: int(le.Uint32(trailer)), fd: int(le.Uint32(trailer[4:])), ino: le.Uint64(trailer[8:])}
	if key.pid != pid {
		return payload{}, fmt.Errorf("%w: a reference into process %d, not %d (the one the link's handshake probed)", ErrProtocol, key.pid, pid)
	}
	off, id := le.Uint64(trailer[16:]), le.Uint64(trailer[24:])
	ep.mu.Lock()
	m := ep.peerMaps[key]
	ep.mu.Unlock()
	if m == nil {
		var err error
		if m, err = shm.MapPeer(key.pid, key.fd, key.ino); err != nil {
			return payload{}, err
		}
		ep.mu.Lock()
		if old := ep.peerMaps[key]; old != nil {
			shm.Unmap(m)
			m = old
		} else {
			ep.peerMaps[key] = m
		}
		ep.mu.Unlock()
	}
	if off > uint64(len(m)) || f.length > uint64(len(m))-off {
		return payload{}, fmt.Errorf("reference to bytes [%d, +%d) of a %d-byte segment", off, f.length, len(m))
	}
	ack := func() { ep.send(from, frame{kind: kindAck, seq: id}, nil, "ack") }
	return payload{ref: m[off : off+f.length : off+f.length], ack: ack}, nil
}

// failPostedFrom fails the receives that wait on a peer that left, and the sends by
// reference that wait for its ack (a leaver acks nothing more); receives from any rank
// fail once every other rank left.
func (ep *Endpoint) failPostedFrom(from int) {
	ep.mu.Lock()
	var reqs []*Request
	for k, r := range ep.acks {
		if k.peer == from {
			reqs = append(reqs, r)
			delete(ep.acks, k)
		}
	}
	for k, r := range ep.posted {
		if k.src == from {
			reqs = append(reqs, r)
			delete(ep.posted, k)
		}
	}
	for k, q := range ep.p2pPosted {
		if k.src == from {
			reqs = append(reqs, q...)
			delete(ep.p2pPosted, k)
		}
	}
	var anyReqs []*Request // receives from any rank, once no rank is left to send
	if ep.allLeftLocked() {
		for tag, q := range ep.anyPosted {
			anyReqs = append(anyReqs, q...)
			delete(ep.anyPosted, tag)
		}
	}
	ep.mu.Unlock()
	for _, r := range reqs {
		r.finish(leftError(from))
	}
	for _, r := range anyReqs {
		r.finish(allLeftError())
	}
}

// deliverColl hands one collective frame to its receive, or keeps it early (invariant 2).
// A returned error means the link is unusable.
func (ep *Endpoint) deliverColl(from int, f *frame, p payload, scratch []byte) error {
	key := collKey{src: from, seq: f.seq, step: f.step, slice: f.slice}
	ep.mu.Lock()
	if ep.broken != nil {
		ep.mu.Unlock()
		return p.discard(f.length)
	}
	var stale []*Request
	if f.seq+1 > ep.lastSeq[from] {
		ep.lastSeq[from] = f.seq + 1
		for k, r := range ep.posted { // invariant 3
			if k.src == from && k.seq < f.seq {
				stale = append(stale, r)
				delete(ep.posted, k)
			}
		}
	}
	r := ep.posted[key]
	if r != nil {
		delete(ep.posted, key)
		ep.fills.Add(1)
	}
	var late error
	if r == nil && f.seq < ep.done { // invariant 9
		late = ep.unreadLocked(from, f)
	}
	ep.mu.Unlock()
	if late != nil {
		ep.Break(late)
		return p.discard(f.length)
	}
	for _, s := range stale {
		err := fmt.Errorf("%w: rank %d moved on to a later collective without sending its part of %s", ErrMismatch, from, s.what)
		s.finish(err)
		ep.Break(err)
	}
	if r != nil {
		defer ep.fills.Done()
		if err := checkColl(r, from, f); err != nil {
			r.finish(err)
			ep.Break(err)
			return p.discard(f.length)
		}
		return fill(r, from, p, scratch)
	}
	e, err := p.keep(ep, f, from)
	if err != nil {
		return err
	}
	ep.mu.Lock()
	if ep.broken != nil {
		ep.mu.Unlock()
		e.release()
		return nil
	}
	r = ep.posted[key]
	if r == nil && f.seq < ep.done { // the collective finished while the frame was read
		late := ep.unreadLocked(from, f)
		ep.mu.Unlock()
		e.release()
		ep.Break(late)
		return nil
	}
	if r == nil {
		ep.early[key] = e
		ep.mu.Unlock()
		return nil
	}
	delete(ep.posted, key)
	ep.mu.Unlock()
	err = takeColl(r, from, e)
	r.finish(err)
	if err != nil && errors.Is(err, ErrMismatch) {
		ep.Break(err)
	}
	return nil
}

// fill hands a payload of the right size to the receive r waits with (taken out of posted,
// its fill counted) and finishes r. A returned error means the link is unusable.
func fill(r *Request, from int, p payload, scratch []byte) error {
	if p.ref != nil {
		err := r.sink.Take(p.ref)
		p.ack()
		r.finish(err)
		return nil
	}
	if err := r.sink.Fill(p.conn, scratch); err != nil {
		r.finish(fmt.Errorf("%w: receiving from rank %d: %v", ErrPeerLost, from, err))
		return err
	}
	r.finish(nil)
	return nil
}

// deliverP2P matches a point-to-point frame with the earliest posted receive for its source
// and tag (or any source), or keeps it early. A matched frame goes straight into the
// receive's sink: only frames no receive waits for are charged to the sender's unmatched
// bytes, so a posted receive takes a message of any size.
func (ep *Endpoint) deliverP2P(from int, f *frame, p payload, scratch []byte) error {
	tag := int64(f.seq)
	k := p2pKey{from, tag}
	ep.mu.Lock()
	if ep.broken != nil {
		ep.mu.Unlock()
		return p.discard(f.length)
	}
	if r := ep.matchP2PLocked(k); r != nil {
		ep.fills.Add(1)
		ep.mu.Unlock()
		defer ep.fills.Done()
		r.src = from
		if f.length != uint64(r.sink.Len()) {
			r.finish(p2pSizeError(from, f.length, tag, r.sink.Len()))
			return p.discard(f.length)
		}
		return fill(r, from, p, scratch)
	}
	ep.mu.Unlock()
	e, err := p.keep(ep, f, from)
	if err != nil {
		return err
	}
	ep.mu.Lock()
	if ep.broken != nil {
		ep.mu.Unlock()
		e.release()
		return nil
	}
	r := ep.matchP2PLocked(k) // posted while the frame was read
	if r == nil {
		ep.arrivals++
		e.arrival = ep.arrivals
		ep.p2pEarly[k] = append(ep.p2pEarly[k], e)
		ep.mu.Unlock()
		return nil
	}
	ep.mu.Unlock()
	r.finish(takeP2P(r, e))
	return nil
}

// matchP2PLocked takes the earliest posted receive for k's source and tag, or for any
// source and k's tag; nil when none waits. ep.mu is held.
func (ep *Endpoint) matchP2PLocked(k p2pKey) *Request {
	var r *Request
	sq, aq := ep.p2pPosted[k], ep.anyPosted[k.tag]
	switch {
	case len(sq) > 0 && (len(aq) == 0 || sq[0].post < aq[0].post):
		r, ep.p2pPosted[k] = sq[0], sq[1:]
	case len(aq) > 0:
		r, ep.anyPosted[k.tag] = aq[0], aq[1:]
	}
	return r
}

// outMsg is one frame queued on a link.
type outMsg struct {
	f    frame
	data []byte
	req  *Request
}

// outLink is the one-way link to a peer (invariant 1). Its writer dials on first use.
type outLink struct {
	ep    *Endpoint
	to    int
	quick bool // made only to deliver an abort: one dial attempt, no retries
	mu    sync.Mutex
	cond  *sync.Cond
	q     []*outMsg
	conn  net.Conn
	err   error  // set when the link failed; queued and later messages fail with it
	stop  string // "abort" or "bye": send the final frame after the queue, then close
	why   error
	// beating: the heartbeat asked for a beat; sent only when nothing else was written
	// since the last tick (any frame tells the peer this side lives)
	beating, wrote bool
}

// beat asks the writer for a heartbeat frame, unless it wrote something since the last ask.
func (l *outLink) beat() {
	l.mu.Lock()
	if !l.wrote {
		l.beating = true
		l.cond.Signal()
	}
	l.wrote = false
	l.mu.Unlock()
}

func (l *outLink) enqueue(m *outMsg) {
	l.mu.Lock()
	if l.err != nil {
		err := l.err
		l.mu.Unlock()
		m.req.finish(err)
		return
	}
	l.q = append(l.q, m)
	l.cond.Signal()
	l.mu.Unlock()
}

func (l *outLink) abort(cause error) {
	l.mu.Lock()
	if l.stop == "" {
		l.stop, l.why = "abort", cause
	}
	q := l.q
	l.q = nil
	l.cond.Signal()
	l.mu.Unlock()
	for _, m := range q {
		m.req.finish(cause)
	}
}

func (l *outLink) bye() {
	l.mu.Lock()
	if l.stop == "" {
		l.stop = "bye"
	}
	l.cond.Signal()
	l.mu.Unlock()
}

func (l *outLink) closeConn() {
	l.mu.Lock()
	c := l.conn
	l.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

// fail ends the link: every queued message fails with err.
func (l *outLink) fail(err error) []*outMsg {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err == nil {
		l.err = err
	}
	q := l.q
	l.q = nil
	return q
}

func (l *outLink) run() {
	ep := l.ep
	defer ep.writers.Done()
	conn, refs, err := ep.node.dial(ep, l.to, l.quick)
	if err == nil {
		l.mu.Lock()
		l.conn = conn
		l.mu.Unlock()
		defer conn.Close()
		ep.readers.Add(1)
		go l.watch(conn)
	}
	hdr := make([]byte, frameHeader+refTrailer)
	for {
		l.mu.Lock()
		for len(l.q) == 0 && l.stop == "" && err == nil && !l.beating {
			l.cond.Wait()
		}
		if err == nil && len(l.q) == 0 && l.stop == "" && l.beating {
			l.beating = false
			l.mu.Unlock()
			err = l.writeBeat(conn, hdr)
			continue
		}
		if err != nil || len(l.q) == 0 {
			stop, why := l.stop, l.why
			l.mu.Unlock()
			if err != nil {
				// A peer that said why it broke the group (in the handshake) is reported
				// with its reason; any other failure may be the wake of an abort still on
				// its way, which lost waits for (invariant 7). Queued sends fail with the
				// endpoint's cause, so an op reports the same reason as the endpoint.
				aborted, left := errors.Is(err, ErrAborted), errors.Is(err, errLeft)
				if !aborted {
					err = ep.linkError("went to", l.to, err)
				}
				switch {
				case stop != "": // this rank broke or left already: that cause, not the link's wake
					err = ep.Broken()
				case aborted:
					ep.Break(err)
					err = ep.Broken()
				default:
					l.mu.Lock()
					pending := len(l.q) > 0
					l.mu.Unlock()
					err = ep.lost(l.to, err, pending, left)
					if ep.Broken() != nil {
						ep.abortBack(l.to, err)
					}
				}
				for _, m := range l.fail(err) {
					m.req.finish(err)
				}
				return
			}
			l.fail(fmt.Errorf("%w: link to rank %d is closed", ErrClosed, l.to))
			l.final(conn, hdr, stop, why)
			return
		}
		m := l.q[0]
		l.q = l.q[1:]
		l.wrote = true
		l.mu.Unlock()
		if err = l.write(conn, hdr, m, refs); err != nil {
			// back in front: it fails with the link's error above
			l.mu.Lock()
			l.q = append([]*outMsg{m}, l.q...)
			l.mu.Unlock()
		}
	}
}

// write puts one message on the wire: by reference when the link allows it and the bytes
// lie in a shared segment (the request then finishes on the ack), else inline.
func (l *outLink) write(conn net.Conn, hdr []byte, m *outMsg, refs bool) error {
	ep := l.ep
	f := m.f
	if refs && len(m.data) >= refMin && (f.kind == kindColl || f.kind == kindP2P) {
		if fd, ino, off, ok := ep.node.locate(m.data); ok {
			f.ref = true
			// Break finished the acks it found; one registered after it would wait for an ack
			// that no peer sends, until the op's deadline.
			if !ep.lockOpen(m.req) {
				return nil
			}
			ep.refID++
			id := ep.refID
			ep.acks[ackKey{l.to, id}] = m.req
			ep.mu.Unlock()
			f.encode(hdr)
			conn.SetWriteDeadline(time.Now().Add(ep.node.peerTimeout))
			le := binary.LittleEndian
			t := hdr[frameHeader:]
			le.PutUint32(t, uint32(ep.node.probe.pid))
			le.PutUint32(t[4:], uint32(fd))
			le.PutUint64(t[8:], ino)
			le.PutUint64(t[16:], off)
			le.PutUint64(t[24:], id)
			if _, err := conn.Write(hdr); err != nil {
				ep.mu.Lock()
				delete(ep.acks, ackKey{l.to, id})
				ep.mu.Unlock()
				return err
			}
			ep.BytesSent.Add(uint64(len(m.data)))
			ep.BytesByRef.Add(uint64(len(m.data)))
			return nil
		}
	}
	f.encode(hdr)
	// The deadline moves on with every chunk: a peer that takes no byte for a peer timeout
	// is dead, however large the frame.
	conn.SetWriteDeadline(time.Now().Add(ep.node.peerTimeout))
	first := min(len(m.data), writeChunk)
	bufs := net.Buffers{hdr[:frameHeader], m.data[:first]}
	if _, err := bufs.WriteTo(conn); err != nil {
		return err
	}
	for rest := m.data[first:]; len(rest) > 0; {
		n := min(len(rest), writeChunk)
		conn.SetWriteDeadline(time.Now().Add(ep.node.peerTimeout))
		if _, err := conn.Write(rest[:n]); err != nil {
			return err
		}
		rest = rest[n:]
	}
	ep.BytesSent.Add(uint64(len(m.data)))
	m.req.finish(nil)
	return nil
}

// silenceLimit is the fifths of the peer timeout a link may stay silent (heartbeats go at
// one fifth): the rest is for the break to reach every rank.
const silenceLimit = 4

// writeChunk is how much of an inline payload goes out under one write deadline.
const writeChunk = 4 << 20

// writeBeat sends a heartbeat with this member's progress (kindBeat).
func (l *outLink) writeBeat(conn net.Conn, hdr []byte) error {
	ep := l.ep
	f := frame{kind: kindBeat}
	ep.mu.Lock()
	progress := ep.progress
	ep.mu.Unlock()
	if progress != nil {
		f.seq, f.sig.Count = progress()
	}
	f.encode(hdr)
	conn.SetWriteDeadline(time.Now().Add(ep.node.peerTimeout))
	_, err := conn.Write(hdr[:frameHeader])
	return err
}

// watch reads the link this rank dialed, on which the peer writes only when it cannot
// reach this rank otherwise: an abort (Endpoint.abortBack), which breaks the group here with
// the peer's reason. It ends when the link closes.
func (l *outLink) watch(conn net.Conn) {
	ep := l.ep
	defer ep.readers.Done()
	hdr := make([]byte, frameHeader)
	f, err := readFrame(conn, hdr)
	if err != nil || f.kind != kindAbort {
		return
	}
	if msg, err := readReason(conn, f.length); err == nil {
		ep.Break(fmt.Errorf("%w by rank %d: %s", ErrAborted, l.to, msg))
	}
}

// final writes the closing frame (abort with its reason, or bye), best effort.
func (l *outLink) final(conn net.Conn, hdr []byte, stop string, why error) {
	conn.SetWriteDeadline(time.Now().Add(2 * time.Second))
	if stop == "abort" {
		writeAbort(conn, why.Error())
		return
	}
	f := frame{kind: kindBye}
	f.encode(hdr)
	conn.Write(hdr[:frameHeader])
}
