package pg

import (
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gocomm/gocomm/wire"
)

// The fd socket carries the POSIX file descriptors of a client's physical memory chunks
// (torch's expandable segments) to its sidecar, which the control socket (gRPC) and the ring
// cannot (docs/decisions/0029-expandable-segments.md). It is a SOCK_SEQPACKET unix socket
// beside the control socket: one message per sendmsg, fds in SCM_RIGHTS.
//
// Messages, little-endian:
//
//	hello    (client): u32 fdHello, u32 fdVersion, u64 session, [32]byte token
//	register (client): u32 fdRegister, u32 segment, u32 chunks, u32 first, u32 count, u32 0,
//	                   count x u64 length; count fds (chunks first..first+count-1)
//	reply    (server): u32 fdReply, u32 segment, u32 status (0: done), u32 0, message
//
// Invariants:
//  1. A connection is served only when its peer runs under the sidecar's uid (SO_PEERCRED)
//     and its hello names a live session with that session's token; anything else is
//     answered with a refusal and the connection closed.
//  2. Every fd received is closed exactly once by the server, whatever happens: at once
//     where the message is refused, after the chunks are mapped (or failed to) otherwise.
//  3. A registration is answered only after its segment is in the session's table (or it
//     failed), and the client writes no op naming the segment before that answer: the ring
//     and this socket are not ordered with each other.
//  4. A registration never maps into a session that closed: the session's end and every
//     registration exclude each other (Session.vmmMu).
const (
	fdHello    = 0x4f4c4548 // "HELO"
	fdRegister = 0x53474552 // "REGS"
	fdReply    = 0x594c5052 // "RPLY"
	fdVersion  = 1

	// fdPerMessage is the most fds one message carries (the kernel's SCM_MAX_FD is 253).
	fdPerMessage = 240
	// fdMaxChunks bounds one registration: 4096 chunks of 20 MiB are 80 GiB, a whole GPU.
	fdMaxChunks = 4096
	fdTokenLen  = 32
	fdHelloLen  = 48
	fdRegHeader = 24
)

// FDToken is the secret a client shows on the fd socket to name its session (Attach).
type FDToken [fdTokenLen]byte

// FDSocket is where the fd socket listens ("" where the sidecar has none).
func (s *Server) FDSocket() string { return s.cfg.FDSocket }

// FDToken is the session's secret for the fd socket.
func (sess *Session) FDToken() FDToken { return sess.fdToken }

// ServeFDs serves clients' fd connections accepted on ln until ln is closed.
func (s *Server) ServeFDs(ln *net.UnixListener) error {
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		go s.serveFD(c)
	}
}

// fdReplyMsg encodes a reply: status 0 and no text where err is nil.
func fdReplyMsg(seg uint32, err error) []byte {
	b := make([]byte, 16, 64)
	le := binary.LittleEndian
	le.PutUint32(b, fdReply)
	le.PutUint32(b[4:], seg)
	if err != nil {
		le.PutUint32(b[8:], 1)
		msg := err.Error()
		if len(msg) > 4000 {
			msg = msg[:4000]
		}
		b = append(b, msg...)
	}
	return b
}

// fdRead reads one message and the fds it carries; the caller owns them (invariant 2).
func fdRead(c *net.UnixConn, buf, oob []byte) (n int, fds []int, err error) {
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
		for i := range msgs {
			got, rerr := unix.ParseUnixRights(&msgs[i])
			if rerr == nil {
				fds = append(fds, got...)
			}
		}
		if perr != nil && err == nil {
			err = perr
		}
	}
	if err == nil && flags&(unix.MSG_CTRUNC|unix.MSG_TRUNC) != 0 {
		err = fmt.Errorf("%w: fd socket message truncated (more than %d fds or %d bytes)", wire.ErrInvalid, fdPerMessage, len(buf))
	}
	return n, fds, err
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// fdHelloWait is how long a connection may take to send its hello: the client sends it as
// it connects, and one that never does would hold a goroutine and a descriptor for good.
var fdHelloWait = 10 * time.Second

