package transport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gocomm/gocomm/shm"
)

// Errors an op can fail with. They wrap into the error the executor reports.
var (
	// ErrMismatch: ranks called different collectives, or the same one with other sizes.
	ErrMismatch = errors.New("collective mismatch")
	// ErrPeerLost: a peer's sidecar went away (connection closed or refused).
	ErrPeerLost = errors.New("peer lost")
	// ErrAborted: a peer (or this sidecar) broke the group.
	ErrAborted = errors.New("group aborted")
	// ErrClosed: the group was destroyed on this side.
	ErrClosed = errors.New("group closed")
	// ErrProtocol: a peer that holds the group's secret sent what its link did not agree to
	// (a frame by reference on a link granted none, or into another process).
	ErrProtocol = errors.New("peer broke the link protocol")
	// ErrUnmatchedMax: a peer sent more bytes that no receive matched than the node keeps.
	ErrUnmatchedMax = errors.New("too many unmatched bytes from a peer")
)

// Endpoint is this rank's member of one group: its links to the other members and the
// matching of arriving frames to posted receives.
//
// Design (invariants numbered for reference in comments):
//  1. Each ordered pair of ranks has its own one-way link: rank a sends to b only over the
//     connection a dialed, so frames from one peer arrive in the order it sent them.
//  2. A collective's frames are keyed (source, seq, step, slice). A frame that arrives before
//     its receive is posted is kept ("early") and handed over when the receive is posted.
//  3. Because of 1, once a frame of seq s arrives from a peer, no frame of an earlier seq will
//     follow from it: a receive still posted for an earlier seq can never be satisfied, and
//     fails at once as a mismatch (the peer skipped or reshaped that collective).
//  4. A broken endpoint stays broken: every posted and later request fails with the cause,
//     readers drain and discard what still arrives, and the peers are told (abort frames).
//  5. A reader writes into a posted receive's memory only between taking it out of posted
//     (under mu) and finishing it; fills counts those windows, so Quiesce can tell when no
//     reader will touch op memory again.
//  6. A payload sent by reference (same host, kindRef) stays untouched by its sender until
//     the receiver's ack: the send request finishes on the ack, not on the write. The
//     receiver acks only after it has copied or reduced the bytes, and maps a peer's segment
//     read-only, once, for the life of the endpoint. References arrive only on links whose
//     handshake granted them, and name only the process the handshake probed; any other
//     breaks the endpoint (ErrProtocol).
//  7. A peer that breaks the group on purpose says why before its links close: an abort
//     frame on its link to each rank, or (to a rank whose link reaches it only after the
//     break) the reason in the handshake's answer. So a link to a peer that fails without a
//     reason breaks the endpoint as a lost peer only once the peer's own link to this rank
//     ended without an abort frame, or had peerLostGrace to deliver one (lost). A peer that
//     leaves in order (a bye, or its node's answer to a dial that it left) breaks nothing
//     where this rank owes it nothing: receives posted from it fail, and what needs it
//     later fails naming its departure.
//  8. Early frames are charged to their sender (unmatched: inline bytes plus earlyCost each)
//     until taken or released; a sender past Config.UnmatchedMax breaks the endpoint
//     (ErrUnmatchedMax) before its next frame is read into memory.
//  9. A rank runs its collectives one at a time in seq order and says when one is done
//     (OpComm.Done): a frame of a seq this rank finished that no receive took, kept early or
//     arriving after, was sent for a collective this rank ran without it (the ranks disagree
//     on its shape, e.g. its root), and breaks the endpoint as a mismatch. Without this a
//     small frame to a rank that expected none would wait unread forever and every rank
//     would go on with different data.
type Endpoint struct {
	node   *Node
	id     [16]byte
	secret []byte
	rank   int
	size   int
	peers  []string
	log    *slog.Logger

	mu        sync.Mutex
	out       []*outLink
	in        []net.Conn
	left      []bool // peer said bye
	posted    map[collKey]*Request
	early     map[collKey]*early
	lastSeq   []uint64     // per peer: highest seq+1 seen in a collective frame
	done      uint64       // collectives of seq < done finished on this rank (invariant 9)
	doneSigs  [8]Signature // the signatures of the last of them, at seq % 8, for errors
	p2pPosted map[p2pKey][]*Request
	anyPosted map[int64][]*Request
	p2pEarly  map[p2pKey][]*early
	postCount uint64 // orders posted p2p receives (MPI matching order)
	arrivals  uint64 // orders early p2p frames (any-source matching order)
	broken    error
	brokenC   chan struct{}   // closed when the endpoint breaks
	inEnded   []chan struct{} // per peer: closed when its link to this rank ended (invariant 7)
	fills     sync.WaitGroup  // invariant 5
	readers   sync.WaitGroup
	writers   sync.WaitGroup
	ctx       context.Context // canceled by Close: stops dials in progress
	cancel    context.CancelFunc
	// closing is canceled as Close begins (a child of ctx): a handshake in progress has
	// closeGrace from then to finish and carry the bye
	closing    context.Context
	closeStart context.CancelFunc
	acks       map[ackKey]*Request // sends by reference waiting for their ack (invariant 6)
	onBreak    []func(error)
	refID      uint64
	peerMaps   map[mapKey][]byte // peers' segments mapped here (invariant 6)
	unmatched  []atomic.Int64    // per peer: what its early frames are charged (invariant 8)
	progress   func() (started, finished uint64)
	peerSeen   []PeerProgress // per peer: its progress as its last heartbeat told, and when

	BytesSent, BytesReceived atomic.Uint64
	// BytesByRef counts the bytes of BytesSent that went by reference (same host).
	BytesByRef atomic.Uint64
}

