/*
 * Elementwise reduction kernels for gocomm's CPU collectives.
 *
 * Every kernel computes dst[i] = dst[i] op src[i] for i < n, where n counts
 * elements (not bytes). dst and src must not overlap; the Go wrapper makes a
 * copy of src when they do. Pointers are only used for the duration of the
 * call and never retained. Neither pointer needs any alignment.
 */
#ifndef GOCOMM_HOSTREDUCE_H
#define GOCOMM_HOSTREDUCE_H

#include <stddef.h>
#include <stdint.h>

/* Element layouts. The Go package mirrors these as hostreduce.Kind. */
enum hr_kind {
	HR_BOOL, /* 1 byte, any non-zero byte is true; results are 0 or 1 */
	HR_U8,
	HR_I8,
	HR_U16,
	HR_I16,
	HR_U32,
	HR_I32,
	HR_U64,
	HR_I64,
	HR_F16,  /* IEEE binary16 */
	HR_BF16, /* bfloat16: the top 16 bits of a binary32 */
	HR_F32,
	HR_F64,
	HR_C64,  /* (float re, float im) */
	HR_C128, /* (double re, double im) */
	HR_NKINDS
};

/* Binary operations. The Go package mirrors these as hostreduce.Op. */
enum hr_op {
	HR_ADD,
	HR_MUL,
	HR_MIN,
	HR_MAX,
	HR_AND,
	HR_OR,
	HR_XOR,
	HR_NOPS
};

/* dst[i] = dst[i] op src[i]. Returns 0, or -1 if there is no such kernel. */
int hr_reduce(int kind, int op, void *dst, const void *src, size_t n);

/*
 * buf[i] = buf[i] / divisor, divisor > 0. Integers use C division
 * (truncation toward zero), floating types divide in their compute type
 * (float for float16/bfloat16) and complex types divide both parts.
 * Returns 0, or -1 if kind has no division kernel.
 */
int hr_div(int kind, void *buf, size_t n, int64_t divisor);

/* 1 if hr_reduce has a kernel for (kind, op), else 0. */
int hr_has(int kind, int op);

/* The instruction-set level the kernels dispatch to on this CPU. */
const char *hr_cpu_level(void);

#endif
