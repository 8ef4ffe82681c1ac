package dl

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// ErrUntrusted: a library file another process named is not one this process may load.
var ErrUntrusted = errors.New("library not trusted")

// Trusted checks that path (a library a client named, such as the NCCL torch loaded) is a
// file the sidecar may dlopen: after symbolic links, a regular file owned by root or this
// user and writable by neither group nor others, in a directory likewise. Loading runs the
// library's code in the sidecar, so a file anyone else could have written is refused.
func Trusted(path string) error {
	if !filepath.IsAbs(path) {
		return fmt.Errorf("%w: %s is not an absolute path", ErrUntrusted, path)
	}
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrUntrusted, path, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(real, &st); err != nil {
		return fmt.Errorf("%w: %s: %v", ErrUntrusted, real, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("%w: %s is not a regular file", ErrUntrusted, real)
	}
	if err := owned(real, &st); err != nil {
		return err
	}
	dir := filepath.Dir(real)
	if err := unix.Stat(dir, &st); err != nil {
		return fmt.Errorf("%w: %s: %v", ErrUntrusted, dir, err)
	}
	return owned(dir, &st)
}

func owned(path string, st *unix.Stat_t) error {
	if st.Uid != 0 && int(st.Uid) != os.Getuid() {
		return fmt.Errorf("%w: %s belongs to uid %d, neither root nor this user (%d)", ErrUntrusted, path, st.Uid, os.Getuid())
	}
	if st.Mode&0o022 != 0 {
		return fmt.Errorf("%w: %s is writable by its group or others (mode %#o)", ErrUntrusted, path, st.Mode&0o7777)
	}
	return nil
}
