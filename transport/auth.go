package transport

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
)

// Link handshake. The dialer speaks first; both sides prove they hold the group's secret
// without sending it, and the accepting side learns which group and rank the link is for.
//
//	dialer   -> hello  (88 bytes): u32 magic "GCHI", u32 version, [16]byte group id,
//	                               u32 from rank, u32 to rank, [32]byte dialer nonce,
//	                               u32 pid, u32 probe fd, [16]byte probe token
//	acceptor -> answer (96 bytes): [32]byte acceptor nonce, u8 status, [31]byte zero,
//	                               [32]byte HMAC(secret, "srv"|hello|nonce|status)
//	dialer   -> proof  (32 bytes): HMAC(secret, "cli"|hello|acceptor nonce)
//	acceptor -> grant  (33 bytes): u8 flags, HMAC(secret, "grt"|hello|nonce|flags)
//	            or an abort frame  (status statusAborted: the reason, as on a link)
//
// The group id is derived from the secret (GroupID), so the acceptor can find the group but
// an eavesdropper learns nothing about the secret from it.
//
// Nothing is done for a dialer before its proof verifies: the acceptor answers a hello from
// the group table as it stands (no waiting) and holds nothing but the connection. Answers
// the acceptor cannot sign, because it does not know the group's secret, carry only a
// status and no HMAC: statusUnknown (no such group here yet: the dialer retries until its
// join wait ends, as a peer may dial before this member joined), statusLeft (this member
// left in order), statusGone (no such group here and there will be none: the acceptor's
// sidecar is ending because its training process died, maybe between making its member of
// the group and joining it, which no abort frame can tell, as the acceptor never learnt the
// group's secret) and statusBusy (the acceptor has too many links in their handshake and
// dropped this one: the dialer retries within its dial timeout). They can be forged by
// whoever can also reset the connection, and grant nothing. A link closed after a signed
// answer, before the grant or abort reason, is retried as statusBusy is (closedForRoom): the
// acceptor closes the oldest links waiting for their proof to make room (Node.claim).
//
// Same-host probe: a dialer that can lend its shared segments names a small file it holds
// open (pid, fd) and the random token written in it (after a magic, in a file of a fixed size
// with no name left). Once the dialer's proof verified, an acceptor that can open that file
// through /proc/<pid>/fd/<fd> (a regular file only, of another process than the acceptor's,
// and a probe by its size, links and magic) and read the token is on the same host, in the same namespaces and allowed to map the
// dialer's segments: it grants flagRefs, and the dialer then sends large payloads by
// reference (see kindRef), naming only that pid. A link granted no references that carries
// one breaks the group (Endpoint.reader).
//
// Broken group: an acceptor whose member of the group broke (or broke and left) answers
// statusAborted and, once the dialer proved it holds the secret, sends one abort frame with
// the reason and closes; the dialer reports that reason (ErrAborted). Closing the link
// unanswered would read as a dead peer to a rank that joined after the break, while the
// abort frames that name the cause are still on their way to it on other links.

const (
	helloMagic   = 0x49484347 // "GCHI"
	helloVersion = 4
	helloSize    = 88
	answerSize   = 96
	grantSize    = 33
	// answer statuses
	statusOK      = 0
	statusAborted = 2
	statusUnknown = 4
	statusLeft    = 8
	statusBusy    = 16
	statusGone    = 32
	// grant flags
	flagRefs = 1
	// maxReason bounds the abort reason read off a link or a handshake.
	maxReason = 4096
)

// Handshake answers that are not a refusal of the dialer's credentials: the dialer tries
// again on errUnknownGroup until its join wait ends, on errBusy within its dial timeout.
var (
	errUnknownGroup = errors.New("the peer has not joined the group (yet)")
	errLeft         = errors.New("the peer has left the group")
	errBusy         = errors.New("the peer has too many links in their handshake")
	errGone         = errors.New("its sidecar is ending (its training process died) and never joined the group")
	// errNoHello: the connection closed before a byte of its hello, holding nothing: a
	// peer's dial that its endpoint's Close cut short after the connection opened, or a
	// liveness check of the port.
	errNoHello = errors.New("closed before its hello")
)

// busyAnswer is the answer of statusBusy.
func busyAnswer() []byte {
	b := make([]byte, answerSize)
	b[32] = statusBusy
	return b
}

// probe is what a dialer offers for the same-host check; pid 0 offers nothing.
type probe struct {
	pid, fd int
	token   [16]byte
}

// ErrAuth means the peer does not hold the group's secret.
var ErrAuth = errors.New("transport: peer failed authentication")

