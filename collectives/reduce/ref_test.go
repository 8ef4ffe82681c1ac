package reduce

// Reference semantics, computed in Go independently of the C kernels:
// exact integer arithmetic (Go's fixed-size integers wrap by definition),
// float64 arithmetic rounded once to float32, and a 16-bit float rounding
// that searches the table of all representable values. That rounding is
// deliberately unlike the bit tricks in hostreduce.c.

import (
	"encoding/binary"
	"math"
	"sort"
	"unsafe"

	"github.com/gocomm/gocomm/wire"
)

type integer interface {
	~int8 | ~int16 | ~int32 | ~int64 | ~uint8 | ~uint16 | ~uint32 | ~uint64
}

func intOp[T integer](o wire.RedOp, x, y T) T {
	switch o {
	case wire.Sum, wire.Avg:
		return x + y
	case wire.Product:
		return x * y
	case wire.Min:
		return min(x, y)
	case wire.Max:
		return max(x, y)
	case wire.BAnd:
		return x & y
	case wire.BOr:
		return x | y
	case wire.BXor:
		return x ^ y
	}
	panic("bad op")
}

func boolOp(o wire.RedOp, a, b byte) byte {
	x, y := a != 0, b != 0
	var r bool
	switch o {
	case wire.Sum, wire.Max, wire.BOr:
		r = x || y
	case wire.Product, wire.Min, wire.BAnd:
		r = x && y
	case wire.BXor:
		r = x != y
	default:
		panic("bad op")
	}
	if r {
		return 1
	}
	return 0
}

// floatOp applies o in float64 to two values of a type with at most 24
// mantissa bits and rounds with round. Rounding a float64 sum, product or
// quotient of two float32 values to float32 gives the correctly rounded
// float32 result (53 >= 2*24+2). wire.Min/wire.Max: NaN wins, and ties keep x.
func floatOp(o wire.RedOp, x, y float64, round func(float64) float64) float64 {
	switch o {
	case wire.Sum, wire.Avg:
		return round(x + y)
	case wire.Product:
		return round(x * y)
	case wire.Min:
		switch {
		case x != x:
			return x
		case y != y, y < x:
			return y
		}
		return x
	case wire.Max:
		switch {
		case x != x:
			return x
		case y != y, y > x:
			return y
		}
		return x
	}
	panic("bad op")
}

func to32(x float64) float64 { return float64(float32(x)) }
func to64(x float64) float64 { return x }

// half16 describes a 16-bit binary float format for the reference rounding.
type half16 struct {
	decode   func(uint16) float64 // exact value of a bit pattern
	inf      uint16               // +Inf pattern; 0..inf-1 are the non-negative finite values, increasing
	overflow float64              // where +Inf sits for rounding: the next power of two after the largest finite
	table    []float64            // decode(p) for p in [0, inf), then overflow
}

func newHalf16(decode func(uint16) float64, inf uint16, overflow float64) *half16 {
	f := &half16{decode: decode, inf: inf, overflow: overflow}
	for p := 0; p < int(inf); p++ {
		f.table = append(f.table, decode(uint16(p)))
	}
	f.table = append(f.table, overflow)
	if !sort.Float64sAreSorted(f.table) {
		panic("format table not sorted")
	}
	return f
}

// f16Value decodes IEEE binary16: sign, 5-bit exponent (bias 15), 10-bit mantissa.
func f16Value(h uint16) float64 {
	e, m := int(h>>10)&0x1f, int(h&0x3ff)
	var v float64
	switch e {
	case 0:
		v = math.Ldexp(float64(m), -24)
	case 0x1f:
		if m != 0 {
			return math.NaN()
		}
		v = math.Inf(1)
	default:
		v = math.Ldexp(float64(0x400|m), e-25)
	}
	if h&0x8000 != 0 {
		v = -v
	}
	return v
}

// bf16Value decodes bfloat16: sign, 8-bit exponent (bias 127), 7-bit mantissa.
func bf16Value(h uint16) float64 {
	e, m := int(h>>7)&0xff, int(h&0x7f)
	var v float64
	switch e {
	case 0:
		v = math.Ldexp(float64(m), -133)
	case 0xff:
		if m != 0 {
			return math.NaN()
		}
		v = math.Inf(1)
	default:
		v = math.Ldexp(float64(0x80|m), e-134)
	}
	if h&0x8000 != 0 {
		v = -v
	}
	return v
}

