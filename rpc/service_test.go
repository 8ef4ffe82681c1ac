package rpc

import (
	"testing"

	"github.com/gocomm/gocomm/gpu"
)

// engineInfo is a GPU engine of which only Info is asked.
type engineInfo struct {
	gpu.Engine
	ok     bool
	detail string
}

func (e engineInfo) Info() (bool, string, []gpu.Device) { return e.ok, e.detail, nil }

// TestCudaRefusal: the tail of the error a client's CUDA tensor raises, decided at Attach: the
// knob first, then the sidecar's engine; none where CUDA tensors are served.
func TestCudaRefusal(t *testing.T) {
	for _, tc := range []struct {
		desc string
		knob bool
		dev  gpu.Engine
		want string
	}{
		{"served", true, engineInfo{ok: true}, ""},
		{"GOCOMM_CUDA=0", false, engineInfo{ok: true}, "and gocomm's CUDA engine is turned off (GOCOMM_CUDA=0)"},
		{"no driver", true, engineInfo{detail: "cuda: no driver"}, "but this rank's pgserver cannot run CUDA ops: cuda: no driver"},
		{"no GPU engine", true, nil, "but this rank's pgserver cannot run CUDA ops: this sidecar has no GPU engine"},
	} {
		if got := cudaRefusal(tc.knob, tc.dev); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.desc, got, tc.want)
		}
	}
}
