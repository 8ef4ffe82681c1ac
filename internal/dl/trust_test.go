package dl

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestTrusted: a private library of this user passes, through a link too; one writable by
// others, in a directory writable by others, owned by another user, or not a regular file
// is refused with a message naming it and why.
func TestTrusted(t *testing.T) {
	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	lib := filepath.Join(dir, "libnccl.so.2.21")
	os.WriteFile(lib, []byte("\x7fELF"), 0o644)
	link := filepath.Join(dir, "libnccl.so.2")
	os.Symlink(lib, link)
	for _, p := range []string{lib, link} {
		if err := Trusted(p); err != nil {
			t.Errorf("Trusted(%s) = %v", p, err)
		}
	}
	open := filepath.Join(dir, "open.so")
	os.WriteFile(open, nil, 0o644)
	os.Chmod(open, 0o666)
	openDir := filepath.Join(dir, "shared")
	os.Mkdir(openDir, 0o755)
	os.Chmod(openDir, 0o777)
	inOpen := filepath.Join(openDir, "lib.so")
	os.WriteFile(inOpen, nil, 0o644)
	cases := []struct{ path, want string }{
		{open, "writable by its group or others"},
		{inOpen, "shared is writable"},
		{dir, "not a regular file"},
		{"libnccl.so.2", "not an absolute path"},
		{filepath.Join(dir, "missing.so"), "missing.so"},
	}
	if os.Getuid() == 0 {
		theirs := filepath.Join(dir, "theirs.so")
		os.WriteFile(theirs, nil, 0o644)
		os.Chown(theirs, 65534, 65534)
		cases = append(cases, struct{ path, want string }{theirs, "belongs to uid 65534"})
	}
	for _, tc := range cases {
		err := Trusted(tc.path)
		if !errors.Is(err, ErrUntrusted) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Trusted(%s) = %v, want ErrUntrusted saying %q", tc.path, err, tc.want)
		}
	}
}
