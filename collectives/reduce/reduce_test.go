package reduce

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gocomm/gocomm/wire"
)

var seedFlag = flag.Uint64("reduce.seed", 0, "seed for random inputs (0: from the clock)")

// newRand returns a generator seeded from the clock (or -reduce.seed). The
// seed is logged if the test fails.
func newRand(t testing.TB) *rand.Rand {
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("random inputs from seed %d (rerun with -reduce.seed=%d)", seed, seed)
		}
	})
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

var allOps = []wire.RedOp{wire.Sum, wire.Avg, wire.Product, wire.Min, wire.Max, wire.BAnd, wire.BOr, wire.BXor}

var (
	intOps   = []wire.RedOp{wire.Sum, wire.Avg, wire.Product, wire.Min, wire.Max, wire.BAnd, wire.BOr, wire.BXor}
	floatOps = []wire.RedOp{wire.Sum, wire.Avg, wire.Product, wire.Min, wire.Max}
)

// supportCases is the support matrix, written out independently of the
// implementation. Every op missing from a row must be rejected.
var supportCases = []struct {
	desc string
	d    wire.DType
	ops  []wire.RedOp
}{
	{"bool: sum/max are OR, product/min are AND, bitwise on truth values, no avg", wire.Bool, []wire.RedOp{wire.Sum, wire.Product, wire.Min, wire.Max, wire.BAnd, wire.BOr, wire.BXor}},
	{"uint8: wrapping arithmetic, unsigned order, bitwise", wire.Uint8, intOps},
	{"int8: wrapping arithmetic, signed order, bitwise", wire.Int8, intOps},
	{"int16: wrapping arithmetic, signed order, bitwise", wire.Int16, intOps},
	{"uint16: wrapping arithmetic, unsigned order, bitwise", wire.Uint16, intOps},
	{"int32: wrapping arithmetic, signed order, bitwise", wire.Int32, intOps},
	{"uint32: wrapping arithmetic, unsigned order, bitwise", wire.Uint32, intOps},
	{"int64: wrapping arithmetic, signed order, bitwise", wire.Int64, intOps},
	{"uint64: wrapping arithmetic, unsigned order, bitwise", wire.Uint64, intOps},
	{"float16: float32 compute, RNE rounding, NaN-propagating min/max", wire.Float16, floatOps},
	{"bfloat16: float32 compute, RNE rounding, NaN-propagating min/max", wire.BFloat16, floatOps},
	{"float32: IEEE, NaN-propagating min/max, no bitwise", wire.Float32, floatOps},
	{"float64: IEEE, NaN-propagating min/max, no bitwise", wire.Float64, floatOps},
	{"complex64: sum/avg/product only", wire.Complex64, []wire.RedOp{wire.Sum, wire.Avg, wire.Product}},
	{"complex128: sum/avg/product only", wire.Complex128, []wire.RedOp{wire.Sum, wire.Avg, wire.Product}},
	{"float8_e4m3fn: data movement only", wire.Float8E4M3FN, nil},
	{"float8_e5m2: data movement only", wire.Float8E5M2, nil},
}

// Lengths in elements: odd sizes exercise the scalar tails after the
// vector loops, and the long ones cover several AVX-512 iterations.
var testLengths = []int{1, 2, 3, 7, 33, 64, 1001, 4099}

func TestIntoMatchesReference(t *testing.T) {
	for _, tc := range supportCases {
		for _, o := range allOps {
			supported := slices.Contains(tc.ops, o)
			t.Run(fmt.Sprintf("%s/%s", tc.d, o), func(t *testing.T) {
				if !supported {
					checkUnsupported(t, tc.desc, tc.d, o)
					return
				}
				if err := Check(tc.d, o); err != nil {
					t.Fatalf("%s: Check(%s, %s) = %v, want nil", tc.desc, tc.d, o, err)
				}
				r := newRand(t)
				for _, n := range testLengths {
					for _, offset := range []int{0, 1} { // 1: misaligned buffers
						dst := randomElems(r, tc.d, n, offset)
						src := randomElems(r, tc.d, n, 2*offset)
						checkInto(t, tc.desc, tc.d, o, dst, src)
					}
				}
			})
		}
	}
}

