package transport

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fdCount is how many descriptors this process holds open.
func fdCount(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestFloodBeforeAuth: hundreds of connections that never finish a hello (half-open), send
// junk, or name a group that is not here, while a group works on the same node. The node
// holds at most its cap of unauthenticated links, the group keeps exchanging, and once the
// flood's connections are gone so are the node's descriptors for them.
func TestFloodBeforeAuth(t *testing.T) {
	const capN, flood = 16, 600
	base := fdCount(t)
	var nodes []*Node
	var addrs []string
	var logged lockedBuffer
	for r := range 2 {
		log := quiet()
		if r == 1 {
			log = slog.New(slog.NewTextHandler(&logged, nil))
		}
		n, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: log, HandshakesMax: capN, HandshakeTimeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer n.Close()
		nodes, addrs = append(nodes, n), append(addrs, n.Addr())
	}
	secret := []byte("a secret of at least sixteen bytes")
	var eps []*Endpoint
	for r := range 2 {
		ep, err := nodes[r].Join(secret, r, addrs)
		if err != nil {
			t.Fatal(err)
		}
		defer ep.Close()
		eps = append(eps, ep)
	}
	exchange := func(seq uint64) {
		t.Helper()
		want := bytes.Repeat([]byte{byte(seq)}, 64<<10)
		got := make([]byte, len(want))
		s := eps[0].Op(seq, sigF32).Send(1, Tag{}, want)
		r := eps[1].Op(seq, sigF32).Recv(0, Tag{}, copySink{Dst: got})
		if err := s.Wait(ctxT(t)); err != nil {
			t.Fatalf("send %d during the flood: %v", seq, err)
		}
		if err := r.Wait(ctxT(t)); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("receive %d during the flood: %v", seq, err)
		}
	}
	exchange(0)
	linked := fdCount(t)

	start := time.Now()
	var conns []net.Conn
	unknown := hello{from: 0, to: 1}
	rand.Read(unknown.group[:])
	for i := range flood {
		c, err := net.Dial("tcp", addrs[1])
		if err != nil {
			t.Fatalf("flood connection %d: %v", i, err)
		}
		switch i % 3 {
		case 0: // half-open: never a byte
		case 1:
			c.Write(bytes.Repeat([]byte("junk"), 40))
		case 2:
			c.Write(unknown.encode())
		}
		conns = append(conns, c)
		if i%50 == 0 {
			exchange(uint64(1 + i/50))
		}
	}
	nodes[1].hsMu.Lock()
	held := len(nodes[1].pending) + len(nodes[1].answering)
	nodes[1].hsMu.Unlock()
	if held > 2*capN {
		t.Errorf("%d unauthenticated links held, cap %d", held, capN)
	}
	// a peer that joins during the flood still gets its links
	late, err := nodes[0].Join([]byte("another secret of sixteen+ bytes"), 0, addrs)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	late1, err := nodes[1].Join([]byte("another secret of sixteen+ bytes"), 1, addrs)
	if err != nil {
		t.Fatal(err)
	}
	defer late1.Close()
	got := make([]byte, 16)
	r := late1.Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: got})
	if err := late.Op(0, sigF32).Send(1, Tag{}, []byte("sixteen bytes!!!")).Wait(ctxT(t)); err != nil {
		t.Fatalf("a group joined during the flood: %v", err)
	}
	if err := r.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	late.Close()
	late1.Close()
	for _, c := range conns {
		c.Close()
	}
	// the node closed its side of the rest by now (evicted, answered, or timed out)
	deadline := time.Now().Add(10 * time.Second)
	for fdCount(t) > linked && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := fdCount(t); n > linked {
		t.Errorf("%d descriptors after the flood, %d before (%d before the group)", n, linked, base)
	}
	exchange(99)
	// warnings about the flood: about one a second, however many connections, and one
	// that counts the rest
	for !strings.Contains(logged.String(), "similar_lines_left_out") && time.Since(start) < 5*time.Second {
		time.Sleep(50 * time.Millisecond)
	}
	lines := strings.Count(logged.String(), "level=WARN")
	if limit := 2*int(time.Since(start)/time.Second) + 2; lines > limit {
		t.Errorf("%d warnings logged in %v about %d rejected connections, want at most %d", lines, time.Since(start), flood, limit)
	}
	if !strings.Contains(logged.String(), "similar_lines_left_out") {
		t.Errorf("the warnings do not say how many lines were left out:\n%s", logged.String())
	}
}