var (
	refF16  = newHalf16(f16Value, 0x7c00, 65536)
	refBF16 = newHalf16(bf16Value, 0x7f80, math.Ldexp(1, 128))
)

func (f *half16) isNaN(h uint16) bool { return h&0x7fff > f.inf }

// round returns the pattern nearest to x (not NaN), ties to the even
// pattern. Values at or past the midpoint between the largest finite value
// and overflow round to Inf. The subtractions below are exact wherever the
// comparison is close, because there x lies within a factor of two of both
// neighbours (Sterbenz).
func (f *half16) round(x float64) uint16 {
	var sign uint16
	if math.Signbit(x) {
		sign, x = 0x8000, -x
	}
	i := sort.SearchFloat64s(f.table, x) // first table[i] >= x
	if i == len(f.table) {
		return sign | f.inf
	}
	if f.table[i] == x {
		return sign | uint16(i)
	}
	lo, hi := i-1, i
	dlo, dhi := x-f.table[lo], f.table[hi]-x
	switch {
	case dlo < dhi:
		return sign | uint16(lo)
	case dhi < dlo:
		return sign | uint16(hi)
	case lo%2 == 0:
		return sign | uint16(lo)
	}
	return sign | uint16(hi)
}

// roundF32 rounds a float32-valued float64 (x may be NaN) to a pattern.
func (f *half16) roundF32(x float64) uint16 {
	if x != x {
		return f.inf + 1 // a NaN; sameElem treats all NaNs alike
	}
	return f.round(x)
}

// op computes one torch CPU step on 16-bit floats: widen to float32, apply
// the op in float32, round back.
func (f *half16) op(o wire.RedOp, a, b uint16) uint16 {
	x, y := f.decode(a), f.decode(b) // exactly representable in float32
	return f.roundF32(floatOp(o, x, y, to32))
}

func (f *half16) div(a uint16, n int) uint16 {
	return f.roundF32(to32(f.decode(a) / float64(n)))
}

func halfOf(d wire.DType) *half16 {
	switch d {
	case wire.Float16:
		return refF16
	case wire.BFloat16:
		return refBF16
	}
	return nil
}

// refInto computes Into(d, o, dst, src) element by element and returns the
// expected dst.
func refInto(d wire.DType, o wire.RedOp, dst, src []byte) []byte {
	out := make([]byte, len(dst))
	size := d.Size()
	for i := 0; i+size <= len(dst); i += size {
		refElem(d, o, out[i:i+size], dst[i:i+size], src[i:i+size])
	}
	return out
}

var ne = binary.NativeEndian

func refElem(d wire.DType, o wire.RedOp, out, a, b []byte) {
	switch d {
	case wire.Bool:
		out[0] = boolOp(o, a[0], b[0])
	case wire.Uint8:
		out[0] = intOp(o, a[0], b[0])
	case wire.Int8:
		out[0] = byte(intOp(o, int8(a[0]), int8(b[0])))
	case wire.Int16:
		ne.PutUint16(out, uint16(intOp(o, int16(ne.Uint16(a)), int16(ne.Uint16(b)))))
	case wire.Uint16:
		ne.PutUint16(out, intOp(o, ne.Uint16(a), ne.Uint16(b)))
	case wire.Int32:
		ne.PutUint32(out, uint32(intOp(o, int32(ne.Uint32(a)), int32(ne.Uint32(b)))))
	case wire.Uint32:
		ne.PutUint32(out, intOp(o, ne.Uint32(a), ne.Uint32(b)))
	case wire.Int64:
		ne.PutUint64(out, uint64(intOp(o, int64(ne.Uint64(a)), int64(ne.Uint64(b)))))
	case wire.Uint64:
		ne.PutUint64(out, intOp(o, ne.Uint64(a), ne.Uint64(b)))
	case wire.Float16, wire.BFloat16:
		ne.PutUint16(out, halfOf(d).op(o, ne.Uint16(a), ne.Uint16(b)))
	case wire.Float32:
		r := floatOp(o, f32At(a, 0), f32At(b, 0), to32)
		ne.PutUint32(out, math.Float32bits(float32(r)))
	case wire.Float64:
		r := floatOp(o, f64At(a, 0), f64At(b, 0), to64)
		ne.PutUint64(out, math.Float64bits(r))
	case wire.Complex64:
		re, im := complexOp(o, f32At(a, 0), f32At(a, 4), f32At(b, 0), f32At(b, 4), to32)
		ne.PutUint32(out, math.Float32bits(float32(re)))
		ne.PutUint32(out[4:], math.Float32bits(float32(im)))
	case wire.Complex128:
		re, im := complexOp(o, f64At(a, 0), f64At(a, 8), f64At(b, 0), f64At(b, 8), to64)
		ne.PutUint64(out, math.Float64bits(re))
		ne.PutUint64(out[8:], math.Float64bits(im))
	default:
		panic("no reference for " + d.String())
	}
}

