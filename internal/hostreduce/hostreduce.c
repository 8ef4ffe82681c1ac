/*
 * Elementwise reduction kernels (see hostreduce.h).
 *
 * The kernels are plain C loops, written so that gcc -O3 auto-vectorizes
 * every one of them: no branches in the loop bodies (only selects), no calls,
 * restrict pointers, and 16-bit floats converted with integer/float
 * arithmetic instead of library calls. The exception is float16 on x86-64
 * CPUs with F16C, which gets four small intrinsic loops (HR_F16C_KERNEL).
 *
 * Built with -O3 (set in hostreduce.go).
 */
#include <string.h>

#include "hostreduce.h"

/* Hand-written F16C kernels for float16 (see HR_F16C_KERNEL). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(HR_NO_CLONES)
#define HR_F16C 1
#include <immintrin.h>
#endif

/*
 * No FMA contraction. a*b - c*d must round both products, as c10::complex
 * and ATen's vectorized complex multiply do. gcc contracts in its GNU modes.
 * cgo does not accept -ffp-contract=off, so contraction is switched off here
 * for every function that follows (hostreduce.go also builds in ISO C mode,
 * which implies it).
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/*
 * Function multiversioning. On x86-64 each kernel is compiled three times:
 * x86-64-v4 (AVX-512), x86-64-v3 (AVX2, F16C, FMA) and baseline SSE2. The
 * dynamic loader binds the best clone for the running CPU through an ifunc
 * resolver, so one binary runs on every x86-64. That needs gcc >= 12
 * (arch=x86-64-vN clones) and glibc (ifunc). Anywhere else, or when built
 * with -DHR_NO_CLONES, each loop is built once and vectorized for whatever
 * -march the compiler targets. The tests use that to exercise the AVX2 and
 * SSE2 code on an AVX-512 machine:
 *   CGO_CFLAGS='-O2 -DHR_NO_CLONES -march=x86-64-v3' go test ./collectives/reduce
 */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && \
    !defined(__clang__) && __GNUC__ >= 12 && !defined(HR_NO_CLONES)
#define HR_KERNEL \
	__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define HR_CLONED 1
#else
#define HR_KERNEL
#endif

/*
 * Element storage types with alignment 1. Buffers come from Go slices or
 * shared memory at arbitrary byte offsets. With these types the vectorizer
 * never assumes alignment, so it never emits aligned-only vector accesses.
 */
typedef uint8_t hr_u8;
typedef int8_t hr_i8;
typedef uint16_t hr_u16 __attribute__((aligned(1)));
typedef int16_t hr_i16 __attribute__((aligned(1)));
typedef uint32_t hr_u32 __attribute__((aligned(1)));
typedef int32_t hr_i32 __attribute__((aligned(1)));
typedef uint64_t hr_u64 __attribute__((aligned(1)));
typedef int64_t hr_i64 __attribute__((aligned(1)));
typedef float hr_f32 __attribute__((aligned(1)));
typedef double hr_f64 __attribute__((aligned(1)));

static inline uint32_t f32_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof u);
	return u;
}

static inline float f32_from_bits(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof f);
	return f;
}

/*
 * Branch-free select: c ? x : y for c in {0, 1}. The 16-bit float
 * conversions use it instead of ?: when an arm holds a float operation.
 * Under -ftrapping-math (gcc's default, and cgo does not allow turning it
 * off) gcc moves such an operation into a conditional block and then will not
 * if-convert it, which stops the loop from vectorizing.
 */
static inline uint32_t sel32(uint32_t c, uint32_t x, uint32_t y)
{
	uint32_t m = 0u - c;
	return (x & m) | (y & ~m);
}

/*
 * 16-bit float conversions. Each kind of operand is computed without a
 * branch and the right result is then selected, so loops that use these
 * functions vectorize.
 *
 * Rounding invariant (both narrowing functions): the result is the 16-bit
 * value nearest to the float32 input, ties to even (IEEE roundTiesToEven).
 * Finite values too large for the format become Inf of the same sign, and
 * every NaN becomes a quiet NaN. This matches c10::Half / c10::BFloat16, so
 * op(a, b) computed as narrow(op(widen(a), widen(b))) is bit-identical to
 * what PyTorch computes on CPU (apart from NaN payloads).
 */