// serveFD serves one client connection (invariants 1-3).
func (s *Server) serveFD(c *net.UnixConn) {
	defer c.Close()
	buf := make([]byte, fdRegHeader+8*fdPerMessage+8)
	oob := make([]byte, unix.CmsgSpace(4*(fdPerMessage+13)))
	c.SetReadDeadline(time.Now().Add(fdHelloWait))
	sess, err := s.fdHello(c, buf, oob)
	c.SetReadDeadline(time.Time{})
	if errors.Is(err, io.EOF) { // a connection that sent nothing: a sibling's liveness probe
		s.log.Debug("fd socket connection closed before its hello", "err", err)
		return
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		s.log.Warn("closed an fd socket connection that sent no hello", "within", fdHelloWait)
		return
	}
	if err != nil {
		s.log.Warn("refused an fd socket connection", "err", err)
		c.Write(fdReplyMsg(0, err))
		return
	}
	if !sess.addFDConn(c) {
		c.Write(fdReplyMsg(0, fmt.Errorf("session %d: %w", sess.ID, ErrNotFound)))
		return
	}
	if _, err := c.Write(fdReplyMsg(0, nil)); err != nil {
		return
	}
	var pend fdPending
	defer func() { closeFDs(pend.fds) }()
	for {
		n, fds, err := fdRead(c, buf, oob)
		if err != nil || n == 0 { // closed (by the client, or by the session's end)
			closeFDs(fds)
			if err != nil && n > 0 {
				c.Write(fdReplyMsg(pend.seg, err))
			}
			return
		}
		seg, done, err := pend.add(buf[:n], fds)
		if err != nil {
			closeFDs(pend.fds)
			pend = fdPending{}
			c.Write(fdReplyMsg(seg, err))
			return
		}
		if !done {
			continue
		}
		err = sess.registerVMM(pend.seg, pend.fds, pend.sizes)
		closeFDs(pend.fds)
		pend = fdPending{}
		if _, werr := c.Write(fdReplyMsg(seg, err)); werr != nil {
			return
		}
	}
}

// fdHello checks the peer's uid and its hello (invariant 1), closing any fds it sent.
func (s *Server) fdHello(c *net.UnixConn, buf, oob []byte) (*Session, error) {
	// the hello is read first: a connection closed with it unread would reset, losing the answer
	n, fds, err := fdRead(c, buf, oob)
	closeFDs(fds)
	if err != nil {
		return nil, err
	}
	uid, pid, err := UnixPeer(c)
	if err != nil {
		return nil, err
	}
	if want := int(s.fdUID.Load()); uid != want {
		return nil, fmt.Errorf("%w: the fd socket's peer (pid %d) runs as uid %d, this sidecar as %d", wire.ErrInvalid, pid, uid, want)
	}
	le := binary.LittleEndian
	if n != fdHelloLen || le.Uint32(buf) != fdHello || le.Uint32(buf[4:]) != fdVersion {
		return nil, fmt.Errorf("%w: not a gocomm fd socket hello (version %d)", wire.ErrInvalid, fdVersion)
	}
	sess, err := s.Session(le.Uint64(buf[8:]))
	if err != nil {
		return nil, err
	}
	if subtle.ConstantTimeCompare(sess.fdToken[:], buf[16:16+fdTokenLen]) != 1 {
		return nil, fmt.Errorf("%w: wrong token for session %d", wire.ErrInvalid, sess.ID)
	}
	return sess, nil
}

// UnixPeer is the uid and pid of the process at the other end of c (SO_PEERCRED): the fd
// socket's check here, the control socket's in cmd/pgserver.
func UnixPeer(c *net.UnixConn) (uid, pid int, err error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return -1, 0, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return -1, 0, err
	}
	if cerr != nil {
		return -1, 0, cerr
	}
	return int(cred.Uid), int(cred.Pid), nil
}

