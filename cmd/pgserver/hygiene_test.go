package main

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestPrivateDir: a new directory is made 0700; an existing one of ours that is open to
// others is tightened; one owned by another user, a symbolic link (to a directory of ours
// or not) or a file is refused with an error naming the path and the fix, and nothing is
// changed through the link.
func TestPrivateDir(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to give a directory to another uid (CI runs as root)")
	}
	base := t.TempDir()
	fresh := filepath.Join(base, "fresh")
	if err := privateDir(fresh); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(fresh); st.Mode().Perm() != 0o700 {
		t.Fatalf("new runtime dir has mode %v", st.Mode())
	}
	open := filepath.Join(base, "open")
	os.Mkdir(open, 0o777)
	os.Chmod(open, 0o777)
	if err := privateDir(open); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(open); st.Mode().Perm() != 0o700 {
		t.Fatalf("open runtime dir left at mode %v", st.Mode())
	}
	theirs := filepath.Join(base, "theirs")
	os.Mkdir(theirs, 0o755)
	os.Chown(theirs, 65534, 65534)
	target := filepath.Join(base, "target")
	os.Mkdir(target, 0o777)
	os.Chmod(target, 0o777)
	link := filepath.Join(base, "link")
	os.Symlink(target, link)
	file := filepath.Join(base, "file")
	os.WriteFile(file, nil, 0o600)
	for _, tc := range []struct{ dir, want string }{
		{theirs, "belongs to uid 65534"},
		{link, "symbolic link"},
		{file, "not a directory"},
	} {
		err := privateDir(tc.dir)
		if err == nil || !strings.Contains(err.Error(), tc.dir) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "--runtime-dir") {
			t.Errorf("privateDir(%s) = %v, want an error naming it, %q and the fix", tc.dir, err, tc.want)
		}
	}
	if st, _ := os.Stat(target); st.Mode().Perm() != 0o777 {
		t.Fatalf("the link's target was changed to %v", st.Mode())
	}
}

// TestStaleSockets: a socket of a process that is gone and one nobody listens on are
// removed; a live sidecar's socket and other files stay.
func TestStaleSockets(t *testing.T) {
	dir := t.TempDir()
	// a process that is gone: a child that exited
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	dead := filepath.Join(dir, fmt.Sprintf("pgserver-%d.sock", cmd.Process.Pid))
	deadClient := filepath.Join(dir, fmt.Sprintf("pgserver-%d-r3.sock", cmd.Process.Pid))
	// a live pid whose socket nobody listens on (a sidecar SIGKILLed, its pid reused)
	refused := filepath.Join(dir, fmt.Sprintf("pgserver-%d.sock", os.Getppid()))
	live := filepath.Join(dir, fmt.Sprintf("pgserver-%d-r0.sock", os.Getppid()))
	// the fd sockets beside them (SOCK_SEQPACKET): one of a process that is gone, one
	// nobody listens on, a live one
	deadFD := filepath.Join(dir, fmt.Sprintf("pgserver-%d-r3.fd.sock", cmd.Process.Pid))
	refusedFD := filepath.Join(dir, fmt.Sprintf("pgserver-%d.fd.sock", os.Getppid()))
	liveFD := filepath.Join(dir, fmt.Sprintf("pgserver-%d-r0.fd.sock", os.Getppid()))
	stale := []string{dead, deadClient, refused, deadFD, refusedFD}
	for _, p := range stale {
		network := "unix"
		if strings.HasSuffix(p, ".fd.sock") {
			network = "unixpacket"
		}
		ln, err := net.Listen(network, p)
		if err != nil {
			t.Fatal(err)
		}
		ln.(*net.UnixListener).SetUnlinkOnClose(false)
		ln.Close()
	}
	ln, err := net.Listen("unix", live)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	lnFD, err := net.Listen("unixpacket", liveFD)
	if err != nil {
		t.Fatal(err)
	}
	defer lnFD.Close()
	other := filepath.Join(dir, "pgserver-1.log")
	os.WriteFile(other, nil, 0o600)
	removed := removeStaleSockets(dir)
	if len(removed) != len(stale) {
		t.Errorf("removed %v, want the %d stale sockets", removed, len(stale))
	}
	for _, p := range stale {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s is still there", p)
		}
	}
	for _, p := range []string{live, liveFD, other} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s was removed", p)
		}
	}
}

// TestPeerCred: the control listener passes this user's connections; one from another uid
// is closed before a byte is read.
func TestPeerCred(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to connect as another uid (CI runs as root)")
	}
	dir, err := os.MkdirTemp("", "peercred")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "ctl.sock")
	uln, err := listenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	// the modes would keep the other user out; the check must hold without them
	os.Chmod(path, 0o777)
	os.Chmod(dir, 0o777)
	ln := &peerCredListener{Listener: uln, log: slog.New(slog.NewTextHandler(io.Discard, nil)), uid: os.Getuid()}
	defer ln.Close()
	accepted := make(chan net.Conn, 2)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	// another user: a child running as uid 65534 connects and waits to be closed
	other := exec.Command("/bin/sh", "-c", fmt.Sprintf("exec python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(%q); s.settimeout(5); sys.exit(0 if s.recv(1)==b\"\" else 1)'", path))
	other.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := other.CombinedOutput()
	if err != nil {
		t.Fatalf("the other user's connection was not closed: %v %s", err, out)
	}
	// this user
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case a := <-accepted:
		a.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("this user's connection was not accepted")
	}
	select {
	case <-accepted:
		t.Fatal("accepted two connections, one of them another user's")
	default:
	}
}

// TestLogRotation: the log is rotated past its cap into <log>.1 .. <log>.keep, the oldest
// dropped; every file stays near the cap.
func TestLogRotation(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pgserver.log")
	const max, keep = 4096, 2
	r, err := openRotating(path, max, keep)
	if err != nil {
		t.Fatal(err)
	}
	line := []byte(strings.Repeat("x", 99) + "\n")
	for range 500 { // 50 KB: rotated about 12 times
		if _, err := r.Write(line); err != nil {
			t.Fatal(err)
		}
	}
	r.Close()
	for _, p := range []string{path, path + ".1", path + ".2"} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if st.Size() > max {
			t.Errorf("%s has %d bytes, cap %d", p, st.Size(), max)
		}
	}
	if _, err := os.Stat(path + ".3"); err == nil {
		t.Errorf("%s.3 kept, keep is %d", path, keep)
	}
	// a symbolic link in the log's place is not followed
	link := filepath.Join(t.TempDir(), "link.log")
	os.Symlink(filepath.Join(t.TempDir(), "elsewhere"), link)
	if _, err := openRotating(link, max, keep); err == nil {
		t.Error("opened a log through a symbolic link")
	}
}