// PeerProgress is what a peer's last heartbeat said about its side of the group: how many
// collectives it had started and finished (so the last of each is that count minus one),
// and when that heartbeat arrived (a busy link carries data instead of heartbeats).
type PeerProgress struct {
	Started, Finished uint64
	Heard             time.Time
}

type collKey struct {
	src         int
	seq         uint64
	step, slice uint32
}

type p2pKey struct {
	src int
	tag int64
}

type ackKey struct {
	peer int
	id   uint64
}

type mapKey struct {
	pid, fd int
	ino     uint64
}

// early is a frame that arrived before its receive was posted. data is a copy for inline
// frames, or the bytes in the sender's segment for frames by reference, which are acked
// once taken.
type early struct {
	f       frame
	src     int
	data    []byte
	ack     func()
	arrival uint64
	held    *atomic.Int64 // the sender's unmatched bytes, which cost was charged to
	cost    int64
}

// take hands an early frame's bytes to a sink and releases them.
func (e *early) take(s Sink) error {
	err := s.Take(e.data)
	e.release()
	return err
}

// release tells the sender of a frame by reference that its bytes are free (invariant 6),
// and gives back what the frame was charged.
func (e *early) release() {
	if e.ack != nil {
		e.ack()
	}
	if e.held != nil {
		e.held.Add(-e.cost)
		e.held = nil
	}
}

// Request is a posted receive or a queued send.
type Request struct {
	done  chan struct{}
	err   error
	state atomic.Bool // finished
	peer  int
	what  string // for errors: "step 3 slice 0 of all_reduce #12"
	sink  Sink
	sig   Signature
	post  uint64
	src   int // p2p: the rank the data came from
}

func newRequest(peer int, what string) *Request {
	return &Request{done: make(chan struct{}), peer: peer, what: what, src: -1}
}

func (r *Request) finish(err error) {
	if r.state.CompareAndSwap(false, true) {
		r.err = err
		close(r.done)
	}
}

// Wait blocks until the request finishes or ctx ends.
func (r *Request) Wait(ctx context.Context) error {
	select {
	case <-r.done:
		return r.err
	case <-ctx.Done():
		return fmt.Errorf("waiting for rank %d (%s): %w", r.peer, r.what, ctx.Err())
	}
}

