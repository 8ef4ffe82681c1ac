// Package shm creates and maps the shared-memory files that a sidecar and its client share
// (rings, host tensor segments), and waits on words inside them with futexes.
//
// Files live in /dev/shm when it is writable (memory-backed), else in the runtime directory.
// They are created 0600 with O_EXCL, so only the user who runs the sidecar can open them; the
// client unlinks a file once it has mapped it, and the sidecar unlinks whatever is left when
// the owner of the segment goes away.
package shm

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrClosed is returned by operations on a closed segment.
var ErrClosed = errors.New("shm: segment closed")

// Segment is a file mapped MAP_SHARED into this process.
type Segment struct {
	// Path is where the file was created; empty after Unlink.
	Path string
	// Data is the mapping; nil after Close.
	Data []byte
	// File stays open for the life of a created segment, so that another process of this
	// user on this host can map it through /proc/<pid>/fd/<fd> even after the unlink.
	File *os.File
	// Ino identifies the file (the kernel cannot reuse it while the file is open or mapped).
	Ino uint64
}

// DefaultDir is /dev/shm where it exists and is writable, else os.TempDir().
func DefaultDir() string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() && unix.Access("/dev/shm", unix.W_OK) == nil {
		return "/dev/shm"
	}
	return os.TempDir()
}

// Create makes a new file of size bytes in dir (named prefix-<random>) and maps it.
func Create(dir, prefix string, size int) (*Segment, error) {
	if size <= 0 {
		return nil, fmt.Errorf("shm: create %s: size %d", prefix, size)
	}
	var nonce [8]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return nil, fmt.Errorf("shm: create %s: %w", prefix, err)
	}
	path := filepath.Join(dir, prefix+"-"+hex.EncodeToString(nonce[:]))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("shm: create: %w", err)
	}
	fail := func(err error) (*Segment, error) {
		f.Close()
		os.Remove(path)
		return nil, err
	}
	// Fallocate reserves the pages now, so a full /dev/shm is an error here rather than a
	// SIGBUS on first touch.
	if err := unix.Fallocate(int(f.Fd()), 0, 0, int64(size)); err != nil {
		if err2 := f.Truncate(int64(size)); err2 != nil || !errors.Is(err, unix.EOPNOTSUPP) {
			return fail(fmt.Errorf("shm: reserve %d bytes in %s: %w", size, dir, err))
		}
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fail(fmt.Errorf("shm: stat %s: %w", path, err))
	}
	data, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail(fmt.Errorf("shm: map %s: %w", path, err))
	}
	return &Segment{Path: path, Data: data, File: f, Ino: st.Ino}, nil
}

// Open maps an existing file whole.
func Open(path string) (*Segment, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: open: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("shm: open: %w", err)
	}
	if st.Size() == 0 {
		return nil, fmt.Errorf("shm: open %s: empty file", path)
	}
	data, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: map %s: %w", path, err)
	}
	return &Segment{Path: path, Data: data}, nil
}

// Unlink removes the file; the mappings stay valid. Unlinking twice is not an error.
func (s *Segment) Unlink() error {
	if s.Path == "" {
		return nil
	}
	err := os.Remove(s.Path)
	s.Path = ""
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("shm: unlink: %w", err)
	}
	return nil
}

// Close unmaps the segment and unlinks its file if that has not happened yet.
func (s *Segment) Close() error {
	errU := s.Unlink()
	var errF error
	if s.File != nil {
		errF = s.File.Close()
		s.File = nil
	}
	if s.Data == nil {
		return errors.Join(errU, errF)
	}
	err := unix.Munmap(s.Data)
	s.Data = nil
	if err != nil {
		err = fmt.Errorf("shm: unmap: %w", err)
	}
	return errors.Join(errU, errF, err)
}

// Contains reports whether b lies inside the segment's mapping, and where.
func (s *Segment) Contains(b []byte) (off uint64, ok bool) {
	if len(b) == 0 || len(s.Data) == 0 {
		return 0, false
	}
	base := uintptr(unsafe.Pointer(&s.Data[0]))
	p := uintptr(unsafe.Pointer(&b[0]))
	if p < base || p-base+uintptr(len(b)) > uintptr(len(s.Data)) {
		return 0, false
	}
	return uint64(p - base), true
}

// MapPeer maps, read-only, a segment another process of this host holds open as fd: it
// opens /proc/<pid>/fd/<fd> and checks the file is the one named (ino), so a descriptor
// number the owner has since reused for another file is refused.
func MapPeer(pid, fd int, ino uint64) ([]byte, error) {
	f, st, err := openPeer(pid, fd)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if st.Ino != ino {
		return nil, fmt.Errorf("shm: %s is inode %d, not %d", f.Name(), st.Ino, ino)
	}
	if st.Size <= 0 {
		return nil, fmt.Errorf("shm: %s is empty", f.Name())
	}
	data, err := unix.Mmap(int(f.Fd()), 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shm: map peer segment: %w", err)
	}
	return data, nil
}

// openPeer opens /proc/<pid>/fd/<fd> for reading without blocking and only if it is a
// regular file: a FIFO, socket or device named there would otherwise pin the caller in
// open or read (O_NONBLOCK makes opening a FIFO return at once; the mode check refuses it).
func openPeer(pid, fd int) (*os.File, unix.Stat_t, error) {
	var st unix.Stat_t
	path := fmt.Sprintf("/proc/%d/fd/%d", pid, fd)
	n, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, st, fmt.Errorf("shm: open peer file %s: %w", path, err)
	}
	f := os.NewFile(uintptr(n), path)
	if err := unix.Fstat(n, &st); err != nil {
		f.Close()
		return nil, st, fmt.Errorf("shm: stat peer file %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		f.Close()
		return nil, st, fmt.Errorf("shm: peer file %s is not a regular file (mode %#o)", path, st.Mode)
	}
	return f, st, nil
}

// Unmap releases a mapping made by MapPeer.
func Unmap(b []byte) error { return unix.Munmap(b) }

// ReadPeer reads the first n bytes of a regular file another process of this host holds
// open as fd (the probe that tells two sidecars they can map each other's segments): only a
// file of exactly size bytes with no name left (created, then unlinked, as a probe is).
func ReadPeer(pid, fd, n int, size int64) ([]byte, error) {
	f, st, err := openPeer(pid, fd)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if st.Size != size || st.Nlink != 0 {
		return nil, fmt.Errorf("shm: peer file /proc/%d/fd/%d is not a probe (%d bytes, %d links)", pid, fd, st.Size, st.Nlink)
	}
	b := make([]byte, n)
	if _, err := f.ReadAt(b, 0); err != nil {
		return nil, fmt.Errorf("shm: read peer file: %w", err)
	}
	return b, nil
}
