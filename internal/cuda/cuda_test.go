package cuda

import (
	"errors"
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
	if _, err := ImportFD(0); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("ImportFD = %v, want ErrNotLoaded", err)
	}
	if err := SetAccess(0, 1<<21, 0); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("SetAccess = %v, want ErrNotLoaded", err)
	}
	if _, err := LoadModule([]byte{1}); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("LoadModule = %v", err)
	}
	if _, err := (Module{}).Function("k"); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("Function = %v", err)
	}
	if err := (Function{}).Launch([3]int{1, 1, 1}, [3]int{1, 1, 1}, 0, Stream{}, new(Args).Ptr(1)); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("Launch = %v", err)
	}
}

// TestArgs: kernel parameters keep their order and sizes.
func TestArgs(t *testing.T) {
	a := new(Args).Ptr(0x1122334455667788).I32(-2).I64(7).Struct(make([]byte, 40))
	if len(a.sizes) != 4 || a.sizes[0] != 8 || a.sizes[1] != 4 || a.sizes[2] != 8 || a.sizes[3] != 40 {
		t.Fatalf("sizes %v", a.sizes)
	}
	if len(a.vals) != 60 || a.vals[0] != 0x88 || a.vals[8] != 0xfe {
		t.Fatalf("values % x", a.vals[:12])
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
}