func checkUnsupported(t *testing.T, desc string, d wire.DType, o wire.RedOp) {
	t.Helper()
	err := Check(d, o)
	if !errors.Is(err, ErrUnsupported) {
		t.Fatalf("%s: Check(%s, %s) = %v, want ErrUnsupported", desc, d, o, err)
	}
	if msg := err.Error(); !strings.Contains(msg, d.String()) || !strings.Contains(msg, o.String()) {
		t.Errorf("%s: error %q does not name both %s and %s", desc, msg, d, o)
	}
	buf := make([]byte, 4*max(d.Size(), 1))
	for _, b := range [][]byte{buf, nil} {
		if err := Into(d, o, b, append([]byte(nil), b...)); !errors.Is(err, ErrUnsupported) {
			t.Errorf("%s: Into(%s, %s, %d bytes) = %v, want ErrUnsupported", desc, d, o, len(b), err)
		}
	}
	if o == wire.Avg {
		if err := Finish(d, o, buf, 2); !errors.Is(err, ErrUnsupported) {
			t.Errorf("%s: Finish(%s, avg) = %v, want ErrUnsupported", desc, d, err)
		}
	}
}

// checkInto runs Into on copies of dst and src and compares the result
// with the reference, element by element.
func checkInto(t *testing.T, desc string, d wire.DType, o wire.RedOp, dst, src []byte) {
	t.Helper()
	want := refInto(d, o, dst, src)
	got := append([]byte(nil), dst...)
	srcCopy := append([]byte(nil), src...)
	if err := Into(d, o, got, srcCopy); err != nil {
		t.Fatalf("%s: Into(%s, %s, %d bytes): %v", desc, d, o, len(dst), err)
	}
	if string(srcCopy) != string(src) {
		t.Fatalf("%s: Into(%s, %s) modified src", desc, d, o)
	}
	compare(t, fmt.Sprintf("%s: %s %s", desc, d, o), d, got, want, dst, src)
}

func compare(t *testing.T, what string, d wire.DType, got, want, a, b []byte) {
	t.Helper()
	size := d.Size()
	bad := 0
	for i := 0; i < len(want); i += size {
		if sameElem(d, got[i:i+size], want[i:i+size]) {
			continue
		}
		if bad++; bad <= 5 {
			detail := ""
			if a != nil {
				detail = fmt.Sprintf(" (dst % x)", a[i:i+size])
			}
			if b != nil {
				detail += fmt.Sprintf(" (src % x)", b[i:i+size])
			}
			t.Errorf("%s: element %d of %d = % x, want % x%s", what, i/size, len(want)/size, got[i:i+size], want[i:i+size], detail)
		}
	}
	if bad > 5 {
		t.Errorf("%s: %d elements differ in all", what, bad)
	}
}

// randomElems returns n random elements of d, starting offset bytes into a
// fresh allocation so that the data is misaligned when offset != 0.
func randomElems(r *rand.Rand, d wire.DType, n, offset int) []byte {
	size := d.Size()
	buf := make([]byte, offset+n*size)[offset:]
	for i := 0; i < len(buf); i += size {
		e := buf[i : i+size]
		switch d {
		case wire.Bool:
			// Half false, the rest any non-zero byte (0x01, 0x02, 0xff, ...).
			if r.IntN(2) == 0 {
				e[0] = 0
			} else {
				e[0] = byte(1 + r.IntN(255))
			}
		case wire.Float16, wire.BFloat16:
			ne.PutUint16(e, randomHalf(r, d))
		case wire.Float32, wire.Complex64:
			for j := 0; j < size; j += 4 {
				ne.PutUint32(e[j:], math.Float32bits(float32(randomFloat(r, 24))))
			}
		case wire.Float64, wire.Complex128:
			for j := 0; j < size; j += 8 {
				ne.PutUint64(e[j:], math.Float64bits(randomFloat(r, 53)))
			}
		default:
			for j := range e {
				e[j] = byte(r.Uint32())
			}
			if r.IntN(8) == 0 { // small values make ties and near-extremes common
				for j := range e {
					e[j] = 0
				}
				e[0] = byte(r.IntN(5))
				if r.IntN(2) == 0 {
					for j := range e {
						e[j] = ^e[j]
					}
				}
			}
		}
	}
	return buf
}

var specialFloats = []float64{
	0, math.Copysign(0, -1), 1, -1, 0.5, math.Inf(1), math.Inf(-1), math.NaN(), -math.NaN(),
	math.MaxFloat32, -math.MaxFloat32, math.SmallestNonzeroFloat32, 0x1p-126, 65504, 65520, 0x1p-24, 0x1p-25,
}

