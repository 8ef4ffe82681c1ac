// Package sparse holds the sparse all-to-all of Mixture-of-Experts layers: which transport
// moves the tokens (this file), and, as it lands, the planner that turns routing into
// one-sided transfers.
package sparse

import (
	"errors"
	"fmt"
	"strings"
)

// Transports of the sparse all-to-all.
const (
	// NVSHMEM: one-sided puts and signals between GPUs of one NVLink domain, device-side
	// splits, no host sync.
	NVSHMEM = "nvshmem"
	// NCCL: grouped send/recv; works on any node (PCIe only, no P2P atomics, several nodes).
	NCCL = "nccl"
)

// Topology is what the choice needs to know about this node's GPUs (internal/nvml reads it
// from NVML; tests fake it).
type Topology interface {
	// Devices is the number of GPUs on the node.
	Devices() int
	// NVLink reports whether GPUs i and j reach each other over NVLink (directly or
	// through NVSwitch).
	NVLink(i, j int) bool
	// Atomics reports whether GPU i can do atomics on GPU j's memory (peer atomics).
	Atomics(i, j int) bool
}

// Choice is the transport picked, and why (logged by the sidecar, shown by its Info).
type Choice struct {
	Transport string
	Reason    string
}

// ErrOverride: GOCOMM_TRANSPORT names something else than auto, nvshmem or nccl, or forces
// NVSHMEM where it cannot run.
var ErrOverride = errors.New("GOCOMM_TRANSPORT")

// Choose picks the sparse transport for a node. override is GOCOMM_TRANSPORT ("" or "auto",
// "nvshmem", "nccl"); nvshmem is nil when the NVSHMEM engine can run here, else why not.
//
// auto gives NVSHMEM only when every pair of the node's GPUs is NVLink-connected with peer
// atomics and the engine is available; anything else gives NCCL, never a hang.
func Choose(t Topology, override string, nvshmem error) (Choice, error) {
	switch strings.ToLower(strings.TrimSpace(override)) {
	case "", "auto":
	case NCCL:
		return Choice{NCCL, "forced by GOCOMM_TRANSPORT=nccl"}, nil
	case NVSHMEM:
		if nvshmem != nil {
			return Choice{}, fmt.Errorf("%w=nvshmem, but NVSHMEM cannot run here: %v", ErrOverride, nvshmem)
		}
		if why := nvlinkDomain(t); why != "" {
			return Choice{NVSHMEM, "forced by GOCOMM_TRANSPORT=nvshmem, although " + why}, nil
		}
		return Choice{NVSHMEM, "forced by GOCOMM_TRANSPORT=nvshmem"}, nil
	default:
		return Choice{}, fmt.Errorf("%w=%q: want auto, nvshmem or nccl", ErrOverride, override)
	}
	if why := nvlinkDomain(t); why != "" {
		return Choice{NCCL, why}, nil
	}
	if nvshmem != nil {
		return Choice{NCCL, fmt.Sprintf("the %d GPUs share NVLink with peer atomics, but NVSHMEM cannot run: %v", t.Devices(), nvshmem)}, nil
	}
	return Choice{NVSHMEM, fmt.Sprintf("all %d GPUs are NVLink-connected with peer atomics", t.Devices())}, nil
}

// nvlinkDomain says why the node is not one NVLink domain with peer atomics, or "".
func nvlinkDomain(t Topology) string {
	if t == nil || t.Devices() < 2 {
		n := 0
		if t != nil {
			n = t.Devices()
		}
		return fmt.Sprintf("%d GPU(s) on this node: nothing to reach over NVLink", n)
	}
	for i := 0; i < t.Devices(); i++ {
		for j := 0; j < t.Devices(); j++ {
			if i == j {
				continue
			}
			if !t.NVLink(i, j) {
				return fmt.Sprintf("GPU %d and GPU %d are not NVLink-connected (PCIe only)", i, j)
			}
			if !t.Atomics(i, j) {
				return fmt.Sprintf("GPU %d cannot do atomics on GPU %d's memory", i, j)
			}
		}
	}
	return ""
}
