package transport

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gocomm/gocomm/shm"
)

// Node is a sidecar's presence on the network: one TCP listener that peers dial, and the
// group endpoints it routes accepted links to.
type Node struct {
	ln        net.Listener
	advertise string
	log       *slog.Logger
	joinWait  time.Duration
	dialLimit time.Duration
	locate    func(b []byte) (fd int, ino, off uint64, ok bool)
	probe     probe
	probeSeg  *shm.Segment
	probeSelf bool // Config.ProbeOwnProcess
	// peerTimeout: a link that carries no frame for this long is dead (Config.PeerTimeout)
	peerTimeout time.Duration
	// handshake bounds an unauthenticated link's handshake; handshakesMax caps how many are
	// in progress at once (the oldest is closed to make room for a new one).
	handshake     time.Duration
	handshakesMax int
	unmatchedMax  int64
	rejects       *rateLog

	mu     sync.Mutex
	groups map[[16]byte]*Endpoint
	gone   map[[16]byte]*departed // groups this node left: a link for one is answered at once
	left   []goneID               // gone's entries, oldest first: at most goneMax are kept
	closed bool
	ending bool // Ending: a link for a group not here is answered errGone, not errUnknownGroup

	hsMu      sync.Mutex
	pending   []*handshaking // accepted links whose hello has not been answered, oldest first
	answering []*handshaking // links past their hello, waiting for the dialer's proof, oldest first
}

// handshaking is an accepted link in its handshake.
type handshaking struct {
	conn    net.Conn
	evicted bool // closed to make room; the handshake must not go on
}

// Config of a Node.
type Config struct {
	// Listen is the host:port to listen on (port 0: any); empty: Advertise's host, port 0
	// (the listener is open on the advertised address only).
	Listen string
	// Advertise is the host peers dial; the port is the one Listen got.
	Advertise string
	Log       *slog.Logger
	// JoinWait bounds how long a dialer keeps retrying a peer that answers that it has not
	// joined the group yet (a peer may dial before this member finished ConnectGroup; the
	// acceptor answers at once and holds nothing for it). Default 60 s.
	JoinWait time.Duration
	// HandshakeTimeout bounds an accepted or dialed link's handshake. Default 5 s.
	HandshakeTimeout time.Duration
	// HandshakesMax caps the accepted links in their handshake (not yet authenticated); a
	// new one closes the oldest. Default 64.
	HandshakesMax int
	// UnmatchedMax caps the bytes a peer's frames that no receive has matched yet may hold
	// here (per peer and group); a peer that sends more breaks the group. Default 1 GiB.
	UnmatchedMax int64
	// DialTimeout bounds connecting to a peer, retries included (a refused connection is
	// retried: the peer may be restarting its listener). Default 10 s.
	DialTimeout time.Duration
	// Locate finds bytes inside a shared-memory segment this process holds open (fd, the
	// file's inode, the offset). Given it, links to peers on this host carry large payloads
	// by reference: the peer maps the segment and reads the bytes in place (one copy instead
	// of a trip through the kernel's socket buffers). Nil: every payload goes inline.
	Locate func(b []byte) (fd int, ino, off uint64, ok bool)
	// ShmDir holds the probe file peers open to check they share this host.
	ShmDir string
	// ProbeOwnProcess lets a dialer pass the same-host probe with a probe of this very
	// process (tests that run several nodes in one process). Off, as pgserver runs: a peer
	// naming this process would get references into every file it holds.
	ProbeOwnProcess bool
	// PeerTimeout is the most a dead or silent peer holds up the group: every link carries a
	// heartbeat at a fifth of it when idle, and a link that carries no frame for four fifths
	// of it, or takes none of this side's bytes for all of it, breaks the group with the
	// peer lost. Default 5 s.
	PeerTimeout time.Duration
}

