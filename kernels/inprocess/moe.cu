// Client-side MoE kernels: the compiled client (csrc/client/inprocess.cc; the launch shapes
// are python/gocomm/_kernels.py's) loads this module into the training process and launches
// them on the caller's stream with the driver API. No NVSHMEM.
//
// gocomm_moe_wsum_<dtype>: out[r] = sum over j in [offs[r], offs[r+1]) of w[j] * src[idx[j]]
// (w may be null: weight 1), accumulated in float32 in j order and rounded once; a row with
// no terms is zero. Rows r < rows, and r < *nrows where nrows is not null (a count the GPU
// made: the host need not learn it). Rows are h elements, h * sizeof(dtype) a multiple of 16 and every row
// 16-byte aligned (the shim checks). combine uses it twice: on the expert side (each
// received token's experts, weighted) and on the token side (each token's partial sums from
// the ranks that held its experts).
#include <stdint.h>

#include "float.cuh"
#include "sync.cuh"


// wsum_vec: 16-byte vector c of the sum over j in [lo, hi) of weight(j) * row(j)[c], in
// float32 in j order, rounded once to T (a row of no terms is zero). row(j) is the address of
// term j's row, weight(j) its weight.
template <typename T, typename Row, typename Weight>
__device__ __forceinline__ int4 wsum_vec(int64_t lo, int64_t hi, int64_t c, Row row, Weight weight) {
  constexpr int V = 16 / sizeof(T);  // elements per 16-byte vector
  float acc[V];
#pragma unroll
  for (int u = 0; u < V; u++) acc[u] = 0.f;
  for (int64_t j = lo; j < hi; j++) {
    const float wj = weight(j);
    const int4 raw = reinterpret_cast<const int4*>(row(j))[c];
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int u = 0; u < V; u++) acc[u] = fmaf(wj, to_f(e[u]), acc[u]);
  }
  int4 o;
  T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
  for (int u = 0; u < V; u++) oe[u] = from_f<T>(acc[u]);
  return o;
}

template <typename T>
__device__ __forceinline__ void wsum(T* __restrict__ out, const T* __restrict__ src, const int64_t* __restrict__ idx,
                                     const float* __restrict__ w, const int64_t* __restrict__ offs, int64_t rows,
                                     const int64_t* __restrict__ nrows, int64_t h) {
  const int64_t hv = h / (16 / sizeof(T));
  if (nrows) rows = min(rows, *nrows);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t lo = offs[r], hi = offs[r + 1];
    for (int64_t c = threadIdx.x; c < hv; c += blockDim.x)
      reinterpret_cast<int4*>(out + r * h)[c] = wsum_vec<T>(
          lo, hi, c, [&](int64_t j) { return src + idx[j] * h; }, [&](int64_t j) { return w ? w[j] : 1.f; });
  }
}

#define WSUM(name, T)                                                                                           \
  extern "C" __global__ void name(T* out, const T* src, const int64_t* idx, const float* w, const int64_t* offs, \
                                  int64_t rows, const int64_t* nrows, int64_t h) {                              \
    wsum<T>(out, src, idx, w, offs, rows, nrows, h);                                                            \
  }
WSUM(gocomm_moe_wsum_bf16, __nv_bfloat16)
WSUM(gocomm_moe_wsum_f16, __half)
WSUM(gocomm_moe_wsum_f32, float)

// block_scan: the exclusive prefix sum of v over the block's threads (in thread order), and
// the total in *total; scan holds 32 entries, and blockDim.x is a multiple of 32. Warp shuffles, then one warp over the warps'
// sums: three block barriers a scan (a Hillis-Steele scan over 1024 threads took twenty, and
// the routing kernel's scans were most of its time).
__device__ __forceinline__ int64_t block_scan(int64_t v, int64_t* scan, int64_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  int64_t x = v;  // inclusive within the warp
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += u;
  }
  if (lane == 31) scan[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t y = lane < warps ? scan[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, y, off);
      if (lane >= off) y += u;
    }
    scan[lane] = y;  // inclusive over warps
  }
  __syncthreads();
  const int64_t ex = (warp ? scan[warp - 1] : 0) + x - v;
  if (total) *total = scan[warps - 1];
  __syncthreads();
  return ex;
}

// gocomm_moe_route_count, then gocomm_moe_route_place, same grid and block (a thread per
// token, blockDim.x tokens per block): which ranks each token goes to, and where in the send
// buffer. Token t goes to rank r when one of its k expert ids lies in [r * per, (r+1) * per);
// ids of -1 choose nothing, and so do ids out of range, which also set meta[n + 1] = 1 (and
// count in flag[0], host memory the GPU writes, where flag is not null: dispatch without a
// host sync reports it later; the host only reads it). n is at most 8 (a byte of mask). Rows are laid out by rank, tokens ascending within a rank: slot s
// holds token send_order[s] for rank send_rank[s]. meta[0..n) = rows per rank (the send
// splits), meta[n] = their sum. Also the token side of combine's sum: token t's rows are
// t_idx[t_offs[t] .. t_offs[t+1]), by rank. The first pass leaves each token's ranks as a
// bit mask (mask, a byte per token) and each block's counts (bcount [blocks][n + 2]: rows
// per rank, their sum, whether an id was bad); the second places the tokens from them, so
// the layout is the same every time, and neither waits on another block.
//
// Both take the block's place b among blocks (blockIdx.x and gridDim.x but where a fused kernel
// runs them as one block of its own); route_place writes what routing writes only where meta
// is not null, and each slot's token and rank as t << 3 | r into table where that is not null.
__device__ __forceinline__ void route_count(const int64_t* __restrict__ idx, int64_t tokens, int k, int64_t experts,
                                            int per, int n, uint8_t* __restrict__ mask, int64_t* __restrict__ bcount,
                                            int b) {
  const int64_t t = (int64_t)b * blockDim.x + threadIdx.x;
  uint32_t m = 0;
  int bad = 0;
  if (t < tokens) {
    for (int j = 0; j < k; j++) {
      const int64_t e = idx[t * k + j];
      if (e < -1 || e >= experts)
        bad = 1;
      else if (e >= 0)
        m |= 1u << (int)(e / per);
    }
    mask[t] = (uint8_t)m;
  }
  int64_t* mine = bcount + (int64_t)b * (n + 2);
  int64_t sum = 0;
  for (int r = 0; r < n; r++) {
    const int c = __syncthreads_count((m >> r) & 1);
    sum += c;
    if (threadIdx.x == 0) mine[r] = c;
  }
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) mine[n] = sum, mine[n + 1] = bad;
}

