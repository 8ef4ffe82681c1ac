package node

import (
	"errors"
	"strings"
	"testing"
)

// topo is a fake topology: links[i][j] and atomics[i][j].
type topo struct{ links, atomics [][]bool }

func (t topo) Devices() int          { return len(t.links) }
func (t topo) NVLink(i, j int) bool  { return t.links[i][j] }
func (t topo) Atomics(i, j int) bool { return t.atomics[i][j] }

func grid(n int, v func(i, j int) bool) [][]bool {
	m := make([][]bool, n)
	for i := range m {
		m[i] = make([]bool, n)
		for j := range m[i] {
			m[i][j] = i == j || v(i, j)
		}
	}
	return m
}

var (
	all   = func(i, j int) bool { return true }
	none  = func(i, j int) bool { return false }
	pairs = func(i, j int) bool { return i/2 == j/2 } // NVLink bridges 0-1 and 2-3
)

// devices is a fake GPU engine.
type devices struct {
	arch   []int
	err    error
	mps    bool
	mpsErr error
}

func (d devices) Arch() ([]int, error) { return d.arch, d.err }
func (d devices) MPS() (bool, error)   { return d.mps, d.mpsErr }

func TestInNVLinkDomain(t *testing.T) {
	for _, tc := range []struct {
		desc   string
		topo   Topology
		want   string
		reason string
	}{
		{"NVSwitch node, 8 GPUs", topo{grid(8, all), grid(8, all)}, Yes, "all 8 GPUs"},
		{"PCIe-only node", topo{grid(4, none), grid(4, none)}, No, "GPU 0 and GPU 1 are not NVLink-connected"},
		{"NVLink bridges in pairs", topo{grid(4, pairs), grid(4, pairs)}, No, "GPU 0 and GPU 2"},
		{"NVLink without peer atomics", topo{grid(4, all), grid(4, none)}, No, "atomics"},
		{"one GPU", topo{grid(1, all), grid(1, all)}, No, "1 GPU(s)"},
		{"no topology", nil, No, "0 GPU(s)"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			f := InNVLinkDomain(tc.topo)
			if f.Name != NVLinkDomain || f.Value != tc.want || !strings.Contains(f.Reason, tc.reason) {
				t.Fatalf("InNVLinkDomain = %v, want %s because %q", f, tc.want, tc.reason)
			}
		})
	}
}

func TestDescribe(t *testing.T) {
	noDriver := errors.New("cuda: libcuda.so.1 not found")
	noNVML := errors.New("nvml: init: library not found")
	h200 := topo{grid(8, all), grid(8, all)}
	for _, tc := range []struct {
		desc    string
		topo    Topology
		topoErr error
		dev     Devices
		want    map[string]string // name -> value
		reasons map[string]string // name -> part of the reason
	}{
		{
			"CPU machine: no GPU engine, no NVML", nil, noNVML, nil,
			map[string]string{Host: "h", GPUs: "0", NVLinkDomain: No, SMArch: Unknown, MPS: Unknown},
			map[string]string{GPUs: "no GPU engine", NVLinkDomain: "library not found", MPS: "no GPU"},
		},
		{
			"driver missing", nil, noNVML, devices{err: noDriver},
			map[string]string{GPUs: "0", SMArch: Unknown, MPS: Unknown},
			map[string]string{GPUs: "libcuda.so.1"},
		},
		{
			"HGX H200 under MPS", h200, nil, devices{arch: []int{90, 90, 90, 90, 90, 90, 90, 90}, mps: true},
			map[string]string{GPUs: "8", NVLinkDomain: Yes, SMArch: "sm_90", MPS: Yes},
			map[string]string{SMArch: "all 8", MPS: "MPS server"},
		},
		{
			"PCIe workstation, mixed GPUs", topo{grid(2, none), grid(2, none)}, nil, devices{arch: []int{89, 90}},
			map[string]string{GPUs: "2", NVLinkDomain: No, SMArch: "sm_89,sm_90", MPS: No},
			map[string]string{NVLinkDomain: "PCIe only", SMArch: "differ"},
		},
		{
			"MPS cannot be asked", h200, nil, devices{arch: []int{90}, mpsErr: errors.New("attribute 133 unsupported")},
			map[string]string{MPS: Unknown},
			map[string]string{MPS: "unsupported"},
		},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			facts := Describe("h", tc.topo, tc.topoErr, tc.dev)
			for _, name := range []string{Host, GPUs, NVLinkDomain, SMArch, MPS} {
				f := Find(facts, name)
				if f.Reason == "" || f.Reason == "not reported" {
					t.Errorf("%s has no reason: %v", name, f)
				}
				if want, ok := tc.want[name]; ok && f.Value != want {
					t.Errorf("%v, want value %q", f, want)
				}
				if part, ok := tc.reasons[name]; ok && !strings.Contains(f.Reason, part) {
					t.Errorf("%v, want a reason naming %q", f, part)
				}
			}
		})
	}
}

func TestLoadedNCCL(t *testing.T) {
	for _, tc := range []struct {
		desc   string
		path   string
		err    error
		want   string
		reason string
	}{
		{"CPU client", "", nil, No, "no NCCL"},
		{"loaded", "/x/libnccl.so.2", nil, Yes, "/x/libnccl.so.2"},
		{"load failed", "/x/libnccl.so.2", errors.New("undefined symbol ncclCommInitRankConfig"), No, "undefined symbol"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			f := LoadedNCCL(tc.path, tc.err)
			if f.Name != NCCL || f.Value != tc.want || !strings.Contains(f.Reason, tc.reason) {
				t.Fatalf("LoadedNCCL = %v, want %s because %q", f, tc.want, tc.reason)
			}
		})
	}
}
