package cuda

import (
	"errors"
	"os"
	"testing"
)

// requireGPUs skips unless the driver loads and at least n devices are visible.
func requireGPUs(t *testing.T, n int) {
	t.Helper()
	if err := Load(); err != nil {
		t.Skipf("no CUDA driver here: %v", err)
	}
	if c, err := DeviceCount(); err != nil || c < n {
		t.Skipf("need %d GPUs, have %d (%v)", n, c, err)
	}
}

// TestNotLoadedIsAnError: with no driver, every call is an error, never a crash.
func TestNotLoadedIsAnError(t *testing.T) {
	if Load() == nil {
		t.Skip("a driver is present; this test is for machines without one")
	}
	if !errors.Is(Load(), ErrNotLoaded) {
		t.Fatalf("Load = %v, want ErrNotLoaded", Load())
	}
	if _, err := DeviceCount(); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("DeviceCount = %v", err)
	}
	if _, err := Alloc(16); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("Alloc = %v", err)
	}
	if err := (Stream{}).WriteValue32(0, 1); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("WriteValue32 = %v", err)
	}
}

func TestResultStrings(t *testing.T) {
	for r, want := range map[Result]string{Success: "CUDA_SUCCESS", ErrOutOfMemory: "CUDA_ERROR_OUT_OF_MEMORY", 12345: "CUDA error 12345"} {
		if r.Error() != want {
			t.Errorf("%d: %q, want %q", int32(r), r.Error(), want)
		}
	}
	var err error = check("x", 0)
	if err != nil {
		t.Fatal("a success status became a non-nil error")
	}
}

// TestDevice runs on a GPU machine: device properties, a stream, memory ops.
func TestDevice(t *testing.T) {
	requireGPUs(t, 1)
	d, err := DeviceGet(0)
	if err != nil {
		t.Fatal(err)
	}
	name, _ := d.Name()
	ops, _ := d.Attribute(AttrCanUseStreamMemOps)
	mps, _ := d.Attribute(AttrMPSEnabled)
	t.Logf("device 0: %s, stream mem ops %d, MPS %d", name, ops, mps)
	ctx, err := d.PrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	defer d.ReleasePrimaryContext()
	if err := ctx.SetCurrent(); err != nil {
		t.Fatal(err)
	}
	s, err := NewStream(StreamNonBlocking)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Destroy()
	p, err := Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	defer Free(p)
	if err := s.CopyToDeviceOn(p, make([]byte, 64)); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteValue32(p, 7); err != nil {
		t.Fatal(err)
	}
	if err := s.WaitValue32(p, 7, WaitGEQ); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if err := s.CopyToHostOn(b, p); err != nil {
		t.Fatal(err)
	}
	if b[0] != 7 {
		t.Fatalf("read back %v", b)
	}
	if _, err := ExportIPC(p); err != nil && os.Getenv("GOCOMM_EXPECT_IPC") != "" {
		t.Fatal(err)
	}
}
