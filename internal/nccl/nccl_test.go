package nccl

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestNotLoadedIsAnError: before Load, or where no library exists, calls fail cleanly.
func TestNotLoadedIsAnError(t *testing.T) {
	if loaded() == nil {
		t.Skip("already loaded")
	}
	if _, err := Version(); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("Version = %v, want ErrNotLoaded", err)
	}
	if err := (Comm{}).AllReduce(0, 0, 1, Float32, Sum, nil); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("AllReduce = %v", err)
	}
	if err := Load("/nonexistent/libnccl.so.2"); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("Load of a missing file = %v", err)
	}
}

// TestLoadWheel loads the NCCL that torch's wheel ships, when the venv has it (CI does): the
// library opens without a GPU and reports its version.
func TestLoadWheel(t *testing.T) {
	matches, _ := filepath.Glob(filepath.Join("..", "..", ".venv", "lib", "python3*", "site-packages", "nvidia", "nccl", "lib", "libnccl.so.2"))
	if env := os.Getenv("GOCOMM_NCCL"); env != "" {
		matches = []string{env}
	}
	if len(matches) == 0 {
		t.Skip("no libnccl.so.2 in .venv (run make)")
	}
	if err := Load(matches[0]); err != nil {
		t.Fatal(err)
	}
	v, err := Version()
	if err != nil {
		t.Fatal(err)
	}
	if v < 22800 {
		t.Fatalf("NCCL version %d, want 2.28 or later", v)
	}
	t.Logf("NCCL %d from %s", v, matches[0])
	if err := Load("/other/libnccl.so.2"); err == nil {
		t.Fatal("a second, different NCCL was accepted")
	}
}

func TestResultStrings(t *testing.T) {
	if InvalidUsage.Error() != "ncclInvalidUsage" || Result(42).Error() != "ncclResult 42" {
		t.Fatal(InvalidUsage.Error(), Result(42).Error())
	}
}
