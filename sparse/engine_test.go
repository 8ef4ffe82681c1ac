package sparse

import (
	"errors"
	"strings"
	"testing"
)

// node is a fake topology: links[i][j] and atomics[i][j].
type node struct {
	links, atomics [][]bool
}

func (n node) Devices() int          { return len(n.links) }
func (n node) NVLink(i, j int) bool  { return n.links[i][j] }
func (n node) Atomics(i, j int) bool { return n.atomics[i][j] }

func full(n int, v bool) [][]bool {
	m := make([][]bool, n)
	for i := range m {
		m[i] = make([]bool, n)
		for j := range m[i] {
			m[i][j] = v || i == j
		}
	}
	return m
}

// nvswitch is an HGX node: every pair over NVSwitch, peer atomics everywhere.
func nvswitch(n int) node { return node{full(n, true), full(n, true)} }

// pcie is a node of PCIe-only cards (no NVLink, no peer atomics).
func pcie(n int) node { return node{full(n, false), full(n, false)} }

// mixed is two NVLink pairs (0-1, 2-3) joined by PCIe, as on some 4-GPU workstations.
func mixed() node {
	l := full(4, false)
	l[0][1], l[1][0], l[2][3], l[3][2] = true, true, true, true
	return node{l, l}
}

// noAtomics is NVLink everywhere but peer atomics switched off (e.g. a virtualized node).
func noAtomics() node { return node{full(4, true), full(4, false)} }

func TestChoose(t *testing.T) {
	missing := errors.New("libnvshmem_host.so.3 not found")
	for _, tc := range []struct {
		desc      string
		topo      Topology
		override  string
		nvshmem   error
		want      string
		reason    string
		wantError bool
	}{
		{"NVSwitch node, 8 GPUs", nvswitch(8), "", nil, NVSHMEM, "all 8 GPUs", false},
		{"NVSwitch node, 4 GPUs, auto", nvswitch(4), "auto", nil, NVSHMEM, "NVLink-connected", false},
		{"NVSwitch node without NVSHMEM", nvswitch(4), "", missing, NCCL, "libnvshmem_host", false},
		{"PCIe-only node", pcie(4), "", nil, NCCL, "GPU 0 and GPU 1 are not NVLink-connected", false},
		{"mixed node", mixed(), "", nil, NCCL, "GPU 0 and GPU 2 are not NVLink-connected", false},
		{"NVLink without peer atomics", noAtomics(), "", nil, NCCL, "atomics", false},
		{"one GPU", nvswitch(1), "", nil, NCCL, "1 GPU(s)", false},
		{"no NVML (nil topology)", nil, "", nil, NCCL, "0 GPU(s)", false},
		{"forced NCCL on an NVSwitch node", nvswitch(8), "NCCL", nil, NCCL, "forced", false},
		{"forced NVSHMEM on a PCIe node", pcie(2), "nvshmem", nil, NVSHMEM, "although GPU 0 and GPU 1", false},
		{"forced NVSHMEM where it cannot run", nvswitch(2), "nvshmem", missing, "", "", true},
		{"unknown override", nvswitch(2), "ucx", nil, "", "", true},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			c, err := Choose(tc.topo, tc.override, tc.nvshmem)
			if tc.wantError {
				if !errors.Is(err, ErrOverride) {
					t.Fatalf("Choose = %+v, %v; want an ErrOverride", c, err)
				}
				return
			}
			if err != nil || c.Engine != tc.want || !strings.Contains(c.Reason, tc.reason) {
				t.Fatalf("Choose = %+v, %v; want %s because %q", c, err, tc.want, tc.reason)
			}
		})
	}
}

// NewChooser loads NVSHMEM for a client only where it may be chosen, and reports what it
// found as the client's NVSHMEM fact.
func TestNewChooser(t *testing.T) {
	missing := errors.New("libnvshmem_host.so.3 not found")
	noCubin := errors.New("kernels: no a2av cubin in this build")
	for _, tc := range []struct {
		desc     string
		topo     Topology
		override string
		kernels  error
		lib      error
		want     string
		loaded   bool   // the loader was called
		nvshmem  string // the NVSHMEM fact's value
	}{
		{"NVSwitch node, NVSHMEM loads", nvswitch(4), "", nil, nil, NVSHMEM, true, "yes"},
		{"NVSwitch node, library missing", nvswitch(4), "", nil, missing, NCCL, true, "no"},
		{"kernels not built", nvswitch(4), "", noCubin, nil, NCCL, false, "no"},
		{"forced NCCL: nothing loaded", nvswitch(4), "nccl", nil, nil, NCCL, false, "unknown"},
		{"PCIe node", pcie(2), "", nil, nil, NCCL, true, "yes"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			choose, err := NewChooser(tc.topo, tc.override, tc.kernels)
			if err != nil {
				t.Fatal(err)
			}
			loaded := false
			c, err := choose(func() error { loaded = true; return tc.lib })
			if err != nil || c.Engine != tc.want || loaded != tc.loaded || c.NVSHMEM.Value != tc.nvshmem || c.NVSHMEM.Reason == "" {
				t.Fatalf("choice %+v, %v, loaded %v; want %s, loaded %v, nvshmem %s", c, err, loaded, tc.want, tc.loaded, tc.nvshmem)
			}
		})
	}
	if _, err := NewChooser(nvswitch(2), "ucx", nil); !errors.Is(err, ErrOverride) {
		t.Fatalf("NewChooser(ucx) = %v, want an ErrOverride", err)
	}
}

// The client's route table reads a forced NCCL choice from the reason's start
// (csrc/client/routes.cc: a group of one rank keeps the in-process kernels unless NCCL was
// asked for), so that wording is part of the protocol.
func TestForcedNCCLReasonPrefix(t *testing.T) {
	for _, o := range []string{"nccl", "NCCL", " nccl "} {
		c, err := Choose(nvswitch(2), o, nil)
		if err != nil || !strings.HasPrefix(c.Reason, "forced by GOCOMM_TRANSPORT=nccl") {
			t.Fatalf("Choose(%q) = %+v, %v; want a reason starting \"forced by GOCOMM_TRANSPORT=nccl\"", o, c, err)
		}
	}
}