// fdPending is a registration whose chunks arrive over several messages, in order.
type fdPending struct {
	seg    uint32
	chunks int
	fds    []int
	sizes  []uint64
}

// add takes one register message and its fds (kept, or closed where it is refused: the
// caller closes p.fds then); done once every chunk arrived.
func (p *fdPending) add(b []byte, fds []int) (seg uint32, done bool, err error) {
	le := binary.LittleEndian
	if len(b) < fdRegHeader || le.Uint32(b) != fdRegister {
		closeFDs(fds)
		return p.seg, false, fmt.Errorf("%w: malformed fd socket message (%d bytes)", wire.ErrInvalid, len(b))
	}
	seg = le.Uint32(b[4:])
	chunks, first, count := int(le.Uint32(b[8:])), int(le.Uint32(b[12:])), int(le.Uint32(b[16:]))
	switch {
	case chunks < 1 || chunks > fdMaxChunks:
		err = fmt.Errorf("%w: CUDA segment %#x of %d chunks (at most %d: 80 GiB of 20 MiB chunks)", wire.ErrInvalid, seg, chunks, fdMaxChunks)
	case len(p.fds) == 0 && first != 0, len(p.fds) > 0 && (seg != p.seg || chunks != p.chunks || first != len(p.fds)):
		err = fmt.Errorf("%w: CUDA segment %#x: chunks %d.. out of order", wire.ErrInvalid, seg, first)
	case count < 1 || count > fdPerMessage || first+count > chunks || len(b) != fdRegHeader+8*count:
		err = fmt.Errorf("%w: CUDA segment %#x: %d chunks in a message of %d bytes", wire.ErrInvalid, seg, count, len(b))
	case len(fds) != count:
		err = fmt.Errorf("%w: CUDA segment %#x: %d fds for %d chunks", wire.ErrInvalid, seg, len(fds), count)
	}
	if err != nil {
		closeFDs(fds)
		return seg, false, err
	}
	p.seg, p.chunks = seg, chunks
	p.fds = append(p.fds, fds...)
	for i := range count {
		p.sizes = append(p.sizes, le.Uint64(b[fdRegHeader+8*i:]))
	}
	return seg, len(p.fds) == chunks, nil
}

// addFDConn ties an fd connection to the session, which closes it when it ends; false
// where the session already ended.
func (sess *Session) addFDConn(c *net.UnixConn) bool {
	sess.vmmMu.Lock()
	defer sess.vmmMu.Unlock()
	if sess.vmmClosed {
		return false
	}
	sess.fdConns = append(sess.fdConns, c)
	return true
}

// closeFDConns ends the fd connections and every later registration (invariant 4).
func (sess *Session) closeFDConns() {
	sess.vmmMu.Lock()
	defer sess.vmmMu.Unlock()
	sess.vmmClosed = true
	for _, c := range sess.fdConns {
		c.Close()
	}
	sess.fdConns = nil
}

// registerVMM maps a client allocation made of chunks as CUDA segment seg (the fds stay the
// caller's).
func (sess *Session) registerVMM(seg uint32, fds []int, sizes []uint64) error {
	sess.vmmMu.Lock()
	defer sess.vmmMu.Unlock()
	if sess.vmmClosed {
		return fmt.Errorf("session %d: %w", sess.ID, ErrNotFound)
	}
	if seg&wire.CUDASegment == 0 {
		return fmt.Errorf("%w: CUDA segment id %#x lacks the CUDA bit", wire.ErrInvalid, seg)
	}
	ds := sess.deviceSession()
	if ds == nil {
		return fmt.Errorf("%w: CUDA segment %#x registered before the device was attached", wire.ErrInvalid, seg)
	}
	err := ds.RegisterVMM(seg, fds, sizes)
	if err != nil {
		sess.log.Warn("CUDA chunks not mapped", "segment", seg, "chunks", len(fds), "err", err)
	} else {
		sess.log.Debug("CUDA chunks mapped", "segment", seg, "chunks", len(fds))
	}
	return err
}