// GroupID is the public name of a group derived from its secret.
func GroupID(secret []byte) [16]byte {
	h := sha256.New()
	h.Write([]byte("gocomm group id v1\x00"))
	h.Write(secret)
	var id [16]byte
	copy(id[:], h.Sum(nil))
	return id
}

type hello struct {
	group    [16]byte
	from, to uint32
	nonce    [32]byte
	probe    probe
}

func (h *hello) encode() []byte {
	b := make([]byte, helloSize)
	le := binary.LittleEndian
	le.PutUint32(b[0:], helloMagic)
	le.PutUint32(b[4:], helloVersion)
	copy(b[8:24], h.group[:])
	le.PutUint32(b[24:], h.from)
	le.PutUint32(b[28:], h.to)
	copy(b[32:64], h.nonce[:])
	le.PutUint32(b[64:], uint32(h.probe.pid))
	le.PutUint32(b[68:], uint32(h.probe.fd))
	copy(b[72:88], h.probe.token[:])
	return b
}

func decodeHello(b []byte) (hello, error) {
	le := binary.LittleEndian
	if le.Uint32(b[0:]) != helloMagic {
		return hello{}, fmt.Errorf("%w: not a gocomm peer", ErrAuth)
	}
	if v := le.Uint32(b[4:]); v != helloVersion {
		return hello{}, fmt.Errorf("%w: protocol version %d, want %d", ErrAuth, v, helloVersion)
	}
	var h hello
	copy(h.group[:], b[8:24])
	h.from, h.to = le.Uint32(b[24:]), le.Uint32(b[28:])
	copy(h.nonce[:], b[32:64])
	h.probe.pid, h.probe.fd = int(le.Uint32(b[64:])), int(le.Uint32(b[68:]))
	copy(h.probe.token[:], b[72:88])
	return h, nil
}

func mac(secret []byte, role string, helloBytes []byte, nonce []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(role))
	m.Write(helloBytes)
	m.Write(nonce)
	return m.Sum(nil)
}

// dialHandshake runs the dialer's half on rw. It reports whether the acceptor granted
// references to this side's segments (flagRefs), or the reason rank to broke the group
// (ErrAborted); errUnknownGroup and errLeft are the unsigned answers.
func dialHandshake(rw io.ReadWriter, secret []byte, from, to int, pr probe) (refs bool, err error) {
	h := hello{group: GroupID(secret), from: uint32(from), to: uint32(to), probe: pr}
	if _, err := rand.Read(h.nonce[:]); err != nil {
		return false, err
	}
	hb := h.encode()
	if _, err := rw.Write(hb); err != nil {
		return false, fmt.Errorf("send hello: %w", err)
	}
	var ans [answerSize]byte
	if _, err := io.ReadFull(rw, ans[:]); err != nil {
		return false, fmt.Errorf("read answer: %w", err)
	}
	switch ans[32] {
	case statusUnknown:
		return false, errUnknownGroup
	case statusLeft:
		return false, errLeft
	case statusBusy:
		return false, errBusy
	case statusGone:
		return false, fmt.Errorf("%w by rank %d: %w", ErrAborted, to, errGone)
	}
	if !hmac.Equal(ans[64:], mac(secret, "srv", hb, ans[:33])) {
		return false, ErrAuth
	}
	if _, err := rw.Write(mac(secret, "cli", hb, ans[:32])); err != nil {
		return false, fmt.Errorf("send proof: %w", err)
	}
	if ans[32] == statusAborted {
		reason, err := readAbort(rw)
		if err != nil {
			return false, closedForRoom("read the abort reason", err)
		}
		return false, fmt.Errorf("%w by rank %d: %s", ErrAborted, to, reason)
	}
	if ans[32] != statusOK {
		return false, fmt.Errorf("%w: answer status %d", ErrAuth, ans[32])
	}
	var g [grantSize]byte
	if _, err := io.ReadFull(rw, g[:]); err != nil {
		return false, closedForRoom("read grant", err)
	}
	if !hmac.Equal(g[1:], mac(secret, "grt", hb, append(ans[:32:32], g[0]))) {
		return false, ErrAuth
	}
	return g[0]&flagRefs != 0, nil
}

// closedForRoom: a link the acceptor closed after its signed answer, before the grant or the
// abort reason, was most likely closed to make room for newer handshakes (Node.claim): it is
// errBusy, which the dialer retries within its dial timeout. Only someone who can reset the
// connection can cause it otherwise, which costs the dialer a retry.
func closedForRoom(step string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
		return fmt.Errorf("%s: %w (%w)", step, errBusy, err)
	}
	return fmt.Errorf("%s: %w", step, err)
}