// complexOp: textbook product with each product and the sum rounded to the
// part type (c10::complex, no FMA). For float32 parts the products are
// exact in float64 and then rounded. For float64 parts the explicit
// float64() conversions stop the Go compiler from fusing them into an FMA.
func complexOp(o wire.RedOp, ar, ai, br, bi float64, round func(float64) float64) (float64, float64) {
	switch o {
	case wire.Sum, wire.Avg:
		return round(ar + br), round(ai + bi)
	case wire.Product:
		p1, p2 := round(float64(ar*br)), round(float64(ai*bi))
		p3, p4 := round(float64(ar*bi)), round(float64(ai*br))
		return round(p1 - p2), round(p3 + p4)
	}
	panic("bad op")
}

func f32At(b []byte, off int) float64 {
	return float64(math.Float32frombits(ne.Uint32(b[off:])))
}

func f64At(b []byte, off int) float64 {
	return math.Float64frombits(ne.Uint64(b[off:]))
}

// refFinish returns buf with every element divided by n as Finish(wire.Avg)
// defines it.
func refFinish(d wire.DType, buf []byte, n int) []byte {
	out := append([]byte(nil), buf...)
	size := d.Size()
	for i := 0; i+size <= len(out); i += size {
		e := out[i : i+size]
		switch d {
		case wire.Uint8:
			e[0] = byte(uint64(e[0]) / uint64(n))
		case wire.Int8:
			e[0] = byte(int8(int64(int8(e[0])) / int64(n)))
		case wire.Int16:
			ne.PutUint16(e, uint16(int16(int64(int16(ne.Uint16(e)))/int64(n))))
		case wire.Uint16:
			ne.PutUint16(e, uint16(uint64(ne.Uint16(e))/uint64(n)))
		case wire.Int32:
			ne.PutUint32(e, uint32(int32(int64(int32(ne.Uint32(e)))/int64(n))))
		case wire.Uint32:
			ne.PutUint32(e, uint32(uint64(ne.Uint32(e))/uint64(n)))
		case wire.Int64:
			ne.PutUint64(e, uint64(int64(ne.Uint64(e))/int64(n)))
		case wire.Uint64:
			ne.PutUint64(e, ne.Uint64(e)/uint64(n))
		case wire.Float16, wire.BFloat16:
			ne.PutUint16(e, halfOf(d).div(ne.Uint16(e), n))
		case wire.Float32, wire.Complex64:
			for j := 0; j < size; j += 4 {
				ne.PutUint32(e[j:], math.Float32bits(float32(f32At(e, j)/float64(n))))
			}
		case wire.Float64, wire.Complex128:
			for j := 0; j < size; j += 8 {
				ne.PutUint64(e[j:], math.Float64bits(f64At(e, j)/float64(n)))
			}
		default:
			panic("no reference for " + d.String())
		}
	}
	return out
}

// sameElem compares one element, treating any two NaNs as equal.
func sameElem(d wire.DType, a, b []byte) bool {
	switch d {
	case wire.Float16, wire.BFloat16:
		x, y := ne.Uint16(a), ne.Uint16(b)
		return x == y || halfOf(d).isNaN(x) && halfOf(d).isNaN(y)
	case wire.Float32, wire.Complex64:
		for j := 0; j < len(a); j += 4 {
			x, y := f32At(a, j), f32At(b, j)
			if ne.Uint32(a[j:]) != ne.Uint32(b[j:]) && !(x != x && y != y) {
				return false
			}
		}
		return true
	case wire.Float64, wire.Complex128:
		for j := 0; j < len(a); j += 8 {
			x, y := f64At(a, j), f64At(b, j)
			if ne.Uint64(a[j:]) != ne.Uint64(b[j:]) && !(x != x && y != y) {
				return false
			}
		}
		return true
	}
	return string(a) == string(b)
}

// pack returns the native-endian bytes of v.
func pack[T any](v ...T) []byte {
	if len(v) == 0 {
		return []byte{}
	}
	n := int(unsafe.Sizeof(v[0])) * len(v)
	return append([]byte(nil), unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), n)...)
}
