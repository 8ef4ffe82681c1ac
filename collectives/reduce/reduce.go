// Package reduce implements the elementwise reductions used by gocomm's CPU
// collectives. Into computes dst = dst (op) src, for example in each step of
// a ring all-reduce, and Finish applies the final division of an average.
//
// Results match what PyTorch computes for the same dtype, so collectives
// compare exactly with torch's gloo and NCCL backends:
//
//   - Integers wrap around (two's complement) on Sum and Product. Min and Max
//     respect signedness. Avg sums, then divides truncating toward zero.
//   - Bool (one byte per element, any non-zero byte is true, results are 0 or
//     1): Sum and Max are OR, Product and Min are AND. The bitwise ops act
//     on the truth values. Avg is unsupported.
//   - float32 and float64 use IEEE arithmetic. Min and Max return NaN if
//     either operand is NaN (like torch.minimum/maximum). On equal operands,
//     including -0 and +0, they keep dst.
//   - float16 and bfloat16 compute each step in float32 and round the
//     result back to nearest even, as torch does for half-precision CPU
//     tensors.
//   - complex64 and complex128 support Sum, Avg and Product.
//   - float8 dtypes can only be moved, not reduced, on CPU.
//
// The loops run as vectorized C kernels (internal/hostreduce).
package reduce

import (
	"errors"
	"fmt"

	"github.com/gocomm/gocomm/internal/hostreduce"
)

// DType is a tensor element type. The numeric values are part of the wire
// protocol (the Python side and the data-plane descriptors use them) and
// must not change.
type DType uint8

// Element types.
const (
	Invalid      DType = 0
	Bool         DType = 1
	Uint8        DType = 2
	Int8         DType = 3
	Int16        DType = 4
	Int32        DType = 5
	Int64        DType = 6
	Float16      DType = 7
	BFloat16     DType = 8
	Float32      DType = 9
	Float64      DType = 10
	Complex64    DType = 11
	Complex128   DType = 12
	Float8E4M3FN DType = 13
	Float8E5M2   DType = 14
	Uint16       DType = 15
	Uint32       DType = 16
	Uint64       DType = 17
)

type dtypeInfo struct {
	name string // torch name, without the "torch." prefix
	size int    // bytes per element
	kind hostreduce.Kind
	// class picks the semantics applied to the dtype.
	class dtypeClass
}

type dtypeClass uint8

const (
	classBool dtypeClass = iota
	classInt
	classFloat
	classComplex
	classFloat8
)

var dtypes = [...]dtypeInfo{
	Bool:         {"bool", 1, hostreduce.Bool, classBool},
	Uint8:        {"uint8", 1, hostreduce.U8, classInt},
	Int8:         {"int8", 1, hostreduce.I8, classInt},
	Int16:        {"int16", 2, hostreduce.I16, classInt},
	Int32:        {"int32", 4, hostreduce.I32, classInt},
	Int64:        {"int64", 8, hostreduce.I64, classInt},
	Float16:      {"float16", 2, hostreduce.F16, classFloat},
	BFloat16:     {"bfloat16", 2, hostreduce.BF16, classFloat},
	Float32:      {"float32", 4, hostreduce.F32, classFloat},
	Float64:      {"float64", 8, hostreduce.F64, classFloat},
	Complex64:    {"complex64", 8, hostreduce.C64, classComplex},
	Complex128:   {"complex128", 16, hostreduce.C128, classComplex},
	Float8E4M3FN: {"float8_e4m3fn", 1, 0, classFloat8},
	Float8E5M2:   {"float8_e5m2", 1, 0, classFloat8},
	Uint16:       {"uint16", 2, hostreduce.U16, classInt},
	Uint32:       {"uint32", 4, hostreduce.U32, classInt},
	Uint64:       {"uint64", 8, hostreduce.U64, classInt},
}

// Valid reports whether d is one of the defined dtypes (not Invalid).
func (d DType) Valid() bool { return d != Invalid && int(d) < len(dtypes) }

// Size returns the number of bytes per element, or 0 for Invalid and
// unknown values.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypes[d].size
}

// String returns the torch name of the dtype ("float32", "bfloat16",
// "float8_e4m3fn", ...).
func (d DType) String() string {
	if !d.Valid() {
		if d == Invalid {
			return "invalid"
		}
		return fmt.Sprintf("dtype(%d)", uint8(d))
	}
	return dtypes[d].name
}

// Op is a reduction operation. The numeric values are part of the wire
// protocol and must not change.
type Op uint8

// Reduction operations.
const (
	Sum     Op = 1
	Avg     Op = 2
	Product Op = 3
	Min     Op = 4
	Max     Op = 5
	BAnd    Op = 6
	BOr     Op = 7
	BXor    Op = 8
)

var opNames = [...]string{
	Sum: "sum", Avg: "avg", Product: "product", Min: "min", Max: "max",
	BAnd: "band", BOr: "bor", BXor: "bxor",
}

// String returns the lower-case name of the op ("sum", "avg", ...).
func (o Op) String() string {
	if o == 0 || int(o) >= len(opNames) {
		return fmt.Sprintf("op(%d)", uint8(o))
	}
	return opNames[o]
}

