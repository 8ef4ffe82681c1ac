// Client-side MoE kernels: the shim (python/gocomm/_kernels.py) loads this module into the
// training process and launches them on the caller's stream with the driver API. No NVSHMEM.
//
// gocomm_moe_wsum_<dtype>: out[r] = sum over j in [offs[r], offs[r+1]) of w[j] * src[idx[j]]
// (w may be null: weight 1), accumulated in float32 in j order and rounded once; a row with
// no terms is zero. Rows are h elements, h * sizeof(dtype) a multiple of 16 and every row
// 16-byte aligned (the shim checks). combine uses it twice: on the expert side (each
// received token's experts, weighted) and on the token side (each token's partial sums from
// the ranks that held its experts).
#include <stdint.h>

#include "float.cuh"


template <typename T>
__device__ __forceinline__ void wsum(T* __restrict__ out, const T* __restrict__ src, const int64_t* __restrict__ idx,
                                     const float* __restrict__ w, const int64_t* __restrict__ offs, int64_t rows,
                                     int64_t h) {
  constexpr int V = 16 / sizeof(T);  // elements per 16-byte vector
  const int64_t hv = h / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t lo = offs[r], hi = offs[r + 1];
    for (int64_t c = threadIdx.x; c < hv; c += blockDim.x) {
      float acc[V];
#pragma unroll
      for (int k = 0; k < V; k++) acc[k] = 0.f;
      for (int64_t j = lo; j < hi; j++) {
        const float wj = w ? w[j] : 1.f;
        const int4 raw = reinterpret_cast<const int4*>(src + idx[j] * h)[c];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < V; k++) acc[k] = fmaf(wj, to_f(e[k]), acc[k]);
      }
      int4 o;
      T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int k = 0; k < V; k++) oe[k] = from_f<T>(acc[k]);
      reinterpret_cast<int4*>(out + r * h)[c] = o;
    }
  }
}

#define WSUM(name, T)                                                                                           \
  extern "C" __global__ void name(T* out, const T* src, const int64_t* idx, const float* w, const int64_t* offs, \
                                  int64_t rows, int64_t h) {                                                    \
    wsum<T>(out, src, idx, w, offs, rows, h);                                                                   \
  }
WSUM(gocomm_moe_wsum_bf16, __nv_bfloat16)
WSUM(gocomm_moe_wsum_f16, __half)
WSUM(gocomm_moe_wsum_f32, float)

// gocomm_moe_route (one block): which ranks each token goes to, and where in the send
// buffer. Token t goes to rank r when one of its k expert ids lies in [r * per, (r+1) * per);
// ids of -1 choose nothing, and so do ids out of range, which also set meta[n + 1] = 1. Rows
// are laid out by rank, tokens ascending within a rank: slot s holds token send_order[s] for
// rank send_rank[s]. meta[0..n) = rows per rank (the send splits), meta[n] = their sum.
// Each rank's rows are counted with a block-wide scan over the tokens, each thread owning a
// contiguous run of them, so the layout is the same every time.
__device__ __forceinline__ bool hits(const int64_t* idx, int64_t t, int k, int64_t lo, int64_t hi) {
  bool hit = false;
  for (int j = 0; j < k; j++) {
    const int64_t e = idx[t * k + j];
    hit |= e >= lo && e < hi;
  }
  return hit;
}

// block_scan: the exclusive prefix sum of v over the block's threads (in thread order), and
// the total in *total; scan holds blockDim.x entries.
__device__ __forceinline__ int64_t block_scan(int64_t v, int64_t* scan, int64_t* total) {
  const int tid = threadIdx.x, nt = blockDim.x;
  scan[tid] = v;
  __syncthreads();
  for (int off = 1; off < nt; off <<= 1) {  // inclusive scan (Hillis-Steele)
    const int64_t u = tid >= off ? scan[tid - off] : 0;
    __syncthreads();
    scan[tid] += u;
    __syncthreads();
  }
  const int64_t ex = scan[tid] - v;
  if (total) *total = scan[nt - 1];
  __syncthreads();
  return ex;
}

