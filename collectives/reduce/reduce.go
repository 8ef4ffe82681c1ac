// Package reduce implements the elementwise reductions used by gocomm's CPU
// collectives. Into computes dst = dst (op) src, for example in each step of
// a ring all-reduce, and Finish applies the final division of an average.
//
// Results match what PyTorch computes for the same dtype, so collectives
// compare exactly with torch's gloo and NCCL backends:
//
//   - Integers wrap around (two's complement) on wire.Sum and wire.Product. wire.Min and wire.Max
//     respect signedness. wire.Avg sums, then divides truncating toward zero.
//   - wire.Bool (one byte per element, any non-zero byte is true, results are 0 or
//     1): wire.Sum and wire.Max are OR, wire.Product and wire.Min are AND. The bitwise ops act
//     on the truth values. wire.Avg is unsupported.
//   - float32 and float64 use IEEE arithmetic. wire.Min and wire.Max return NaN if
//     either operand is NaN (like torch.minimum/maximum). On equal operands,
//     including -0 and +0, they keep dst.
//   - float16 and bfloat16 compute each step in float32 and round the
//     result back to nearest even, as torch does for half-precision CPU
//     tensors.
//   - complex64 and complex128 support wire.Sum, wire.Avg and wire.Product.
//   - float8 dtypes can only be moved, not reduced, on CPU.
//
// The loops run as vectorized C kernels (internal/hostreduce).
package reduce

import (
	"errors"
	"fmt"

	"github.com/gocomm/gocomm/internal/hostreduce"
	"github.com/gocomm/gocomm/wire"
)

type dtypeInfo struct {
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
	wire.Bool:         {hostreduce.Bool, classBool},
	wire.Uint8:        {hostreduce.U8, classInt},
	wire.Int8:         {hostreduce.I8, classInt},
	wire.Int16:        {hostreduce.I16, classInt},
	wire.Int32:        {hostreduce.I32, classInt},
	wire.Int64:        {hostreduce.I64, classInt},
	wire.Float16:      {hostreduce.F16, classFloat},
	wire.BFloat16:     {hostreduce.BF16, classFloat},
	wire.Float32:      {hostreduce.F32, classFloat},
	wire.Float64:      {hostreduce.F64, classFloat},
	wire.Complex64:    {hostreduce.C64, classComplex},
	wire.Complex128:   {hostreduce.C128, classComplex},
	wire.Float8E4M3FN: {0, classFloat8},
	wire.Float8E5M2:   {0, classFloat8},
	wire.Uint16:       {hostreduce.U16, classInt},
	wire.Uint32:       {hostreduce.U32, classInt},
	wire.Uint64:       {hostreduce.U64, classInt},
}

// ErrUnsupported is wrapped by every error that reports a dtype/op pair that
// cannot be reduced.
var ErrUnsupported = errors.New("unsupported reduction")

type unsupportedError struct {
	d    wire.DType
	o    wire.RedOp
	note string
}

func (e *unsupportedError) Error() string {
	return fmt.Sprintf("reduce: %s is not defined for %s%s", e.o, e.d, e.note)
}

func (e *unsupportedError) Unwrap() error { return ErrUnsupported }

// kernel returns the hostreduce kernel that implements o on d.
func kernel(d wire.DType, o wire.RedOp) (hostreduce.Kind, hostreduce.Op, error) {
	switch {
	case !d.Valid():
		return 0, 0, &unsupportedError{d, o, " (unknown dtype)"}
	case !o.Valid():
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
func kernelOp(c dtypeClass, o wire.RedOp) (hostreduce.Op, bool) {
	switch c {
	case classBool:
		switch o {
		case wire.Sum, wire.Max, wire.BOr:
			return hostreduce.Or, true
		case wire.Product, wire.Min, wire.BAnd:
			return hostreduce.And, true
		case wire.BXor:
			return hostreduce.Xor, true
		}
	case classInt:
		switch o {
		case wire.Sum, wire.Avg:
			return hostreduce.Add, true
		case wire.Product:
			return hostreduce.Mul, true
		case wire.Min:
			return hostreduce.Min, true
		case wire.Max:
			return hostreduce.Max, true
		case wire.BAnd:
			return hostreduce.And, true
		case wire.BOr:
			return hostreduce.Or, true
		case wire.BXor:
			return hostreduce.Xor, true
		}
	case classFloat:
		switch o {
		case wire.Sum, wire.Avg:
			return hostreduce.Add, true
		case wire.Product:
			return hostreduce.Mul, true
		case wire.Min:
			return hostreduce.Min, true
		case wire.Max:
			return hostreduce.Max, true
		}
	case classComplex:
		switch o {
		case wire.Sum, wire.Avg:
			return hostreduce.Add, true
		case wire.Product:
			return hostreduce.Mul, true
		}
	}
	// wire.Avg on bool, bitwise ops on floating types, ordering on complex,
	// anything on float8.
	return 0, false
}

// Check returns nil if o can reduce d. Otherwise it returns an error that
// wraps ErrUnsupported and names both, e.g. "reduce: max is not defined for
// complex64".
func Check(d wire.DType, o wire.RedOp) error {
	_, _, err := kernel(d, o)
	return err
}

// Into computes dst[i] = dst[i] (op) src[i] for every element. dst and src
// hold native-endian elements of type d. Their lengths must be equal and a
// multiple of d.Size(). For wire.Avg it only accumulates the sum; call Finish
// once all contributions are in. Unsupported pairs return an error wrapping
// ErrUnsupported, even for empty buffers. Supported pairs on empty buffers
// return nil. If the buffers overlap, src is read as it was before the call.
func Into(d wire.DType, o wire.RedOp, dst, src []byte) error {
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

// Finish applies the last step of an wire.Avg over n contributions to buf, in
// place: every element is divided by n. Integers truncate toward zero (as C
// and NCCL do). float16 and bfloat16 divide in float32 and round to nearest
// even. Complex values have both parts divided. For every op other than wire.Avg,
// Finish does nothing and returns nil. n must be positive.
func Finish(d wire.DType, o wire.RedOp, buf []byte, n int) error {
	if o != wire.Avg {
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

func checkLen(d wire.DType, n int) error {
	if n%d.Size() != 0 {
		return fmt.Errorf("reduce: buffer of %d bytes is not a whole number of %s elements (%d bytes each)", n, d, d.Size())
	}
	return nil
}
