package nvml

import (
	"fmt"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// fakeNode builds an NVML mock of n GPUs whose pair (i, j) has NVLink when link(i, j) and
// peer atomics when atomics(i, j).
func fakeNode(n int, link, atomics func(i, j int) bool) *mock.Interface {
	devs := make([]*mock.Device, n)
	index := map[nvml.Device]int{}
	for i := range devs {
		i := i
		d := &mock.Device{
			GetNameFunc: func() (string, nvml.Return) { return "NVIDIA H200", nvml.SUCCESS },
			GetUUIDFunc: func() (string, nvml.Return) { return fmt.Sprintf("GPU-%d", i), nvml.SUCCESS },
		}
		d.GetP2PStatusFunc = func(other nvml.Device, idx nvml.GpuP2PCapsIndex) (nvml.GpuP2PStatus, nvml.Return) {
			j := index[other]
			ok := (idx == nvml.P2P_CAPS_INDEX_NVLINK && link(i, j)) || (idx == nvml.P2P_CAPS_INDEX_ATOMICS && atomics(i, j))
			if ok {
				return nvml.P2P_STATUS_OK, nvml.SUCCESS
			}
			return nvml.P2P_STATUS_NOT_SUPPORTED, nvml.SUCCESS
		}
		devs[i] = d
		index[d] = i
	}
	return &mock.Interface{
		InitFunc:           func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
		ErrorStringFunc:    func(r nvml.Return) string { return fmt.Sprintf("nvml return %d", r) },
		DeviceGetCountFunc: func() (int, nvml.Return) { return n, nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			return devs[i], nvml.SUCCESS
		},
	}
}

func TestRead(t *testing.T) {
	all := func(i, j int) bool { return true }
	none := func(i, j int) bool { return false }
	pairs := func(i, j int) bool { return i/2 == j/2 } // NVLink bridges 0-1 and 2-3
	for _, tc := range []struct {
		desc            string
		lib             *mock.Interface
		link01, link02  bool
		atomic01, devsN int
	}{
		{"NVSwitch node", fakeNode(8, all, all), true, true, 1, 8},
		{"PCIe-only node", fakeNode(4, none, none), false, false, 0, 4},
		{"mixed node", fakeNode(4, pairs, pairs), true, false, 1, 4},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			topo, err := Read(tc.lib)
			if err != nil {
				t.Fatal(err)
			}
			if topo.Devices() != tc.devsN || topo.NVLink(0, 1) != tc.link01 || topo.NVLink(0, 2) != tc.link02 ||
				topo.Atomics(0, 1) != (tc.atomic01 == 1) || !topo.NVLink(1, 1) {
				t.Fatalf("topology %+v", topo)
			}
			if topo.UUIDs[3] != "GPU-3" {
				t.Fatalf("uuids %v", topo.UUIDs)
			}
		})
	}
}

func TestInitFailure(t *testing.T) {
	lib := &mock.Interface{
		InitFunc:        func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND },
		ErrorStringFunc: func(r nvml.Return) string { return "library not found" },
	}
	if _, err := Read(lib); err == nil {
		t.Fatal("Read succeeded without NVML")
	}
}