// socketBuffer is the send and receive buffer asked for on every link: large enough to keep
// a 1 MiB slice in flight while the receiver reduces the previous one.
const socketBuffer = 4 << 20

// Listen starts a node.
func Listen(cfg Config) (*Node, error) {
	listen := cfg.Listen
	if listen == "" {
		listen = net.JoinHostPort(cfg.Advertise, "0")
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("transport: listen on %s: %w (the advertised address must be one of this host's: "+
			"check GOCOMM_ADVERTISE_ADDR and GOCOMM_SOCKET_IFNAME, or set GOCOMM_LISTEN_ADDR)", listen, err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	n := &Node{
		ln:          ln,
		advertise:   net.JoinHostPort(cfg.Advertise, port),
		log:         cfg.Log,
		joinWait:    cmp.Or(cfg.JoinWait, 60*time.Second),
		dialLimit:   cmp.Or(cfg.DialTimeout, 10*time.Second),
		peerTimeout: cmp.Or(cfg.PeerTimeout, 5*time.Second),
		handshake:   cmp.Or(cfg.HandshakeTimeout, 5*time.Second),
		// a cap of 1 would let every new connection close the one before it
		handshakesMax: max(cmp.Or(cfg.HandshakesMax, 64), 2),
		probeSelf:     cfg.ProbeOwnProcess,
		unmatchedMax:  cmp.Or(cfg.UnmatchedMax, 1<<30),
		groups:        map[[16]byte]*Endpoint{},
		gone:          map[[16]byte]*departed{},
	}
	if n.log == nil {
		n.log = slog.Default()
	}
	n.rejects = newRateLog(n.log, time.Second)
	if cfg.Locate != nil {
		if err := n.makeProbe(cmp.Or(cfg.ShmDir, shm.DefaultDir())); err != nil {
			n.log.Warn("same-host transfers by reference are off", "err", err)
		} else {
			n.locate = cfg.Locate
		}
	}
	go n.serve()
	return n, nil
}

// The probe file: probeMagic, then the token, in probeSize bytes. A peer reads it only where
// it is a probe (that size, unlinked, the magic first), so the prefix of another file of some
// process (a ring file, whose first bytes are public) cannot pass for one.
const (
	probeMagic = "GOCOMMP1"
	probeSize  = 4096
)

// makeProbe creates the small file (held open, already unlinked) whose token proves to a
// peer that it can open this process's segments.
func (n *Node) makeProbe(dir string) error {
	seg, err := shm.Create(dir, "gocomm-probe", probeSize)
	if err != nil {
		return err
	}
	if _, err := rand.Read(n.probe.token[:]); err != nil {
		seg.Close()
		return err
	}
	copy(seg.Data, probeMagic)
	copy(seg.Data[len(probeMagic):], n.probe.token[:])
	seg.Unlink()
	n.probeSeg = seg
	n.probe.pid, n.probe.fd = os.Getpid(), int(seg.File.Fd())
	return nil
}

// canMap runs the acceptor's side of the same-host probe. The dialer must name a probe file
// of a process other than this one: references into this process's own files would read
// what other sessions keep there.
func (n *Node) canMap(p probe) bool {
	if n.locate == nil || (p.pid == os.Getpid() && !n.probeSelf) { // this side does not take part (it would also not map peers)
		return false
	}
	b, err := shm.ReadPeer(p.pid, p.fd, len(probeMagic)+len(p.token), probeSize)
	return err == nil && string(b[:len(probeMagic)]) == probeMagic && bytes.Equal(b[len(probeMagic):], p.token[:])
}

// Addr is the address peers dial.
func (n *Node) Addr() string { return n.advertise }

// Close stops accepting links. Endpoints close on their own.
func (n *Node) Close() error {
	n.mu.Lock()
	n.closed = true
	n.mu.Unlock()
	n.hsMu.Lock()
	for _, h := range append(n.pending, n.answering...) {
		h.evicted = true // a proof that comes after cannot be granted
		h.conn.Close()
	}
	n.pending, n.answering = nil, nil
	n.hsMu.Unlock()
	if n.probeSeg != nil {
		n.probeSeg.Close()
	}
	return n.ln.Close()
}

// Join registers this rank's member of a group whose secret is secret; peers[i] is the
// address of rank i's node.
func (n *Node) Join(secret []byte, rank int, peers []string) (*Endpoint, error) {
	size := len(peers)
	if rank < 0 || rank >= size {
		return nil, fmt.Errorf("transport: rank %d in a group of %d", rank, size)
	}
	if len(secret) < 16 {
		return nil, fmt.Errorf("transport: group secret of %d bytes, want at least 16", len(secret))
	}
	ctx, cancel := context.WithCancel(context.Background())
	closing, closeStart := context.WithCancel(ctx)
	ep := &Endpoint{
		ctx:        ctx,
		cancel:     cancel,
		closing:    closing,
		closeStart: closeStart,
		node:       n,
		id:         GroupID(secret),
		secret:     append([]byte(nil), secret...),
		rank:       rank,
		size:       size,
		peers:      append([]string(nil), peers...),
		log:        n.log,
		out:        make([]*outLink, size),
		in:         make([]net.Conn, size),
		left:       make([]bool, size),
		posted:     map[collKey]*Request{},
		early:      map[collKey]*early{},
		lastSeq:    make([]uint64, size),
		p2pPosted:  map[p2pKey][]*Request{},
		anyPosted:  map[int64][]*Request{},
		p2pEarly:   map[p2pKey][]*early{},
		acks:       map[ackKey]*Request{},
		peerMaps:   map[mapKey][]byte{},
		brokenC:    make(chan struct{}),
		inEnded:    make([]chan struct{}, size),
		unmatched:  make([]atomic.Int64, size),
		peerSeen:   make([]PeerProgress, size),
	}
	for i := range ep.inEnded {
		ep.inEnded[i] = make(chan struct{})
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		cancel()
		return nil, errors.New("transport: node closed")
	}
	if _, dup := n.groups[ep.id]; dup {
		cancel()
		return nil, errors.New("transport: this node already joined a group with that secret")
	}
	n.groups[ep.id] = ep
	delete(n.gone, ep.id)
	go ep.heartbeat() // every link a peer reads gets beats, dialed eagerly (Connect) or not
	return ep, nil
}

// departed is what a node remembers of a group it left. A group it broke keeps its secret
// and the cause, so that a peer whose link arrives only after the leave (it joined late) is
// told why the group broke instead of finding the link closed, which reads as a dead peer.
type departed struct {
	secret []byte // nil: the group was left in order (a bye); links are refused
	reason string
}

// goneID names one departure (a group left, joined again and left is two: two entries).
type goneID struct {
	id [16]byte
	d  *departed
}

// goneMax bounds the departures a node remembers, so that a process that makes and destroys
// groups all along does not grow with them: a peer's link comes within its join wait of the
// leave, and by then many more groups are rarely left.
var goneMax = 4096

// leave forgets ep's group, remembering why it broke if it did.
func (n *Node) leave(ep *Endpoint) {
	d := &departed{}
	if reason := ep.abortReason(); reason != "" {
		d.secret, d.reason = ep.secret, reason
	}
	n.mu.Lock()
	if n.groups[ep.id] == ep {
		delete(n.groups, ep.id)
		n.gone[ep.id] = d
		n.left = append(n.left, goneID{ep.id, d})
		for len(n.left) > goneMax {
			old := n.left[0]
			n.left = n.left[1:]
			if n.gone[old.id] == old.d { // not a later departure of the same group
				delete(n.gone, old.id)
			}
		}
	}
	n.mu.Unlock()
}

// Ending tells the node its sidecar is ending because its training process died: from now
// on a link for a group not joined here is answered errGone (the dialer breaks the group at
// once) instead of errUnknownGroup (it would retry until this process is gone, then for a
// quarter of the peer timeout while its connections are refused).
func (n *Node) Ending() {
	n.mu.Lock()
	n.ending = true
	n.mu.Unlock()
}

// answerLink finds what a link for group id is answered with: the group's secret, and the
// reason it broke when it did (the handshake then hands the reason over instead of opening
// the link). It never waits: a group not joined here is errUnknownGroup (the dialer
// retries), or errGone once the node is Ending; one left in order errLeft.
func (n *Node) answerLink(id [16]byte) (*Endpoint, []byte, string, error) {
	n.mu.Lock()
	ep, d, closed, ending := n.groups[id], n.gone[id], n.closed, n.ending
	n.mu.Unlock()
	switch {
	case ep != nil:
		return ep, ep.secret, ep.abortReason(), nil
	case d != nil && d.secret == nil:
		return nil, nil, "", errLeft
	case d != nil:
		return nil, d.secret, d.reason, nil
	case closed:
		return nil, nil, "", fmt.Errorf("%w: this node is closing", ErrAuth)
	case ending:
		return nil, nil, "", errGone
	}
	return nil, nil, "", errUnknownGroup
}

func (n *Node) serve() {
	var backoff time.Duration
	for {
		conn, err := n.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// out of fds or the like: the connection stays in the backlog; try again a
			// little later, and say so at most once a second
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			n.rejects.warn("accepting a peer link failed", "err", err, "retry_in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		go n.accept(n.admit(conn))
	}
}

// admit puts conn among the links in their handshake. When handshakesMax links wait for
// their hello to be answered, the oldest is answered statusBusy and closed: junk and
// half-open connections cannot pile up, a real peer's hello (one write) is answered long
// before a flood reaches the cap's worth of newer connections, and a real peer that was
// dropped all the same retries.
func (n *Node) admit(conn net.Conn) *handshaking {
	h := &handshaking{conn: conn}
	n.hsMu.Lock()
	defer n.hsMu.Unlock()
	n.pending = append(n.makeRoom(n.pending, true, "closed an unauthenticated peer link to make room"), h)
	return h
}

// makeRoom closes the oldest link of q where q holds handshakesMax (hsMu held), answering it
// statusBusy first where busy (a link that has not been answered yet), and logs why; it
// returns the rest of q.
func (n *Node) makeRoom(q []*handshaking, busy bool, why string) []*handshaking {
	if len(q) < n.handshakesMax {
		return q
	}
	old := q[0]
	old.evicted = true
	if busy {
		old.conn.SetWriteDeadline(time.Now().Add(10 * time.Millisecond))
		old.conn.Write(busyAnswer())
	}
	old.conn.Close()
	n.rejects.warn(why, "remote", old.conn.RemoteAddr().String(), "cap", n.handshakesMax)
	return q[1:]
}

// errEvicted: the link was closed to make room (makeRoom); the handshake must not go on.
var errEvicted = fmt.Errorf("%w: dropped to make room for newer links", ErrAuth)

// claim moves h from the links waiting for their hello's answer to those waiting for the
// dialer's proof, which are also at most handshakesMax: past that the oldest of those is
// closed, as admit does. A hello costs nothing to forge or replay for whoever saw a group's
// id (it goes in the clear), so refusing the newest instead would let a few forged hellos
// every handshake timeout keep every real peer out; a real dialer's proof follows the
// answer within a round trip, and one closed before its grant retries (dialHandshake). An
// evicted link is ErrAuth: its connection is closed.
func (n *Node) claim(h *handshaking) error {
	n.hsMu.Lock()
	defer n.hsMu.Unlock()
	if h.evicted {
		return errEvicted
	}
	n.pending = remove(n.pending, h)
	n.answering = append(n.makeRoom(n.answering, false, "closed a peer link waiting for its proof to make room"), h)
	return nil
}

// proved takes h, whose dialer's proof verified, out of the links claim may close; one it
// closed already is ErrAuth.
func (n *Node) proved(h *handshaking) error {
	n.hsMu.Lock()
	defer n.hsMu.Unlock()
	if h.evicted {
		return errEvicted
	}
	n.answering = remove(n.answering, h)
	return nil
}

// done takes h out of the links in their handshake; it reports whether h was evicted.
func (n *Node) done(h *handshaking) bool {
	n.hsMu.Lock()
	defer n.hsMu.Unlock()
	n.pending = remove(n.pending, h)
	n.answering = remove(n.answering, h)
	return h.evicted
}

func remove(hs []*handshaking, h *handshaking) []*handshaking {
	return slices.DeleteFunc(hs, func(p *handshaking) bool { return p == h })
}

func (n *Node) accept(hs *handshaking) {
	conn := hs.conn
	conn.SetDeadline(time.Now().Add(n.handshake))
	var ep *Endpoint
	h, refs, err := acceptHandshake(conn, func(id [16]byte) ([]byte, string, error) {
		if err := n.claim(hs); err != nil {
			return nil, "", err
		}
		var secret []byte
		var reason string
		var err error
		ep, secret, reason, err = n.answerLink(id)
		return secret, reason, err
	}, n.canMap, func() error { return n.proved(hs) })
	if n.done(hs) && err != nil { // closed to make room (admit, claim), which said so
		conn.Close()
		return
	}
	if errors.Is(err, ErrAborted) {
		n.log.Info("answered a link with the group's abort", "remote", conn.RemoteAddr().String(), "from", h.from, "to", h.to, "detail", err)
		conn.Close()
		return
	}
	if errors.Is(err, errUnknownGroup) || errors.Is(err, errLeft) || errors.Is(err, errGone) {
		n.log.Debug("answered a link for a group not here", "remote", conn.RemoteAddr().String(), "from", h.from, "to", h.to, "detail", err)
		conn.Close()
		return
	}
	if errors.Is(err, errNoHello) {
		n.log.Debug("a peer link closed before its hello", "remote", conn.RemoteAddr().String())
		conn.Close()
		return
	}
	if err != nil {
		n.rejects.warn("rejected peer link", "remote", conn.RemoteAddr().String(), "err", err)
		conn.Close()
		return
	}
	conn.SetDeadline(time.Time{})
	tune(conn) // only now: a connection that never authenticates costs no setsockopt calls
	from := int(h.from)
	if int(h.to) != ep.rank || from < 0 || from >= ep.size || from == ep.rank {
		n.rejects.warn("rejected peer link", "from", from, "to", h.to, "rank", ep.rank, "size", ep.size)
		conn.Close()
		return
	}
	ep.mu.Lock()
	if ep.in[from] != nil || ep.broken != nil {
		broken := ep.broken
		ep.mu.Unlock()
		if broken != nil {
			n.log.Debug("closed a peer link to a broken or closed group", "from", from, "cause", broken)
		} else {
			n.rejects.warn("rejected duplicate peer link", "from", from)
		}
		conn.Close()
		return
	}
	ep.in[from] = conn
	ep.readers.Add(1)
	ep.mu.Unlock()
	var refPID int // the only process a reference on this link may name
	if refs {
		refPID = h.probe.pid
	}
	go ep.reader(from, conn, refPID)
}

// dial connects and authenticates the link from ep's rank to rank to. Refused connections
// and busy answers (the peer's listener may still be starting, or dropped the handshake to
// make room for newer ones) are retried until the dial timeout; a peer that has not
// joined the group yet, until the join wait ends. quick bounds it all by abortGrace and
// retries only a peer that has not joined (links that only carry an abort). Close of the
// endpoint stops it (a handshake in progress, after closeGrace).
func (n *Node) dial(ep *Endpoint, to int, quick bool) (net.Conn, bool, error) {
	limit := max(n.dialLimit, n.joinWait)
	if quick {
		limit = abortGrace
	}
	ctx, cancel := context.WithTimeout(ep.ctx, limit)
	defer cancel()
	start := time.Now()
	d := net.Dialer{KeepAlive: 15 * time.Second}
	pause := 10 * time.Millisecond
	for {
		var retry bool
		conn, refs, err := n.dialOnce(ctx, &d, ep, to)
		switch {
		case err == nil:
			return conn, refs, nil
		case errors.Is(err, ErrAborted): // the peer broke the group: its reason, as an abort frame says it
			return nil, false, err
		case errors.Is(err, errUnknownGroup): // also for an abort: the peer may be about to join
			retry = time.Since(start) < n.joinWait
		case errors.Is(err, syscall.ECONNREFUSED):
			// A refused connection is retried for a quarter of the peer timeout only: the
			// peer published its address after it listened, so a refusal that lasts means it
			// died.
			retry = !quick && time.Since(start) < min(n.dialLimit, n.peerTimeout/4)
		case errors.Is(err, errBusy):
			retry = !quick && time.Since(start) < n.dialLimit
		}
		if !retry || ctx.Err() != nil {
			var df *dialFailure
			if quick || ep.ctx.Err() != nil || !errors.As(err, &df) {
				return nil, false, fmt.Errorf("link to %s: %w", ep.peers[to], err)
			}
			if ctx.Err() != nil {
				err = fmt.Errorf("no connection within %s: %w", limit, err)
			}
			return nil, false, unreachable(to, ep.peers[to], err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(pause):
		}
		pause = min(2*pause, 200*time.Millisecond)
	}
}

// dialOnce makes one connection to rank to and runs the dialer's handshake on it.
func (n *Node) dialOnce(ctx context.Context, d *net.Dialer, ep *Endpoint, to int) (net.Conn, bool, error) {
	conn, err := d.DialContext(ctx, "tcp", ep.peers[to])
	if err != nil {
		return nil, false, &dialFailure{err}
	}
	tune(conn)
	deadline := time.Now().Add(n.handshake)
	conn.SetDeadline(deadline)
	var pr probe
	if n.locate != nil {
		pr = n.probe
	}
	// The endpoint's Close cuts a handshake short (the peer may never answer), closeGrace
	// after it began: a live peer may have taken the link already (it does once it sent its
	// grant), and a link that ends without a frame reads there as a lost peer. Finished in
	// the grace, the link carries the bye (or abort) this rank leaves with.
	// (under mu, once the handshake ended: a late callback must not put its deadline on the
	// finished link)
	var mu sync.Mutex
	ended := false
	stop := context.AfterFunc(ep.closing, func() {
		mu.Lock()
		defer mu.Unlock()
		if d := time.Now().Add(closeGrace); !ended && d.Before(deadline) {
			conn.SetDeadline(d)
		}
	})
	refs, err := dialHandshake(conn, ep.secret, ep.rank, to, pr)
	mu.Lock()
	ended = true
	mu.Unlock()
	stop()
	if err != nil {
		conn.Close()
		if errors.Is(err, ErrAborted) {
			return nil, false, err
		}
		return nil, false, fmt.Errorf("handshake: %w", err)
	}
	conn.SetDeadline(time.Time{})
	return conn, refs, nil
}

// closeGrace is how long a link still dialing or in its handshake may go on, to carry the
// bye, once its endpoint's Close began.
const closeGrace = 500 * time.Millisecond

// dialFailure is a connection that did not open (as opposed to a handshake that failed on
// one that did): the peer's address may be unreachable from here.
type dialFailure struct{ err error }

func (e *dialFailure) Error() string { return e.err.Error() }
func (e *dialFailure) Unwrap() error { return e.err }

func tune(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		tc.SetReadBuffer(socketBuffer)
		tc.SetWriteBuffer(socketBuffer)
	}
}