// randomFloat mixes special values, small integers (ties, exact results),
// values of moderate range, and arbitrary bit patterns.
func randomFloat(r *rand.Rand, mant int) float64 {
	switch r.IntN(10) {
	case 0:
		return specialFloats[r.IntN(len(specialFloats))]
	case 1, 2:
		return float64(r.IntN(9) - 4)
	case 3, 4, 5, 6:
		return math.Ldexp(r.Float64()*2-1, r.IntN(40)-20)
	}
	if mant == 24 {
		return float64(math.Float32frombits(r.Uint32()))
	}
	return math.Float64frombits(r.Uint64())
}

// randomHalf returns arbitrary 16-bit patterns (all classes of values) or
// patterns with exponents close together, whose sums often need rounding.
func randomHalf(r *rand.Rand, d wire.DType) uint16 {
	if r.IntN(2) == 0 {
		return uint16(r.Uint32())
	}
	sign := uint16(r.IntN(2)) << 15
	if d == wire.Float16 {
		return sign | uint16(12+r.IntN(6))<<10 | uint16(r.IntN(1<<10))
	}
	return sign | uint16(124+r.IntN(6))<<7 | uint16(r.IntN(1<<7))
}

// TestHalfExhaustive runs every 16-bit pattern against a set of partners
// and checks every value, subnormal, Inf and NaN through both conversions
// and the rounding.
func TestHalfExhaustive(t *testing.T) {
	all := make([]uint16, 1<<16)
	for i := range all {
		all[i] = uint16(i)
	}
	partners := map[wire.DType][]uint16{
		// 0, -0, 1, 0.5, 3, 1/3, 2^-10, -2^-14, 1000, 65504, Inf, NaN, smallest subnormal
		wire.Float16: {0x0000, 0x8000, 0x3c00, 0x3800, 0x4200, 0x3555, 0x1400, 0x8400, 0x63d0, 0x7bff, 0x7c00, 0x7e00, 0x0001},
		// 0, -0, 1, 0.5, 3, 1/3, 2^-8, -2^-126, 1000, max, Inf, NaN, smallest subnormal
		wire.BFloat16: {0x0000, 0x8000, 0x3f80, 0x3f00, 0x4040, 0x3eab, 0x3b80, 0x8080, 0x447a, 0x7f7f, 0x7f80, 0x7fc0, 0x0001},
	}
	for _, d := range []wire.DType{wire.Float16, wire.BFloat16} {
		for _, o := range []wire.RedOp{wire.Sum, wire.Product, wire.Min, wire.Max} {
			t.Run(fmt.Sprintf("%s/%s", d, o), func(t *testing.T) {
				for _, p := range partners[d] {
					other := make([]uint16, len(all))
					for i := range other {
						other[i] = p
					}
					desc := fmt.Sprintf("all patterns vs %#04x", p)
					checkInto(t, desc, d, o, pack(all...), pack(other...))
					checkInto(t, desc+" (swapped)", d, o, pack(other...), pack(all...))
				}
				r := newRand(t)
				a, b := make([]uint16, 1<<16), make([]uint16, 1<<16)
				for i := range a {
					a[i], b[i] = randomHalf(r, d), randomHalf(r, d)
				}
				checkInto(t, "random pairs", d, o, pack(a...), pack(b...))
			})
		}
	}
}

// elemCase is an edge case with expected values worked out by hand.
type elemCase struct {
	desc          string
	d             wire.DType
	o             wire.RedOp
	dst, src, out []byte
}