__device__ __forceinline__ void route_place(int64_t tokens, int n, const uint8_t* __restrict__ mask,
                                            const int64_t* __restrict__ bcount, int64_t* __restrict__ meta,
                                            int64_t* __restrict__ send_order, int32_t* __restrict__ send_rank,
                                            int64_t* __restrict__ t_idx, int64_t* __restrict__ t_offs,
                                            volatile uint32_t* flag, int b, int blocks, uint16_t* table) {
  __shared__ int64_t scan[32];
  __shared__ int64_t base[8], tbase;  // the first slot of this block's rows per rank; its first pair
  const int w = n + 2;
  if (threadIdx.x < n) {  // rank r's slots start after every rank before r, then the blocks before this one
    const int r = threadIdx.x;
    int64_t at = 0;
    for (int q = 0; q < blocks; q++) {
      for (int rr = 0; rr < r; rr++) at += bcount[q * w + rr];
      if (q < b) at += bcount[q * w + r];
    }
    base[r] = at;
  }
  if (threadIdx.x == 0) {
    int64_t at = 0;  // this block's first pair
    for (int q = 0; q < b; q++) at += bcount[q * w + n];
    tbase = at;
    if (b == 0 && meta) {
      int64_t all = 0, bad = 0;
      for (int q = 0; q < blocks; q++) all += bcount[q * w + n], bad |= bcount[q * w + n + 1];
      for (int r = 0; r < n; r++) {
        int64_t c = 0;
        for (int q = 0; q < blocks; q++) c += bcount[q * w + r];
        meta[r] = c;
      }
      meta[n] = all, meta[n + 1] = bad;
      t_offs[tokens] = all;
      if (bad && flag) flag[0] = flag[0] + 1, __threadfence_system();  // the host reads it
    }
  }
  __syncthreads();
  const int64_t t = (int64_t)b * blockDim.x + threadIdx.x;
  const uint32_t m = t < tokens ? mask[t] : 0;
  const int64_t toff = tbase + block_scan(__popc(m), scan, nullptr);
  if (t < tokens && meta) t_offs[t] = toff;
  int j = 0;
  for (int r = 0; r < n; r++) {
    const int hit = (m >> r) & 1;
    const int64_t slot = base[r] + block_scan(hit, scan, nullptr);
    if (hit && meta) {
      send_order[slot] = t, send_rank[slot] = r;
      t_idx[toff + j++] = slot;
    }
    if (hit && table) table[slot] = (uint16_t)(t << 3 | r);
  }
}

extern "C" __global__ void gocomm_moe_route_count(const int64_t* __restrict__ idx, int64_t tokens, int k,
                                                  int64_t experts, int per, int n, uint8_t* __restrict__ mask,
                                                  int64_t* __restrict__ bcount) {
  route_count(idx, tokens, k, experts, per, n, mask, bcount, blockIdx.x);
}

extern "C" __global__ void gocomm_moe_route_place(int64_t tokens, int n, const uint8_t* __restrict__ mask,
                                                  const int64_t* __restrict__ bcount, int64_t* __restrict__ meta,
                                                  int64_t* __restrict__ send_order, int32_t* __restrict__ send_rank,
                                                  int64_t* __restrict__ t_idx, int64_t* __restrict__ t_offs,
                                                  volatile uint32_t* flag) {
  route_place(tokens, n, mask, bcount, meta, send_order, send_rank, t_idx, t_offs, flag, blockIdx.x, gridDim.x,
              nullptr);
}

// gocomm_moe_route: both passes in one block (tokens <= blockDim.x: decode), one launch
// less; the block's own writes are visible to it after the barrier.
extern "C" __global__ void gocomm_moe_route(const int64_t* __restrict__ idx, int64_t tokens, int k, int64_t experts,
                                            int per, int n, uint8_t* __restrict__ mask, int64_t* __restrict__ bcount,
                                            int64_t* __restrict__ meta, int64_t* __restrict__ send_order,
                                            int32_t* __restrict__ send_rank, int64_t* __restrict__ t_idx,
                                            int64_t* __restrict__ t_offs, volatile uint32_t* flag) {
  route_count(idx, tokens, k, experts, per, n, mask, bcount, 0);
  __syncthreads();
  route_place(tokens, n, mask, bcount, meta, send_order, send_rank, t_idx, t_offs, flag, 0, 1, nullptr);
}

// gocomm_moe_pack: the send buffer of dispatch, one row per slot of gocomm_moe_route (the
// first meta[n] of cap slots): the token's x row (xbytes), then its k local expert ids on
// that rank (int32, -1 where the expert lives elsewhere) at id_off, then its k weights
// (float32, 0 where -1) at w_off. Rows are row_bytes apart, every part 16-byte aligned.
// copy_row: v 16-byte vectors from src to dst by the block, four in flight a thread (so that
// a block of a few warps, or one block an SM of the route_pack grid, still keeps the memory busy).
__device__ __forceinline__ void copy_row(int4* __restrict__ d, const int4* __restrict__ s, int64_t v) {
  const int64_t nt = blockDim.x;
  for (int64_t c = threadIdx.x; c < v; c += 4 * nt) {
    int4 a[4];
#pragma unroll
    for (int u = 0; u < 4; u++)
      if (c + u * nt < v) a[u] = s[c + u * nt];
#pragma unroll
    for (int u = 0; u < 4; u++)
      if (c + u * nt < v) d[c + u * nt] = a[u];
  }
}

__device__ __forceinline__ void pack_row(char* __restrict__ dst, const char* __restrict__ x,
                                         const int64_t* __restrict__ idx, const float* __restrict__ weights,
                                         int64_t t, int r, int k, int64_t experts, int per, int64_t xbytes,
                                         int64_t id_off, int64_t w_off) {
  copy_row(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(x + t * xbytes), xbytes / 16);
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int64_t e = idx[t * k + j];
    const bool mine = e >= (int64_t)r * per && e < (int64_t)(r + 1) * per && e < experts;
    reinterpret_cast<int32_t*>(dst + id_off)[j] = mine ? (int32_t)(e - (int64_t)r * per) : -1;
    reinterpret_cast<float*>(dst + w_off)[j] = mine ? weights[t * k + j] : 0.f;
  }
}

extern "C" __global__ void gocomm_moe_pack(char* __restrict__ payload, const char* __restrict__ x,
                                           const int64_t* __restrict__ idx, const float* __restrict__ weights,
                                           const int64_t* __restrict__ meta, const int64_t* __restrict__ send_order,
                                           const int32_t* __restrict__ send_rank, int n, int k, int64_t experts,
                                           int per, int64_t xbytes, int64_t id_off, int64_t w_off, int64_t row_bytes) {
  const int64_t total = meta[n];
  for (int64_t s = blockIdx.x; s < total; s += gridDim.x)
    pack_row(payload + s * row_bytes, x, idx, weights, send_order[s], send_rank[s], k, experts, per, xbytes, id_off,
             w_off);
}