// readAbort reads an abort frame's reason (at most maxReason bytes of it).
func readAbort(r io.Reader) ([]byte, error) {
	f, err := readFrame(r, make([]byte, frameHeader))
	if err != nil {
		return nil, err
	}
	if f.kind != kindAbort {
		return nil, fmt.Errorf("frame kind %d, want an abort", f.kind)
	}
	return readReason(r, f.length)
}

// readReason reads an abort frame's payload of n bytes, keeping at most maxReason of them.
func readReason(r io.Reader, n uint64) ([]byte, error) {
	msg := make([]byte, min(n, maxReason))
	if _, err := io.ReadFull(r, msg); err != nil {
		return nil, err
	}
	if _, err := io.CopyN(io.Discard, r, int64(n)-int64(len(msg))); err != nil {
		return nil, err
	}
	return msg, nil
}

// writeAbort writes an abort frame carrying reason.
func writeAbort(w io.Writer, reason string) error {
	f := frame{kind: kindAbort, length: uint64(len(reason))}
	hdr := make([]byte, frameHeader)
	f.encode(hdr)
	bufs := net.Buffers{hdr, []byte(reason)}
	_, err := bufs.WriteTo(w)
	return err
}

// acceptHandshake reads the dialer's hello, asks lookup for the group's secret (lookup must
// not wait or hold anything: the dialer is not authenticated yet), checks the dialer's proof
// and only then runs the same-host probe with canMap. It returns the hello so the caller
// can route the link, and whether references were granted. proved, where given, is asked once
// the proof verified, before anything is sent on it: its error ends the handshake there. When lookup gives a reason the
// group broke, the dialer is sent that reason instead and the error is ErrAborted: the link
// is not to be used. A lookup error wrapping errUnknownGroup or errLeft is answered with
// that status before the error is returned; one wrapping errBusy, likewise. A connection
// that closes before a byte of its hello is errNoHello.
func acceptHandshake(rw io.ReadWriter, lookup func(group [16]byte) (secret []byte, aborted string, err error), canMap func(probe) bool, proved func() error) (hello, bool, error) {
	hb := make([]byte, helloSize)
	if _, err := io.ReadFull(rw, hb); errors.Is(err, io.EOF) { // not a byte (a partial hello is ErrUnexpectedEOF)
		return hello{}, false, errNoHello
	} else if err != nil {
		return hello{}, false, fmt.Errorf("read hello: %w", err)
	}
	h, err := decodeHello(hb)
	if err != nil {
		return hello{}, false, err
	}
	var ans [answerSize]byte
	if _, err := rand.Read(ans[:32]); err != nil {
		return hello{}, false, err
	}
	secret, aborted, err := lookup(h.group)
	if err != nil {
		switch {
		case errors.Is(err, errUnknownGroup):
			ans[32] = statusUnknown
		case errors.Is(err, errLeft):
			ans[32] = statusLeft
		case errors.Is(err, errBusy):
			ans[32] = statusBusy
		case errors.Is(err, errGone):
			ans[32] = statusGone
		default:
			return h, false, err
		}
		rw.Write(ans[:]) // best effort: the dialer retries or fails either way
		return h, false, err
	}
	if aborted != "" {
		ans[32] = statusAborted
	}
	copy(ans[64:], mac(secret, "srv", hb, ans[:33]))
	if _, err := rw.Write(ans[:]); err != nil {
		return h, false, fmt.Errorf("send answer: %w", err)
	}
	var proof [32]byte
	if _, err := io.ReadFull(rw, proof[:]); err != nil {
		return h, false, fmt.Errorf("read proof: %w", err)
	}
	if !hmac.Equal(proof[:], mac(secret, "cli", hb, ans[:32])) {
		return h, false, ErrAuth
	}
	if proved != nil {
		if err := proved(); err != nil {
			return h, false, err
		}
	}
	if aborted != "" {
		if err := writeAbort(rw, aborted); err != nil {
			return h, false, fmt.Errorf("%w: sending the reason: %v", ErrAborted, err)
		}
		return h, false, fmt.Errorf("%w: the peer was told why", ErrAborted)
	}
	var g [grantSize]byte
	if h.probe.pid != 0 && canMap(h.probe) { // only now: the dialer proved it holds the secret
		g[0] = flagRefs
	}
	copy(g[1:], mac(secret, "grt", hb, append(ans[:32:32], g[0])))
	if _, err := rw.Write(g[:]); err != nil {
		return h, false, fmt.Errorf("send grant: %w", err)
	}
	return h, g[0]&flagRefs != 0, nil
}