func TestEdgeCases(t *testing.T) {
	nan32, inf32 := float32(math.NaN()), float32(math.Inf(1))
	nan64, inf64 := math.NaN(), math.Inf(1)
	negz32 := float32(math.Copysign(0, -1))
	pt1, pt2 := 0.1, 0.2 // variables: a constant 0.1+0.2 would be folded exactly
	cases := []elemCase{
		// NaN and Inf.
		{"f32 max: NaN in dst or src wins", wire.Float32, wire.Max, pack(nan32, 1, nan32, inf32), pack[float32](1, nan32, nan32, nan32), pack(nan32, nan32, nan32, nan32)},
		{"f32 min: NaN in dst or src wins", wire.Float32, wire.Min, pack(nan32, -inf32, nan32), pack(-inf32, nan32, nan32), pack(nan32, nan32, nan32)},
		{"f32 min/max of numbers and infinities", wire.Float32, wire.Min, pack(-inf32, 2, inf32, 1), pack[float32](1, -3, 5, inf32), pack(-inf32, -3, 5, 1)},
		{"f32 min keeps dst on ties of -0 and +0", wire.Float32, wire.Min, pack(negz32, 0), pack(0, negz32), pack(negz32, 0)},
		{"f32 sum: Inf + -Inf is NaN, Inf + x is Inf", wire.Float32, wire.Sum, pack(inf32, inf32, -inf32), pack(-inf32, 1, -1), pack(nan32, inf32, -inf32)},
		{"f32 sum overflows to Inf", wire.Float32, wire.Sum, pack[float32](math.MaxFloat32), pack[float32](math.MaxFloat32), pack(inf32)},
		{"f32 product: 0 * Inf is NaN", wire.Float32, wire.Product, pack[float32](0, -2), pack(inf32, inf32), pack(nan32, -inf32)},
		{"f64 max: NaN wins", wire.Float64, wire.Max, pack(nan64, 1, inf64), pack(1, nan64, nan64), pack(nan64, nan64, nan64)},
		{"f64 min: NaN wins, -Inf is least", wire.Float64, wire.Min, pack(nan64, -inf64, 3), pack(-inf64, 7, nan64), pack(nan64, -inf64, nan64)},
		{"f64 sum: exact IEEE", wire.Float64, wire.Sum, pack(pt1, 1e308, -inf64), pack(pt2, 1e308, inf64), pack(pt1+pt2, inf64, nan64)},

		// float16 rounding, subnormals, overflow.
		{"f16 sum: 1 + 2^-11 ties to even (down)", wire.Float16, wire.Sum, pack[uint16](0x3c00), pack[uint16](0x1000), pack[uint16](0x3c00)},
		{"f16 sum: (1+2^-10) + 2^-11 ties to even (up)", wire.Float16, wire.Sum, pack[uint16](0x3c01), pack[uint16](0x1000), pack[uint16](0x3c02)},
		{"f16 sum: 1 + 3*2^-12 rounds up (above half)", wire.Float16, wire.Sum, pack[uint16](0x3c00), pack[uint16](0x1200), pack[uint16](0x3c01)},
		{"f16 product: 2^-24 * 0.5 ties to zero", wire.Float16, wire.Product, pack[uint16](0x0001, 0x8001), pack[uint16](0x3800, 0x3800), pack[uint16](0x0000, 0x8000)},
		{"f16 product: 3*2^-24 * 0.5 ties to 2*2^-24", wire.Float16, wire.Product, pack[uint16](0x0003), pack[uint16](0x3800), pack[uint16](0x0002)},
		{"f16 sum of subnormals", wire.Float16, wire.Sum, pack[uint16](0x0001, 0x03ff), pack[uint16](0x0001, 0x0001), pack[uint16](0x0002, 0x0400)},
		{"f16 sum: 2^-14 - 2^-24 is the largest subnormal", wire.Float16, wire.Sum, pack[uint16](0x0400), pack[uint16](0x8001), pack[uint16](0x03ff)},
		{"f16 product: 2^-14 * 0.5 is subnormal", wire.Float16, wire.Product, pack[uint16](0x0400), pack[uint16](0x3800), pack[uint16](0x0200)},
		{"f16 sum: 65504 + 14 stays at 65504", wire.Float16, wire.Sum, pack[uint16](0x7bff), pack[uint16](0x4b00), pack[uint16](0x7bff)},
		{"f16 sum: 65504 + 16 = 65520 ties to Inf", wire.Float16, wire.Sum, pack[uint16](0x7bff, 0xfbff), pack[uint16](0x4c00, 0xcc00), pack[uint16](0x7c00, 0xfc00)},
		{"f16 sum: Inf + -Inf is NaN, Inf + 1 is Inf", wire.Float16, wire.Sum, pack[uint16](0x7c00, 0x7c00), pack[uint16](0xfc00, 0x3c00), pack[uint16](0x7e00, 0x7c00)},
		{"f16 max: NaN wins", wire.Float16, wire.Max, pack[uint16](0x7e00, 0x3c00, 0x7c00), pack[uint16](0x3c00, 0x7e01, 0x7e00), pack[uint16](0x7e00, 0x7e00, 0x7e00)},
		{"f16 min: ordinary values and -Inf", wire.Float16, wire.Min, pack[uint16](0x3c00, 0xfc00, 0x8001), pack[uint16](0xbc00, 0x7bff, 0x0001), pack[uint16](0xbc00, 0xfc00, 0x8001)},

		// bfloat16 rounding, subnormals, overflow.
		{"bf16 sum: 1 + 2^-8 ties to even (down)", wire.BFloat16, wire.Sum, pack[uint16](0x3f80), pack[uint16](0x3b80), pack[uint16](0x3f80)},
		{"bf16 sum: (1+2^-7) + 2^-8 ties to even (up)", wire.BFloat16, wire.Sum, pack[uint16](0x3f81), pack[uint16](0x3b80), pack[uint16](0x3f82)},
		{"bf16 product: 2^-133 * 0.5 ties to zero", wire.BFloat16, wire.Product, pack[uint16](0x0001), pack[uint16](0x3f00), pack[uint16](0x0000)},
		{"bf16 product: 3*2^-133 * 0.5 ties to 2*2^-133", wire.BFloat16, wire.Product, pack[uint16](0x0003), pack[uint16](0x3f00), pack[uint16](0x0002)},
		{"bf16 sum of subnormals reaches the smallest normal", wire.BFloat16, wire.Sum, pack[uint16](0x007f), pack[uint16](0x0001), pack[uint16](0x0080)},
		{"bf16 sum: max + 2^119 ties to Inf", wire.BFloat16, wire.Sum, pack[uint16](0x7f7f), pack[uint16](0x7b00), pack[uint16](0x7f80)},
		{"bf16 sum: max + 2^118 stays at max", wire.BFloat16, wire.Sum, pack[uint16](0x7f7f), pack[uint16](0x7a80), pack[uint16](0x7f7f)},
		{"bf16 sum: max + max overflows float32 to Inf", wire.BFloat16, wire.Sum, pack[uint16](0x7f7f, 0xff7f), pack[uint16](0x7f7f, 0xff7f), pack[uint16](0x7f80, 0xff80)},
		{"bf16 sum: 1 + 1/3", wire.BFloat16, wire.Sum, pack[uint16](0x3f80), pack[uint16](0x3eab), pack[uint16](0x3fab)},
		{"bf16 min: NaN wins", wire.BFloat16, wire.Min, pack[uint16](0x7fc0, 0x3f80), pack[uint16](0x3f80, 0xffc1), pack[uint16](0x7fc0, 0x7fc0)},

		// Integer wrap-around.
		{"int8 sum wraps", wire.Int8, wire.Sum, pack[int8](127, -128, -1), pack[int8](1, -1, 1), pack[int8](-128, 127, 0)},
		{"uint8 sum and product wrap", wire.Uint8, wire.Sum, pack[uint8](255, 200), pack[uint8](1, 100), pack[uint8](0, 44)},
		{"uint8 product wraps", wire.Uint8, wire.Product, pack[uint8](16, 255), pack[uint8](16, 255), pack[uint8](0, 1)},
		{"int16 product: -32768 * -1 wraps to -32768", wire.Int16, wire.Product, pack[int16](-32768, 300), pack[int16](-1, 300), pack[int16](-32768, 24464)},
		{"uint16 product: 65535 * 65535 = 1 (no int overflow)", wire.Uint16, wire.Product, pack[uint16](65535, 256), pack[uint16](65535, 256), pack[uint16](1, 0)},
		{"int32 product: 2^16 * 2^16 wraps to 0", wire.Int32, wire.Product, pack[int32](65536, math.MaxInt32), pack[int32](65536, 2), pack[int32](0, -2)},
		{"int64 sum: MaxInt64 + 1 is MinInt64", wire.Int64, wire.Sum, pack[int64](math.MaxInt64, math.MinInt64), pack[int64](1, -1), pack[int64](math.MinInt64, math.MaxInt64)},
		{"uint64 sum and max", wire.Uint64, wire.Sum, pack[uint64](math.MaxUint64), pack[uint64](2), pack[uint64](1)},
		{"int8 min/max are signed", wire.Int8, wire.Max, pack[int8](-1, 5), pack[int8](1, -128), pack[int8](1, 5)},
		{"uint8 min/max are unsigned", wire.Uint8, wire.Max, pack[uint8](0xff, 5), pack[uint8](1, 0x80), pack[uint8](0xff, 0x80)},
		{"int64 min is signed", wire.Int64, wire.Min, pack[int64](-1, math.MaxInt64), pack[int64](1, math.MinInt64), pack[int64](-1, math.MinInt64)},
		{"uint32 min is unsigned", wire.Uint32, wire.Min, pack[uint32](0xffffffff, 7), pack[uint32](1, 8), pack[uint32](1, 7)},
		{"int16 bxor", wire.Int16, wire.BXor, pack[int16](-1, 0x0f0f), pack[int16](0x00ff, 0x00ff), pack[int16](-256, 0x0ff0)},

		// wire.Bool: any non-zero byte is true, results are 0 or 1.
		{"bool sum is OR", wire.Bool, wire.Sum, pack[uint8](0x02, 0x00, 0xff, 0x00), pack[uint8](0x00, 0x00, 0x80, 0x01), pack[uint8](1, 0, 1, 1)},
		{"bool product is AND", wire.Bool, wire.Product, pack[uint8](0x02, 0xff, 0x00, 0x10), pack[uint8](0x01, 0xff, 0x07, 0x00), pack[uint8](1, 1, 0, 0)},
		{"bool min is AND", wire.Bool, wire.Min, pack[uint8](0x02, 0xff, 0x00), pack[uint8](0x04, 0x00, 0x00), pack[uint8](1, 0, 0)},
		{"bool max is OR", wire.Bool, wire.Max, pack[uint8](0x02, 0x00, 0x00), pack[uint8](0x00, 0xff, 0x00), pack[uint8](1, 1, 0)},
		{"bool band is logical (0x02 & 0x01 is true)", wire.Bool, wire.BAnd, pack[uint8](0x02, 0xff), pack[uint8](0x01, 0x00), pack[uint8](1, 0)},
		{"bool bor", wire.Bool, wire.BOr, pack[uint8](0x40, 0x00), pack[uint8](0x00, 0x00), pack[uint8](1, 0)},
		{"bool bxor is logical (0xff ^ 0x01 is false)", wire.Bool, wire.BXor, pack[uint8](0xff, 0x02, 0x00, 0x00), pack[uint8](0x01, 0x00, 0x80, 0x00), pack[uint8](0, 1, 1, 0)},

		// Complex.
		{"complex64 product (1+2i)(3+4i) = -5+10i", wire.Complex64, wire.Product, pack(complex64(1+2i), 2i), pack(complex64(3+4i), 2i), pack(complex64(-5+10i), -4)},
		{"complex128 sum", wire.Complex128, wire.Sum, pack(1+2i, complex(inf64, 0)), pack(3-5i, complex(-inf64, 1)), pack(4-3i, complex(nan64, 1))},
		{"complex128 product (0.5-1i)(2+2i) = 3-1i", wire.Complex128, wire.Product, pack(0.5 - 1i), pack(2 + 2i), pack(3 - 1i)},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			got := append([]byte(nil), c.dst...)
			if err := Into(c.d, c.o, got, c.src); err != nil {
				t.Fatalf("Into(%s, %s): %v", c.d, c.o, err)
			}
			compare(t, c.desc, c.d, got, c.out, c.dst, c.src)
			// The hand-computed values also check the Go reference.
			compare(t, c.desc+" (reference)", c.d, refInto(c.d, c.o, c.dst, c.src), c.out, c.dst, c.src)
		})
	}
}