/* bfloat16 -> float32 is exact: bfloat16 is the top half of a float32. */
static inline float bf16_to_f32(uint16_t h)
{
	return f32_from_bits((uint32_t)h << 16);
}

static inline uint16_t f32_to_bf16(float f)
{
	uint32_t u = f32_bits(f);
	/*
	 * Adding 0x7fff plus the lowest kept bit to the 16 dropped bits carries
	 * into the kept half exactly when the dropped part is above one half,
	 * or exactly one half and the kept part is odd. That is round to
	 * nearest even. A carry out of the mantissa increments the exponent,
	 * which is also correct, and it turns the largest finite values into
	 * Inf (0x7f80) when they round up. Subnormals need no special case:
	 * bfloat16 has the float32 exponent range. NaN is the one input the
	 * carry would corrupt (a payload in the low bits could carry into
	 * Inf), so NaN is replaced by the canonical quiet NaN, as c10 does.
	 */
	uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
	return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)r;
}

/* float16 -> float32 is exact. */
static inline float f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t em = h & 0x7fffu; /* exponent and mantissa */
	/* Normal: move into place and rebias the exponent from 15 to 127. */
	uint32_t normal = (em << 13) + ((127u - 15u) << 23);
	/* Inf/NaN: all-ones exponent, keep the mantissa (NaN payload). */
	uint32_t special = (em << 13) | 0x7f800000u;
	/*
	 * Subnormal (and zero): value = mantissa * 2^-24. The int->float
	 * conversion and the power-of-two scale are exact, and the result is a
	 * normal float32, so this does not depend on DAZ/FTZ.
	 */
	uint32_t sub = f32_bits((float)(int32_t)em * 0x1p-24f);
	uint32_t u = sel32(em < 0x0400u, sub, em >= 0x7c00u ? special : normal);
	return f32_from_bits(u | sign);
}

static inline uint16_t f32_to_f16(float f)
{
	uint32_t u = f32_bits(f);
	uint32_t sign = (u >> 16) & 0x8000u;
	uint32_t a = u & 0x7fffffffu; /* |f| as bits */
	/*
	 * Normal result (|f| >= 2^-14): rebias the exponent, then round away
	 * the 13 dropped mantissa bits with the same carry trick as bfloat16
	 * (add 0x0fff plus the lowest kept bit). A carry into the exponent is
	 * correct. The value is meaningless when a is outside this range, but
	 * then another value is selected below.
	 */
	uint32_t normal = (a - ((127u - 15u) << 23) + 0x0fffu + ((a >> 13) & 1u)) >> 13;
	/*
	 * Subnormal result (|f| < 2^-14): the result is round(|f| * 2^24) in
	 * units of the float16 subnormal step 2^-24. Adding 0.5 makes the FPU
	 * round |f| to a multiple of 2^-24 (the ulp of floats in [0.5, 1)) in
	 * the default round-to-nearest-even mode. The mantissa bits of the sum
	 * are then the rounded count, which is at most 0x400 (= 2^-14, the
	 * smallest normal, also the correct encoding). float32 subnormal inputs
	 * round to 0 with or without DAZ.
	 */
	uint32_t sub = f32_bits(f32_from_bits(a) + 0.5f) - 0x3f000000u;
	uint32_t h = sel32(a < 0x38800000u, sub, normal);
	/*
	 * 65520 = 0x477ff000 is halfway between the largest float16 (65504)
	 * and 2^16. It and everything above it round to Inf. Ties go to Inf
	 * because 65504 has an odd mantissa. This also maps float32 Inf to Inf.
	 */
	h = sel32(a >= 0x477ff000u, 0x7c00u, h);
	h = sel32(a > 0x7f800000u, 0x7e00u, h); /* NaN -> quiet NaN */
	return (uint16_t)(h | sign);
}

#define ID(x) (x)

