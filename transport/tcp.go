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
	"sync"
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
	// peerTimeout: a link that carries no frame for this long is dead (Config.PeerTimeout)
	peerTimeout time.Duration
	locate      func(b []byte) (fd int, ino, off uint64, ok bool)
	probe       probe
	probeSeg    *shm.Segment

	mu     sync.Mutex
	cond   *sync.Cond
	groups map[[16]byte]*Endpoint
	gone   map[[16]byte]*departed // groups this node left: a link for one is answered at once
	closed bool
}

// Config of a Node.
type Config struct {
	// Listen is the host:port to listen on (port 0: any).
	Listen string
	// Advertise is the host peers dial; the port is the one Listen got.
	Advertise string
	Log       *slog.Logger
	// JoinWait bounds how long an accepted link waits for its group to be joined here (a
	// peer may dial before this member finished ConnectGroup). Default 60 s.
	JoinWait time.Duration
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
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("transport: listen: %w", err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	n := &Node{
		ln:          ln,
		advertise:   net.JoinHostPort(cfg.Advertise, port),
		log:         cfg.Log,
		joinWait:    cmp.Or(cfg.JoinWait, 60*time.Second),
		dialLimit:   cmp.Or(cfg.DialTimeout, 10*time.Second),
		peerTimeout: cmp.Or(cfg.PeerTimeout, 5*time.Second),
		groups:      map[[16]byte]*Endpoint{},
		gone:        map[[16]byte]*departed{},
	}
	if n.log == nil {
		n.log = slog.Default()
	}
	if cfg.Locate != nil {
		if err := n.makeProbe(cmp.Or(cfg.ShmDir, shm.DefaultDir())); err != nil {
			n.log.Warn("same-host transfers by reference are off", "err", err)
		} else {
			n.locate = cfg.Locate
		}
	}
	n.cond = sync.NewCond(&n.mu)
	go n.serve()
	return n, nil
}

// makeProbe creates the small file (held open, already unlinked) whose token proves to a
// peer that it can open this process's segments.
func (n *Node) makeProbe(dir string) error {
	seg, err := shm.Create(dir, "gocomm-probe", 4096)
	if err != nil {
		return err
	}
	if _, err := rand.Read(n.probe.token[:]); err != nil {
		seg.Close()
		return err
	}
	copy(seg.Data, n.probe.token[:])
	seg.Unlink()
	n.probeSeg = seg
	n.probe.pid, n.probe.fd = os.Getpid(), int(seg.File.Fd())
	return nil
}

// canMap runs the acceptor's side of the same-host probe.
func (n *Node) canMap(p probe) bool {
	if n.locate == nil { // this side does not take part (it would also not map peers)
		return false
	}
	b, err := shm.ReadPeer(p.pid, p.fd, len(p.token))
	return err == nil && bytes.Equal(b, p.token[:])
}

// Addr is the address peers dial.
func (n *Node) Addr() string { return n.advertise }

// Close stops accepting links. Endpoints close on their own.
func (n *Node) Close() error {
	n.mu.Lock()
	n.closed = true
	n.cond.Broadcast()
	n.mu.Unlock()
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
	ep := &Endpoint{
		ctx:       ctx,
		cancel:    cancel,
		node:      n,
		id:        GroupID(secret),
		secret:    append([]byte(nil), secret...),
		rank:      rank,
		size:      size,
		peers:     append([]string(nil), peers...),
		log:       n.log,
		out:       make([]*outLink, size),
		in:        make([]net.Conn, size),
		left:      make([]bool, size),
		posted:    map[collKey]*Request{},
		early:     map[collKey]*early{},
		lastSeq:   make([]uint64, size),
		p2pPosted: map[p2pKey][]*Request{},
		anyPosted: map[int64][]*Request{},
		p2pEarly:  map[p2pKey][]*early{},
		acks:      map[ackKey]*Request{},
		peerMaps:  map[mapKey][]byte{},
		brokenC:   make(chan struct{}),
		inEnded:   make([]chan struct{}, size),
		peerSeen:  make([]PeerProgress, size),
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
	n.cond.Broadcast()
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
	}
	n.mu.Unlock()
}

// answerLink finds what a link for group id is answered with: the group's secret, and the
// reason it broke when it did (the handshake then hands the reason over instead of opening
// the link). A group that is not joined yet is waited for (lookup).
func (n *Node) answerLink(id [16]byte) (*Endpoint, []byte, string, error) {
	ep, d, err := n.lookup(id)
	if err != nil {
		return nil, nil, "", err
	}
	if d != nil {
		return nil, d.secret, d.reason, nil
	}
	return ep, ep.secret, ep.abortReason(), nil
}

// lookup waits up to JoinWait for the group with id to be joined; a group this node has
// left is answered at once (a peer's abort link must not wait out JoinWait for it): with
// what the node remembers of a group it broke, else with an error.
func (n *Node) lookup(id [16]byte) (*Endpoint, *departed, error) {
	deadline := time.Now().Add(n.joinWait)
	timer := time.AfterFunc(n.joinWait, func() {
		n.mu.Lock()
		n.cond.Broadcast()
		n.mu.Unlock()
	})
	defer timer.Stop()
	n.mu.Lock()
	defer n.mu.Unlock()
	for {
		if ep := n.groups[id]; ep != nil {
			return ep, nil, nil
		}
		if d := n.gone[id]; d != nil {
			if d.secret == nil {
				return nil, nil, fmt.Errorf("%w: this rank has left the group", ErrAuth)
			}
			return nil, d, nil
		}
		if n.closed || time.Now().After(deadline) {
			return nil, nil, fmt.Errorf("%w: no such group here", ErrAuth)
		}
		n.cond.Wait()
	}
}

func (n *Node) serve() {
	for {
		conn, err := n.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			n.log.Warn("accept", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go n.accept(conn)
	}
}

func (n *Node) accept(conn net.Conn) {
	tune(conn)
	conn.SetDeadline(time.Now().Add(n.joinWait + 10*time.Second))
	var ep *Endpoint
	h, err := acceptHandshake(conn, func(id [16]byte) ([]byte, string, error) {
		var secret []byte
		var reason string
		var err error
		ep, secret, reason, err = n.answerLink(id)
		return secret, reason, err
	}, n.canMap)
	if errors.Is(err, ErrAborted) {
		n.log.Info("answered a link with the group's abort", "remote", conn.RemoteAddr().String(), "from", h.from, "to", h.to, "detail", err)
		conn.Close()
		return
	}
	if err != nil {
		n.log.Warn("rejected peer link", "remote", conn.RemoteAddr().String(), "err", err)
		conn.Close()
		return
	}
	conn.SetDeadline(time.Time{})
	from := int(h.from)
	if int(h.to) != ep.rank || from < 0 || from >= ep.size || from == ep.rank {
		n.log.Warn("rejected peer link", "from", from, "to", h.to, "rank", ep.rank, "size", ep.size)
		conn.Close()
		return
	}
	ep.mu.Lock()
	if ep.in[from] != nil || ep.broken != nil {
		ep.mu.Unlock()
		n.log.Warn("rejected duplicate peer link", "from", from)
		conn.Close()
		return
	}
	ep.in[from] = conn
	ep.readers.Add(1)
	ep.mu.Unlock()
	go ep.reader(from, conn)
}

// dial connects and authenticates the link from ep's rank to rank to, retrying refused
// connections until the dial timeout (the peer's listener may still be starting); quick makes a
// single short attempt (links that only carry an abort). Close of the endpoint stops it.
func (n *Node) dial(ep *Endpoint, to int, quick bool) (net.Conn, bool, error) {
	limit := n.dialLimit
	if quick {
		limit = abortGrace
	}
	ctx, cancel := context.WithTimeout(ep.ctx, limit)
	defer cancel()
	d := net.Dialer{KeepAlive: 15 * time.Second}
	begin := time.Now()
	for {
		conn, err := d.DialContext(ctx, "tcp", ep.peers[to])
		if err == nil {
			tune(conn)
			conn.SetDeadline(time.Now().Add(n.joinWait + 10*time.Second))
			var pr probe
			if n.locate != nil {
				pr = n.probe
			}
			// the endpoint's Close cuts a handshake short (the peer may never answer)
			stop := context.AfterFunc(ep.ctx, func() { conn.Close() })
			refs, err := dialHandshake(conn, ep.secret, ep.rank, to, pr)
			if !stop() {
				err = cmp.Or(err, ErrClosed)
			}
			if err == nil {
				conn.SetDeadline(time.Time{})
				return conn, refs, nil
			}
			conn.Close()
			if errors.Is(err, ErrAborted) { // the peer broke the group: its reason, as an abort frame says it
				return nil, false, err
			}
			return nil, false, fmt.Errorf("handshake with %s: %w", ep.peers[to], err)
		}
		// A refused connection is retried for a quarter of the peer timeout only: the peer
		// published its address after it listened, so a refusal that lasts means it died.
		if quick || !errors.Is(err, syscall.ECONNREFUSED) || ctx.Err() != nil || time.Since(begin) > n.peerTimeout/4 {
			return nil, false, fmt.Errorf("dial %s: %w", ep.peers[to], err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func tune(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		tc.SetReadBuffer(socketBuffer)
		tc.SetWriteBuffer(socketBuffer)
	}
}
