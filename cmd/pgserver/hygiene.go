package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gocomm/gocomm/pg"
)

// privateDir makes dir (0700) or checks that an existing one is this user's own, private
// directory: the control socket in it must be reachable by this user only. It never follows
// a symbolic link at dir, and tightens the mode through a descriptor of the directory it
// checked (no chmod by name, which a swapped-in link would redirect). Someone else's
// directory, or a link, is an error naming the path and the way out.
func privateDir(dir string) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return fmt.Errorf("runtime dir: %w", err)
	}
	if err := unix.Mkdir(dir, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("runtime dir %s: %w", dir, err)
	}
	fix := "remove it, or point --runtime-dir (or XDG_RUNTIME_DIR) at a directory of your own"
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("runtime dir %s: %w", dir, err)
	}
	switch {
	case st.Mode&unix.S_IFMT == unix.S_IFLNK:
		return fmt.Errorf("runtime dir %s is a symbolic link, which gocomm does not follow: %s", dir, fix)
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("runtime dir %s is not a directory: %s", dir, fix)
	case int(st.Uid) != os.Getuid():
		return fmt.Errorf("runtime dir %s belongs to uid %d, not to this user (uid %d): %s", dir, st.Uid, os.Getuid(), fix)
	}
	if st.Mode&0o077 == 0 {
		return nil
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("runtime dir %s: %w", dir, err)
	}
	defer unix.Close(fd)
	var fst unix.Stat_t
	if err := unix.Fstat(fd, &fst); err != nil || fst.Ino != st.Ino || fst.Dev != st.Dev || int(fst.Uid) != os.Getuid() {
		return fmt.Errorf("runtime dir %s changed while it was checked: %s", dir, fix)
	}
	if err := unix.Fchmod(fd, 0o700); err != nil {
		return fmt.Errorf("runtime dir %s is open to others and cannot be made private: %w", dir, err)
	}
	return nil
}

// socketName matches the control sockets pgserver makes (pgserver-<pid>.sock) and the shim
// names (pgserver-<client pid>-r<rank>.sock), and the fd sockets beside them (.fd.sock,
// SOCK_SEQPACKET); the pid is the process the socket lives with.
var socketName = regexp.MustCompile(`^pgserver-(\d+)(-r\d+)?(\.fd)?\.sock$`)

// removeStaleSockets deletes the control and fd sockets in dir left by sidecars that died without
// cleaning up (SIGKILL): this user's sockets whose process is gone, or that refuse a
// connection twice. It returns the paths removed.
func removeStaleSockets(dir string) []string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var removed []string
	for _, e := range ents {
		m := socketName.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		path := filepath.Join(dir, e.Name())
		var st unix.Stat_t
		if unix.Lstat(path, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK || int(st.Uid) != os.Getuid() {
			continue
		}
		pid, _ := strconv.Atoi(m[1])
		network := "unix"
		if m[3] != "" {
			network = "unixpacket"
		}
		if pid != os.Getpid() && (errors.Is(unix.Kill(pid, 0), unix.ESRCH) || refuses(network, path) && refuses(network, path)) {
			if os.Remove(path) == nil {
				removed = append(removed, path)
			}
		}
	}
	return removed
}

// refuses reports whether nothing listens on the unix socket at path, of network "unix" or
// "unixpacket" (a brief pause first, so a sidecar between bind and listen is not taken for a
// dead one).
func refuses(network, path string) bool {
	time.Sleep(50 * time.Millisecond)
	c, err := net.DialTimeout(network, path, time.Second)
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, unix.ECONNREFUSED)
}

// peerCredListener refuses control connections from processes of another user
// (SO_PEERCRED): the socket's mode keeps them out already, this holds even where the mode
// or the directory was loosened by hand.
type peerCredListener struct {
	net.Listener
	log  *slog.Logger
	uid  int
	mu   sync.Mutex
	last time.Time
}

func (l *peerCredListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		uid, pid, err := peerUID(c)
		if err == nil && uid == l.uid {
			return c, nil
		}
		c.Close()
		l.mu.Lock()
		if time.Since(l.last) > time.Second {
			l.last = time.Now()
			l.log.Warn("refused a control connection from another user", "uid", uid, "pid", pid, "err", err)
		}
		l.mu.Unlock()
	}
}

// peerUID is the uid and pid of the process at the other end of a unix connection.
func peerUID(c net.Conn) (int, int, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return -1, 0, errors.New("not a unix socket")
	}
	return pg.UnixPeer(uc)
}

// rotatingFile is the sidecar's log file: past max bytes it is renamed <path>.1 (older ones
// shifted up to <path>.<keep>, the oldest dropped) and a new one started. Every slog record
// is one Write, so a record is never split across files.
type rotatingFile struct {
	path string
	max  int64
	keep int

	mu   sync.Mutex
	f    *os.File
	size int64
}

func openRotating(path string, max int64, keep int) (*rotatingFile, error) {
	r := &rotatingFile{path: path, max: max, keep: keep}
	if err := r.open(); err != nil {
		return nil, err
	}
	return r, nil
}

// open opens the log for appending; a symbolic link in its place is refused (O_NOFOLLOW).
func (r *rotatingFile) open() error {
	f, err := os.OpenFile(r.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("log file: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("log file: %w", err)
	}
	r.f, r.size = f, st.Size()
	return nil
}

func (r *rotatingFile) Write(b []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.size > 0 && r.size+int64(len(b)) > r.max {
		r.rotate()
	}
	if r.f == nil {
		return 0, errors.New("log file closed")
	}
	n, err := r.f.Write(b)
	r.size += int64(n)
	return n, err
}

// rotate shifts the old files and starts a new one; on failure it goes on appending.
func (r *rotatingFile) rotate() {
	for i := r.keep - 1; i >= 1; i-- {
		os.Rename(fmt.Sprintf("%s.%d", r.path, i), fmt.Sprintf("%s.%d", r.path, i+1))
	}
	if r.keep > 0 {
		os.Rename(r.path, r.path+".1")
	} else {
		os.Remove(r.path)
	}
	old := r.f
	if err := r.open(); err != nil {
		r.f = old // keep writing where we can
		return
	}
	// stdout and stderr that were the old file (the shim starts the sidecar so, for what the
	// Go runtime itself prints) follow to the new one
	var ost unix.Stat_t
	if unix.Fstat(int(old.Fd()), &ost) == nil {
		for _, fd := range []int{1, 2} {
			var st unix.Stat_t
			if unix.Fstat(fd, &st) == nil && st.Ino == ost.Ino && st.Dev == ost.Dev {
				unix.Dup2(int(r.f.Fd()), fd)
			}
		}
	}
	old.Close()
}

func (r *rotatingFile) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.f == nil {
		return nil
	}
	err := r.f.Close()
	r.f = nil
	return err
}

var _ io.WriteCloser = (*rotatingFile)(nil)