// gocomm_moe_route_pack: gocomm_moe_route, then gocomm_moe_pack, in one launch (the in-process
// dispatch's first kernel). Where routed is 0 (tokens <= kRoutePackTokens, at most
// blockDim.x), every block routes every token by itself, as one logical block with its masks
// and counts in shared memory, block 0 alone writing what routing writes (and the flag); each
// slot's token and rank land in the block's table, and the block packs slots blockIdx.x,
// + gridDim.x, ... from it. No block waits for another: a block routes in about the time it
// would wait for one routing block, and no word needs zeroing between launches (no kernel of
// the dispatch precedes this one to zero it, and words kept across dispatches would be shared
// by dispatches on concurrent streams). Where routed is 1 (more tokens:
// gocomm_moe_route_count and _place ran before it) it packs as gocomm_moe_pack does. Block 0
// also zeroes sync (kSyncWords words in the dispatch's own workspace, which
// gocomm_moe_group_gather of the same dispatch counts in: queued after this kernel on the same
// stream, and no other kernel knows the workspace).
// (both as csrc/client/moe_kernels.h has them)
constexpr int kRoutePackTokens = 1024;  // the most tokens one block routes (a thread a token)
constexpr int kSyncWords = 4;           // gocomm_moe_group_gather's ticket and its two done counts
extern "C" __global__ void gocomm_moe_route_pack(char* __restrict__ payload, const char* __restrict__ x,
                                                 const int64_t* __restrict__ idx, const float* __restrict__ weights,
                                                 int64_t tokens, int k, int64_t experts, int per, int n,
                                                 int64_t* __restrict__ meta, int64_t* __restrict__ send_order,
                                                 int32_t* __restrict__ send_rank, int64_t* __restrict__ t_idx,
                                                 int64_t* __restrict__ t_offs, volatile uint32_t* flag, int routed,
                                                 int64_t xbytes, int64_t id_off, int64_t w_off, int64_t row_bytes,
                                                 uint32_t* sync) {
  __shared__ uint8_t mask[kRoutePackTokens];
  __shared__ int64_t bcount[8 + 2];
  __shared__ uint16_t table[kRoutePackTokens * 8];  // slot -> t << 3 | r
  if (blockIdx.x == 0 && threadIdx.x < kSyncWords && sync) sync[threadIdx.x] = 0;
  if (routed) {
    const int64_t total = meta[n];
    for (int64_t s = blockIdx.x; s < total; s += gridDim.x)
      pack_row(payload + s * row_bytes, x, idx, weights, send_order[s], send_rank[s], k, experts, per, xbytes,
               id_off, w_off);
    return;
  }
  route_count(idx, tokens, k, experts, per, n, mask, bcount, 0);
  __syncthreads();
  route_place(tokens, n, mask, bcount, blockIdx.x == 0 ? meta : nullptr, send_order, send_rank, t_idx, t_offs, flag,
              0, 1, table);
  __syncthreads();
  const int64_t total = bcount[n];
  for (int64_t s = blockIdx.x; s < total; s += gridDim.x) {
    const uint16_t e = table[s];
    pack_row(payload + s * row_bytes, x, idx, weights, e >> 3, e & 7, k, experts, per, xbytes, id_off, w_off);
  }
}

// gocomm_moe_group_count, then gocomm_moe_group_place, same grid and block: dispatch's
// receive side. The first R = sum(out_splits) rows of recv (packed as gocomm_moe_pack packs)
// hold tokens with their local expert ids (int32 at id_off, -1 for none) and weights (float32
// at w_off); R = 0 where that passes cap_rows (the exchange overflowed and wrote nothing:
// counted in flag[1], where flag is not null). Each (row, id) pair gets a place in the output
// grouped by expert, rows ascending within an expert: rows_sorted[p] and w_sorted[p] are its
// row and weight, tpe[e] counts expert e's pairs. For combine: row r's pairs are at
// e_idx[e_offs[r] .. e_offs[r+1]) (ids in slot order), with their weights at w_e[e_offs[r] ..].
// gmeta = {pairs, R}; back[s] = out_splits[s], or 0 where the exchange overflowed (what
// combine sends back to each rank). Each block takes a run of the rows, each of its threads a run of
// those; a thread counts its pairs per expert in hist (shared, [per][blockDim.x + 1] int32). The
// first pass leaves each block's counts per expert and its pairs in bhist [blocks][per + 1];
// the second gives every pair its place from them and a scan of each expert's counts over
// the block's threads, the same every time.
__device__ __forceinline__ int64_t group_rows(const int64_t* out_splits, int n, int64_t cap_rows) {
  int64_t r = 0;
  for (int s = 0; s < n; s++) r += out_splits[s];
  return r <= cap_rows ? r : 0;
}

// count_pairs: this thread's rows [*r0, *r1) of block b's run of R rows (of blocks runs),
// counted per expert into its hist column; returns its pairs. The grouping functions take the
// block's place b among blocks as route_count does (blockIdx.x and gridDim.x in their own
// kernels).
__device__ __forceinline__ int64_t count_pairs(const char* recv, int64_t row_bytes, int64_t id_off, int k, int per,
                                               int64_t R, int32_t* hist, int64_t* r0, int64_t* r1, int b,
                                               int blocks) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t rpb = (R + blocks - 1) / blocks;
  const int64_t lo = min((int64_t)b * rpb, R), hi = min(lo + rpb, R);
  const int64_t run = (hi - lo + nt - 1) / nt;
  *r0 = min(lo + tid * run, hi), *r1 = min(*r0 + run, hi);
  for (int e = 0; e < per; e++) hist[e * (nt + 1) + tid] = 0;
  int64_t mine = 0;
  for (int64_t r = *r0; r < *r1; r++) {
    const int32_t* ids = reinterpret_cast<const int32_t*>(recv + r * row_bytes + id_off);
    for (int j = 0; j < k; j++) {
      const int32_t e = ids[j];
      if (e >= 0 && e < per) hist[e * (nt + 1) + tid]++, mine++;
    }
  }
  __syncthreads();
  return mine;
}

// scan_columns: each expert's counts (hist[e * P + t], t < blockDim.x, P = blockDim.x + 1)
// become their exclusive prefix over t, by a thread per expert; column e's total goes to
// tot[e] where tot is not null. The pitch of one word more than the block keeps both this
// (threads on consecutive experts) and the counting (threads on consecutive t) free of
// shared-memory bank conflicts; a warp per expert took 16 us at 128 experts on 64 threads.
__device__ __forceinline__ void scan_columns(int32_t* hist, int per, int64_t* tot) {
  const int nt = blockDim.x, P = nt + 1;
  for (int e = threadIdx.x; e < per; e += nt) {
    int32_t acc = 0;
    int32_t* col = hist + e * P;
    for (int t = 0; t < nt; t++) {
      const int32_t v = col[t];
      col[t] = acc;
      acc += v;
    }
    if (tot) tot[e] = acc;
  }
  __syncthreads();
}

__device__ __forceinline__ void group_count(const char* __restrict__ recv, int64_t row_bytes, int64_t id_off, int k,
                                            int per, const int64_t* __restrict__ out_splits, int n, int64_t cap_rows,
                                            int64_t* __restrict__ bhist, int32_t* hist, int b, int blocks) {
  __shared__ int64_t scan[32];
  int64_t r0, r1, total;
  const int64_t R = group_rows(out_splits, n, cap_rows);
  const int64_t mine = count_pairs(recv, row_bytes, id_off, k, per, R, hist, &r0, &r1, b, blocks);
  int64_t* out = bhist + (int64_t)b * (per + 1);
  scan_columns(hist, per, out);
  block_scan(mine, scan, &total);
  if (threadIdx.x == 0) out[per] = total;
}

