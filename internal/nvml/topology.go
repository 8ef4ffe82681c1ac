// Package nvml reads the GPU topology of this node through NVML (github.com/NVIDIA/go-nvml,
// which loads libnvidia-ml at run time and fails cleanly where there is none).
package nvml

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Topology is the node's GPUs and how each pair is connected (sparse.Topology).
type Topology struct {
	Names   []string
	UUIDs   []string
	nvlink  [][]bool
	atomics [][]bool
}

func (t *Topology) Devices() int          { return len(t.Names) }
func (t *Topology) NVLink(i, j int) bool  { return t.nvlink[i][j] }
func (t *Topology) Atomics(i, j int) bool { return t.atomics[i][j] }

// Read initializes lib, reads every device and the P2P status of every pair (NVLink and
// peer atomics), and shuts lib down. Pass nvml.New() for the real library.
func Read(lib nvml.Interface) (*Topology, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvml: init: %v", lib.ErrorString(ret))
	}
	defer lib.Shutdown()
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvml: device count: %v", lib.ErrorString(ret))
	}
	t := &Topology{}
	devs := make([]nvml.Device, n)
	for i := 0; i < n; i++ {
		d, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("nvml: device %d: %v", i, lib.ErrorString(ret))
		}
		devs[i] = d
		name, _ := d.GetName()
		uuid, _ := d.GetUUID()
		t.Names = append(t.Names, name)
		t.UUIDs = append(t.UUIDs, uuid)
	}
	t.nvlink, t.atomics = make([][]bool, n), make([][]bool, n)
	for i := range devs {
		t.nvlink[i], t.atomics[i] = make([]bool, n), make([]bool, n)
		for j := range devs {
			if i == j {
				t.nvlink[i][j], t.atomics[i][j] = true, true
				continue
			}
			t.nvlink[i][j] = p2p(devs[i], devs[j], nvml.P2P_CAPS_INDEX_NVLINK)
			t.atomics[i][j] = p2p(devs[i], devs[j], nvml.P2P_CAPS_INDEX_ATOMICS)
		}
	}
	return t, nil
}

func p2p(a, b nvml.Device, idx nvml.GpuP2PCapsIndex) bool {
	st, ret := a.GetP2PStatus(b, idx)
	return ret == nvml.SUCCESS && st == nvml.P2P_STATUS_OK
}