typedef void (*hr_binary_fn)(void *restrict, const void *restrict, size_t);
typedef void (*hr_div_fn)(void *restrict, size_t, int64_t);

/*
 * HR_MAP defines the binary kernel NAME over elements stored as ST. Both
 * operands are widened by LOAD to the compute type CT, combined by EXPR
 * (written in terms of a = dst[i] and b = src[i]), narrowed by STORE and
 * written back to dst[i].
 */
#define HR_MAP(NAME, ST, CT, LOAD, STORE, EXPR)                              \
	HR_KERNEL static void NAME(void *restrict dv, const void *restrict sv, \
				   size_t n)                                   \
	{                                                                      \
		ST *restrict d = (ST *)dv;                                     \
		const ST *restrict s = (const ST *)sv;                         \
		for (size_t i = 0; i < n; i++) {                               \
			const CT a = LOAD(d[i]), b = LOAD(s[i]);               \
			d[i] = STORE(EXPR);                                    \
		}                                                              \
	}

/* HR_DIV defines the in-place kernel NAME: d[i] = STORE(LOAD(d[i]) / q),
 * computed in type QT. */
#define HR_DIV(NAME, ST, QT, LOAD, STORE)                                     \
	HR_KERNEL static void NAME(void *restrict dv, size_t n, int64_t divisor) \
	{                                                                       \
		ST *restrict d = (ST *)dv;                                      \
		const QT q = (QT)divisor;                                       \
		for (size_t i = 0; i < n; i++)                                  \
			d[i] = STORE((QT)LOAD(d[i]) / q);                       \
	}

/*
 * Integers. Sum and product are computed in the unsigned type W, at least
 * as wide as an int, so they wrap around in two's complement instead of
 * overflowing a signed int. That includes uint16 * uint16, which would
 * otherwise be promoted to int. Min and max compare in T, so signedness is
 * respected. Division widens to the 64-bit type Q of the same signedness,
 * so the divisor is never truncated, and C '/' truncates toward zero.
 */