__device__ __forceinline__ void group_place(const char* __restrict__ recv, int64_t row_bytes, int64_t id_off,
                                            int64_t w_off, int k, int per, const int64_t* __restrict__ out_splits,
                                            int n, int64_t cap_rows, const int64_t* bhist,
                                            int64_t* __restrict__ rows_sorted, float* __restrict__ w_sorted,
                                            int64_t* __restrict__ tpe, int64_t* __restrict__ e_idx,
                                            float* __restrict__ w_e, int64_t* __restrict__ e_offs,
                                            int64_t* __restrict__ gmeta, int64_t* __restrict__ back,
                                            volatile uint32_t* flag, int64_t* adj, int32_t* hist, int b,
                                            int blocks) {
  __shared__ int64_t scan[32];
  __shared__ int64_t pb;
  const int tid = threadIdx.x, nt = blockDim.x, w = per + 1;
  const int64_t R = group_rows(out_splits, n, cap_rows);
  // 1. Where each expert's pairs of this block start: after every expert before it (all
  //    blocks), then the blocks before this one. Thread tid owns a run of the experts.
  const int ce = (per + nt - 1) / nt, e0 = min(tid * ce, per), e1 = min(e0 + ce, per);
  int64_t mysum = 0, pairs;
  for (int e = e0; e < e1; e++) {
    int64_t tot = 0;
    for (int q = 0; q < blocks; q++) tot += __ldcg(bhist + q * w + e);  // L2: in a fused kernel another block wrote it
    adj[e] = tot, mysum += tot;
  }
  int64_t ex = block_scan(mysum, scan, &pairs);
  for (int e = e0; e < e1; e++) {
    const int64_t tot = adj[e];
    int64_t before = 0;
    for (int q = 0; q < b; q++) before += __ldcg(bhist + q * w + e);
    if (b == 0) tpe[e] = tot;
    adj[e] = ex + before, ex += tot;
  }
  if (tid == 0) {
    int64_t at = 0;
    for (int q = 0; q < b; q++) at += __ldcg(bhist + q * w + per);
    pb = at;
    if (b == 0) {
      gmeta[0] = pairs, gmeta[1] = R, e_offs[R] = pairs;
      if (back)
        for (int s = 0; s < n; s++) back[s] = R ? out_splits[s] : 0;
      if (flag && group_rows(out_splits, n, INT64_MAX) > cap_rows) flag[1] = flag[1] + 1, __threadfence_system();
    }
  }
  // 2. This block's pairs: counted again, then each expert's column scanned over the
  //    threads, so a thread's pairs of expert e go after the block's pairs of e before it.
  int64_t r0, r1;
  const int64_t mine = count_pairs(recv, row_bytes, id_off, k, per, R, hist, &r0, &r1, b, blocks);
  scan_columns(hist, per, nullptr);
  int64_t base = pb + block_scan(mine, scan, nullptr);  // this thread's first pair in row order
  for (int64_t r = r0; r < r1; r++) {
    const char* row = recv + r * row_bytes;
    const int32_t* ids = reinterpret_cast<const int32_t*>(row + id_off);
    const float* ws = reinterpret_cast<const float*>(row + w_off);
    e_offs[r] = base;
    for (int j = 0; j < k; j++) {
      const int32_t e = ids[j];
      if (e >= 0 && e < per) {
        const int64_t p = hist[e * (nt + 1) + tid]++ + adj[e];
        rows_sorted[p] = r, w_sorted[p] = ws[j], e_idx[base] = p;
        if (w_e) w_e[base] = ws[j];
        base++;
      }
    }
  }
}

extern "C" __global__ void gocomm_moe_group_count(const char* __restrict__ recv, int64_t row_bytes, int64_t id_off,
                                                  int k, int per, const int64_t* __restrict__ out_splits, int n,
                                                  int64_t cap_rows, int64_t* __restrict__ bhist) {
  extern __shared__ int32_t hist[];  // [per][blockDim.x + 1]
  group_count(recv, row_bytes, id_off, k, per, out_splits, n, cap_rows, bhist, hist, blockIdx.x, gridDim.x);
}

#define GROUP_PLACE_ARGS                                                                                            \
  const char *__restrict__ recv, int64_t row_bytes, int64_t id_off, int64_t w_off, int k, int per,                 \
      const int64_t *__restrict__ out_splits, int n, int64_t cap_rows, int64_t *__restrict__ bhist,                \
      int64_t *__restrict__ rows_sorted, float *__restrict__ w_sorted, int64_t *__restrict__ tpe,                  \
      int64_t *__restrict__ e_idx, float *__restrict__ w_e, int64_t *__restrict__ e_offs,                          \
      int64_t *__restrict__ gmeta, int64_t *__restrict__ back, volatile uint32_t *flag

extern "C" __global__ void gocomm_moe_group_place(GROUP_PLACE_ARGS) {
  extern __shared__ int64_t dyn[];  // adj [per] int64, then hist [per][blockDim.x + 1] int32
  group_place(recv, row_bytes, id_off, w_off, k, per, out_splits, n, cap_rows, bhist, rows_sorted, w_sorted, tpe,
              e_idx, w_e, e_offs, gmeta, back, flag, dyn, reinterpret_cast<int32_t*>(dyn + per), blockIdx.x,
              gridDim.x);
}

// gocomm_moe_group: both passes in one block (at most 32 rows), one launch less; the
// arguments and shared memory are group_place's.
extern "C" __global__ void gocomm_moe_group(GROUP_PLACE_ARGS) {
  extern __shared__ int64_t dyn[];
  int32_t* hist = reinterpret_cast<int32_t*>(dyn + per);
  group_count(recv, row_bytes, id_off, k, per, out_splits, n, cap_rows, bhist, hist, 0, 1);
  __syncthreads();
  group_place(recv, row_bytes, id_off, w_off, k, per, out_splits, n, cap_rows, bhist, rows_sorted, w_sorted, tpe,
              e_idx, w_e, e_offs, gmeta, back, flag, dyn, hist, 0, 1);
}

// gocomm_moe_gather: out[p] = the first bytes of src's row rows[p] (rows stride apart), for
// p < min(*count, cap): dispatch's tokens in expert order, with the pair count on the GPU.
// bytes, stride and both bases are multiples of 16.
extern "C" __global__ void gocomm_moe_gather(char* __restrict__ out, const char* __restrict__ src,
                                             const int64_t* __restrict__ rows, const int64_t* __restrict__ count,
                                             int64_t cap, int64_t stride, int64_t bytes) {
  const int64_t m = min(*count, cap), v = bytes / 16;
  for (int64_t p = blockIdx.x; p < m; p += gridDim.x) {
    const int4* s = reinterpret_cast<const int4*>(src + rows[p] * stride);
    int4* d = reinterpret_cast<int4*>(out + p * bytes);
    for (int64_t c = threadIdx.x; c < v; c += blockDim.x) d[c] = s[c];
  }
}

