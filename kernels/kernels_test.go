package kernels

import (
	"bytes"
	"debug/elf"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestModulesBuilt: every kernels/*/*.cu is embedded as an sm_90 CUDA ELF holding the kernels
// looked up in it and, where it uses NVSHMEM, NVSHMEM's device state (what
// nvshmemx_cumodule_init fills in).
// make builds them before the tests; no GPU is needed to check them.
func TestModulesBuilt(t *testing.T) {
	srcs, err := filepath.Glob("*/*.cu")
	if err != nil || len(srcs) == 0 {
		t.Fatalf("no kernel sources: %v", err)
	}
	for _, src := range srcs {
		name := strings.TrimSuffix(filepath.Base(src), ".cu")
		t.Run(name, func(t *testing.T) {
			want, ok := Modules[name]
			if !ok {
				t.Fatalf("kernels/%s has no entry in Modules", src)
			}
			b, err := Cubin(name)
			if err != nil {
				t.Fatal(err)
			}
			f, err := elf.NewFile(bytes.NewReader(b))
			if err != nil {
				t.Fatalf("not an ELF file: %v", err)
			}
			if f.Machine != elf.EM_CUDA {
				t.Fatalf("machine %v, want EM_CUDA", f.Machine)
			}
			// The cubin's e_flags carry the SM version in bits 8-15.
			var hdr [52]byte
			copy(hdr[:], b)
			flags := uint32(hdr[48]) | uint32(hdr[49])<<8 | uint32(hdr[50])<<16 | uint32(hdr[51])<<24
			if sm := int(flags>>8) & 0xff; sm != Arch {
				t.Fatalf("compiled for sm_%d, want sm_%d", sm, Arch)
			}
			syms, err := f.Symbols()
			if err != nil {
				t.Fatal(err)
			}
			have := map[string]bool{}
			for _, s := range syms {
				have[s.Name] = true
			}
			if NVSHMEM[name] {
				want = append(want, "nvshmemi_device_state_d")
			}
			for _, k := range want {
				if !have[k] {
					t.Errorf("symbol %s missing from %s.cubin", k, name)
				}
			}
		})
	}
	if _, err := Cubin("no-such-module"); err == nil {
		t.Fatal("Cubin of a missing module succeeded")
	}
	if _, err := os.Stat("build/README.md"); err != nil {
		t.Fatal("build/README.md keeps go:embed valid in a fresh checkout:", err)
	}
}