// Source is the rank a finished p2p receive got its data from.
func (r *Request) Source() int { return r.src }

// Rank of this member; Size of the group.
func (ep *Endpoint) Rank() int { return ep.rank }
func (ep *Endpoint) Size() int { return ep.size }

// Broken returns the cause once the endpoint broke, else nil.
func (ep *Endpoint) Broken() error {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return ep.broken
}

// abortReason is what a peer is told when its link arrives after this member broke the
// group: the cause, or "" while the endpoint works or once it was closed in order.
func (ep *Endpoint) abortReason() string {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	if ep.broken == nil || errors.Is(ep.broken, ErrClosed) {
		return ""
	}
	r := ep.broken.Error()
	if len(r) > maxReason {
		r = r[:maxReason]
	}
	return r
}

// peerLostGrace bounds how long a failed link to a peer waits for that peer's abort frame
// (invariant 7) before the endpoint breaks with the peer lost. A peer that died closes its
// link to this rank too, which ends the wait at once.
const peerLostGrace = time.Second

// lost handles the failure of this rank's link to peer (err: ErrPeerLost): if the peer broke
// the group, its abort frame may still be on its way on its own link to this rank, and the
// endpoint must break with that reason, not with the link's error. Wait until the endpoint
// broke (the abort arrived), the peer's link ended without one, peerLostGrace passed, or
// the endpoint closed; then break with err (kept only if nothing broke it first). A peer
// that left in order (it said bye, or its node answered the dial so: answered) breaks
// nothing where this rank had nothing queued for it (pending false): it left as the reader's
// bye handling has it, and whatever needs it later fails naming its departure. A peer
// whose node answered that it left may still have frames on their way to this rank on its
// own link, its bye after them: where that link is up, the wait lets them in first, so a
// receive they match is not failed for a departure they preceded. It returns the error the
// link's requests fail with.
func (ep *Endpoint) lost(peer int, err error, pending, answered bool) error {
	ep.mu.Lock()
	inbound := ep.in[peer] != nil
	ep.mu.Unlock()
	if !answered || inbound {
		t := time.NewTimer(peerLostGrace)
		defer t.Stop()
		select {
		case <-ep.brokenC:
		case <-ep.inEnded[peer]:
		case <-t.C:
		case <-ep.ctx.Done():
		}
	}
	ep.mu.Lock()
	left := ep.left[peer] || answered
	ep.left[peer] = left
	ep.mu.Unlock()
	if left && !pending {
		ep.failPostedFrom(peer)
		return leftError(peer)
	}
	if left { // it said bye first: it destroyed its group, or its process closed it
		err = fmt.Errorf("%w: rank %d left the group while this rank still had data for it (%s)", ErrPeerLost, peer,
			strings.TrimPrefix(err.Error(), ErrPeerLost.Error()+": "))
	}
	ep.Break(err)
	return ep.Broken()
}

// leftError is what a request that needs a peer which left the group in order fails with.
func leftError(peer int) error { return fmt.Errorf("%w: rank %d left the group", ErrPeerLost, peer) }

func allLeftError() error {
	return fmt.Errorf("%w: receive from any rank: every other rank left the group", ErrPeerLost)
}

// allLeftLocked: no other rank is left to send anything (an any-source receive waits for
// nobody). ep.mu is held.
func (ep *Endpoint) allLeftLocked() bool {
	for p := range ep.size {
		if p != ep.rank && !ep.left[p] {
			return false
		}
	}
	return true
}

// opName names op codes in errors about a peer's signature; SetOpNames installs it.
var opName func(op uint8) string

// SetOpNames tells the transport how to name the op codes of signatures (call once, at start).
func SetOpNames(f func(op uint8) string) { opName = f }

// named gives a peer's signature (whose name is not sent) the name this rank's op of its code
// has, for describe.
func named(theirs, ours Signature) Signature {
	if theirs.Op == ours.Op {
		theirs.OpName = ours.OpName
	} else if opName != nil {
		theirs.OpName = opName(theirs.Op)
	}
	return theirs
}

