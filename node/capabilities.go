// Package node holds what the sidecar knows about its node and its client, each fact decided
// once, with the reason: the GPUs' NVLink domain, their architecture, MPS, and per client
// whether its NCCL and NVSHMEM load. The sidecar reports them through Attach and Info; the
// shim agrees them across a group's ranks and builds the group's route table from them.
//
// Nothing here touches a library: the topology and the devices come in through interfaces
// (internal/nvml and collectives/device implement them; tests fake them).
package node

import (
	"fmt"
	"strings"
)

// Names of the facts, as Attach and Info report them.
const (
	// Host is the host the sidecar runs on: a group whose members report one host is on one
	// node (the sidecar cannot see its peers; the shim compares).
	Host = "host"
	// GPUs is how many GPUs the sidecar sees.
	GPUs = "gpus"
	// NVLinkDomain: every pair of this node's GPUs shares NVLink (direct or through NVSwitch)
	// with peer atomics, the condition of the one-sided kernels (NVSHMEM, the in-process ones).
	NVLinkDomain = "nvlink_domain"
	// SMArch is the GPUs' compute capability (sm_XY), one for all or the list.
	SMArch = "sm_arch"
	// MPS: contexts the sidecar creates go through an MPS server.
	MPS = "mps"
	// NCCL: the client's NCCL (the path it sent at Attach) loaded in the sidecar.
	NCCL = "nccl"
	// NVSHMEM: the sidecar's NVSHMEM engine can run for the client (kernels built for these
	// GPUs, host library beside the client's NCCL loaded).
	NVSHMEM = "nvshmem"
)

// Values of a yes/no fact; a fact that could not be found out cheaply is Unknown.
const (
	Yes     = "yes"
	No      = "no"
	Unknown = "unknown"
)

// Fact is one thing known about the node or a client, and why it holds.
type Fact struct {
	Name   string
	Value  string // Yes, No, Unknown, or a value (a host name, a count, "sm_90")
	Reason string
}

// Holds reports whether a yes/no fact is Yes.
func (f Fact) Holds() bool { return f.Value == Yes }

func (f Fact) String() string { return fmt.Sprintf("%s=%s (%s)", f.Name, f.Value, f.Reason) }

// Topology is this node's GPUs and how each pair is connected (internal/nvml reads it from
// NVML; tests fake it).
type Topology interface {
	// Devices is the number of GPUs on the node.
	Devices() int
	// NVLink reports whether GPUs i and j reach each other over NVLink (directly or
	// through NVSwitch).
	NVLink(i, j int) bool
	// Atomics reports whether GPU i can do atomics on GPU j's memory (peer atomics).
	Atomics(i, j int) bool
}

// Devices is what the sidecar's GPU engine says of the GPUs it opened (collectives/device
// implements it; nil where the sidecar has no GPU engine).
type Devices interface {
	// Arch is each device's compute capability, major*10 + minor; an error says why there
	// are no devices.
	Arch() ([]int, error)
	// MPS reports whether contexts on the devices go through an MPS server; an error where
	// that cannot be asked.
	MPS() (bool, error)
}

// InNVLinkDomain decides the NVLinkDomain fact: Yes when every pair of t's GPUs is
// NVLink-connected with peer atomics. A nil t is a node whose topology could not be read.
func InNVLinkDomain(t Topology) Fact {
	n := 0
	if t != nil {
		n = t.Devices()
	}
	if n < 2 {
		return Fact{NVLinkDomain, No, fmt.Sprintf("%d GPU(s) on this node: nothing to reach over NVLink", n)}
	}
	for i := 0; i < n; i++ {
		for j := 0; j < n; j++ {
			if i == j {
				continue
			}
			if !t.NVLink(i, j) {
				return Fact{NVLinkDomain, No, fmt.Sprintf("GPU %d and GPU %d are not NVLink-connected (PCIe only)", i, j)}
			}
			if !t.Atomics(i, j) {
				return Fact{NVLinkDomain, No, fmt.Sprintf("GPU %d cannot do atomics on GPU %d's memory", i, j)}
			}
		}
	}
	return Fact{NVLinkDomain, Yes, fmt.Sprintf("all %d GPUs are NVLink-connected with peer atomics", n)}
}

// Describe decides the node's facts once: host, GPUs, NVLink domain, SM arch and MPS.
// topoErr says why t is nil (NVML not readable); dev is nil without a GPU engine.
func Describe(host string, t Topology, topoErr error, dev Devices) []Fact {
	facts := []Fact{{Host, host, "the sidecar's host name, for people: the shim tells hosts apart by boot id and /dev/shm mount (csrc/client/routes.cc host_id)"}}
	var arch []int
	archErr := fmt.Errorf("this sidecar has no GPU engine")
	if dev != nil {
		arch, archErr = dev.Arch()
	}
	if archErr != nil {
		facts = append(facts, Fact{GPUs, "0", archErr.Error()})
	} else {
		facts = append(facts, Fact{GPUs, fmt.Sprint(len(arch)), "devices the CUDA driver lists"})
	}
	link := InNVLinkDomain(t)
	if t == nil && topoErr != nil {
		link.Reason = "no GPU topology: " + topoErr.Error()
	}
	facts = append(facts, link, smArch(arch, archErr), mps(dev, archErr))
	return facts
}

func smArch(arch []int, err error) Fact {
	if err != nil || len(arch) == 0 {
		return Fact{SMArch, Unknown, "no GPU"}
	}
	names := make([]string, len(arch))
	same := true
	for i, a := range arch {
		names[i] = fmt.Sprintf("sm_%d", a)
		same = same && a == arch[0]
	}
	if same {
		return Fact{SMArch, names[0], fmt.Sprintf("compute capability of all %d GPU(s)", len(arch))}
	}
	return Fact{SMArch, strings.Join(names, ","), "the GPUs differ: kernels built for one architecture run on its GPUs only"}
}

func mps(dev Devices, archErr error) Fact {
	if archErr != nil {
		return Fact{MPS, Unknown, "no GPU"}
	}
	on, err := dev.MPS()
	switch {
	case err != nil:
		return Fact{MPS, Unknown, err.Error()}
	case on:
		return Fact{MPS, Yes, "the driver reports MPS enabled on GPU 0: this sidecar's contexts go through the MPS server"}
	}
	return Fact{MPS, No, "the driver reports MPS disabled on GPU 0"}
}

// LoadedNCCL decides the NCCL fact of a client that sent path at Attach; err is the load's
// result (nil: loaded).
func LoadedNCCL(path string, err error) Fact {
	switch {
	case path == "":
		return Fact{NCCL, No, "the client has no NCCL loaded (it sent no path at attach)"}
	case err != nil:
		return Fact{NCCL, No, fmt.Sprintf("%s did not load: %v", path, err)}
	}
	return Fact{NCCL, Yes, "loaded the client's " + path}
}

// Find returns the fact named name, or an Unknown one.
func Find(facts []Fact, name string) Fact {
	for _, f := range facts {
		if f.Name == name {
			return f
		}
	}
	return Fact{name, Unknown, "not reported"}
}