// Also the token side of combine's sum: token t's rows are t_idx[t_offs[t] .. t_offs[t+1]),
// by rank (cursor is scratch of tokens entries).
extern "C" __global__ void gocomm_moe_route(const int64_t* __restrict__ idx, int64_t tokens, int k, int64_t experts,
                                            int per, int n, int64_t* __restrict__ meta,
                                            int64_t* __restrict__ send_order, int32_t* __restrict__ send_rank,
                                            int64_t* __restrict__ t_idx, int64_t* __restrict__ t_offs,
                                            int64_t* __restrict__ cursor) {
  __shared__ int64_t scan[1024];
  __shared__ int64_t base, all;
  __shared__ int bad;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t run = (tokens + nt - 1) / nt, t0 = min((int64_t)tid * run, tokens), t1 = min(t0 + run, tokens);
  if (tid == 0) base = 0, bad = 0;
  __syncthreads();
  int64_t pairs = 0;  // (token, rank) pairs of this thread's tokens
  for (int64_t t = t0; t < t1; t++) {
    for (int j = 0; j < k; j++) {
      const int64_t e = idx[t * k + j];
      if (e < -1 || e >= experts) bad = 1;  // benign race: any writer writes 1
    }
    for (int r = 0; r < n; r++) pairs += hits(idx, t, k, (int64_t)r * per, (int64_t)(r + 1) * per);
  }
  int64_t at = block_scan(pairs, scan, &all);
  for (int64_t t = t0; t < t1; t++) {
    t_offs[t] = cursor[t] = at;
    for (int r = 0; r < n; r++) at += hits(idx, t, k, (int64_t)r * per, (int64_t)(r + 1) * per);
  }
  if (tid == 0) t_offs[tokens] = all;
  for (int r = 0; r < n; r++) {
    const int64_t lo = (int64_t)r * per, hi = lo + per;
    int64_t mine = 0;
    for (int64_t t = t0; t < t1; t++) mine += hits(idx, t, k, lo, hi);
    int64_t total;
    int64_t slot = base + block_scan(mine, scan, &total);
    for (int64_t t = t0; t < t1; t++) {
      if (hits(idx, t, k, lo, hi)) {
        send_order[slot] = t, send_rank[slot] = r;
        t_idx[cursor[t]++] = slot++;
      }
    }
    __syncthreads();
    if (tid == 0) {
      meta[r] = total;
      base += total;
    }
    __syncthreads();
  }
  if (tid == 0) meta[n] = base, meta[n + 1] = bad;
}

// gocomm_moe_pack: the send buffer of dispatch, one row per slot of gocomm_moe_route (the
// first meta[n] of cap slots): the token's x row (xbytes), then its k local expert ids on
// that rank (int32, -1 where the expert lives elsewhere) at id_off, then its k weights
// (float32, 0 where -1) at w_off. Rows are row_bytes apart, every part 16-byte aligned.
extern "C" __global__ void gocomm_moe_pack(char* __restrict__ payload, const char* __restrict__ x,
                                           const int64_t* __restrict__ idx, const float* __restrict__ weights,
                                           const int64_t* __restrict__ meta, const int64_t* __restrict__ send_order,
                                           const int32_t* __restrict__ send_rank, int n, int k, int64_t experts,
                                           int per, int64_t xbytes, int64_t id_off, int64_t w_off, int64_t row_bytes) {
  const int64_t total = meta[n];
  for (int64_t s = blockIdx.x; s < total; s += gridDim.x) {
    const int64_t t = send_order[s];
    const int r = send_rank[s];
    char* dst = payload + s * row_bytes;
    const int4* src = reinterpret_cast<const int4*>(x + t * xbytes);
    for (int64_t c = threadIdx.x; c < xbytes / 16; c += blockDim.x) reinterpret_cast<int4*>(dst)[c] = src[c];
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
      const int64_t e = idx[t * k + j];
      const bool mine = e >= (int64_t)r * per && e < (int64_t)(r + 1) * per && e < experts;
      reinterpret_cast<int32_t*>(dst + id_off)[j] = mine ? (int32_t)(e - (int64_t)r * per) : -1;
      reinterpret_cast<float*>(dst + w_off)[j] = mine ? weights[t * k + j] : 0.f;
    }
  }
}

