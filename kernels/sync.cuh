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

// Whether a wait gives up: its deadline passed, or the host set the u32 word at err (pinned,
// host-mapped: the shim sets it when the sidecar reports the group broken, e.g. a peer
// died, so kernels waiting for that peer stop within microseconds instead of at the
// group's timeout). Call it every few hundred spins: the word lies across PCIe.
__device__ __forceinline__ bool give_up(uint64_t deadline, uint64_t err) {
  return now_ns() > deadline || *reinterpret_cast<const volatile uint32_t*>(err) != 0;
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

// Loads in flight per thread in block_copy (16 bytes each).
#ifndef GOCOMM_COPY_UNROLL
#define GOCOMM_COPY_UNROLL 4
#endif

// A 16-byte load of memory no one writes while the kernel runs (the read-only data path).
__device__ __forceinline__ int4 ld_nc(const int4* p) {
#if GOCOMM_COPY_NC
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return *p;
#endif
}

// block_copy copies bytes from src to dst with the whole block: 16 bytes per load and store,
// GOCOMM_COPY_UNROLL loads in flight per thread (the last round too, predicated), where both
// ends are 16-byte aligned; byte by byte for the rest. dst may be a peer's memory (an NVLink
// mapping): stores post, where loads would wait a round trip, so the copy is pushed, never
// pulled, across GPUs.
__device__ __forceinline__ void block_copy(char* __restrict__ dst, const char* __restrict__ src, int64_t bytes) {
  constexpr int U = GOCOMM_COPY_UNROLL;
  int64_t done = 0;
  if (((((uintptr_t)dst) | ((uintptr_t)src)) & 15) == 0) {
    const int64_t vec = bytes >> 4, bd = blockDim.x;
    int4* d = reinterpret_cast<int4*>(dst);
    const int4* s = reinterpret_cast<const int4*>(src);
    int64_t i = threadIdx.x;
    for (; i + (U - 1) * bd < vec; i += U * bd) {
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; u++) v[u] = ld_nc(s + i + u * bd);
#pragma unroll
      for (int u = 0; u < U; u++) d[i + u * bd] = v[u];
    }
    if (i < vec) {  // fewer than U left for this thread: one more round, all loads first
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; u++)
        if (i + u * bd < vec) v[u] = ld_nc(s + i + u * bd);
#pragma unroll
      for (int u = 0; u < U; u++)
        if (i + u * bd < vec) d[i + u * bd] = v[u];
    }
    done = vec << 4;
  }
  for (int64_t k = done + threadIdx.x; k < bytes; k += blockDim.x) dst[k] = src[k];
}