func TestLengthErrors(t *testing.T) {
	cases := []struct {
		desc     string
		d        wire.DType
		dst, src int // byte lengths
	}{
		{"float32 dst and src lengths differ", wire.Float32, 8, 4},
		{"float32 length not a multiple of 4", wire.Float32, 6, 6},
		{"int64 length not a multiple of 8", wire.Int64, 12, 12},
		{"complex128 length is a multiple of 8 but not 16", wire.Complex128, 24, 24},
		{"bfloat16 odd byte count", wire.BFloat16, 3, 3},
		{"bool lengths differ", wire.Bool, 3, 2},
		{"empty dst, non-empty src", wire.Int32, 0, 4},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			err := Into(c.d, wire.Sum, make([]byte, c.dst), make([]byte, c.src))
			if err == nil {
				t.Fatalf("Into(%s, sum, %d bytes, %d bytes) = nil, want error", c.d, c.dst, c.src)
			}
			if errors.Is(err, ErrUnsupported) {
				t.Errorf("length error %q wraps ErrUnsupported", err)
			}
		})
	}
	if err := Finish(wire.Float32, wire.Avg, make([]byte, 6), 2); err == nil {
		t.Error("Finish(float32, avg, 6 bytes) = nil, want error")
	}
}

func TestEmpty(t *testing.T) {
	for _, tc := range supportCases {
		for _, o := range tc.ops {
			if err := Into(tc.d, o, nil, []byte{}); err != nil {
				t.Errorf("%s: Into(%s, %s) on empty buffers = %v", tc.desc, tc.d, o, err)
			}
			if err := Finish(tc.d, o, nil, 3); err != nil {
				t.Errorf("%s: Finish(%s, %s) on empty buffer = %v", tc.desc, tc.d, o, err)
			}
		}
	}
}