// arrive(word): this block's writes before it, then one more in *word (as cooperative groups'
// grid barrier arrives: the block's barrier, then one thread's fence and add).
__device__ __forceinline__ void arrive(uint32_t* word) {
  __syncthreads();
  if (threadIdx.x == 0) __threadfence(), atomicAdd(word, 1u);
}

// await_count(word, want): the block waits until *word reaches want, then sees the writes made
// before each arrive() that counted in it.
__device__ __forceinline__ void await_count(const uint32_t* word, uint32_t want) {
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<const volatile uint32_t*>(word) < want) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}

// gocomm_moe_group_gather: gocomm_moe_group_count, _place (or gocomm_moe_group where G is 1)
// and gocomm_moe_gather in one launch (the padded in-process dispatch's last kernel): the
// arguments are group_place's, then G = group_blocks(cap) (the grouping's blocks), out
// (out_rows rows of xbytes: the first xbytes of recv's row rows_sorted[p] in row p, for p
// below the pairs and out_rows) and sync (kSyncWords words that are zero at launch:
// gocomm_moe_route_pack of the same dispatch zeroed them). Blocks take roles by the order they
// start in, not by blockIdx.x (the GPU may start any block first): ticket q < G counts run q
// (with G = 1 it also places it), G + q places run q once every count is done, and the
// rest gather once every place is done. A block waits only for blocks with smaller tickets,
// which are running or done (a ticket is taken by a running block, in order), so the launch
// finishes with any number of its blocks resident at once: no cooperative launch.
extern "C" __global__ void gocomm_moe_group_gather(GROUP_PLACE_ARGS, int G, char* __restrict__ out,
                                                   int64_t out_rows, int64_t xbytes, uint32_t* sync) {
  extern __shared__ int64_t dyn[];  // as gocomm_moe_group_place's
  __shared__ uint32_t ticket;
  int32_t* hist = reinterpret_cast<int32_t*>(dyn + per);
  if (threadIdx.x == 0) ticket = atomicAdd(&sync[0], 1u);
  __syncthreads();
  const uint32_t id = ticket, g = G, gather0 = G == 1 ? 1 : 2 * g;
  if (id < g) {
    group_count(recv, row_bytes, id_off, k, per, out_splits, n, cap_rows, bhist, hist, id, G);
    if (G == 1) {  // as gocomm_moe_group, but bhist is read through L2: fenced first
      __threadfence();
      __syncthreads();
      group_place(recv, row_bytes, id_off, w_off, k, per, out_splits, n, cap_rows, bhist, rows_sorted, w_sorted,
                  tpe, e_idx, w_e, e_offs, gmeta, back, flag, dyn, hist, 0, 1);
    }
    arrive(&sync[G == 1 ? 2 : 1]);
    return;
  }
  if (id < gather0) {
    await_count(&sync[1], g);
    group_place(recv, row_bytes, id_off, w_off, k, per, out_splits, n, cap_rows, bhist, rows_sorted, w_sorted, tpe,
                e_idx, w_e, e_offs, gmeta, back, flag, dyn, hist, id - g, G);
    arrive(&sync[2]);
    return;
  }
  await_count(&sync[2], g);
  // rows_sorted and the pairs (gmeta[0]) were written by other blocks of this launch: read
  // through L2. The blocks are as small as the grouping's: copy_row keeps four vectors in flight.
  const int64_t m = min(__ldcg(gmeta), out_rows);
  for (int64_t p = id - gather0; p < m; p += gridDim.x - gather0)
    copy_row(reinterpret_cast<int4*>(out + p * xbytes),
             reinterpret_cast<const int4*>(recv + __ldcg(rows_sorted + p) * row_bytes), xbytes / 16);
}

// ----- the low-latency mode (docs/decisions/0036): one kernel a dispatch, one a combine ------
//
// Every rank of the group owns one buffer (csrc/client/inprocess.cc's LlPath: cuMemAlloc'd,
// zeroed, mapped into every peer by CUDA IPC at the group's first low-latency call), laid out
// with strides fixed at that setup (S slots a source, D bytes a dispatch slot, C bytes a
// combine slot; n ranks):
//   0      dcount u64 [2][8]   dcount[p][s] = ll_count(epoch, rows s sent here, s's row bytes)
//                              for dispatches of parity p, written by s once its rows landed
//   128    cdone  u64 [2][8]   cdone[p][d] = ll_count(epoch, 1, 0) once rank d's combine rows for this
//                              rank landed, for combines of parity p
//   256    bar    u64 [4]      [0] dispatch's blocks that sent, [1] combine's blocks that sent,
//                              [2] the last dispatch whose rows block 0 grouped (all monotonic)
//   320    failed u64          1 once a wait gave up: every later launch returns at once
//   1024   dep    u64 [1024]   dep[b] = the last dispatch block b of this rank ran
//   9216   cep    u64 [1024]   cep[b] = the last combine block b ran
//   65536  drows  [2][n][S][D] dispatch: source s's rows of parity p, packed as
//                              gocomm_moe_pack packs them, at [p][s][i]
//   ...    crows  [2][n][S][C] combine: rank d's partial sums for this rank's slot i at [p][d][i]
//
// Why two parities are enough, and nothing is ever zeroed: each kernel copies what it
// received out of the buffer before it ends, and a rank's kernels of one kind run one after
// another (the shim orders a stream change after the previous call; graph replays are
// ordered by the caller). A rank at epoch e + 2 finished e + 1, which waited for every rank's
// word of e + 1, written after that rank's e + 1 started, so after its e (which read the
// slots of e's parity) ended. Every word carries its epoch, so an old value never passes for
// a new one. A kernel that gave up waiting leaves the epochs of the ranks disagreeing: the
// rank is marked failed and the shim aborts the group at its next call (as a2av_ipc.cu's
// invariant 1).
//
// The blocks of a launch wait for each other (a grid-wide arrival, then one block's publish):
// the shim caps the grid at what the GPU holds at once, as a2av_ipc's. Every block routes
// every token itself (at most blockDim.x tokens, as gocomm_moe_route_pack's one-block path),
// so no block waits for routing.
#define LL_MAX_RANKS 8
#define LL_DCOUNT 0
#define LL_CDONE 128
#define LL_BAR 256
#define LL_FAILED 320
#define LL_DEP 1024
#define LL_CEP 9216
#define LL_HEAD 65536