#define HR_INT_KERNELS(P, ST, T, W, Q)                             \
	HR_MAP(P##_add, ST, T, ID, ID, (T)((W)a + (W)b))            \
	HR_MAP(P##_mul, ST, T, ID, ID, (T)((W)a * (W)b))            \
	HR_MAP(P##_min, ST, T, ID, ID, b < a ? b : a)               \
	HR_MAP(P##_max, ST, T, ID, ID, a < b ? b : a)               \
	HR_MAP(P##_and, ST, T, ID, ID, (T)(a & b))                  \
	HR_MAP(P##_or, ST, T, ID, ID, (T)(a | b))                   \
	HR_MAP(P##_xor, ST, T, ID, ID, (T)(a ^ b))                  \
	HR_DIV(P##_div, ST, Q, ID, ID)

HR_INT_KERNELS(u8, hr_u8, uint8_t, unsigned, uint64_t)
HR_INT_KERNELS(i8, hr_i8, int8_t, unsigned, int64_t)
HR_INT_KERNELS(u16, hr_u16, uint16_t, unsigned, uint64_t)
HR_INT_KERNELS(i16, hr_i16, int16_t, unsigned, int64_t)
HR_INT_KERNELS(u32, hr_u32, uint32_t, uint32_t, uint64_t)
HR_INT_KERNELS(i32, hr_i32, int32_t, uint32_t, int64_t)
HR_INT_KERNELS(u64, hr_u64, uint64_t, uint64_t, uint64_t)
HR_INT_KERNELS(i64, hr_i64, int64_t, uint64_t, int64_t)

/* Bool: any non-zero byte is true and results are always 0 or 1. */
HR_MAP(b8_and, hr_u8, uint8_t, ID, ID, (uint8_t)((a != 0) & (b != 0)))
HR_MAP(b8_or, hr_u8, uint8_t, ID, ID, (uint8_t)((a | b) != 0))
HR_MAP(b8_xor, hr_u8, uint8_t, ID, ID, (uint8_t)((a != 0) ^ (b != 0)))

/*
 * Min/max propagate NaN like torch.minimum/maximum: if either operand is
 * NaN, the result is NaN. Otherwise, on equal operands (including -0 and +0)
 * the result is a, the dst operand.
 */
#define HR_FMIN(a, b) ((b) != (b) ? (b) : ((b) < (a) ? (b) : (a)))
#define HR_FMAX(a, b) ((b) != (b) ? (b) : ((a) < (b) ? (b) : (a)))

/*
 * Floating point. The 16-bit types compute in float32 and round once on
 * the way back. That is exactly PyTorch's CPU arithmetic on half and
 * bfloat16 tensors.
 */
#define HR_FLOAT_KERNELS(P, ST, CT, LOAD, STORE)           \
	HR_MAP(P##_add, ST, CT, LOAD, STORE, a + b)         \
	HR_MAP(P##_mul, ST, CT, LOAD, STORE, a * b)         \
	HR_DIV(P##_div, ST, CT, LOAD, STORE)

HR_FLOAT_KERNELS(f32, hr_f32, float, ID, ID)
HR_FLOAT_KERNELS(f64, hr_f64, double, ID, ID)
HR_FLOAT_KERNELS(f16, hr_u16, float, f16_to_f32, f32_to_f16)
HR_FLOAT_KERNELS(bf16, hr_u16, float, bf16_to_f32, f32_to_bf16)

HR_MAP(f32_min, hr_f32, float, ID, ID, HR_FMIN(a, b))
HR_MAP(f32_max, hr_f32, float, ID, ID, HR_FMAX(a, b))
HR_MAP(f64_min, hr_f64, double, ID, ID, HR_FMIN(a, b))
HR_MAP(f64_max, hr_f64, double, ID, ID, HR_FMAX(a, b))

/*
 * Min/max of 16-bit floats compare in float32 and then keep one of the two
 * stored 16-bit values unchanged. No rounding is needed: the result is
 * always one of the operands. The selection is the one HR_FMIN/HR_FMAX
 * make: take b if b is NaN or b wins the comparison, otherwise keep a.
 * Written with '|' rather than '||' so the loop has no branches.
 */
#define HR_PICK16(NAME, LOAD, TAKE_B)                                         \
	HR_KERNEL static void NAME(void *restrict dv, const void *restrict sv, \
				   size_t n)                                   \
	{                                                                      \
		hr_u16 *restrict d = (hr_u16 *)dv;                             \
		const hr_u16 *restrict s = (const hr_u16 *)sv;                 \
		for (size_t i = 0; i < n; i++) {                               \
			const uint16_t x = d[i], y = s[i];                     \
			const float a = LOAD(x), b = LOAD(y);                  \
			d[i] = (TAKE_B) ? y : x;                               \
		}                                                              \
	}

HR_PICK16(f16_min, f16_to_f32, (b != b) | (b < a))
HR_PICK16(f16_max, f16_to_f32, (b != b) | (a < b))
HR_PICK16(bf16_min, bf16_to_f32, (b != b) | (b < a))
HR_PICK16(bf16_max, bf16_to_f32, (b != b) | (a < b))

/*
 * float16 with F16C. gcc 12 vectorizes the portable conversions above, but
 * into long permute-heavy code, about 4x slower than bfloat16. On x86-64
 * CPUs with AVX2 and F16C (every x86-64-v3 and v4 CPU), the float16 add,
 * mul, min and max kernels therefore use the hardware conversions instead,
 * picked at run time in hr_reduce. vcvtph2ps is exact. vcvtps2ph with
 * _MM_FROUND_TO_NEAREST_INT rounds to nearest even whatever MXCSR says,
 * with correct subnormals and overflow to Inf, which is the invariant
 * f32_to_f16 documents. The only difference: a NaN keeps its (quieted)
 * payload. Tails shorter than one vector go to the portable kernel.
 */
#ifdef HR_F16C
#define HR_F16C_KERNEL(NAME, TAIL, VEXPR)                                      \
	__attribute__((target("avx2,f16c"))) static void NAME(                  \
		void *restrict dv, const void *restrict sv, size_t n)           \
	{                                                                       \
		hr_u16 *restrict d = (hr_u16 *)dv;                              \
		const hr_u16 *restrict s = (const hr_u16 *)sv;                  \
		size_t i = 0;                                                   \
		for (; i + 8 <= n; i += 8) {                                    \
			const __m256 a = _mm256_cvtph_ps(                        \
				_mm_loadu_si128((const __m128i *)(d + i)));     \
			const __m256 b = _mm256_cvtph_ps(                        \
				_mm_loadu_si128((const __m128i *)(s + i)));     \
			_mm_storeu_si128((__m128i *)(d + i),                    \
					 _mm256_cvtps_ph((VEXPR),               \
							 _MM_FROUND_TO_NEAREST_INT)); \
		}                                                               \
		if (i < n)                                                      \
			TAIL(d + i, s + i, n - i);                              \
	}

/* Same selection as HR_FMIN/HR_FMAX: b if b is NaN or b wins, else a. */
#define HR_V_TAKE_B(a, b, WINS)                                          \
	_mm256_blendv_ps((a), (b),                                      \
			 _mm256_or_ps(_mm256_cmp_ps((b), (b), _CMP_UNORD_Q), \
				      (WINS)))

HR_F16C_KERNEL(f16_add_f16c, f16_add, _mm256_add_ps(a, b))
HR_F16C_KERNEL(f16_mul_f16c, f16_mul, _mm256_mul_ps(a, b))
HR_F16C_KERNEL(f16_min_f16c, f16_min, HR_V_TAKE_B(a, b, _mm256_cmp_ps(b, a, _CMP_LT_OQ)))
HR_F16C_KERNEL(f16_max_f16c, f16_max, HR_V_TAKE_B(a, b, _mm256_cmp_ps(a, b, _CMP_LT_OQ)))

static const hr_binary_fn f16c_kernels[HR_NOPS] = {
	[HR_ADD] = f16_add_f16c, [HR_MUL] = f16_mul_f16c,
	[HR_MIN] = f16_min_f16c, [HR_MAX] = f16_max_f16c,
};

static int have_f16c(void)
{
	__builtin_cpu_init(); /* cheap after the first call */
	return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#endif

/*
 * Complex product, textbook formula as in c10::complex:
 * (a + bi)(c + di) = (ac - bd) + (ad + bc)i, with no FMA (see the pragma at
 * the top of the file). n counts complex elements.
 *
 * The real part is written ac + (-b)d. Negation is exact and rounding is
 * symmetric, so that is bit-identical to ac - bd. It keeps gcc 12's SLP
 * vectorizer from matching the mixed sub/add lanes as an "addsub" and
 * emitting vfmaddsub, which fuses even with contraction off.
 */
#define HR_CMUL(NAME, ST, CT)                                                 \
	HR_KERNEL static void NAME(void *restrict dv, const void *restrict sv, \
				   size_t n)                                   \
	{                                                                      \
		ST *restrict d = (ST *)dv;                                     \
		const ST *restrict s = (const ST *)sv;                         \
		for (size_t i = 0; i < n; i++) {                               \
			const CT ar = d[2 * i], ai = d[2 * i + 1];             \
			const CT br = s[2 * i], bi = s[2 * i + 1];             \
			d[2 * i] = ar * br + (-ai) * bi;                       \
			d[2 * i + 1] = ar * bi + ai * br;                      \
		}                                                              \
	}

HR_CMUL(c64_mul, hr_f32, float)
HR_CMUL(c128_mul, hr_f64, double)

/* Complex sum and division act on the real and imaginary parts independently. */
static void c64_add(void *restrict d, const void *restrict s, size_t n) { f32_add(d, s, 2 * n); }
static void c128_add(void *restrict d, const void *restrict s, size_t n) { f64_add(d, s, 2 * n); }
static void c64_div(void *restrict d, size_t n, int64_t q) { f32_div(d, 2 * n, q); }
static void c128_div(void *restrict d, size_t n, int64_t q) { f64_div(d, 2 * n, q); }

#define HR_INT_ROW(P)                                                      \
	{                                                                  \
		[HR_ADD] = P##_add, [HR_MUL] = P##_mul, [HR_MIN] = P##_min, \
		[HR_MAX] = P##_max, [HR_AND] = P##_and, [HR_OR] = P##_or,   \
		[HR_XOR] = P##_xor,                                         \
	}
#define HR_FLOAT_ROW(P)                                                    \
	{                                                                  \
		[HR_ADD] = P##_add, [HR_MUL] = P##_mul, [HR_MIN] = P##_min, \
		[HR_MAX] = P##_max,                                         \
	}

/* NULL entries have no kernel. */
static const hr_binary_fn binary_kernels[HR_NKINDS][HR_NOPS] = {
	[HR_BOOL] = {[HR_AND] = b8_and, [HR_OR] = b8_or, [HR_XOR] = b8_xor},
	[HR_U8] = HR_INT_ROW(u8),
	[HR_I8] = HR_INT_ROW(i8),
	[HR_U16] = HR_INT_ROW(u16),
	[HR_I16] = HR_INT_ROW(i16),
	[HR_U32] = HR_INT_ROW(u32),
	[HR_I32] = HR_INT_ROW(i32),
	[HR_U64] = HR_INT_ROW(u64),
	[HR_I64] = HR_INT_ROW(i64),
	[HR_F16] = HR_FLOAT_ROW(f16),
	[HR_BF16] = HR_FLOAT_ROW(bf16),
	[HR_F32] = HR_FLOAT_ROW(f32),
	[HR_F64] = HR_FLOAT_ROW(f64),
	[HR_C64] = {[HR_ADD] = c64_add, [HR_MUL] = c64_mul},
	[HR_C128] = {[HR_ADD] = c128_add, [HR_MUL] = c128_mul},
};

static const hr_div_fn div_kernels[HR_NKINDS] = {
	[HR_U8] = u8_div,   [HR_I8] = i8_div,     [HR_U16] = u16_div,
	[HR_I16] = i16_div, [HR_U32] = u32_div,   [HR_I32] = i32_div,
	[HR_U64] = u64_div, [HR_I64] = i64_div,   [HR_F16] = f16_div,
	[HR_BF16] = bf16_div, [HR_F32] = f32_div, [HR_F64] = f64_div,
	[HR_C64] = c64_div, [HR_C128] = c128_div,
};

int hr_has(int kind, int op)
{
	return kind >= 0 && kind < HR_NKINDS && op >= 0 && op < HR_NOPS &&
	       binary_kernels[kind][op] != NULL;
}

int hr_reduce(int kind, int op, void *dst, const void *src, size_t n)
{
	if (!hr_has(kind, op))
		return -1;
#ifdef HR_F16C
	if (kind == HR_F16 && f16c_kernels[op] != NULL && have_f16c()) {
		f16c_kernels[op](dst, src, n);
		return 0;
	}
#endif
	binary_kernels[kind][op](dst, src, n);
	return 0;
}

int hr_div(int kind, void *buf, size_t n, int64_t divisor)
{
	if (kind < 0 || kind >= HR_NKINDS || div_kernels[kind] == NULL || divisor <= 0)
		return -1;
	div_kernels[kind](buf, n, divisor);
	return 0;
}

const char *hr_cpu_level(void)
{
#ifdef HR_CLONED
	/* The same tests the ifunc resolvers of the clones make. */
	__builtin_cpu_init();
	if (__builtin_cpu_supports("x86-64-v4"))
		return "x86-64-v4 (AVX-512; float16 via F16C)";
	if (__builtin_cpu_supports("x86-64-v3"))
		return "x86-64-v3 (AVX2; float16 via F16C)";
	return "x86-64 (SSE2)";
#elif defined(__AVX512F__)
	return "single build (AVX-512)";
#elif defined(__AVX2__)
	return "single build (AVX2)";
#elif defined(__x86_64__)
	return "single build (x86-64 SSE2)";
#else
	return "single build (portable C)";
#endif
}
