// Package kernels holds gocomm's CUDA device code, grouped by the runtime that launches it:
// kernels/sidecar/*.cu (pgserver) and kernels/inprocess/*.cu (the training process, which
// loads the cubins make copies next to the Python package). make compiles each file with nvcc
// from the pinned PyPI packages and links it with NVSHMEM's device library into one cubin
// (kernels/build/<name>.cubin, never committed), embedded here. The driver loads a cubin with
// cuModuleLoadData; NVSHMEM's state in it is set up with nvshmemx_cumodule_init.
package kernels

import (
	"embed"
	"errors"
	"fmt"
	"io/fs"
)

//go:embed build
var built embed.FS

// ErrNotBuilt: the binary was built without running make's kernels step.
var ErrNotBuilt = errors.New("kernel module not built (make compiles kernels/*/*.cu with the pinned nvcc)")

// Modules names each module (kernels/<runtime>/<name>.cu) and the kernels looked up in it:
// the sidecar's (a2av) and the in-process ones (a2av_ipc, allreduce and moe, which make also
// copies next to the Python package).
var Modules = map[string][]string{
	"a2av":     {"gocomm_a2av"},
	"a2av_ipc": {"gocomm_a2av_ipc"},
	"allreduce": {
		"gocomm_ar_one_bf16", "gocomm_ar_one_f16", "gocomm_ar_one_f32",
		"gocomm_ar_two_bf16", "gocomm_ar_two_f16", "gocomm_ar_two_f32",
	},
	"moe": {"gocomm_moe_wsum_bf16", "gocomm_moe_wsum_f16", "gocomm_moe_wsum_f32", "gocomm_moe_route_count", "gocomm_moe_route_place", "gocomm_moe_route", "gocomm_moe_pack", "gocomm_moe_group_count", "gocomm_moe_group_place", "gocomm_moe_group", "gocomm_moe_gather", "gocomm_moe_route_pack", "gocomm_moe_group_gather", "gocomm_moe_ll_dispatch", "gocomm_moe_ll_combine_bf16", "gocomm_moe_ll_combine_f16", "gocomm_moe_ll_combine_f32"},
}

// NVSHMEM says which modules use NVSHMEM's device library (the driver must set their state
// up with nvshmemx_cumodule_init).
var NVSHMEM = map[string]bool{"a2av": true}

// Arch is the GPU architecture the modules are compiled for (Makefile's CUDA_ARCH).
const Arch = 90

// Cubin returns the compiled module <name>.cu.
func Cubin(name string) ([]byte, error) {
	b, err := built.ReadFile("build/" + name + ".cubin")
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w", name, ErrNotBuilt)
	}
	return b, err
}