// lockedBuffer is a bytes.Buffer for a logger written from several goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestUnknownGroupHoldsNothing: a hello for a group that is not here is answered at once
// and the connection closed; nothing waits for the group to appear.
func TestUnknownGroupHoldsNothing(t *testing.T) {
	nodes, _ := listen(t, 1)
	c, err := net.Dial("tcp", nodes[0].Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h := hello{from: 0, to: 1}
	rand.Read(h.group[:])
	start := time.Now()
	c.Write(h.encode())
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	ans, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("reading the answer: %v (after %v)", err, time.Since(start))
	}
	if len(ans) != answerSize || ans[32] != statusUnknown {
		t.Fatalf("answer %d bytes, status %v; want %d bytes of statusUnknown", len(ans), ans, answerSize)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("answered and closed after %v", took)
	}
}

// TestHandshakeTimesOut: a connection that never finishes its hello is closed by the node
// after the handshake timeout.
func TestHandshakeTimesOut(t *testing.T) {
	n, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quiet(), HandshakeTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	c, err := net.Dial("tcp", n.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("GCHI")) // part of a hello
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = c.Read(make([]byte, 1))
	if took := time.Since(start); err == nil || took > 2*time.Second {
		t.Fatalf("read = %v after %v, want the node to close within its 300 ms handshake timeout", err, took)
	}
}

// heldElsewhere starts a child process that holds f open as its fd 3 (the acceptor refuses
// probes naming its own process) and returns the child's pid.
func heldElsewhere(t *testing.T, f *os.File) int {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	cmd.ExtraFiles = []*os.File{f}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd.Process.Pid
}

// fifoProbe makes a FIFO, held open by a child process, and returns the probe naming it.
func fifoProbe(t *testing.T) probe {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0) // RDWR: does not block on a FIFO
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return probe{pid: heldElsewhere(t, f), fd: 3}
}

// fileProbe writes content (padded to size) into a file, unlinks it where unlinked, has a
// child process hold it and returns the probe naming it with token.
func fileProbe(t *testing.T, content []byte, size int, unlinked bool, token [16]byte) probe {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "probe")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, size)
	copy(b, content)
	if _, err := f.Write(b); err != nil {
		t.Fatal(err)
	}
	if unlinked {
		os.Remove(f.Name())
	}
	return probe{pid: heldElsewhere(t, f), fd: 3, token: token}
}

