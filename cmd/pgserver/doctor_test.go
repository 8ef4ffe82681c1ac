package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestCheckShm: free space below 256 MiB fails, below 2 GiB warns, and a missing mount warns;
// every row but ok names a fix.
func TestCheckShm(t *testing.T) {
	statfs := func(free uint64, err error) func(string, *syscall.Statfs_t) error {
		return func(_ string, st *syscall.Statfs_t) error {
			st.Bsize, st.Blocks, st.Bavail = 4096, (8<<30)/4096, free/4096
			return err
		}
	}
	for _, tc := range []struct {
		free   uint64
		err    error
		status string
	}{
		{100 << 20, nil, statusFail},
		{1 << 30, nil, statusWarn},
		{4 << 30, nil, statusOK},
		{0, errors.New("no such file"), statusWarn},
	} {
		r := checkShm("/dev/shm", statfs(tc.free, tc.err))
		if r.Status != tc.status || (r.Status == statusOK) != (r.Fix == "") {
			t.Errorf("free %d, err %v: %+v, want status %s", tc.free, tc.err, r, tc.status)
		}
	}
}

func TestCheckPtrace(t *testing.T) {
	dir := t.TempDir()
	for scope, status := range map[string]string{"0\n": statusOK, "1\n": statusWarn, "": statusOK} {
		path := filepath.Join(dir, "missing")
		if scope != "" {
			path = filepath.Join(dir, "scope"+strings.TrimSpace(scope))
			if err := os.WriteFile(path, []byte(scope), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if r := checkPtrace(path); r.Status != status || (r.Status == statusOK) != (r.Fix == "") {
			t.Errorf("scope %q: %+v, want %s", scope, r, status)
		}
	}
}

func TestNeedsFlag(t *testing.T) {
	var n needs
	if err := n.Set("torch=13.0"); err != nil || len(n) != 1 || n[0] != (need{"torch", 13, 0}) {
		t.Fatalf("torch=13.0: %v %v", n, err)
	}
	if err := n.Set("the kernels' nvcc=12.8.93"); err != nil || n[1] != (need{"the kernels' nvcc", 12, 8}) {
		t.Fatalf("nvcc 12.8.93: %v %v", n, err)
	}
	for _, bad := range []string{"torch", "torch=13", "=13.0", "torch=x.y"} {
		if err := n.Set(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// TestDoctorJSON: `pgserver doctor` prints a JSON list of rows with the node checks; without
// a driver (CI) the CUDA row says CPU tensors only, and a bad --ipc is refused as a row, not a
// crash, where there is one.
func TestDoctorJSON(t *testing.T) {
	var out bytes.Buffer
	if err := doctor([]string{"--needs-cuda", "torch=13.0"}, &out); err != nil {
		t.Fatal(err)
	}
	var rows []checkRow
	if err := json.Unmarshal(out.Bytes(), &rows); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	got := map[string]bool{}
	for _, r := range rows {
		got[r.Check] = true
		if (r.Status == statusOK) != (r.Fix == "") {
			t.Errorf("%+v: a problem must name its fix, ok must not", r)
		}
	}
	for _, c := range []string{"/dev/shm", "fd limit", "ptrace scope"} {
		if !got[c] {
			t.Errorf("no %s row in %s", c, out.String())
		}
	}
	if !got["CUDA"] && !got["driver"] {
		t.Errorf("no CUDA or driver row in %s", out.String())
	}
	if err := doctor([]string{"--needs-cuda", "13"}, &out); err == nil {
		t.Error("a malformed --needs-cuda was accepted")
	}
}