func TestOverlap(t *testing.T) {
	r := newRand(t)
	for _, d := range []wire.DType{wire.Int32, wire.Float32, wire.BFloat16, wire.Complex128} {
		size := d.Size()
		base := randomElems(r, d, 64, 0)
		// Identical buffers: x op x.
		same := append([]byte(nil), base...)
		if err := Into(d, wire.Sum, same, same); err != nil {
			t.Fatal(err)
		}
		compare(t, d.String()+" sum with dst == src", d, same, refInto(d, wire.Sum, base, base), nil, nil)
		// Partial overlap: src is read as it was before the call.
		buf := append([]byte(nil), base...)
		dst, src := buf[:32*size], buf[size:33*size]
		want := refInto(d, wire.Sum, base[:32*size], base[size:33*size])
		if err := Into(d, wire.Sum, dst, src); err != nil {
			t.Fatal(err)
		}
		compare(t, d.String()+" sum with overlapping src", d, dst, want, nil, nil)
	}
}

func TestFinishMatchesReference(t *testing.T) {
	for _, tc := range supportCases {
		if !slices.Contains(tc.ops, wire.Avg) {
			continue
		}
		t.Run(tc.d.String(), func(t *testing.T) {
			r := newRand(t)
			for _, length := range testLengths {
				for _, n := range []int{2, 3, 7, 8, 1000, 1 << 20} {
					// wire.Avg over n ranks: accumulate a few contributions, then finish.
					acc := randomElems(r, tc.d, length, 0)
					for range 2 {
						if err := Into(tc.d, wire.Avg, acc, randomElems(r, tc.d, length, 0)); err != nil {
							t.Fatal(err)
						}
					}
					want := refFinish(tc.d, acc, n)
					got := append([]byte(nil), acc...)
					if err := Finish(tc.d, wire.Avg, got, n); err != nil {
						t.Fatalf("Finish(%s, avg, n=%d): %v", tc.d, n, err)
					}
					compare(t, fmt.Sprintf("%s: finish avg n=%d", tc.desc, n), tc.d, got, want, acc, nil)
				}
			}
		})
	}
}

