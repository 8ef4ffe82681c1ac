package collectives

// Test inputs and an independent reference for the reducing collectives. The reference
// never calls package reduce: integers use Go's wrapping fixed-size arithmetic, bool works on
// truth values, and floats are decoded to float64 (float16 and bfloat16 by hand), reduced in
// float64 and compared within a tolerance that bounds the rounding of a reduction done one
// step at a time in the dtype's precision.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand"
	"strings"
	"unsafe"

	"github.com/gocomm/gocomm/collectives/reduce"
	"github.com/gocomm/gocomm/wire"
)

var fcDTypes = []wire.DType{
	wire.Float32, wire.Float64, wire.BFloat16, wire.Float16,
	wire.Int32, wire.Int64, wire.Uint8, wire.Int8, wire.Bool,
}

var fcOps = []wire.RedOp{
	wire.Sum, wire.Avg, wire.Product, wire.Min, wire.Max,
	wire.BAnd, wire.BOr, wire.BXor,
}

type fcCombo struct {
	dt wire.DType
	op wire.RedOp
}

func (c fcCombo) String() string { return c.dt.String() + "/" + c.op.String() }

// fcCombos lists every dtype/op pair of the test that reduce.Check accepts.
func fcCombos() []fcCombo {
	var out []fcCombo
	for _, dt := range fcDTypes {
		for _, op := range fcOps {
			if reduce.Check(dt, op) == nil {
				out = append(out, fcCombo{dt, op})
			}
		}
	}
	return out
}

func fcIsFloat(dt wire.DType) bool {
	switch dt {
	case wire.Float32, wire.Float64, wire.BFloat16, wire.Float16:
		return true
	}
	return false
}

// fcUnitRoundoff is the relative rounding error of one operation in dt.
func fcUnitRoundoff(dt wire.DType) float64 {
	switch dt {
	case wire.Float64:
		return 0x1p-53
	case wire.Float32:
		return 0x1p-24
	case wire.Float16:
		return 0x1p-11
	case wire.BFloat16:
		return 0x1p-8
	}
	panic("not a float dtype")
}

// Half-precision codecs, written out rather than borrowed.

func fcF16Decode(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	exp, mant := int(h>>10&0x1f), float64(h&0x3ff)
	switch exp {
	case 0:
		return sign * mant * 0x1p-24
	case 31:
		if mant != 0 {
			return math.NaN()
		}
		return sign * math.Inf(1)
	}
	return sign * (1 + mant/1024) * math.Ldexp(1, exp-15)
}

// fcF16Encode truncates x to float16; x must be zero, infinite, NaN, or normal in float16.
func fcF16Encode(x float64) uint16 {
	var sign uint16
	if math.Signbit(x) {
		sign, x = 0x8000, -x
	}
	switch {
	case math.IsNaN(x):
		return 0x7e00
	case math.IsInf(x, 0):
		return sign | 0x7c00
	case x == 0:
		return sign
	}
	frac, exp := math.Frexp(x) // x = frac * 2^exp, frac in [0.5, 1)
	e := exp - 1
	if e < -14 || e > 15 {
		panic(fmt.Sprintf("%g is outside float16's normal range", x))
	}
	mant := uint16((2*frac - 1) * 1024)
	return sign | uint16(e+15)<<10 | mant
}

func fcBF16Decode(h uint16) float64 { return float64(math.Float32frombits(uint32(h) << 16)) }

func fcBF16Encode(x float64) uint16 { return uint16(math.Float32bits(float32(x)) >> 16) }

func fcGetFloat(dt wire.DType, b []byte, i int) float64 {
	switch dt {
	case wire.Float64:
		return math.Float64frombits(binary.NativeEndian.Uint64(b[8*i:]))
	case wire.Float32:
		return float64(math.Float32frombits(binary.NativeEndian.Uint32(b[4*i:])))
	case wire.Float16:
		return fcF16Decode(binary.NativeEndian.Uint16(b[2*i:]))
	case wire.BFloat16:
		return fcBF16Decode(binary.NativeEndian.Uint16(b[2*i:]))
	}
	panic("not a float dtype")
}

func fcPutFloat(dt wire.DType, b []byte, i int, x float64) {
	switch dt {
	case wire.Float64:
		binary.NativeEndian.PutUint64(b[8*i:], math.Float64bits(x))
	case wire.Float32:
		binary.NativeEndian.PutUint32(b[4*i:], math.Float32bits(float32(x)))
	case wire.Float16:
		binary.NativeEndian.PutUint16(b[2*i:], fcF16Encode(x))
	case wire.BFloat16:
		binary.NativeEndian.PutUint16(b[2*i:], fcBF16Encode(x))
	default:
		panic("not a float dtype")
	}
}

type fcInt interface {
	~int8 | ~uint8 | ~int32 | ~int64
}

func fcGetInt[T fcInt](b []byte, i int) T {
	var z T
	switch unsafe.Sizeof(z) {
	case 1:
		return T(b[i])
	case 4:
		return T(binary.NativeEndian.Uint32(b[4*i:]))
	default:
		return T(binary.NativeEndian.Uint64(b[8*i:]))
	}
}