// unreadLocked is the mismatch of invariant 9: from sent f for a collective this rank
// finished without taking it. Called with mu held.
func (ep *Endpoint) unreadLocked(from int, f *frame) error {
	ours := fmt.Sprintf("collective #%d", f.seq)
	var sig Signature
	if f.seq+uint64(len(ep.doneSigs)) >= ep.done { // recent enough to be remembered
		sig = ep.doneSigs[f.seq%uint64(len(ep.doneSigs))]
		ours = describe(sig)
	}
	return fmt.Errorf("%w: rank %d sent a part of %s #%d, which this rank ran as %s without a part from rank %d",
		ErrMismatch, from, describe(named(f.sig, sig)), f.seq, ours, from)
}

// describe renders a signature for errors, e.g. "op 1 (float32 sum, root 0, count 1024)".
func describe(s Signature) string {
	name := s.OpName
	if name == "" {
		name = fmt.Sprintf("op %d", s.Op)
	}
	return fmt.Sprintf("%s(dtype=%s, op=%s, root=%d, count=%d)", name, s.DType, s.RedOp, s.Root, s.Count)
}

// SendP2P queues a point-to-point message for rank to under tag.
func (ep *Endpoint) SendP2P(to int, tag int64, data []byte) *Request {
	f := frame{kind: kindP2P, seq: uint64(tag), length: uint64(len(data))}
	return ep.send(to, f, data, fmt.Sprintf("send tag %d", tag))
}

// RecvP2P posts a point-to-point receive from rank from (or any rank when from < 0).
func (ep *Endpoint) RecvP2P(from int, tag int64, s Sink) *Request {
	r := newRequest(from, fmt.Sprintf("recv tag %d", tag))
	r.sink = s
	if from >= ep.size || from == ep.rank {
		r.finish(fmt.Errorf("recv from rank %d in a group of %d", from, ep.size))
		return r
	}
	if !ep.lockOpen(r) {
		return r
	}
	var e *early
	if from >= 0 {
		k := p2pKey{from, tag}
		if q := ep.p2pEarly[k]; len(q) > 0 {
			e = q[0]
			ep.p2pEarly[k] = q[1:]
		}
	} else {
		// any source: the earliest arrival with this tag
		var best p2pKey
		for k, q := range ep.p2pEarly {
			if k.tag == tag && len(q) > 0 && (e == nil || q[0].arrival < e.arrival) {
				e, best = q[0], k
			}
		}
		if e != nil {
			ep.p2pEarly[best] = ep.p2pEarly[best][1:]
		}
	}
	if e != nil {
		ep.mu.Unlock()
		r.finish(takeP2P(r, e))
		return r
	}
	if from >= 0 && ep.left[from] {
		ep.mu.Unlock()
		r.finish(leftError(from))
		return r
	}
	if from < 0 && ep.allLeftLocked() {
		ep.mu.Unlock()
		r.finish(allLeftError())
		return r
	}
	ep.postCount++
	r.post = ep.postCount
	if from >= 0 {
		k := p2pKey{from, tag}
		ep.p2pPosted[k] = append(ep.p2pPosted[k], r)
	} else {
		ep.anyPosted[tag] = append(ep.anyPosted[tag], r)
	}
	ep.mu.Unlock()
	return r
}

func takeP2P(r *Request, e *early) error {
	r.src = e.src
	if e.f.length != uint64(r.sink.Len()) {
		e.release()
		return p2pSizeError(r.src, e.f.length, int64(e.f.seq), r.sink.Len())
	}
	return e.take(r.sink)
}

func p2pSizeError(from int, sent uint64, tag int64, holds int) error {
	return fmt.Errorf("%w: recv: rank %d sent %d bytes with tag %d, the receiving tensor holds %d", ErrMismatch,
		from, sent, tag, holds)
}

// lockOpen locks ep for matching or queueing r; where the endpoint is broken it finishes r
// with the cause instead and returns false, ep unlocked.
func (ep *Endpoint) lockOpen(r *Request) bool {
	ep.mu.Lock()
	if ep.broken != nil {
		err := ep.broken
		ep.mu.Unlock()
		r.finish(err)
		return false
	}
	return true
}