func TestFinish(t *testing.T) {
	cases := []struct {
		desc     string
		d        wire.DType
		n        int
		buf, out []byte
	}{
		{"int32 truncates toward zero", wire.Int32, 2, pack[int32](7, -7, 1, -1, math.MinInt32, math.MaxInt32), pack[int32](3, -3, 0, 0, -1073741824, 1073741823)},
		{"int8 divisor larger than the type", wire.Int8, 128, pack[int8](-128, 127, -1), pack[int8](-1, 0, 0)},
		{"int8 n=3", wire.Int8, 3, pack[int8](-128, 127, -5), pack[int8](-42, 42, -1)},
		{"uint8 n=2", wire.Uint8, 2, pack[uint8](255, 1), pack[uint8](127, 0)},
		{"int64 n=3", wire.Int64, 3, pack[int64](math.MinInt64, -8, 8), pack[int64](-3074457345618258602, -2, 2)},
		{"uint64 n=3", wire.Uint64, 3, pack[uint64](math.MaxUint64), pack[uint64](6148914691236517205)},
		{"float32 divides", wire.Float32, 2, pack[float32](3, -1, float32(math.Inf(1))), pack[float32](1.5, -0.5, float32(math.Inf(1)))},
		{"float64 divides", wire.Float64, 4, pack(1.0, -6), pack(0.25, -1.5)},
		{"float16 1/3 rounds to nearest", wire.Float16, 3, pack[uint16](0x3c00, 0x7c00), pack[uint16](0x3555, 0x7c00)},
		{"float16 into the subnormals", wire.Float16, 4, pack[uint16](0x0400), pack[uint16](0x0100)},
		{"bfloat16 1/3 rounds to nearest", wire.BFloat16, 3, pack[uint16](0x3f80), pack[uint16](0x3eab)},
		{"complex64 divides both parts", wire.Complex64, 3, pack(complex64(3 + 6i)), pack(complex64(1 + 2i))},
		{"n=1 is a no-op", wire.Float16, 1, pack[uint16](0x7e01), pack[uint16](0x7e01)},
	}
	for _, c := range cases {
		t.Run(c.desc, func(t *testing.T) {
			got := append([]byte(nil), c.buf...)
			if err := Finish(c.d, wire.Avg, got, c.n); err != nil {
				t.Fatal(err)
			}
			compare(t, c.desc, c.d, got, c.out, c.buf, nil)
			compare(t, c.desc+" (reference)", c.d, refFinish(c.d, c.buf, c.n), c.out, c.buf, nil)
		})
	}
	t.Run("bad n", func(t *testing.T) {
		for _, n := range []int{0, -1} {
			if err := Finish(wire.Float32, wire.Avg, make([]byte, 4), n); err == nil {
				t.Errorf("Finish(float32, avg, n=%d) = nil, want error", n)
			}
		}
	})
	t.Run("other ops are no-ops", func(t *testing.T) {
		for _, o := range []wire.RedOp{wire.Sum, wire.Product, wire.Min, wire.Max, wire.BAnd, wire.BOr, wire.BXor} {
			buf := pack[float32](3)
			if err := Finish(wire.Float32, o, buf, 2); err != nil || string(buf) != string(pack[float32](3)) {
				t.Errorf("Finish(float32, %s) = %v, changed %v", o, err, buf)
			}
		}
	})
}

