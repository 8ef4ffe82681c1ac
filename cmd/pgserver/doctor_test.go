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

// TestCheckConfig: a knob's bad value fails the row naming the variable and what it accepts,
// a deprecated name warns naming its new one, and an environment of accepted values passes.
func TestCheckConfig(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	for _, tc := range []struct {
		env    map[string]string
		status string
		want   []string
	}{
		{map[string]string{"GOCOMM_SPIN": "forever", "GOCOMM_AR_MAX": "-3"}, statusFail, []string{"GOCOMM_SPIN", "GOCOMM_AR_MAX", "up to 1s"}},
		{map[string]string{"GOCOMM_A2AV_HERE": "1"}, statusWarn, []string{"GOCOMM_A2AV_HERE", "GOCOMM_A2AV_INPROCESS"}},
		{map[string]string{"GOCOMM_SPIN": "500us"}, statusOK, nil},
		{nil, statusOK, nil},
	} {
		r := checkConfig(env(tc.env))
		if r.Check != "config" || r.Status != tc.status || (r.Status == statusOK) != (r.Fix == "") {
			t.Errorf("%v: %+v, want status %s", tc.env, r, tc.status)
		}
		for _, w := range tc.want {
			if !strings.Contains(r.Found, w) {
				t.Errorf("%v: %q does not name %s", tc.env, r.Found, w)
			}
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

// TestDoctorJSON: `pgserver doctor --json` prints a JSON list of rows with the node checks;
// without a driver (CI) the CUDA row says CPU tensors only, and a bad --ipc is refused as a
// row, not a crash, where there is one.
func TestDoctorJSON(t *testing.T) {
	var out bytes.Buffer
	if err := doctor([]string{"--json", "--needs-cuda", "torch=13.0"}, &out); err != nil && !errors.Is(err, errChecksFailed) {
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

// TestTrainingProcessChecks: the rows of what `gocomm doctor` hands over (its torch, the
// package's version, the in-process kernels' arch) and MPS, each case with its status; every
// row but ok names a fix.
func TestTrainingProcessChecks(t *testing.T) {
	for _, tc := range []struct {
		desc   string
		row    checkRow
		status string
		found  string
	}{
		{"no build record", checkTorch("", "2.11.0+cu130"), statusWarn, "no build record"},
		{"another torch", checkTorch("2.11.0+cu130", "2.10.0+cu130"), statusFail, "gocomm was built for torch 2.11.0+cu130, this is torch 2.10.0+cu130"},
		{"another CUDA build", checkTorch("2.11.0+cu130", "2.11.0+cu128"), statusWarn, "other CUDA build"},
		{"the same torch", checkTorch("2.11.0+cu130", "2.11.0+cu130"), statusOK, "torch 2.11.0+cu130 (built for 2.11.0+cu130)"},
		{"a local version against none", checkTorch("2.11.0", "2.11.0+cu130"), statusOK, "built for 2.11.0"},
		{"pgserver of another version", checkVersion("/x/pgserver", "0.0.0-other", "0.1.0"), statusFail, "/x/pgserver is pgserver 0.0.0-other, gocomm is 0.1.0"},
		{"pgserver of this version", checkVersion("/x/pgserver", "0.1.0", "0.1.0"), statusOK, "/x/pgserver runs, version 0.1.0"},
		{"kernels of another arch", checkKernels("sm_90", "sm_100"), statusWarn, "built for sm_90, GPU 0 is sm_100: their ops take sidecar NCCL"},
		{"kernels of this arch", checkKernels("sm_90", "sm_90"), statusOK, "kernels built for sm_90, GPU 0 is sm_90"},
		{"MPS on", checkMPS(true, nil, "/tmp/p"), statusOK, "an MPS daemon answers on /tmp/p"},
		{"MPS off", checkMPS(false, nil, "/tmp/p"), statusWarn, "no MPS daemon"},
		{"MPS unknown", checkMPS(false, errors.New("CUDA_ERROR_INVALID_VALUE"), "/tmp/p"), statusWarn, "CUDA_ERROR_INVALID_VALUE"},
	} {
		r := tc.row
		if r.Status != tc.status || !strings.Contains(r.Found, tc.found) || (r.Status == statusOK) != (r.Fix == "") {
			t.Errorf("%s: %+v, want status %s and %q", tc.desc, r, tc.status, tc.found)
		}
	}
	if r := checkTorch("2.11.0+cu130", "2.10.0"); r.Fix != "pip install torch==2.11.0" {
		t.Errorf("another torch: fix %q", r.Fix)
	}
	if r := checkKernels("sm_90", "sm_100"); r.Fix != "build with make CUDA_ARCH=sm_100" {
		t.Errorf("kernels: fix %q", r.Fix)
	}
}

// TestDoctorTable: the rows of `gocomm doctor` in its order (torch, pgserver, then the node),
// printed as a table with each fix under its row, and a failed check (here the package's
// version and an IPC handle the training process could not make) ends in errChecksFailed.
func TestDoctorTable(t *testing.T) {
	var out bytes.Buffer
	err := doctor([]string{"--gocomm", "0.0.0-other", "--torch-here", "2.11.0+cu130", "--torch-built", "2.11.0+cu130",
		"--torch-cuda", "no", "--ipc-error", "no device"}, &out)
	if !errors.Is(err, errChecksFailed) {
		t.Fatalf("doctor: %v, want errChecksFailed", err)
	}
	lines := strings.Split(out.String(), "\n")
	want := []string{
		"[ok  ] torch        torch 2.11.0+cu130 (built for 2.11.0+cu130)",
		"[fail] pgserver     " + os.Args[0] + " is pgserver " + version + ", gocomm is 0.0.0-other",
		"                    fix: install the matching wheel",
	}
	for i, w := range want {
		if i >= len(lines) || lines[i] != w {
			t.Fatalf("line %d: %q, want %q in\n%s", i, lines[min(i, len(lines)-1)], w, out.String())
		}
	}
	for _, w := range []string{"] /dev/shm ", "] fd limit ", "[fail] CUDA IPC     CUDA IPC of a tensor: this process could not export one: no device"} {
		if !strings.Contains(out.String(), w) {
			t.Errorf("no %q in\n%s", w, out.String())
		}
	}
	out.Reset()
	if err := doctor([]string{"--gocomm", version, "--json"}, &out); err != nil && !errors.Is(err, errChecksFailed) {
		t.Fatal(err)
	}
	var rows []checkRow
	if err := json.Unmarshal(out.Bytes(), &rows); err != nil || rows[0].Check != "pgserver" || rows[0].Status != statusOK {
		t.Fatalf("--json: %v %s", err, out.String())
	}
}