struct LlArgs {
  uint64_t base[LL_MAX_RANKS];  // every rank's buffer, mapped here
  // dispatch: x [t, h], topk ids int64 and weights float32 [t, k]; out [cap * k, h], tpe [per];
  // combine: x is y [cap * k, h'], out [t, h']
  uint64_t x, idx, w, out, tpe;
  // the call's workspace (the handle's; csrc/client/moe.cc's Carve): routing, grouping, counts
  uint64_t meta, send_order, send_rank, t_idx, t_offs, rows_sorted, w_sorted, e_idx, w_e, e_offs, gmeta, rcount;
  uint64_t flag;  // host words: [0] ids out of range, [1] rows dropped (more than cap, or row sizes differ)
  uint64_t err;   // host words: [0] 1 once a wait gave up (the shim also sets it when the group broke)
  int64_t tokens, k, experts, per, xbytes, id_off, w_off, row_bytes;  // dispatch's packed rows: row_bytes
  int64_t slots, slot_bytes, cslot_bytes, crows;  // the buffer's strides; crows: the combine rows' offset
  int64_t cap;     // rows this rank takes (out has cap * k rows)
  int64_t hbytes;  // combine: bytes of a row of y and out
  int64_t segs;    // dispatch: the grouping's runs of rows (ll_group)
  uint64_t timeout_ns;
  uint32_t rank, n;
};
static_assert(sizeof(LlArgs) == 352, "csrc/client/inprocess.h's LlArgs");

__device__ __forceinline__ uint64_t* ll_word(uint64_t base, int64_t off) {
  return reinterpret_cast<uint64_t*>(base + off);
}

// A count word: the epoch's low 32 bits, then the row size in 16-byte units (16 bits) and
// the rows (16 bits): a reader that sees the epoch has both (one aligned 8-byte store).
__device__ __forceinline__ uint64_t ll_count(uint64_t epoch, int64_t rows, int64_t row_bytes) {
  return (epoch << 32) | ((uint64_t)(row_bytes >> 4) & 0xffff) << 16 | ((uint64_t)rows & 0xffff);
}

// The low-latency waits poll with plain (volatile) loads and a pause between them, then fence
// once (up to 128 blocks may wait on one word while block 0 groups the rows).
// ll_await_tag spins (thread-wise) until the word's top 32 bits are the epoch's; returns the
// word, or 0 once the deadline passed or the shim set err (*late set).
__device__ __forceinline__ uint64_t ll_await_tag(const uint64_t* word, uint64_t epoch, uint64_t deadline, uint64_t err,
                                                 int* late) {
  uint64_t v;
  for (uint32_t spins = 0; ((v = *reinterpret_cast<const volatile uint64_t*>(word)) >> 32) != (epoch & 0xffffffffull);
       spins++) {
    __nanosleep(32);
    if ((spins & 255) == 255 && give_up(deadline, err)) {
      atomicExch(late, 1);
      return 0;
    }
  }
  __threadfence_system();  // what the writer released before the word is visible after it
  return v;
}

// Spins until *word >= want (as ll_await_tag gives up).
__device__ __forceinline__ void ll_await_ge(const uint64_t* word, uint64_t want, uint64_t deadline, uint64_t err,
                                            int* late) {
  for (uint32_t spins = 0, ns = 32; *reinterpret_cast<const volatile uint64_t*>(word) < want; spins++) {
    __nanosleep(ns);
    ns = min(ns * 2, 1024u);  // backs off: block 0 groups the rows meanwhile (several us)
    if ((spins & 255) == 255 && give_up(deadline, err)) {
      atomicExch(late, 1);
      return;
    }
  }
  __threadfence_system();
}

// The grid's arrival: this block's writes (peers' memory included) are visible before its
// count; block 0 then waits for every block's count of this epoch. Returns in every block.
__device__ __forceinline__ void ll_arrive_all(uint64_t* bar, uint64_t epoch, uint64_t deadline, uint64_t err,
                                              int* late) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    atomicAdd(reinterpret_cast<unsigned long long*>(bar), 1ull);
    if (blockIdx.x == 0) ll_await_ge(bar, epoch * gridDim.x, deadline, err, late);
  }
  __syncthreads();
}

// The rank's state on entry: this block's epoch (each block counts every launch, so all agree
// without waiting), or 0 where the rank failed (the launch returns at once).
__device__ __forceinline__ uint64_t ll_epoch(uint64_t mine, int64_t counters) {
  if (*reinterpret_cast<volatile uint64_t*>(ll_word(mine, LL_FAILED))) return 0;
  return *reinterpret_cast<volatile uint64_t*>(ll_word(mine, counters) + blockIdx.x) + 1;
}

// The launch's end: a block that gave up marks the rank failed; every block counts the launch.
__device__ __forceinline__ void ll_end(const LlArgs& a, uint64_t mine, int64_t counters, uint64_t epoch, int late) {
  if (threadIdx.x != 0) return;
  if (late) {
    reinterpret_cast<volatile uint32_t*>(a.err)[0] = 1;
    *reinterpret_cast<volatile uint64_t*>(ll_word(mine, LL_FAILED)) = 1;
    __threadfence_system();
  }
  *reinterpret_cast<volatile uint64_t*>(ll_word(mine, counters) + blockIdx.x) = epoch;
}

// Where received row r lies: the sources' rows one after another (roff [n + 1]: the first row
// of each), source s's slot i at [par][s][i] of this rank's dispatch rows.
__device__ __forceinline__ const char* ll_row(const LlArgs& a, const int64_t* roff, int par, int64_t r) {
  int s = 0;
  while (s + 1 < (int)a.n && r >= roff[s + 1]) s++;
  return reinterpret_cast<const char*>(a.base[a.rank] + LL_HEAD) +
         (((int64_t)par * a.n + s) * a.slots + (r - roff[s])) * a.slot_bytes;
}