func TestNames(t *testing.T) {
	dtypes := []struct {
		d    wire.DType
		name string
		size int
	}{
		{wire.Invalid, "invalid", 0}, {wire.Bool, "bool", 1}, {wire.Uint8, "uint8", 1}, {wire.Int8, "int8", 1},
		{wire.Int16, "int16", 2}, {wire.Int32, "int32", 4}, {wire.Int64, "int64", 8}, {wire.Float16, "float16", 2},
		{wire.BFloat16, "bfloat16", 2}, {wire.Float32, "float32", 4}, {wire.Float64, "float64", 8},
		{wire.Complex64, "complex64", 8}, {wire.Complex128, "complex128", 16},
		{wire.Float8E4M3FN, "float8_e4m3fn", 1}, {wire.Float8E5M2, "float8_e5m2", 1},
		{wire.Uint16, "uint16", 2}, {wire.Uint32, "uint32", 4}, {wire.Uint64, "uint64", 8},
		{18, "dtype(18)", 0}, {255, "dtype(255)", 0},
	}
	for _, c := range dtypes {
		if c.d.String() != c.name || c.d.Size() != c.size || c.d.Valid() != (c.size != 0) {
			t.Errorf("wire.DType(%d): String %q Size %d Valid %v, want %q %d %v",
				uint8(c.d), c.d, c.d.Size(), c.d.Valid(), c.name, c.size, c.size != 0)
		}
	}
	ops := map[wire.RedOp]string{wire.Sum: "sum", wire.Avg: "avg", wire.Product: "product", wire.Min: "min", wire.Max: "max",
		wire.BAnd: "band", wire.BOr: "bor", wire.BXor: "bxor", 0: "op(0)", 9: "op(9)"}
	for o, name := range ops {
		if o.String() != name {
			t.Errorf("wire.RedOp(%d).String() = %q, want %q", uint8(o), o, name)
		}
	}
	for _, c := range []struct {
		d    wire.DType
		o    wire.RedOp
		text string
	}{
		{wire.Complex64, wire.Max, "reduce: max is not defined for complex64"},
		{wire.Float32, wire.BXor, "reduce: bxor is not defined for float32"},
		{wire.Bool, wire.Avg, "reduce: avg is not defined for bool"},
		{wire.Float8E4M3FN, wire.Sum, "reduce: sum is not defined for float8_e4m3fn (float8 tensors are data-movement only on CPU)"},
		{wire.Invalid, wire.Sum, "reduce: sum is not defined for invalid (unknown dtype)"},
		{wire.Float32, 0, "reduce: op(0) is not defined for float32 (unknown op)"},
		{wire.Int32, 200, "reduce: op(200) is not defined for int32 (unknown op)"},
		{99, wire.Max, "reduce: max is not defined for dtype(99) (unknown dtype)"},
	} {
		err := Check(c.d, c.o)
		if !errors.Is(err, ErrUnsupported) || err.Error() != c.text {
			t.Errorf("Check(%d, %d) = %v, want %q wrapping ErrUnsupported", c.d, c.o, err, c.text)
		}
	}
}
