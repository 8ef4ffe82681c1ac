// Package sparse holds the sparse all-to-all of Mixture-of-Experts layers: which engine
// moves the tokens (this file; the public names, GOCOMM_TRANSPORT and the proto fields, call
// it the sparse transport; the NVSHMEM engine itself is sparse/nvshmem), and, as it lands,
// the planner that turns routing into one-sided transfers.
package sparse

import (
	"errors"
	"fmt"
	"strings"

	gonode "github.com/gocomm/gocomm/node"
)

// Engines of the sparse all-to-all.
const (
	// NVSHMEM: one-sided puts and signals between GPUs of one NVLink domain, device-side
	// splits, no host sync.
	NVSHMEM = "nvshmem"
	// NCCL: grouped send/recv; works on any node (PCIe only, no P2P atomics, several nodes).
	NCCL = "nccl"
)

// Topology is what the choice needs to know about this node's GPUs (gonode.Topology).
type Topology = gonode.Topology

// Choice is the engine picked, and why (logged by the sidecar, shown by its Info).
type Choice struct {
	Engine string
	Reason string
	// NVSHMEM is whether the NVSHMEM engine can run for the client (gonode.NVSHMEM), as the
	// chooser found it.
	NVSHMEM gonode.Fact
}

// ErrOverride: GOCOMM_TRANSPORT names something else than auto, nvshmem or nccl, or forces
// NVSHMEM where it cannot run.
var ErrOverride = errors.New("GOCOMM_TRANSPORT")

// Choose picks the sparse engine for a node. override is GOCOMM_TRANSPORT ("" or "auto",
// "nvshmem", "nccl"); nvshmem is nil when the NVSHMEM engine can run here, else why not.
//
// auto gives NVSHMEM only when every pair of the node's GPUs is NVLink-connected with peer
// atomics and the engine is available; anything else gives NCCL, never a hang.
func Choose(t Topology, override string, nvshmem error) (Choice, error) {
	switch strings.ToLower(strings.TrimSpace(override)) {
	case "", "auto":
	case NCCL:
		return Choice{Engine: NCCL, Reason: "forced by GOCOMM_TRANSPORT=nccl"}, nil
	case NVSHMEM:
		if nvshmem != nil {
			return Choice{}, fmt.Errorf("%w=nvshmem, but NVSHMEM cannot run here: %v", ErrOverride, nvshmem)
		}
		if d := gonode.InNVLinkDomain(t); !d.Holds() {
			return Choice{Engine: NVSHMEM, Reason: "forced by GOCOMM_TRANSPORT=nvshmem, although " + d.Reason}, nil
		}
		return Choice{Engine: NVSHMEM, Reason: "forced by GOCOMM_TRANSPORT=nvshmem"}, nil
	default:
		return Choice{}, fmt.Errorf("%w=%q: want auto, nvshmem or nccl", ErrOverride, override)
	}
	d := gonode.InNVLinkDomain(t)
	if !d.Holds() {
		return Choice{Engine: NCCL, Reason: d.Reason}, nil
	}
	if nvshmem != nil {
		return Choice{Engine: NCCL, Reason: fmt.Sprintf("the %d GPUs share NVLink with peer atomics, but NVSHMEM cannot run: %v", t.Devices(), nvshmem)}, nil
	}
	return Choice{Engine: NVSHMEM, Reason: d.Reason}, nil
}

// Chooser picks an attaching client's sparse engine; nvshmem loads the NVSHMEM host library for
// that client (nil: it can run).
type Chooser func(nvshmem func() error) (Choice, error)

// NewChooser returns how each attaching client's sparse engine is picked on a node of topology t
// (nil: none could be read): from t, override (GOCOMM_TRANSPORT) and whether the NVSHMEM
// engine can run for the client: kernels is nil when its kernels are built into this binary,
// else why not; the host library beside the client's NCCL is loaded only where NVSHMEM may
// be chosen. An override other than auto, nvshmem or nccl is an ErrOverride here.
func NewChooser(t Topology, override string, kernels error) (Chooser, error) {
	if _, err := Choose(t, override, nil); err != nil {
		return nil, err
	}
	forcedNCCL := strings.EqualFold(strings.TrimSpace(override), NCCL)
	return func(load func() error) (Choice, error) {
		err := kernels
		if err == nil && !forcedNCCL {
			err = load()
		}
		c, cerr := Choose(t, override, err)
		if cerr != nil {
			return Choice{}, cerr
		}
		switch {
		case err != nil:
			c.NVSHMEM = gonode.Fact{Name: gonode.NVSHMEM, Value: gonode.No, Reason: err.Error()}
		case forcedNCCL:
			c.NVSHMEM = gonode.Fact{Name: gonode.NVSHMEM, Value: gonode.Unknown, Reason: "not loaded: GOCOMM_TRANSPORT=nccl"}
		default:
			c.NVSHMEM = gonode.Fact{Name: gonode.NVSHMEM, Value: gonode.Yes, Reason: "kernels built for these GPUs, host library loaded"}
		}
		return c, nil
	}, nil
}

// Default is the choice where no chooser runs (no GPU engine, or a client without NCCL):
// NCCL, because why.
func Default(why string) Choice {
	return Choice{Engine: NCCL, Reason: why, NVSHMEM: gonode.Fact{Name: gonode.NVSHMEM, Value: gonode.No, Reason: why}}
}