// ErrUnsupported is wrapped by every error that reports a dtype/op pair that
// cannot be reduced.
var ErrUnsupported = errors.New("unsupported reduction")

type unsupportedError struct {
	d    DType
	o    Op
	note string
}

func (e *unsupportedError) Error() string {
	return fmt.Sprintf("reduce: %s is not defined for %s%s", e.o, e.d, e.note)
}

func (e *unsupportedError) Unwrap() error { return ErrUnsupported }

// kernel returns the hostreduce kernel that implements o on d.
func kernel(d DType, o Op) (hostreduce.Kind, hostreduce.Op, error) {
	switch {
	case !d.Valid():
		return 0, 0, &unsupportedError{d, o, " (unknown dtype)"}
	case o == 0 || int(o) >= len(opNames):
		return 0, 0, &unsupportedError{d, o, " (unknown op)"}
	}
	info := &dtypes[d]
	op, ok := kernelOp(info.class, o)
	if !ok {
		note := ""
		if info.class == classFloat8 {
			note = " (float8 tensors are data-movement only on CPU)"
		}
		return 0, 0, &unsupportedError{d, o, note}
	}
	return info.kind, op, nil
}

// kernelOp maps o to the kernel operation for a class of dtypes.
func kernelOp(c dtypeClass, o Op) (hostreduce.Op, bool) {
	switch c {
	case classBool:
		switch o {
		case Sum, Max, BOr:
			return hostreduce.Or, true
		case Product, Min, BAnd:
			return hostreduce.And, true
		case BXor:
			return hostreduce.Xor, true
		}
	case classInt:
		switch o {
		case Sum, Avg:
			return hostreduce.Add, true
		case Product:
			return hostreduce.Mul, true
		case Min:
			return hostreduce.Min, true
		case Max:
			return hostreduce.Max, true
		case BAnd:
			return hostreduce.And, true
		case BOr:
			return hostreduce.Or, true
		case BXor:
			return hostreduce.Xor, true
		}
	case classFloat:
		switch o {
		case Sum, Avg:
			return hostreduce.Add, true
		case Product:
			return hostreduce.Mul, true
		case Min:
			return hostreduce.Min, true
		case Max:
			return hostreduce.Max, true
		}
	case classComplex:
		switch o {
		case Sum, Avg:
			return hostreduce.Add, true
		case Product:
			return hostreduce.Mul, true
		}
	}
	// Avg on bool, bitwise ops on floating types, ordering on complex,
	// anything on float8.
	return 0, false
}

// Check returns nil if o can reduce d. Otherwise it returns an error that
// wraps ErrUnsupported and names both, e.g. "reduce: max is not defined for
// complex64".
func Check(d DType, o Op) error {
	_, _, err := kernel(d, o)
	return err
}

// Into computes dst[i] = dst[i] (op) src[i] for every element. dst and src
// hold native-endian elements of type d. Their lengths must be equal and a
// multiple of d.Size(). For Avg it only accumulates the sum; call Finish
// once all contributions are in. Unsupported pairs return an error wrapping
// ErrUnsupported, even for empty buffers. Supported pairs on empty buffers
// return nil. If the buffers overlap, src is read as it was before the call.
func Into(d DType, o Op, dst, src []byte) error {
	k, op, err := kernel(d, o)
	if err != nil {
		return err
	}
	if err := checkLen(d, len(dst)); err != nil {
		return err
	}
	if len(dst) != len(src) {
		return fmt.Errorf("reduce: %s %s: dst has %d bytes but src has %d", d, o, len(dst), len(src))
	}
	if len(dst) == 0 {
		return nil
	}
	if err := hostreduce.Reduce(k, op, dst, src); err != nil {
		return fmt.Errorf("reduce: %s %s: %w", d, o, err)
	}
	return nil
}

// Finish applies the last step of an Avg over n contributions to buf, in
// place: every element is divided by n. Integers truncate toward zero (as C
// and NCCL do). float16 and bfloat16 divide in float32 and round to nearest
// even. Complex values have both parts divided. For every op other than Avg,
// Finish does nothing and returns nil. n must be positive.
func Finish(d DType, o Op, buf []byte, n int) error {
	if o != Avg {
		return nil
	}
	k, _, err := kernel(d, o)
	if err != nil {
		return err
	}
	if n < 1 {
		return fmt.Errorf("reduce: %s avg over %d contributions: need at least 1", d, n)
	}
	if err := checkLen(d, len(buf)); err != nil {
		return err
	}
	if n == 1 || len(buf) == 0 {
		return nil
	}
	if err := hostreduce.Div(k, buf, n); err != nil {
		return fmt.Errorf("reduce: %s avg: %w", d, err)
	}
	return nil
}

func checkLen(d DType, n int) error {
	if n%d.Size() != 0 {
		return fmt.Errorf("reduce: buffer of %d bytes is not a whole number of %s elements (%d bytes each)", n, d, d.Size())
	}
	return nil
}