// ll_group: dispatch's grouping of the R received rows by local expert, in one block, with
// the outputs gocomm_moe_group writes (the same values: expert e's pairs in row order, a
// row's pairs in the order of its ids). The rows are cut into a.segs runs, one a warp; cc
// [segs][per + 1] (shared) first counts each run's pairs per expert (and in all: column per),
// then holds where the run's pairs of each expert start, and the warp walks its run row by
// row, a lane an id, moving those starts on as it places the row's pairs.
__device__ __forceinline__ void ll_group(const LlArgs& a, const int64_t* roff, int par, int64_t R, int32_t* cc,
                                         int64_t* ebase) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k = (int)a.k, per = (int)a.per, P = per + 1, S = (int)a.segs;
  const int64_t q = (R + S - 1) / S;  // rows a run
  int64_t* rows_sorted = reinterpret_cast<int64_t*>(a.rows_sorted);
  float* w_sorted = reinterpret_cast<float*>(a.w_sorted);
  int64_t* e_idx = reinterpret_cast<int64_t*>(a.e_idx);
  float* w_e = reinterpret_cast<float*>(a.w_e);
  int64_t* e_offs = reinterpret_cast<int64_t*>(a.e_offs);
  for (int i = threadIdx.x; i < S * P; i += blockDim.x) cc[i] = 0;
  __syncthreads();
  // 1. each run's pairs per expert: a thread a (row, id)
  for (int64_t i = threadIdx.x; i < R * k; i += blockDim.x) {
    const int64_t r = i / k;
    const int32_t e = reinterpret_cast<const int32_t*>(ll_row(a, roff, par, r) + a.id_off)[i % k];
    if (e >= 0 && e < per) {
      int32_t* run = cc + (r / q) * P;
      atomicAdd(run + e, 1);
      atomicAdd(run + per, 1);
    }
  }
  __syncthreads();
  // 2. each column over the runs: exclusive, in place, its total in ebase; then where each
  //    expert's pairs start
  for (int e = threadIdx.x; e < P; e += blockDim.x) {
    int64_t acc = 0;
    for (int g = 0; g < S; g++) {
      const int32_t v = cc[g * P + e];
      cc[g * P + e] = (int32_t)acc;
      acc += v;
    }
    ebase[e] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int e = 0; e < per; e++) {
      const int64_t tot = ebase[e];
      reinterpret_cast<int64_t*>(a.tpe)[e] = tot;
      ebase[e] = acc;
      acc += tot;
    }
    reinterpret_cast<int64_t*>(a.gmeta)[0] = acc;  // the pairs (ebase[per] counted them too)
    reinterpret_cast<int64_t*>(a.gmeta)[1] = R;
    e_offs[R] = acc;
  }
  __syncthreads();
  // 3. warp g places run g's pairs, row by row
  if (warp < S) {
    int32_t* run = cc + warp * P;
    int64_t pos = run[per];  // the run's first pair
    const unsigned lt = (1u << lane) - 1;
    const int64_t end = min((warp + 1) * q, R);
    int32_t e_next = -1;
    float w_next = 0.f;
    auto load = [&](int64_t r) {  // the row's id and weight of this lane, a row ahead
      if (r < end && lane < k) {
        const char* row = ll_row(a, roff, par, r);
        e_next = reinterpret_cast<const int32_t*>(row + a.id_off)[lane];
        w_next = reinterpret_cast<const float*>(row + a.w_off)[lane];
      }
    };
    load(warp * q);
    for (int64_t r = warp * q; r < end; r++) {
      const int32_t e = e_next;
      const float wj = w_next;
      e_next = -1;
      load(r + 1);
      const bool valid = e >= 0 && e < per;
      const unsigned vm = __ballot_sync(0xffffffffu, valid);
      // lanes with the same expert (an invalid id matches no lane but its own)
      const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
      if (lane == 0) e_offs[r] = pos;
      if (valid) {
        const int64_t p = ebase[e] + run[e] + __popc(same & lt);
        const int64_t at = pos + __popc(vm & lt);  // this pair among the row's
        rows_sorted[p] = r, w_sorted[p] = wj, e_idx[at] = p, w_e[at] = wj;
      }
      __syncwarp();
      if (valid && (same & lt) == 0) run[e] += __popc(same);  // the lowest lane of each expert
      __syncwarp();
      pos += __popc(vm);
    }
  }
  __syncthreads();
}

// gocomm_moe_ll_dispatch: moe.dispatch(padded=True)'s result in one launch (the same rows,
// counts and workspace as the three-launch path, bit for bit). Dynamic shared memory: ll_group's
// cc, a.segs x (per + 1) int32.
//   1. Every block routes every token (a thread each); block 0 writes the routing into the
//      workspace (combine reads it).
//   2. Slot s of the routing (token t for rank r, the i-th of r's) is packed straight into
//      r's dispatch rows at [par][this rank][i], the blocks taking every gridDim.x-th slot.
//   3. Once every block packed (the grid's arrival), block 0 tells each rank how many rows it
//      sent there, and the row size.
//   4. Block 0 waits for every source's word, groups the rows (ll_group), and marks the
//      epoch grouped. Rows from a source whose row size differs from this rank's, or more
//      rows than cap: none received (counted in flag[1]; a later combine raises).
//   5. Every block waits for the grouping and gathers the grouped tokens into out.
extern "C" __global__ void __launch_bounds__(1024, 1) gocomm_moe_ll_dispatch(const LlArgs a) {
  extern __shared__ int32_t cc[];
  __shared__ uint8_t mask[kRoutePackTokens];
  __shared__ int64_t bcount[LL_MAX_RANKS + 2];
  __shared__ uint16_t table[kRoutePackTokens * LL_MAX_RANKS];  // slot -> t << 3 | r
  __shared__ int64_t sbase[LL_MAX_RANKS], roff[LL_MAX_RANKS + 1], ebase[1025];
  __shared__ int late, take;
  const int me = a.rank, n = a.n;
  const uint64_t mine = a.base[me];
  const uint64_t epoch = ll_epoch(mine, LL_DEP);
  if (epoch == 0) return;
  const int par = (int)(epoch & 1);
  const uint64_t deadline = now_ns() + a.timeout_ns;
  if (threadIdx.x == 0) late = 0;
  const int64_t* idx = reinterpret_cast<const int64_t*>(a.idx);
  const int k = (int)a.k, per = (int)a.per;
  volatile uint32_t* flag = reinterpret_cast<volatile uint32_t*>(a.flag);

  // 1. routing
  route_count(idx, a.tokens, k, a.experts, per, n, mask, bcount, 0);
  __syncthreads();
  const bool writer = blockIdx.x == 0;
  route_place(a.tokens, n, mask, bcount, writer ? reinterpret_cast<int64_t*>(a.meta) : nullptr,
              reinterpret_cast<int64_t*>(a.send_order), reinterpret_cast<int32_t*>(a.send_rank),
              reinterpret_cast<int64_t*>(a.t_idx), reinterpret_cast<int64_t*>(a.t_offs), flag, 0, 1, table);
  if (threadIdx.x == 0) {
    int64_t at = 0;
    for (int r = 0; r < n; r++) sbase[r] = at, at += bcount[r];
  }
  __syncthreads();

  // 2. packing into the receivers' rows
  const int64_t total = bcount[n];
  for (int64_t s = blockIdx.x; s < total; s += gridDim.x) {
    const uint16_t e = table[s];
    const int r = e & 7;
    char* dst = reinterpret_cast<char*>(a.base[r] + LL_HEAD) +
                (((int64_t)par * n + me) * a.slots + (s - sbase[r])) * a.slot_bytes;
    pack_row(dst, reinterpret_cast<const char*>(a.x), idx, reinterpret_cast<const float*>(a.w), e >> 3, r, k,
             a.experts, per, a.xbytes, a.id_off, a.w_off);
  }

  // 3. the counts, once every block's rows are out
  ll_arrive_all(ll_word(mine, LL_BAR), epoch, deadline, a.err, &late);
  if (writer && threadIdx.x < n && !late)
    st_release_sys(ll_word(a.base[threadIdx.x], LL_DCOUNT) + par * LL_MAX_RANKS + me,
                   ll_count(epoch, bcount[threadIdx.x], a.row_bytes));

  // 4. receiving and grouping, in block 0
  if (writer) {
    __shared__ int64_t got[LL_MAX_RANKS];
    __shared__ int same;
    if (threadIdx.x == 0) same = 1;
    __syncthreads();
    if (threadIdx.x < n && !late) {
      const uint64_t v = ll_await_tag(ll_word(mine, LL_DCOUNT) + par * LL_MAX_RANKS + threadIdx.x, epoch, deadline,
                                      a.err, &late);
      got[threadIdx.x] = (int64_t)(v & 0xffff);
      if ((int64_t)((v >> 16) & 0xffff) != ((a.row_bytes >> 4) & 0xffff)) same = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t at = 0;
      for (int s = 0; s < n; s++) roff[s] = at, at += late ? 0 : got[s];
      take = !late && same && at <= a.cap;
      if (!late && !take) flag[1] = flag[1] + 1, __threadfence_system();  // the host reads it
      roff[n] = take ? at : 0;
      for (int s = 0; s < n; s++) reinterpret_cast<int64_t*>(a.rcount)[s] = take ? got[s] : 0;
    }
    __syncthreads();
    ll_group(a, roff, par, roff[n], cc, ebase);
    if (threadIdx.x == 0) {
      __threadfence();
      st_release_sys(ll_word(mine, LL_BAR) + 2, epoch);
    }
  } else if (threadIdx.x == 0) {
    ll_await_ge(ll_word(mine, LL_BAR) + 2, epoch, deadline, a.err, &late);
  }
  __syncthreads();

  // 5. the gather: rows_sorted and the rows' offsets were written by block 0 (read through L2)
  if (!late) {
    if (!writer && threadIdx.x == 0) {
      int64_t at = 0;
      for (int s = 0; s < n; s++) roff[s] = at, at += __ldcg(reinterpret_cast<const int64_t*>(a.rcount) + s);
      roff[n] = at;
    }
    __syncthreads();
    const int64_t m = min(__ldcg(reinterpret_cast<const int64_t*>(a.gmeta)), a.cap * k);
    for (int64_t p = blockIdx.x; p < m; p += gridDim.x)
      copy_row(reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out) + p * a.xbytes),
               reinterpret_cast<const int4*>(ll_row(a, roff, par, __ldcg(reinterpret_cast<const int64_t*>(a.rows_sorted) + p))),
               a.xbytes / 16);
  }
  ll_end(a, mine, LL_DEP, epoch, late);
}