func fcPutInt[T fcInt](b []byte, i int, v T) {
	switch unsafe.Sizeof(v) {
	case 1:
		b[i] = byte(v)
	case 4:
		binary.NativeEndian.PutUint32(b[4*i:], uint32(v))
	default:
		binary.NativeEndian.PutUint64(b[8*i:], uint64(v))
	}
}

// fcSplitMix is a fast generator for bulk test data (math/rand costs too much per element
// on the large buffers).
type fcSplitMix uint64

func (s *fcSplitMix) next() uint64 {
	*s += 0x9e3779b97f4a7c15
	z := uint64(*s)
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// fcPow2[e+fcPow2Bias] is 2^e.
const fcPow2Bias = 32

var fcPow2 = func() (t [64]float64) {
	for i := range t {
		t[i] = math.Ldexp(1, i-fcPow2Bias)
	}
	return t
}()

// fcUnit maps 52 random bits to [0, 1).
func fcUnit(u uint64) float64 { return float64(u>>12) * 0x1p-52 }

// fcGen returns elems random elements of dt, shaped for op: float sums stay far from
// overflow, products near 1, and min/max see the whole range with ±0, ±Inf and NaN; bool
// truth values lean towards the op's absorbing value so results are not all one value.
func fcGen(rng *rand.Rand, dt wire.DType, op wire.RedOp, elems int) []byte {
	b := make([]byte, elems*dt.Size())
	g := fcSplitMix(rng.Uint64())
	switch dt {
	case wire.Bool:
		pTrue := uint64(50)
		switch op {
		case wire.Product, wire.Min, wire.BAnd:
			pTrue = 90
		case wire.Sum, wire.Max, wire.BOr:
			pTrue = 10
		}
		for i := range b {
			u := g.next()
			if u%100 < pTrue {
				b[i] = 1
				if u>>8%5 == 0 { // any non-zero byte is true
					b[i] = byte(2 + u>>16%254)
				}
			}
		}
	case wire.Int8, wire.Uint8, wire.Int32, wire.Int64:
		es := dt.Size()
		for i := 0; i < elems; i++ {
			u := g.next()
			v := u >> 16
			if es == 8 {
				v = g.next()
			}
			switch u % 4 {
			case 0: // small values, so products and sums are not all noise
				v = uint64(int64(u>>8%7) - 3)
			case 1: // extremes: 0, -1, min, max
				v = -(u >> 8 % 2)
				if u>>9%2 == 0 {
					v ^= 1 << (8*es - 1)
				}
			}
			for j := range es {
				b[i*es+j] = byte(v >> (8 * j))
			}
		}
	default:
		maxExp := 20
		if dt == wire.Float16 {
			maxExp = 15
		}
		for i := 0; i < elems; i++ {
			u, v := g.next(), g.next()
			var x float64
			switch op {
			case wire.Product:
				x = 0.8 + 0.45*fcUnit(v)
			case wire.Min, wire.Max:
				switch k := u % 1000; {
				case k < 20:
					x = 0
				case k < 25:
					x = math.Inf(1)
				case k < 27:
					x = math.NaN()
				default:
					x = (1 + fcUnit(v)) * fcPow2[-14+int(u>>10%uint64(maxExp+15))+fcPow2Bias]
				}
			default: // Sum, Avg
				if u%20 != 0 {
					x = (1 + fcUnit(v)) * fcPow2[int(u>>10%9)-3+fcPow2Bias]
				}
			}
			if u>>63 != 0 {
				x = -x
			}
			fcPutFloat(dt, b, i, x)
		}
	}
	return b
}

// fcMismatches collects the first few differences of one comparison.
type fcMismatches struct {
	n     int
	lines []string
}

func (m *fcMismatches) add(format string, args ...any) {
	if m.n++; m.n <= 5 {
		m.lines = append(m.lines, fmt.Sprintf(format, args...))
	}
}

func (m *fcMismatches) err(total int) error {
	if m.n == 0 {
		return nil
	}
	return fmt.Errorf("%d of %d elements differ from the reference:\n\t\t%s", m.n, total, strings.Join(m.lines, "\n\t\t"))
}

// fcCheckReduced compares got with the reference reduction (Finish applied for Avg) of
// elements first, first+1, ... of ins, one input per rank.
func fcCheckReduced(dt wire.DType, op wire.RedOp, ins [][]byte, first int, got []byte) error {
	switch dt {
	case wire.Int8:
		return fcCheckInts[int8](op, ins, first, got)
	case wire.Uint8:
		return fcCheckInts[uint8](op, ins, first, got)
	case wire.Int32:
		return fcCheckInts[int32](op, ins, first, got)
	case wire.Int64:
		return fcCheckInts[int64](op, ins, first, got)
	case wire.Bool:
		return fcCheckBools(op, ins, first, got)
	}
	return fcCheckFloats(dt, op, ins, first, got)
}

func fcCheckInts[T fcInt](op wire.RedOp, ins [][]byte, first int, got []byte) error {
	var z T
	elems := len(got) / int(unsafe.Sizeof(z))
	var bad fcMismatches
	for i := 0; i < elems; i++ {
		acc := fcGetInt[T](ins[0], first+i)
		for _, in := range ins[1:] {
			v := fcGetInt[T](in, first+i)
			switch op {
			case wire.Sum, wire.Avg:
				acc += v
			case wire.Product:
				acc *= v
			case wire.Min:
				acc = min(acc, v)
			case wire.Max:
				acc = max(acc, v)
			case wire.BAnd:
				acc &= v
			case wire.BOr:
				acc |= v
			case wire.BXor:
				acc ^= v
			}
		}
		if op == wire.Avg {
			acc /= T(len(ins)) // truncates toward zero
		}
		if g := fcGetInt[T](got, i); g != acc {
			in := make([]T, len(ins))
			for r := range ins {
				in[r] = fcGetInt[T](ins[r], first+i)
			}
			bad.add("element %d: got %d, want %d; inputs %v", first+i, g, acc, in)
		}
	}
	return bad.err(elems)
}

func fcCheckBools(op wire.RedOp, ins [][]byte, first int, got []byte) error {
	var bad fcMismatches
	for i := range got {
		acc := ins[0][first+i] != 0
		for _, in := range ins[1:] {
			v := in[first+i] != 0
			switch op {
			case wire.Sum, wire.Max, wire.BOr:
				acc = acc || v
			case wire.Product, wire.Min, wire.BAnd:
				acc = acc && v
			case wire.BXor:
				acc = acc != v
			}
		}
		// A single input is passed through as is; every reduced element is 0 or 1.
		if (got[i] != 0) != acc || len(ins) > 1 && got[i] > 1 {
			in := make([]byte, len(ins))
			for r := range ins {
				in[r] = ins[r][first+i]
			}
			bad.add("element %d: got byte %d, want truth %v; inputs %v", first+i, got[i], acc, in)
		}
	}
	return bad.err(len(got))
}

func fcCheckFloats(dt wire.DType, op wire.RedOp, ins [][]byte, first int, got []byte) error {
	n := float64(len(ins))
	// The algorithm rounds to dt (unit roundoff u) at each step; the reference rounds to
	// float64 at each step. Both errors count.
	u := fcUnitRoundoff(dt) + 0x1p-53
	elems := len(got) / dt.Size()
	var bad fcMismatches
	vals := make([]float64, len(ins))
	for i := 0; i < elems; i++ {
		for r := range ins {
			vals[r] = fcGetFloat(dt, ins[r], first+i)
		}
		var want, tol float64
		switch op {
		case wire.Sum, wire.Avg:
			var abs float64
			for _, v := range vals {
				want += v
				abs += math.Abs(v)
			}
			// n-1 additions, each rounded once (half types add in float32 first): at most
			// (n-1)·u·Σ|x| in all, plus second-order terms.
			tol = (n - 1) * u * abs * (1 + 1e-3)
			if op == wire.Avg { // and one rounded division
				want /= n
				tol = tol/n + u*(math.Abs(want)+tol/n)
			}
		case wire.Product:
			want = 1
			for _, v := range vals {
				want *= v
			}
			tol = (n - 1) * u * math.Abs(want) * (1 + 1e-2) // (1+u)^(n-1) - 1, and then some
		case wire.Min, wire.Max:
			want = vals[0]
			for _, v := range vals[1:] {
				switch {
				case math.IsNaN(want):
				case math.IsNaN(v):
					want = v
				case op == wire.Min && v < want, op == wire.Max && v > want:
					want = v
				}
			}
		}
		g := fcGetFloat(dt, got, i)
		ok := math.Abs(g-want) <= tol || g == want
		if math.IsNaN(want) || math.IsNaN(g) {
			ok = math.IsNaN(want) && math.IsNaN(g)
		}
		if !ok {
			bad.add("element %d: got %g, want %g ± %g; inputs %v", first+i, g, want, tol, vals)
		}
	}
	return bad.err(elems)
}

// fcFirstDiff describes where a and b first differ, or returns "" if they are equal.
func fcFirstDiff(a, b []byte) string {
	if len(a) != len(b) {
		return fmt.Sprintf("lengths differ: %d and %d bytes", len(a), len(b))
	}
	if bytes.Equal(a, b) {
		return ""
	}
	for i := range a {
		if a[i] != b[i] {
			j := i
			for j < len(a) && a[j] != b[j] {
				j++
			}
			diff := 0
			for k := range a {
				if a[k] != b[k] {
					diff++
				}
			}
			return fmt.Sprintf("%d of %d bytes differ, first at byte %d (%d bytes in a row: %x vs %x)",
				diff, len(a), i, j-i, a[i:min(j, i+16)], b[i:min(j, i+16)])
		}
	}
	return ""
}

// fcRandBytes returns n random bytes.
func fcRandBytes(rng *rand.Rand, n int) []byte {
	b := make([]byte, n)
	g := fcSplitMix(rng.Uint64())
	i := 0
	for ; i+8 <= n; i += 8 {
		binary.NativeEndian.PutUint64(b[i:], g.next())
	}
	for u := g.next(); i < n; i, u = i+1, u>>8 {
		b[i] = byte(u)
	}
	return b
}
