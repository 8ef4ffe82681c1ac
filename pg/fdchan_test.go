package pg

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gocomm/gocomm/wire"
)

// fdServe starts srv's fd socket in a temporary directory; its path.
func fdServe(t *testing.T, srv *Server) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fd.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go srv.ServeFDs(ln)
	return path
}

func fdDial(t *testing.T, path string) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func fdHelloMsg(session uint64, token FDToken) []byte {
	b := make([]byte, fdHelloLen)
	binary.LittleEndian.PutUint32(b, fdHello)
	binary.LittleEndian.PutUint32(b[4:], fdVersion)
	binary.LittleEndian.PutUint64(b[8:], session)
	copy(b[16:], token[:])
	return b
}

func fdRegMsg(seg uint32, chunks, first int, sizes []uint64) []byte {
	b := make([]byte, fdRegHeader+8*len(sizes))
	le := binary.LittleEndian
	le.PutUint32(b, fdRegister)
	le.PutUint32(b[4:], seg)
	le.PutUint32(b[8:], uint32(chunks))
	le.PutUint32(b[12:], uint32(first))
	le.PutUint32(b[16:], uint32(len(sizes)))
	for i, n := range sizes {
		le.PutUint64(b[fdRegHeader+8*i:], n)
	}
	return b
}

func fdSend(t *testing.T, c *net.UnixConn, msg []byte, fds []int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.WriteMsgUnix(msg, oob, nil); err != nil {
		t.Fatal(err)
	}
}

// fdAnswer reads a reply: its segment, and nil or the refusal's text as an error.
func fdAnswer(t *testing.T, c *net.UnixConn) (uint32, error) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 8192)
	n, err := c.Read(b)
	if err != nil {
		t.Fatalf("no reply: %v", err)
	}
	le := binary.LittleEndian
	if n < 16 || le.Uint32(b) != fdReply {
		t.Fatalf("not a reply: % x", b[:n])
	}
	if le.Uint32(b[8:]) == 0 {
		return le.Uint32(b[4:]), nil
	}
	return le.Uint32(b[4:]), fmt.Errorf("%s", b[16:n])
}

// memfds makes n memory files named after the test; the caller closes them.
func memfds(t *testing.T, n int) (fds []int, name string) {
	t.Helper()
	name = fmt.Sprintf("gocomm-%s-%d", t.Name(), time.Now().UnixNano())
	for range n {
		fd, err := unix.MemfdCreate(name, 0)
		if err != nil {
			t.Fatal(err)
		}
		fds = append(fds, fd)
	}
	return fds, name
}

// openNamed counts this process's fds open on a memory file called name.
func openNamed(name string) int {
	ents, _ := os.ReadDir("/proc/self/fd")
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(target, "/memfd:"+name+" ") {
			n++
		}
	}
	return n
}

