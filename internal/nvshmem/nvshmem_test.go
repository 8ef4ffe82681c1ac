package nvshmem

import (
	"encoding/binary"
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

// wheelSitePackages lists the repository venv's site-packages directories (make installs
// torch's nvidia-nvshmem wheel there).
func wheelSitePackages(t *testing.T) []string {
	t.Helper()
	dirs, _ := filepath.Glob("../../.venv/lib/python3*/site-packages")
	return dirs
}

// TestLoader runs without a GPU: calls before the library is loaded are errors (never a
// crash), a missing library says why, and the wheel's library loads, exports every symbol
// the sidecar binds and makes a unique id in the layout Init assumes.
func TestLoader(t *testing.T) {
	if _, err := NewUniqueID(); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("NewUniqueID before Load: %v, want ErrNotLoaded", err)
	}
	if err := Init(UniqueID{}, 0, 1); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("Init before Load: %v, want ErrNotLoaded", err)
	}
	if MyPE() != -1 || NPEs() != -1 || Ptr(1, 0) != 0 || BarrierAll() == nil || ModuleInit(1) == nil {
		t.Fatal("an entry point ran without the library")
	}
	err := Load("/nonexistent/libnvshmem_host.so.3")
	if !errors.Is(err, ErrNotLoaded) || !strings.Contains(err.Error(), "nonexistent") {
		t.Fatalf("Load of a missing file: %v", err)
	}
	path := Find(wheelSitePackages(t)...)
	if path == LibraryName {
		t.Skip("no nvidia-nvshmem wheel in ../../.venv (run make): the loaded-library half needs it")
	}
	if err := Load(path); err != nil {
		t.Fatalf("Load(%s): %v", path, err)
	}
	if err := Load("/other/libnvshmem_host.so.3"); err == nil {
		t.Fatal("a second library path was accepted")
	}
	id, err := NewUniqueID()
	if err != nil {
		t.Fatalf("NewUniqueID: %v", err)
	}
	if v := binary.LittleEndian.Uint32(id[:4]); v != 1<<16+128 {
		t.Fatalf("unique id version %#x, want %#x (the 3.4 layout Init fills in)", v, 1<<16+128)
	}
}

func TestStatusText(t *testing.T) {
	if got := Status(-2).Error(); got != "NVSHMEMX_ERROR_OUT_OF_MEMORY" {
		t.Fatalf("Status(-2) = %q", got)
	}
	if got := check("x", 0); got != nil {
		t.Fatalf("check(0) = %v, want nil", got)
	}
}