// gocomm_moe_group (one block): dispatch's receive side. The first R = min(sum(out_splits),
// cap_rows) rows of recv (packed as gocomm_moe_pack packs) hold tokens with their local
// expert ids (int32 at id_off, -1 for none) and weights (float32 at w_off). Each (row, id)
// pair gets a place in the output grouped by expert, rows ascending within an expert:
// rows_sorted[p] and w_sorted[p] are its row and weight, tpe[e] counts expert e's pairs.
// For combine: row r's pairs are at e_idx[e_offs[r] .. e_offs[r+1]) (ids in slot order).
// gmeta = {pairs, R}. Each thread owns a run of rows and counts its pairs per expert in a
// column of hist (shared, per x blockDim.x int32); one scan over hist in (expert, thread)
// order gives every pair its place, the same every time.
extern "C" __global__ void gocomm_moe_group(const char* __restrict__ recv, int64_t row_bytes, int64_t id_off,
                                            int64_t w_off, int k, int per, const int64_t* __restrict__ out_splits,
                                            int n, int64_t cap_rows, int64_t* __restrict__ rows_sorted,
                                            float* __restrict__ w_sorted, int64_t* __restrict__ tpe,
                                            int64_t* __restrict__ e_idx, int64_t* __restrict__ e_offs,
                                            int64_t* __restrict__ gmeta) {
  extern __shared__ int32_t hist[];  // [per][nt]
  __shared__ int64_t scan[1024];
  __shared__ int64_t rows, pairs;
  const int tid = threadIdx.x, nt = blockDim.x;
  if (tid == 0) {
    int64_t r = 0;
    for (int s = 0; s < n; s++) r += out_splits[s];
    rows = min(r, cap_rows);
  }
  __syncthreads();
  const int64_t R = rows;
  const int64_t run = (R + nt - 1) / nt, r0 = min((int64_t)tid * run, R), r1 = min(r0 + run, R);
  for (int e = 0; e < per; e++) hist[e * nt + tid] = 0;
  int64_t mine = 0;
  for (int64_t r = r0; r < r1; r++) {
    const int32_t* ids = reinterpret_cast<const int32_t*>(recv + r * row_bytes + id_off);
    for (int j = 0; j < k; j++) {
      const int32_t e = ids[j];
      if (e >= 0 && e < per) hist[e * nt + tid]++, mine++;
    }
  }
  __syncthreads();
  // exclusive scan of hist in (expert, thread) order: thread tid owns entries [tid*per, tid*per+per)
  int64_t chunk = 0;
  for (int i = 0; i < per; i++) chunk += hist[tid * per + i];
  int64_t total;
  int64_t at = block_scan(chunk, scan, &total);
  for (int i = 0; i < per; i++) {
    const int32_t c = hist[tid * per + i];
    hist[tid * per + i] = (int32_t)at;
    at += c;
  }
  if (tid == 0) pairs = total;
  __syncthreads();
  for (int e = tid; e < per; e += nt) tpe[e] = (e + 1 < per ? hist[(e + 1) * nt] : pairs) - hist[e * nt];
  int64_t base = block_scan(mine, scan, nullptr);  // this thread's first pair in row order
  for (int64_t r = r0; r < r1; r++) {
    const char* row = recv + r * row_bytes;
    const int32_t* ids = reinterpret_cast<const int32_t*>(row + id_off);
    const float* ws = reinterpret_cast<const float*>(row + w_off);
    e_offs[r] = base;
    for (int j = 0; j < k; j++) {
      const int32_t e = ids[j];
      if (e >= 0 && e < per) {
        const int32_t p = hist[e * nt + tid]++;
        rows_sorted[p] = r, w_sorted[p] = ws[j], e_idx[base++] = p;
      }
    }
  }
  if (tid == 0) e_offs[R] = pairs, gmeta[0] = pairs, gmeta[1] = R;
}
