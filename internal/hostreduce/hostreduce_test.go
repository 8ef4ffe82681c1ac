package hostreduce

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"
)

func TestCPULevel(t *testing.T) {
	level := CPULevel()
	if level == "" {
		t.Fatal("empty CPU level")
	}
	t.Logf("kernels dispatch to: %s", level)
}

func TestKernelTable(t *testing.T) {
	all := []Op{Add, Mul, Min, Max, And, Or, Xor}
	want := map[Kind][]Op{
		Bool: {And, Or, Xor},
		U8:   all, I8: all, U16: all, I16: all, U32: all, I32: all, U64: all, I64: all,
		F16: {Add, Mul, Min, Max}, BF16: {Add, Mul, Min, Max},
		F32: {Add, Mul, Min, Max}, F64: {Add, Mul, Min, Max},
		C64: {Add, Mul}, C128: {Add, Mul},
	}
	for k := Kind(0); k < numKinds; k++ {
		if k.Size() == 0 {
			t.Errorf("kind %d has no size", k)
		}
		for _, op := range all {
			expect := false
			for _, o := range want[k] {
				expect = expect || o == op
			}
			if Has(k, op) != expect {
				t.Errorf("Has(%d, %d) = %v, want %v", k, op, !expect, expect)
			}
		}
	}
	for _, c := range []struct {
		k  Kind
		op Op
	}{{-1, Add}, {numKinds, Add}, {F32, -1}, {F32, 7}} {
		if Has(c.k, c.op) {
			t.Errorf("Has(%d, %d) = true for an out-of-range value", c.k, c.op)
		}
		if err := Reduce(c.k, c.op, make([]byte, 16), make([]byte, 16)); err == nil {
			t.Errorf("Reduce(%d, %d) = nil, want an error", c.k, c.op)
		}
	}
}

func TestErrors(t *testing.T) {
	if err := Reduce(Bool, Add, []byte{1}, []byte{1}); !errors.Is(err, ErrNoKernel) {
		t.Errorf("Reduce(Bool, Add) = %v, want ErrNoKernel", err)
	}
	if err := Reduce(F32, Add, make([]byte, 8), make([]byte, 4)); !errors.Is(err, ErrLength) {
		t.Errorf("Reduce with different lengths = %v, want ErrLength", err)
	}
	if err := Reduce(F64, Add, make([]byte, 12), make([]byte, 12)); !errors.Is(err, ErrLength) {
		t.Errorf("Reduce with a partial element = %v, want ErrLength", err)
	}
	if err := Reduce(F32, Add, nil, nil); err != nil {
		t.Errorf("Reduce on empty buffers = %v", err)
	}
	if err := Div(F32, make([]byte, 4), 0); !errors.Is(err, ErrDivisor) {
		t.Errorf("Div by 0 = %v, want ErrDivisor", err)
	}
	if err := Div(Bool, make([]byte, 4), 2); !errors.Is(err, ErrNoKernel) {
		t.Errorf("Div(Bool) = %v, want ErrNoKernel", err)
	}
	if err := Div(I16, make([]byte, 3), 2); !errors.Is(err, ErrLength) {
		t.Errorf("Div with a partial element = %v, want ErrLength", err)
	}
}

// TestUnaligned runs float64 kernels on buffers at every byte offset.
func TestUnaligned(t *testing.T) {
	const n = 37
	ne := binary.NativeEndian
	for off := range 8 {
		dst := make([]byte, 8*n+off)[off:]
		src := make([]byte, 8*n+8)[(off+3)%8:][:8*n]
		for i := range n {
			ne.PutUint64(dst[8*i:], math.Float64bits(float64(i)))
			ne.PutUint64(src[8*i:], math.Float64bits(0.5))
		}
		if err := Reduce(F64, Add, dst, src); err != nil {
			t.Fatal(err)
		}
		if err := Div(F64, dst, 2); err != nil {
			t.Fatal(err)
		}
		for i := range n {
			if got, want := math.Float64frombits(ne.Uint64(dst[8*i:])), (float64(i)+0.5)/2; got != want {
				t.Fatalf("offset %d element %d = %v, want %v", off, i, got, want)
			}
		}
	}
}