// gocomm_moe_ll_combine_<dtype>: moe.combine of a low-latency dispatch in one launch (the same
// sums as the three-launch combine, bit for bit).
//   1. Received row r (source s, slot i): the weighted sum of its experts' outputs (float32
//      in its pairs' order, rounded once) goes straight into s's combine rows at [par][this
//      rank][i], the blocks taking every gridDim.x-th row.
//   2. Once every block wrote (the grid's arrival), block 0 tells every rank.
//   3. Every block waits for every rank's word, then sums each token's rows, by rank (float32,
//      rounded once), into out.
template <typename T>
__device__ __forceinline__ void ll_combine(const LlArgs& a) {
  __shared__ int64_t roff[LL_MAX_RANKS + 1], sbase[LL_MAX_RANKS];
  __shared__ int late;
  const int me = a.rank, n = a.n;
  const uint64_t mine = a.base[me];
  const uint64_t epoch = ll_epoch(mine, LL_CEP);
  if (epoch == 0) return;
  const int par = (int)(epoch & 1);
  const uint64_t deadline = now_ns() + a.timeout_ns;
  const int64_t hv = a.hbytes / 16;
  if (threadIdx.x == 0) {
    late = 0;
    int64_t at = 0, sat = 0;
    for (int s = 0; s < n; s++) {
      roff[s] = at, at += reinterpret_cast<const int64_t*>(a.rcount)[s];
      sbase[s] = sat, sat += reinterpret_cast<const int64_t*>(a.meta)[s];
    }
    roff[n] = at;
  }
  __syncthreads();
  const T* y = reinterpret_cast<const T*>(a.x);
  const int64_t* e_idx = reinterpret_cast<const int64_t*>(a.e_idx);
  const float* w_e = reinterpret_cast<const float*>(a.w_e);
  const int64_t* e_offs = reinterpret_cast<const int64_t*>(a.e_offs);
  const int64_t h = a.hbytes / (int64_t)sizeof(T);

  // 1. the experts' side
  for (int64_t r = blockIdx.x; r < roff[n]; r += gridDim.x) {
    int s = 0;
    while (s + 1 < n && r >= roff[s + 1]) s++;
    char* dst = reinterpret_cast<char*>(a.base[s] + a.crows) +
                (((int64_t)par * n + me) * a.slots + (r - roff[s])) * a.cslot_bytes;
    const int64_t lo = e_offs[r], hi = e_offs[r + 1];
    for (int64_t c = threadIdx.x; c < hv; c += blockDim.x)
      reinterpret_cast<int4*>(dst)[c] = wsum_vec<T>(
          lo, hi, c, [&](int64_t j) { return y + e_idx[j] * h; }, [&](int64_t j) { return w_e[j]; });
  }

  // 2. every rank learns this rank's rows for it are in
  ll_arrive_all(ll_word(mine, LL_BAR) + 1, epoch, deadline, a.err, &late);
  if (blockIdx.x == 0 && threadIdx.x < n && !late)
    st_release_sys(ll_word(a.base[threadIdx.x], LL_CDONE) + par * LL_MAX_RANKS + me, ll_count(epoch, 1, 0));

  // 3. the tokens' side
  if (threadIdx.x < n && !late)
    ll_await_tag(ll_word(mine, LL_CDONE) + par * LL_MAX_RANKS + threadIdx.x, epoch, deadline, a.err, &late);
  __syncthreads();
  if (!late) {
    const int64_t* t_idx = reinterpret_cast<const int64_t*>(a.t_idx);
    const int64_t* t_offs = reinterpret_cast<const int64_t*>(a.t_offs);
    const int32_t* send_rank = reinterpret_cast<const int32_t*>(a.send_rank);
    const char* rows = reinterpret_cast<const char*>(mine + a.crows);
    for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
      const int64_t lo = t_offs[t], hi = t_offs[t + 1];
      auto row = [&](int64_t j) {  // the rank's partial sum of slot t_idx[j]
        const int64_t slot = t_idx[j];
        const int d = send_rank[slot];
        return rows + (((int64_t)par * n + d) * a.slots + (slot - sbase[d])) * a.cslot_bytes;
      };
      for (int64_t c = threadIdx.x; c < hv; c += blockDim.x)
        reinterpret_cast<int4*>(reinterpret_cast<char*>(a.out) + t * a.hbytes)[c] =
            wsum_vec<T>(lo, hi, c, row, [](int64_t) { return 1.f; });
    }
  }
  ll_end(a, mine, LL_CEP, epoch, late);
}

extern "C" __global__ void __launch_bounds__(1024, 1) gocomm_moe_ll_combine_bf16(const LlArgs a) {
  ll_combine<__nv_bfloat16>(a);
}
extern "C" __global__ void __launch_bounds__(1024, 1) gocomm_moe_ll_combine_f16(const LlArgs a) {
  ll_combine<__half>(a);
}
extern "C" __global__ void __launch_bounds__(1024, 1) gocomm_moe_ll_combine_f32(const LlArgs a) {
  ll_combine<float>(a);
}
