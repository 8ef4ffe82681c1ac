// What the shim's and the sidecar's kernels share for talking to other GPUs: the global
// clock for deadlines, system-scope release/acquire on 64-bit signal words, the all-to-all
// kernels' check of their splits, and a block-wide copy that may write into a peer's memory.
#pragma once
#include <stdint.h>

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A signal another GPU reads: what this thread wrote before is visible to whoever acquires v.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// split_at is split j of an int32 (i32) or int64 array of splits.
__device__ __forceinline__ int64_t split_at(uint64_t splits, int j, bool i32) {
  return i32 ? (int64_t) reinterpret_cast<const int32_t*>(splits)[j] : reinterpret_cast<const int64_t*>(splits)[j];
}

// splits_valid: whether n splits are each >= 0 and add up to at most rows (the all-to-all
// kernels never trust splits that are not: they publish zeros and send nothing).
__device__ __forceinline__ bool splits_valid(uint64_t splits, int n, bool i32, int64_t rows) {
  int64_t sum = 0;
  for (int j = 0; j < n; j++) {
    const int64_t s = split_at(splits, j, i32);
    if (s < 0 || s > rows) return false;  // capped before summing: no overflow
    sum += s;
  }
  return sum <= rows;
}

// block_copy copies bytes from src to dst with the whole block: 16 bytes per load and store,
// four loads in flight per thread, where both ends are 16-byte aligned; byte by byte for the
// rest. dst may be a peer's memory (an NVLink mapping): stores post, where loads would wait
// a round trip, so the copy is pushed, never pulled, across GPUs.
__device__ __forceinline__ void block_copy(char* __restrict__ dst, const char* __restrict__ src, int64_t bytes) {
  int64_t done = 0;
  if (((((uintptr_t)dst) | ((uintptr_t)src)) & 15) == 0) {
    const int64_t vec = bytes >> 4;
    int4* d = reinterpret_cast<int4*>(dst);
    const int4* s = reinterpret_cast<const int4*>(src);
    const int64_t step = (int64_t)blockDim.x * 4;
    int64_t i = threadIdx.x;
    for (; i + 3 * blockDim.x < vec; i += step) {
      int4 a = s[i], b = s[i + blockDim.x], c = s[i + 2 * blockDim.x], e = s[i + 3 * blockDim.x];
      d[i] = a, d[i + blockDim.x] = b, d[i + 2 * blockDim.x] = c, d[i + 3 * blockDim.x] = e;
    }
    for (; i < vec; i += blockDim.x) d[i] = s[i];
    done = vec << 4;
  }
  for (int64_t k = done + threadIdx.x; k < bytes; k += blockDim.x) dst[k] = src[k];
}