// send queues a frame on the link to rank to.
func (ep *Endpoint) send(to int, f frame, data []byte, what string) *Request {
	r := newRequest(to, what)
	if to < 0 || to >= ep.size || to == ep.rank {
		r.finish(fmt.Errorf("send to rank %d in a group of %d", to, ep.size))
		return r
	}
	if !ep.lockOpen(r) {
		return r
	}
	l := ep.linkLocked(to)
	ep.mu.Unlock()
	l.enqueue(&outMsg{f: f, data: data, req: r})
	return r
}

// OnBreak registers f to be called (once) with the cause when the endpoint breaks; an
// endpoint already broken calls it at once.
func (ep *Endpoint) OnBreak(f func(error)) {
	ep.mu.Lock()
	if err := ep.broken; err != nil {
		ep.mu.Unlock()
		f(err)
		return
	}
	ep.onBreak = append(ep.onBreak, f)
	ep.mu.Unlock()
}

// SetProgress tells the endpoint how far this member got (collectives started and finished),
// which its heartbeats carry to the peers.
func (ep *Endpoint) SetProgress(f func() (started, finished uint64)) {
	ep.mu.Lock()
	ep.progress = f
	ep.mu.Unlock()
}

// Peers returns each peer's progress as its heartbeats told (this rank's entry is zero).
func (ep *Endpoint) Peers() []PeerProgress {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return append([]PeerProgress(nil), ep.peerSeen...)
}

// PeerTimeout is how long a peer may stay silent before it counts as dead.
func (ep *Endpoint) PeerTimeout() time.Duration { return ep.node.peerTimeout }

// heartbeat wakes every idle link five times per peer timeout, so that each sends a beat and
// the peers' readers, which give a link up after four fifths of it in silence, know this side
// lives. It runs until the endpoint breaks or closes.
func (ep *Endpoint) heartbeat() {
	t := time.NewTicker(ep.node.peerTimeout / 5)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-ep.brokenC:
			return
		case <-ep.ctx.Done():
			return
		}
		ep.mu.Lock()
		links := append([]*outLink(nil), ep.out...)
		ep.mu.Unlock()
		for _, l := range links {
			if l != nil {
				l.beat()
			}
		}
	}
}

// Connect starts the links to every peer (in the background) instead of on first use, so
// that each peer also dials this rank and the death of any of them closes a link here.
func (ep *Endpoint) Connect() {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	if ep.broken != nil {
		return
	}
	for to := 0; to < ep.size; to++ {
		if to != ep.rank {
			ep.linkLocked(to)
		}
	}
}

// linkLocked returns the link to rank to, starting its writer on first use.
func (ep *Endpoint) linkLocked(to int) *outLink {
	if l := ep.out[to]; l != nil {
		return l
	}
	l := &outLink{ep: ep, to: to, quick: ep.broken != nil}
	l.cond = sync.NewCond(&l.mu)
	ep.out[to] = l
	ep.writers.Add(1)
	go l.run()
	return l
}