// waitClosed waits until no fd is open on the memory file name (the server closes its
// copies right after it answered).
func waitClosed(t *testing.T, name string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for openNamed(name) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d fds still open on %s", openNamed(name), name)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestFDSocketRegistersChunks: 300 chunks over two messages become one CUDA segment of the
// session, in its table by the time the reply comes (an op naming it then runs), the fds
// the engine was handed are the client's files, the server keeps none of them, and a drop
// through the ring unmaps it.
func TestFDSocketRegistersChunks(t *testing.T) {
	eng := &fakeEngine{}
	clients, groups := deviceCluster(t, 1, 5*time.Second, eng)
	c, g := clients[0], groups[0]
	path := fdServe(t, c.sess.srv)
	conn := fdDial(t, path)
	fdSend(t, conn, fdHelloMsg(c.sess.ID, c.sess.FDToken()), nil)
	if _, err := fdAnswer(t, conn); err != nil {
		t.Fatalf("hello refused: %v", err)
	}
	fds, name := memfds(t, 300)
	sizes := make([]uint64, len(fds))
	for i := range sizes {
		sizes[i] = 20 << 20
	}
	seg := uint32(wire.CUDASegment | 5)
	fdSend(t, conn, fdRegMsg(seg, 300, 0, sizes[:fdPerMessage]), fds[:fdPerMessage])
	fdSend(t, conn, fdRegMsg(seg, 300, fdPerMessage, sizes[fdPerMessage:]), fds[fdPerMessage:])
	closeFDs(fds) // ours: the messages hold their own references
	if got, err := fdAnswer(t, conn); err != nil || got != seg {
		t.Fatalf("registration answered %#x, %v", got, err)
	}
	if st := c.sess.CUDASegments(); st.Live != 1 {
		t.Fatalf("segments %+v right after the reply", st)
	}
	ds := c.sess.deviceSession().(*fakeDevSession)
	ds.mu.Lock()
	names, total := ds.vmm[seg], ds.segs[seg]
	ds.mu.Unlock()
	if total != 300*20<<20 || len(names) != 300 {
		t.Fatalf("engine got %d chunks, %d bytes", len(names), total)
	}
	for i, n := range names {
		if !strings.HasPrefix(n, "/memfd:"+name+" ") {
			t.Fatalf("chunk %d's fd named %q, not the client's memory file", i, n)
		}
	}
	waitClosed(t, name)
	c.submit(cudaAllReduce(g, seg, 1000, 1))
	if d := c.next(5 * time.Second); d.status != wire.StatusOK {
		t.Fatalf("op on the registered chunks: %+v", d)
	}
	c.dropIPC(seg)
	deadline := time.Now().Add(5 * time.Second)
	for c.sess.CUDASegments().Live != 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if st := c.sess.CUDASegments(); st.Live != 0 {
		t.Fatalf("segments %+v after the drop", st)
	}
	// the same connection goes on: a refused registration is answered with the driver's words
	fds, name = memfds(t, 1)
	fdSend(t, conn, fdRegMsg(seg+1, 1, 0, []uint64{7 << 21}), fds)
	closeFDs(fds)
	if _, err := fdAnswer(t, conn); err == nil || !strings.Contains(err.Error(), "cuMemMap") {
		t.Fatalf("refused chunk answered %v", err)
	}
	waitClosed(t, name)
}

// TestFDSocketRefusals: another uid, a wrong token, an unknown session, a message whose fds
// do not match its chunks, each refused with the reason and every fd sent closed; the
// session's end closes its connections and refuses new ones.
func TestFDSocketRefusals(t *testing.T) {
	eng := &fakeEngine{}
	clients, _ := deviceCluster(t, 1, 5*time.Second, eng)
	sess := clients[0].sess
	srv := sess.srv
	path := fdServe(t, srv)
	hello := func(session uint64, token FDToken, withFD bool) (error, string) {
		conn := fdDial(t, path)
		var fds []int
		var name string
		if withFD {
			fds, name = memfds(t, 1)
		}
		fdSend(t, conn, fdHelloMsg(session, token), fds)
		closeFDs(fds)
		_, err := fdAnswer(t, conn)
		return err, name
	}
	wrong := sess.FDToken()
	wrong[0] ^= 1
	err, name := hello(sess.ID, wrong, true)
	if err == nil || !strings.Contains(err.Error(), "wrong token") {
		t.Fatalf("wrong token answered %v", err)
	}
	waitClosed(t, name)
	if err, _ := hello(sess.ID+100, sess.FDToken(), false); err == nil || !strings.Contains(err.Error(), "not found") {
		t.Fatalf("unknown session answered %v", err)
	}
	srv.fdUID.Store(int64(os.Getuid()) + 1) // as if the peer ran under another user
	if err, _ := hello(sess.ID, sess.FDToken(), false); err == nil || !strings.Contains(err.Error(), "uid") {
		t.Fatalf("another uid answered %v", err)
	}
	srv.fdUID.Store(int64(os.Getuid()))

	conn := fdDial(t, path)
	fdSend(t, conn, fdHelloMsg(sess.ID, sess.FDToken()), nil)
	if _, err := fdAnswer(t, conn); err != nil {
		t.Fatal(err)
	}
	fds, name := memfds(t, 1)
	fdSend(t, conn, fdRegMsg(wire.CUDASegment|9, 2, 0, []uint64{2 << 20, 2 << 20}), fds)
	closeFDs(fds)
	if _, err := fdAnswer(t, conn); err == nil || !strings.Contains(err.Error(), "1 fds for 2 chunks") {
		t.Fatalf("fds not matching the chunks answered %v", err)
	}
	waitClosed(t, name)
	if st := sess.CUDASegments(); st.Live != 0 {
		t.Fatalf("segments %+v after refusals", st)
	}

	conn = fdDial(t, path)
	fdSend(t, conn, fdHelloMsg(sess.ID, sess.FDToken()), nil)
	if _, err := fdAnswer(t, conn); err != nil {
		t.Fatal(err)
	}
	sess.Close("test over")
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := conn.Read(make([]byte, 64)); err == nil && n > 0 {
		t.Fatalf("the session's connection still open after its end (%d bytes)", n)
	}
	if err, _ := hello(sess.ID, sess.FDToken(), false); err == nil {
		t.Fatal("hello to a closed session accepted")
	}
	if err := sess.registerVMM(wire.CUDASegment|10, []int{0}, []uint64{2 << 20}); err == nil {
		t.Fatal("registration into a closed session accepted")
	}
}

// syncBuf is a log sink the test reads while the server writes it.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) { s.mu.Lock(); defer s.mu.Unlock(); return s.b.Write(p) }
func (s *syncBuf) String() string              { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// TestFDSocketProbeIsQuiet: a connection that closes before its hello (a sibling sidecar's
// check that this socket is live, cmd/pgserver's hygiene) is no refusal worth a warning; a
// bad hello still is.
func TestFDSocketProbeIsQuiet(t *testing.T) {
	eng := &fakeEngine{}
	clients, _ := deviceCluster(t, 1, 5*time.Second, eng)
	srv := clients[0].sess.srv
	var logs syncBuf
	srv.log = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	path := fdServe(t, srv)
	fdDial(t, path).Close()
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if strings.Contains(logs.String(), "fd socket connection") { // the probe's line, either kind
			break
		}
	}
	conn := fdDial(t, path)
	fdSend(t, conn, fdHelloMsg(clients[0].sess.ID+100, clients[0].sess.FDToken()), nil)
	if _, err := fdAnswer(t, conn); err == nil {
		t.Fatal("a hello for an unknown session was answered ok")
	}
	if n := strings.Count(logs.String(), "refused an fd socket connection"); n != 1 {
		t.Fatalf("%d refusals logged, want the bad hello's only:\n%s", n, logs.String())
	}
}

// TestFDSocketSilentConnectionClosed: a connection that sends no hello is closed after
// fdHelloWait (with a warning), not held for good; one that says hello in time is served.
func TestFDSocketSilentConnectionClosed(t *testing.T) {
	defer func(w time.Duration) { fdHelloWait = w }(fdHelloWait)
	fdHelloWait = 200 * time.Millisecond
	eng := &fakeEngine{}
	clients, _ := deviceCluster(t, 1, 5*time.Second, eng)
	srv := clients[0].sess.srv
	var logs syncBuf
	srv.log = slog.New(slog.NewTextHandler(&logs, nil))
	path := fdServe(t, srv)
	start := time.Now() // before the dial: the sidecar's wait starts as it accepts
	silent := fdDial(t, path)
	silent.SetReadDeadline(start.Add(5 * time.Second))
	if n, err := silent.Read(make([]byte, 64)); n != 0 || err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read on a silent connection = %d, %v; want it closed by the sidecar", n, err)
	}
	if waited := time.Since(start); waited < fdHelloWait || waited > 3*time.Second {
		t.Fatalf("closed after %v, want about %v", waited, fdHelloWait)
	}
	if !strings.Contains(logs.String(), "sent no hello") {
		t.Fatalf("no warning:\n%s", logs.String())
	}
	conn := fdDial(t, path)
	fdSend(t, conn, fdHelloMsg(clients[0].sess.ID, clients[0].sess.FDToken()), nil)
	if _, err := fdAnswer(t, conn); err != nil {
		t.Fatalf("a hello in time: %v", err)
	}
	time.Sleep(2 * fdHelloWait) // past the hello's deadline: the connection stays served
	fdSend(t, conn, fdRegMsg(1, 1, 0, []uint64{4096}), nil)
	fdAnswer(t, conn) // a reply (a refusal: no fd came with it), not a closed connection
}