// TestProbeRefusesForgeries: the same-host probe passes only for a probe file (its size, no
// name left, the magic, then the token) of another process than the acceptor's; a file whose
// first bytes are public (a ring file's header), or the acceptor's own probe, passes for none.
func TestProbeRefusesForgeries(t *testing.T) {
	n, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quiet(), ShmDir: t.TempDir(),
		Locate: func([]byte) (int, uint64, uint64, bool) { return 0, 0, 0, false }})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	var tok [16]byte
	rand.Read(tok[:])
	good := append([]byte(probeMagic), tok[:]...)
	var ringTok [16]byte
	copy(ringTok[:], "GOCOMMR1\x01\x00\x00\x00")
	for _, c := range []struct {
		name string
		p    probe
		want bool
	}{
		{"a probe file of another process", fileProbe(t, good, probeSize, true, tok), true},
		{"the acceptor's own probe", n.probe, false},
		{"a file with a name left", fileProbe(t, good, probeSize, false, tok), false},
		{"a file of another size", fileProbe(t, good, 1<<20, true, tok), false},
		{"the token without the magic", fileProbe(t, tok[:], probeSize, true, tok), false},
		{"a ring file's public header", fileProbe(t, ringTok[:], probeSize, true, ringTok), false},
	} {
		if got := n.canMap(c.p); got != c.want {
			t.Errorf("%s: canMap = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestProbeOnlyAfterProof: the acceptor opens the dialer's probe file only after the
// dialer proved it holds the secret, and never a file that is not a regular one (a FIFO
// would pin the reading goroutine).
func TestProbeOnlyAfterProof(t *testing.T) {
	secret := []byte("a secret of at least sixteen bytes")
	for _, withSecret := range []bool{false, true} {
		a, b := net.Pipe()
		probed := false
		done := make(chan error, 1)
		go func() {
			_, refs, err := acceptHandshake(a, func([16]byte) ([]byte, string, error) { return secret, "", nil },
				func(p probe) bool { probed = true; return false }, nil)
			if refs {
				err = errors.New("references granted")
			}
			done <- err
			a.Close()
		}()
		dialSecret := []byte("not the secret but sixteen bytes")
		if withSecret {
			dialSecret = secret
		}
		h := hello{group: GroupID(secret), from: 0, to: 1, probe: fifoProbe(t)}
		b.SetDeadline(time.Now().Add(5 * time.Second))
		hb := h.encode()
		b.Write(hb)
		ans := make([]byte, answerSize)
		io.ReadFull(b, ans)
		b.Write(mac(dialSecret, "cli", hb, ans[:32]))
		io.ReadAll(b)
		err := <-done
		if withSecret != probed {
			t.Fatalf("with the secret=%v: probed=%v", withSecret, probed)
		}
		if !withSecret && !errors.Is(err, ErrAuth) {
			t.Fatalf("wrong proof: %v, want ErrAuth", err)
		}
	}
	// the probe itself refuses a FIFO at once
	n, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quiet(), ShmDir: t.TempDir(),
		Locate: func([]byte) (int, uint64, uint64, bool) { return 0, 0, 0, false }})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	start := time.Now()
	if n.canMap(fifoProbe(t)) {
		t.Fatal("a FIFO passed the same-host probe")
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("probing a FIFO took %v", took)
	}
}

// refuseAll closes every link rank 1 makes to the fake peer (its abort links included), so
// that rank 1's Close need not wait out abortGrace for them.
func (p *fakePeer) refuseAll() {
	go func() {
		for {
			c, err := p.ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
}

// fakeDialer is a peer that holds the secret and speaks the link protocol by hand: it
// links to rank 1 as rank 0 offering pr, and reports whether references were granted.
func fakeDialer(t *testing.T, addr string, secret []byte, pr probe) (net.Conn, bool) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	refs, err := dialHandshake(c, secret, 0, 1, pr)
	if err != nil {
		t.Fatal(err)
	}
	return c, refs
}

// refFrame is a p2p frame by reference into process pid's descriptor fd.
func refFrame(pid, fd int, n uint64) []byte {
	b := make([]byte, frameHeader+refTrailer)
	f := frame{kind: kindP2P, seq: 7, length: n, ref: true}
	f.encode(b)
	le := binary.LittleEndian
	le.PutUint32(b[frameHeader:], uint32(pid))
	le.PutUint32(b[frameHeader+4:], uint32(fd))
	return b
}

// waitBroken waits for ep to break and returns the cause.
func waitBroken(t *testing.T, ep *Endpoint) error {
	t.Helper()
	select {
	case <-ep.brokenC:
		return ep.Broken()
	case <-time.After(5 * time.Second):
		t.Fatal("the endpoint did not break")
		return nil
	}
}

// TestRefWithoutNegotiation: a peer that holds the secret but was granted no references
// (it offered no probe) sends a frame by reference: the group breaks, saying so, and
// nothing is mapped.
func TestRefWithoutNegotiation(t *testing.T) {
	secret := []byte("a secret of at least sixteen bytes")
	n, ep := besideFake(t, secret, Config{})
	c, refs := fakeDialer(t, n.Addr(), secret, probe{})
	if refs {
		t.Fatal("references granted without a probe")
	}
	f, err := os.CreateTemp(t.TempDir(), "victim")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.Write(make([]byte, 1<<20))
	c.Write(refFrame(os.Getpid(), int(f.Fd()), 64<<10))
	cause := waitBroken(t, ep)
	if !errors.Is(cause, ErrProtocol) || !strings.Contains(cause.Error(), "did not negotiate references") {
		t.Fatalf("broke with %v, want a protocol error about references", cause)
	}
	if len(ep.peerMaps) != 0 {
		t.Fatal("a segment was mapped")
	}
}

// besideFake starts a node with cfg (listening on loopback, quiet) and joins it as rank 1 of
// a group whose rank 0 is a fake peer that refuses every link; it closes at the test's end.
func besideFake(t *testing.T, secret []byte, cfg Config) (*Node, *Endpoint) {
	t.Helper()
	cfg.Listen, cfg.Advertise, cfg.Log = "127.0.0.1:0", "127.0.0.1", quiet()
	n, err := Listen(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	peer := newFakePeer(t, secret)
	peer.refuseAll()
	ep, err := n.Join(secret, 1, []string{peer.ln.Addr().String(), n.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ep.Close)
	return n, ep
}

// TestRefIntoAnotherProcess: references were granted for the probed process, and a frame
// names another one: the group breaks.
func TestRefIntoAnotherProcess(t *testing.T) {
	secret := []byte("a secret of at least sixteen bytes")
	n, ep := besideFake(t, secret, Config{ShmDir: t.TempDir(),
		Locate: func([]byte) (int, uint64, uint64, bool) { return 0, 0, 0, false }})
	// the fake peer passes the probe with a probe file another process holds
	var tok [16]byte
	rand.Read(tok[:])
	c, refs := fakeDialer(t, n.Addr(), secret, fileProbe(t, append([]byte(probeMagic), tok[:]...), probeSize, true, tok))
	if !refs {
		t.Fatal("references not granted to a peer that passed the probe")
	}
	c.Write(refFrame(1, 0, 64<<10)) // pid 1's stdin
	cause := waitBroken(t, ep)
	if !errors.Is(cause, ErrProtocol) || !strings.Contains(cause.Error(), "process 1") {
		t.Fatalf("broke with %v, want a protocol error naming process 1", cause)
	}
}

// patternSink takes a message of n bytes without keeping it: byte i must be i mod 251
// (sampled).
type patternSink struct {
	n   int
	bad *int // the first offset that broke the pattern, or -1
}

func (s patternSink) Len() int { return s.n }

func (s patternSink) Fill(r io.Reader, scratch []byte) error {
	for off := 0; off < s.n; {
		k, err := io.ReadFull(r, scratch[:min(len(scratch), s.n-off)])
		if err != nil {
			return err
		}
		for i := 0; i < k; i += 997 { // a sample of each read: every byte would cost seconds
			if scratch[i] != byte((off+i)%251) && *s.bad < 0 {
				*s.bad = off + i
			}
		}
		off += k
	}
	return nil
}

func (s patternSink) Take(b []byte) error { return s.Fill(bytes.NewReader(b), make([]byte, 64<<10)) }

// TestMessageOver2GiB: a peer's 2.25 GiB message (a CPU tensor between hosts: one frame)
// goes into the receive that waits for it, whole and in order; frames were once refused
// past 2 GiB, which broke the group.
func TestMessageOver2GiB(t *testing.T) {
	const size = 9 << 28 // 2.25 GiB
	secret := []byte("a secret of at least sixteen bytes")
	n, ep := besideFake(t, secret, Config{})
	bad := -1
	r := ep.RecvP2P(0, 5, patternSink{n: size, bad: &bad})
	c, _ := fakeDialer(t, n.Addr(), secret, probe{})
	hdr := make([]byte, frameHeader)
	(&frame{kind: kindP2P, seq: 5, length: size}).encode(hdr)
	chunk := make([]byte, 251<<14) // whole periods of the pattern: every chunk is the same
	for i := range chunk {
		chunk[i] = byte(i % 251)
	}
	go func() {
		c.Write(hdr)
		for left := size; left > 0; left -= len(chunk) {
			if _, err := c.Write(chunk[:min(left, len(chunk))]); err != nil {
				return
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // 1 s alone, more beside other tests
	defer cancel()
	if err := r.Wait(ctx); err != nil || bad >= 0 {
		t.Fatalf("receive: %v, first wrong byte at %d", err, bad)
	}
	if ep.Broken() != nil {
		t.Fatal(ep.Broken())
	}
}

// TestUnmatchedBytesCapped: a peer sends many messages nobody receives. Under the cap they
// are kept and received in full later (and the charge goes back to zero); past it the
// group breaks with an error naming the knob, and the node's memory does not grow with
// what the peer keeps sending.
func TestUnmatchedBytesCapped(t *testing.T) {
	const msg, capBytes = 60 << 10, 4 << 20
	secret := []byte("a secret of at least sixteen bytes")
	n, ep := besideFake(t, secret, Config{UnmatchedMax: capBytes})
	c, _ := fakeDialer(t, n.Addr(), secret, probe{})
	send := func(tag int64) {
		hdr := make([]byte, frameHeader)
		f := frame{kind: kindP2P, seq: uint64(tag), length: msg}
		f.encode(hdr)
		(&net.Buffers{hdr, bytes.Repeat([]byte{byte(tag)}, msg)}).WriteTo(c)
	}
	// under the cap: kept, then received
	for tag := range int64(10) {
		send(tag)
	}
	for tag := range int64(10) {
		got := make([]byte, msg)
		if err := ep.RecvP2P(0, tag, copySink{Dst: got}).Wait(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		if got[0] != byte(tag) || got[msg-1] != byte(tag) {
			t.Fatalf("tag %d: wrong bytes", tag)
		}
	}
	if held := ep.unmatched[0].Load(); held != 0 {
		t.Fatalf("%d bytes still charged after every message was received", held)
	}
	// past it: 4,000 never-received sends (240 MiB) must not grow this process
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	go func() {
		for tag := range int64(4000) {
			send(100 + tag)
		}
	}()
	cause := waitBroken(t, ep)
	if !errors.Is(cause, ErrUnmatchedMax) || !strings.Contains(cause.Error(), "GOCOMM_UNMATCHED_BYTES_MAX") {
		t.Fatalf("broke with %v, want the unmatched-bytes cap", cause)
	}
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 4*capBytes {
		t.Fatalf("heap grew by %d bytes with a cap of %d", grew, capBytes)
	}
}

// TestUnmatchedSenderHearsWhy: rank 0 floods rank 1 with sends nobody receives until rank
// 1's cap breaks the group. Rank 0 must break with rank 1's reason (the abort frame), never
// with its link to rank 1 reset: rank 1 reads the flooded link dry until rank 0 closes it
// instead of closing it with bytes unread (which resets it, and the reset could reach rank 0
// before the abort frame on the other link). Many rounds, as the race was rare.
func TestUnmatchedSenderHearsWhy(t *testing.T) {
	const msg, capBytes, rounds = 60 << 10, 2 << 20, 20
	for round := range rounds {
		nodes, addrs := listen(t, 2)
		eps := make([]*Endpoint, 2)
		for r := range nodes {
			if r == 1 {
				nodes[r].unmatchedMax = capBytes
			}
			ep, err := nodes[r].Join([]byte("a secret of at least sixteen bytes"), r, addrs)
			if err != nil {
				t.Fatal(err)
			}
			eps[r] = ep
		}
		data := make([]byte, msg)
		reqs := make([]*Request, 0, 200)
		for tag := range int64(200) {
			reqs = append(reqs, eps[0].SendP2P(1, tag, data))
		}
		for r, ep := range eps {
			cause := waitBroken(t, ep)
			if !strings.Contains(cause.Error(), "GOCOMM_UNMATCHED_BYTES_MAX") {
				t.Fatalf("round %d: rank %d broke with %v, want the unmatched-bytes cap", round, r, cause)
			}
		}
		for _, q := range reqs {
			if err := q.Wait(ctxT(t)); err != nil && !strings.Contains(err.Error(), "GOCOMM_UNMATCHED_BYTES_MAX") {
				t.Fatalf("round %d: a send failed with %v, want the unmatched-bytes cap", round, err)
			}
		}
		for _, ep := range eps {
			ep.Close()
		}
	}
}

// TestLinkClosedBeforeHelloIsQuiet: a connection that closes before a byte of its hello (a
// peer's dial cut short by its own endpoint's Close, as groups end at different times on
// different ranks) holds nothing and is logged at debug, not warned about; a connection
// that sends junk is still warned about.
func TestLinkClosedBeforeHelloIsQuiet(t *testing.T) {
	var logged lockedBuffer
	n, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1",
		Log: slog.New(slog.NewTextHandler(&logged, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	waitFor := func(what string) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); !strings.Contains(logged.String(), what); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("no %q in the log:\n%s", what, logged.String())
			}
		}
	}
	c, err := net.Dial("tcp", n.Addr())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	waitFor("closed before its hello")
	if s := logged.String(); strings.Contains(s, "level=WARN") {
		t.Fatalf("a connection that sent nothing was warned about:\n%s", s)
	}
	if c, err = net.Dial("tcp", n.Addr()); err != nil {
		t.Fatal(err)
	}
	c.Write(make([]byte, helloSize))
	c.Close()
	waitFor("not a gocomm peer")
}

// TestForgedHellosKeepNoPeerOut: a hello is sent in the clear, so whoever saw one can send it
// again (or forge one for that group) and leave the answer unproved. Far more of those than
// the cap, holding every node's links that wait for a proof, do not keep a group that joins
// meanwhile from linking up: the oldest waiting links make room, well before the handshake
// timeout would have freed them, and the real dialer that lost its place retries.
func TestForgedHellosKeepNoPeerOut(t *testing.T) {
	const capN = 4
	var nodes []*Node
	var addrs []string
	for range 2 {
		n, err := Listen(Config{Listen: "127.0.0.1:0", Advertise: "127.0.0.1", Log: quiet(), HandshakesMax: capN,
			HandshakeTimeout: 10 * time.Second, JoinWait: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer n.Close()
		nodes, addrs = append(nodes, n), append(addrs, n.Addr())
	}
	seen := []byte("a group whose hello was seen on the wire")
	join := func(secret []byte) []*Endpoint {
		t.Helper()
		eps := make([]*Endpoint, 2)
		errs := make(chan error, 2)
		for r := range 2 {
			go func() {
				var err error
				eps[r], err = nodes[r].Join(secret, r, addrs)
				errs <- err
			}()
		}
		for range 2 {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		for _, ep := range eps {
			t.Cleanup(func() { ep.Close() })
		}
		return eps
	}
	join(seen)
	// the forger: hellos of the seen group to both nodes, each read for its answer and left there
	var forged []net.Conn
	defer func() {
		for _, c := range forged {
			c.Close()
		}
	}()
	answered := 0
	for i := range 3 * capN {
		c, err := net.Dial("tcp", addrs[i%2])
		if err != nil {
			t.Fatal(err)
		}
		forged = append(forged, c)
		h := hello{group: GroupID(seen), from: uint32(1 - i%2), to: uint32(i % 2)}
		rand.Read(h.nonce[:])
		c.Write(h.encode())
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		var ans [answerSize]byte
		if _, err := io.ReadFull(c, ans[:]); err == nil && ans[32] == statusOK {
			answered++
		}
	}
	if answered < 2*capN {
		t.Fatalf("%d of %d forged hellos were answered: the forger held no slots", answered, 3*capN)
	}
	start := time.Now()
	eps := join([]byte("a group that joins during the forgery"))
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("the new group took %v to link up (handshake timeout 10 s)", took)
	}
	got := make([]byte, 16)
	r := eps[1].Op(0, sigF32).Recv(0, Tag{}, copySink{Dst: got})
	if err := eps[0].Op(0, sigF32).Send(1, Tag{}, []byte("sixteen bytes!!!")).Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if err := r.Wait(ctxT(t)); err != nil || string(got) != "sixteen bytes!!!" {
		t.Fatalf("%v %q", err, got)
	}
	for _, n := range nodes {
		n.hsMu.Lock()
		if len(n.answering) > capN {
			t.Errorf("%d links wait for their proof, cap %d", len(n.answering), capN)
		}
		n.hsMu.Unlock()
	}
}