// Break marks the endpoint broken with cause (invariant 4): fails every posted receive, tells
// the peers, and from then on fails every new request. Breaking twice keeps the first cause.
func (ep *Endpoint) Break(cause error) {
	ep.mu.Lock()
	if ep.broken != nil {
		ep.mu.Unlock()
		return
	}
	ep.broken = cause
	close(ep.brokenC)
	var reqs []*Request
	for k, r := range ep.posted {
		reqs = append(reqs, r)
		delete(ep.posted, k)
	}
	for k, q := range ep.p2pPosted {
		reqs = append(reqs, q...)
		delete(ep.p2pPosted, k)
	}
	for k, q := range ep.anyPosted {
		reqs = append(reqs, q...)
		delete(ep.anyPosted, k)
	}
	for k, r := range ep.acks {
		reqs = append(reqs, r)
		delete(ep.acks, k)
	}
	clear(ep.early)
	clear(ep.p2pEarly)
	var links []*outLink
	for to := range ep.out {
		if to != ep.rank && !ep.left[to] && !errors.Is(cause, ErrClosed) {
			links = append(links, ep.linkLocked(to))
		} else if ep.out[to] != nil {
			links = append(links, ep.out[to])
		}
	}
	hooks := ep.onBreak
	ep.mu.Unlock()
	for _, h := range hooks {
		h(cause)
	}
	if errors.Is(cause, ErrClosed) {
		ep.log.Debug("group closed", "rank", ep.rank)
	} else {
		ep.log.Warn("group broken", "rank", ep.rank, "cause", cause)
	}
	for _, r := range reqs {
		r.finish(cause)
	}
	for _, l := range links {
		if errors.Is(cause, ErrClosed) {
			l.bye() // leaving on purpose: peers learn it from the bye, not an abort
		}
		l.abort(cause)
	}
}

// Quiesce waits until no reader writes into op memory any more (invariant 5); after limit it
// closes the inbound connections to cut fills short. Call after Break.
func (ep *Endpoint) Quiesce(limit time.Duration) {
	done := make(chan struct{})
	go func() { ep.fills.Wait(); close(done) }()
	select {
	case <-done:
		return
	case <-time.After(limit):
	}
	ep.closeInbound()
	<-done
}

func (ep *Endpoint) closeInbound() {
	ep.mu.Lock()
	conns := append([]net.Conn(nil), ep.in...)
	ep.mu.Unlock()
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
}

// abortBack tells peer why the group broke over the link peer dialed to this rank: this
// rank's own link to peer could not be made (peer advertised an address this host does not
// reach), so an abort frame on it would never arrive, and peer would wait for its timeout.
func (ep *Endpoint) abortBack(peer int, cause error) {
	ep.mu.Lock()
	c := ep.in[peer]
	ep.mu.Unlock()
	if c == nil {
		return
	}
	c.SetWriteDeadline(time.Now().Add(abortGrace))
	writeAbort(c, cause.Error())
}

// abortGrace bounds how long Close waits for a broken endpoint's abort frames to be written.
const abortGrace = 2 * time.Second

// Close leaves the group: peers get a bye, links close, and every request still pending
// fails with ErrClosed. A broken endpoint first lets its abort frames reach the peers (at
// most abortGrace); else a link still dialing (a peer that has not joined yet: ranks leave
// and join a group at different times) or in its handshake may connect to carry the bye (at
// most closeGrace), since a peer that never hears it takes this rank for lost once its
// process is gone. It does not wait for the peers to leave too.
func (ep *Endpoint) Close() {
	ep.closeStart()
	ep.node.leave(ep)
	ep.mu.Lock()
	aborting := ep.broken != nil && !errors.Is(ep.broken, ErrClosed)
	ep.mu.Unlock()
	ep.Break(fmt.Errorf("%w", ErrClosed)) // sends byes, fails what is pending
	done := make(chan struct{})
	go func() { ep.writers.Wait(); close(done) }()
	// The abort frames or byes are still on their way (a peer that joins late may not have
	// accepted the link yet); cancelling now would leave that peer waiting for data until
	// its timeout, or taking this rank for lost. Give them the quick dial's time (aborts) or
	// closeGrace (byes).
	grace := closeGrace
	if aborting {
		grace = abortGrace
	}
	select {
	case <-done:
	case <-time.After(grace):
	}
	ep.cancel() // links still dialing give up
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		ep.mu.Lock()
		links := append([]*outLink(nil), ep.out...)
		ep.mu.Unlock()
		for _, l := range links {
			if l != nil {
				l.closeConn()
			}
		}
	}
	<-done
	ep.closeInbound()
	ep.readers.Wait()
	ep.mu.Lock()
	maps := ep.peerMaps
	ep.peerMaps = map[mapKey][]byte{}
	ep.mu.Unlock()
	for _, m := range maps {
		shm.Unmap(m)
	}
}
