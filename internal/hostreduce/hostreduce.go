// Package hostreduce holds the C kernels behind collectives/reduce:
// elementwise dst[i] = dst[i] op src[i] loops over raw tensor memory.
//
// The kernels live in hostreduce.c. cgo compiles them with -O3, so gcc
// auto-vectorizes them. On x86-64 with glibc each kernel is also built for
// AVX-512 (x86-64-v4), AVX2 (x86-64-v3) and baseline SSE2, and the loader
// picks the best version for the CPU (see CPULevel). float16 add, mul, min
// and max use the F16C conversion instructions where the CPU has them
// (AVX2-class CPUs). This package only
// moves memory through the kernels. Which dtype/op pairs exist and what they
// mean is decided by collectives/reduce, the only intended caller.
package hostreduce

/*
#cgo CFLAGS: -O3 -std=c11 -Wall -Wextra
#cgo noescape hr_reduce
#cgo nocallback hr_reduce
#cgo noescape hr_div
#cgo nocallback hr_div
#include "hostreduce.h"
*/
import "C"

import (
	"errors"
	"unsafe"
)

// Kind is an element layout the kernels understand.
type Kind int

// Element kinds; the values are the C enum hr_kind.
const (
	Bool Kind = C.HR_BOOL // 1 byte; non-zero is true, results are 0 or 1
	U8   Kind = C.HR_U8
	I8   Kind = C.HR_I8
	U16  Kind = C.HR_U16
	I16  Kind = C.HR_I16
	U32  Kind = C.HR_U32
	I32  Kind = C.HR_I32
	U64  Kind = C.HR_U64
	I64  Kind = C.HR_I64
	F16  Kind = C.HR_F16  // IEEE binary16, computed in float32
	BF16 Kind = C.HR_BF16 // bfloat16, computed in float32
	F32  Kind = C.HR_F32
	F64  Kind = C.HR_F64
	C64  Kind = C.HR_C64  // complex of two float32
	C128 Kind = C.HR_C128 // complex of two float64

	numKinds = C.HR_NKINDS
)

var kindSizes = [numKinds]int{
	Bool: 1, U8: 1, I8: 1, U16: 2, I16: 2, U32: 4, I32: 4, U64: 8, I64: 8,
	F16: 2, BF16: 2, F32: 4, F64: 8, C64: 8, C128: 16,
}

// Size is the element size in bytes, or 0 for an unknown kind.
func (k Kind) Size() int {
	if k < 0 || k >= numKinds {
		return 0
	}
	return kindSizes[k]
}

// Op is a binary kernel operation.
type Op int

// Operations; the values are the C enum hr_op.
//
// Integers: Add and Mul wrap around, Min and Max respect signedness.
// Bool: only And, Or and Xor (logical). Floats: Add, Mul, Min, Max. Min
// and Max propagate NaN and keep dst on ties. Complex: Add, Mul.
const (
	Add Op = C.HR_ADD
	Mul Op = C.HR_MUL
	Min Op = C.HR_MIN
	Max Op = C.HR_MAX
	And Op = C.HR_AND
	Or  Op = C.HR_OR
	Xor Op = C.HR_XOR
)

var (
	// ErrNoKernel reports a kind/op pair (or a division kind) that has no kernel.
	ErrNoKernel = errors.New("hostreduce: no kernel for this kind and op")
	// ErrLength reports buffers of different lengths, or a length that is
	// not a whole number of elements.
	ErrLength = errors.New("hostreduce: buffer length mismatch")
	// ErrDivisor reports a divisor < 1.
	ErrDivisor = errors.New("hostreduce: divisor must be positive")
)

// Has reports whether Reduce has a kernel for (k, op).
func Has(k Kind, op Op) bool {
	return C.hr_has(C.int(k), C.int(op)) != 0
}

// Reduce computes dst[i] = dst[i] op src[i] over the elements of kind k.
// The buffers must have equal lengths that are multiples of k.Size(). They
// need no alignment. If they overlap, src is read as it was before the call.
// Empty buffers return nil without calling C.
func Reduce(k Kind, op Op, dst, src []byte) error {
	size := k.Size()
	if size == 0 {
		return ErrNoKernel
	}
	if len(dst) != len(src) || len(dst)%size != 0 {
		return ErrLength
	}
	if len(dst) == 0 {
		return nil
	}
	if overlap(dst, src) {
		// The C loops use restrict pointers, so they must not see aliasing.
		src = append([]byte(nil), src...)
	}
	if C.hr_reduce(C.int(k), C.int(op), unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), C.size_t(len(dst)/size)) != 0 {
		return ErrNoKernel
	}
	return nil
}

// Div divides every element of buf (of kind k) by divisor, in place.
// Integers truncate toward zero (C division), 16-bit floats divide in
// float32 and round to nearest even, and complex kinds divide both parts.
// Bool has no division kernel.
func Div(k Kind, buf []byte, divisor int) error {
	size := k.Size()
	if size == 0 || k == Bool {
		return ErrNoKernel
	}
	if divisor < 1 {
		return ErrDivisor
	}
	if len(buf)%size != 0 {
		return ErrLength
	}
	if len(buf) == 0 {
		return nil
	}
	if C.hr_div(C.int(k), unsafe.Pointer(&buf[0]), C.size_t(len(buf)/size), C.int64_t(divisor)) != 0 {
		return ErrNoKernel
	}
	return nil
}

// CPULevel names the instruction set the kernels run with on this machine,
// e.g. "x86-64-v4 (AVX-512)".
func CPULevel() string {
	return C.GoString(C.hr_cpu_level())
}

// overlap reports whether a and b (both non-empty) share any byte.
func overlap(a, b []byte) bool {
	pa := uintptr(unsafe.Pointer(unsafe.SliceData(a)))
	pb := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return pa < pb+uintptr(len(b)) && pb < pa+uintptr(len(a))
}
