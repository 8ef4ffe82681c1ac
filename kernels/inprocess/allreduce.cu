// Client-side all_reduce (sum, avg) of bf16, fp16 and fp32, any size, between GPUs that map
// each other's memory (NVLink): the compiled client (csrc/client/inprocess.cc) loads this
// module into the training process and launches it on the caller's stream, so an all_reduce costs one
// kernel launch instead of a hand-off to the sidecar and an NCCL launch there. No NVSHMEM.
//
// Every rank owns a staging buffer of two halves (epoch parity picks one; an op is one epoch,
// or one per round for two-shot) and a flag array, both mapped into every peer by CUDA IPC.
// Ranks push (remote stores over NVLink, which post, where loads wait a round trip) their
// data into slot r of the peers' halves and read their own half locally. Block b of every
// rank works on the same set of 16-byte vectors (the same grid-stride set, within each shard
// for two-shot), so the barrier between phases is per block and pairwise: block b tells
// block b of each peer "phase done for epoch e" (a release store into the peer's flag array)
// and waits until each peer's block b has told it the same (acquire loads). No block waits
// for another block of its own rank, and a block only overwrites output vectors it has read
// itself (in == out is fine).
//
// Why two halves are enough: epochs of one group run one after another on each rank (rounds
// in a block's loop; ops because the shim orders a stream change after the previous op's
// event, and graph replays are ordered by the caller, as torch's NCCL ops in graphs are), so
// when a peer writes into a half for epoch e + 2, it has passed the barrier of epoch e + 1,
// which this rank's block entered only after finishing epoch e with that half.
//
// The epoch lives on the GPU, so nothing on the host changes from one op to the next and an
// op can be captured in a CUDA graph and replayed. ctl (this rank's own memory, 16 bytes):
//   0  u64  the last epoch the group's ops used on this rank (0 before the first op)
//   8  u32  blocks of the running op that are done with the word above
// Every block reads the last epoch at its start; the block that finds itself the last one
// done (every other block has read it by then) adds the op's rounds and resets the count.
// The next op, later on the stream, reads the new value. Each rank counts the same rounds
// (the message size is the same on every rank), so the ranks' epochs stay equal.
//
// Sums are taken in float32 in rank order 0..n-1 and rounded once, so every rank gets the
// same bits. A wait that passes the deadline sets *err (host-mapped memory the shim checks
// before its next op) and the block gives up; the output is then not valid. A wait also
// gives up once the shim set *err itself (the group broke: a peer is gone).
#include <stdint.h>

#include "float.cuh"
#include "sync.cuh"

#define AR_MAX_RANKS 8
#define AR_MAX_BLOCKS 128

struct ArArgs {
  uint64_t stage[AR_MAX_RANKS];  // every rank's staging buffer, mapped in this process
  uint64_t flags[AR_MAX_RANKS];  // every rank's flags: u64 [2 phases][AR_MAX_BLOCKS][AR_MAX_RANKS]
  uint64_t in, out;              // the caller's tensors (element-aligned; 16-byte if aligned)
  uint64_t err;                  // u32 the host reads: 1 once a wait gave up
  uint64_t nvec;                 // 16-byte vectors in the message
  uint64_t round;                // two-shot: vectors per round (the message passes the staging in rounds)
  uint64_t half;                 // bytes per staging half
  uint64_t timeout_ns;           // how long a wait may take
  uint64_t ctl;                  // this rank's epoch word and done count (see the top)
  float scale;                   // 1 for sum, 1/n for avg
  uint32_t rank, n, aligned;
};


// The caller's tensors may start at any element boundary (a view); staging is 16-byte aligned.
template <typename T> __device__ __forceinline__ int4 load_vec(const ArArgs& a, uint64_t i) {
  if (a.aligned) return reinterpret_cast<const int4*>(a.in)[i];
  constexpr int V = 16 / sizeof(T);
  int4 v;
  T* e = reinterpret_cast<T*>(&v);
  const T* p = reinterpret_cast<const T*>(a.in) + i * V;
#pragma unroll
  for (int k = 0; k < V; k++) e[k] = p[k];
  return v;
}

template <typename T> __device__ __forceinline__ void store_vec(const ArArgs& a, uint64_t i, int4 v) {
  if (a.aligned) {
    reinterpret_cast<int4*>(a.out)[i] = v;
    return;
  }
  constexpr int V = 16 / sizeof(T);
  const T* e = reinterpret_cast<const T*>(&v);
  T* p = reinterpret_cast<T*>(a.out) + i * V;
#pragma unroll
  for (int k = 0; k < V; k++) p[k] = e[k];
}

__device__ __forceinline__ uint64_t* flag(uint64_t base, int phase, int block, int from) {
  return reinterpret_cast<uint64_t*>(base) + (phase * AR_MAX_BLOCKS + block) * AR_MAX_RANKS + from;
}

// Block-level barrier with the same block of every peer (see the top). False when a wait
// gave up (then *err is set and the block stops).
__device__ bool barrier(const ArArgs& a, int phase, uint64_t epoch, uint64_t deadline) {
  __syncthreads();
  bool ok = true;
  const uint32_t t = threadIdx.x;
  if (t < a.n && t != a.rank) {
    uint64_t* theirs = flag(a.flags[t], phase, blockIdx.x, a.rank);
    st_release_sys(theirs, epoch);
    uint64_t* mine = flag(a.flags[a.rank], phase, blockIdx.x, t);
    for (uint32_t spins = 0;; spins++) {
      const uint64_t v = ld_acquire_sys(mine);
      // >=, not ==: a peer may already have moved on and written epoch + 1 here. The epoch
      // is 64 bits and starts at 1, so a block left unused for a while (smaller grids) has
      // an old value that never compares as new.
      if (v >= epoch) break;
      if ((spins & 1023) == 1023 && give_up(deadline, a.err)) {
        *reinterpret_cast<volatile uint32_t*>(a.err) = 1;
        __threadfence_system();
        ok = false;
        break;
      }
    }
  }
  return __syncthreads_and(ok);
}

// Sum, in rank order, of vector j of every rank's contribution: this rank's own is in its
// input at i; rank q's (q != this rank) was pushed into slot q of this rank's staging half.
// Scaled and rounded once.
template <typename T>
__device__ __forceinline__ int4 reduce_vec(const ArArgs& a, const int4* half, uint64_t slot, uint64_t j, uint64_t i) {
  constexpr int V = 16 / sizeof(T);
  int4 v[AR_MAX_RANKS];
#pragma unroll
  for (int q = 0; q < AR_MAX_RANKS; q++)
    if (q < a.n) v[q] = q == a.rank ? load_vec<T>(a, i) : half[q * slot + j];
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; k++) acc[k] = 0.f;
#pragma unroll
  for (int q = 0; q < AR_MAX_RANKS; q++) {
    if (q < a.n) {
      const T* e = reinterpret_cast<const T*>(&v[q]);
#pragma unroll
      for (int k = 0; k < V; k++) acc[k] += to_f(e[k]);
    }
  }
  int4 o;
  T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
  for (int k = 0; k < V; k++) oe[k] = from_f<T>(acc[k] * a.scale);
  return o;
}

__device__ __forceinline__ int4* half_of(const ArArgs& a, uint32_t rank, uint64_t epoch) {
  return reinterpret_cast<int4*>(a.stage[rank] + (epoch & 1) * a.half);
}

// one-shot: push the whole input into slot r of every peer's half; barrier; sum the slots.
template <typename T> __device__ void one_shot(const ArArgs& a, uint64_t epoch) {
  const uint64_t deadline = now_ns() + a.timeout_ns;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t i0 = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (uint32_t d = 1; d < a.n; d++) {
    int4* theirs = half_of(a, (a.rank + d) % a.n, epoch) + a.rank * a.nvec;
    for (uint64_t i = i0; i < a.nvec; i += stride) theirs[i] = load_vec<T>(a, i);
  }
  if (!barrier(a, 0, epoch, deadline)) return;
  const int4* mine = half_of(a, a.rank, epoch);
  for (uint64_t i = i0; i < a.nvec; i += stride) store_vec<T>(a, i, reduce_vec<T>(a, mine, a.nvec, i, i));
}

// two-shot, per round of at most a.round vectors (round k is epoch first + k, in the half
// of its parity): push shard s of the round into slot r of rank s's half; barrier; rank r
// sums its shard's slots into its output and pushes the sum into slot r of every peer's
// gather region (the half's second n slots); barrier; copy the other shards' sums from this
// rank's own gather region. Both phases push (remote stores post; remote loads wait a round
// trip). The gather region is separate because rank s may still be reading rank r's shard-s
// slot when rank r is done reducing. Rounds reuse the halves as consecutive ops do (see the
// top), so a message of any size passes a staging buffer of fixed size.
template <typename T> __device__ void two_shot(const ArArgs& a, uint64_t epoch) {
  const uint64_t deadline = now_ns() + a.timeout_ns;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t i0 = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // A half holds 2n slots of `slot` vectors, the same in every round: vector j of slot s is at
  // the same place, handled by the same block, in each, so block b's pairwise barrier is all
  // that orders a peer's round-k writes into a half after this rank's round k - 2 reads of it.
  // (A short last round whose slots were its own shards' size would move places between
  // blocks, and another block of this rank may still be two rounds behind.) Shards are cut
  // per round (chunk), so a short last round still splits evenly over the ranks.
  const uint64_t slot = (min(a.round, a.nvec) + a.n - 1) / a.n;
  for (uint64_t base = 0; base < a.nvec; base += a.round, epoch++) {
    const uint64_t nvec = min(a.round, a.nvec - base);
    const uint64_t chunk = (nvec + a.n - 1) / a.n;  // at most slot
    for (uint32_t d = 1; d < a.n; d++) {
      const uint32_t s = (a.rank + d) % a.n;
      const uint64_t lo = s * chunk, len = min(nvec, lo + chunk) - min(nvec, lo);
      int4* theirs = half_of(a, s, epoch) + a.rank * slot;
      for (uint64_t j = i0; j < len; j += stride) theirs[j] = load_vec<T>(a, base + lo + j);
    }
    if (!barrier(a, 0, epoch, deadline)) return;
    const int4* mine = half_of(a, a.rank, epoch);
    {
      const uint64_t lo = a.rank * chunk, len = min(nvec, lo + chunk) - min(nvec, lo);
      const uint64_t gather = (a.n + a.rank) * slot;  // slot r of a gather region
      for (uint64_t j = i0; j < len; j += stride) {
        const int4 v = reduce_vec<T>(a, mine, slot, j, base + lo + j);
        for (uint32_t d = 1; d < a.n; d++) half_of(a, (a.rank + d) % a.n, epoch)[gather + j] = v;
        store_vec<T>(a, base + lo + j, v);
      }
    }
    if (!barrier(a, 1, epoch, deadline)) return;
    for (uint32_t d = 1; d < a.n; d++) {
      const uint32_t s = (a.rank + d) % a.n;
      const uint64_t lo = s * chunk, len = min(nvec, lo + chunk) - min(nvec, lo);
      const int4* got = mine + (a.n + s) * slot;
      for (uint64_t j = i0; j < len; j += stride) store_vec<T>(a, base + lo + j, got[j]);
    }
  }
}

// The op's first epoch, from the last one the group used (ctl, see the top).
__device__ __forceinline__ uint64_t first_epoch(const ArArgs& a) {
  __shared__ uint64_t last;
  if (threadIdx.x == 0) last = *reinterpret_cast<volatile uint64_t*>(a.ctl);
  __syncthreads();
  return last + 1;
}

// After the block's last use of the epoch: the last block done moves ctl on by the op's
// rounds (also where a wait gave up: the group is aborted then, but the count stays whole).
__device__ __forceinline__ void end_epoch(const ArArgs& a, uint64_t first, uint64_t rounds) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  unsigned int* done = reinterpret_cast<unsigned int*>(a.ctl + 8);
  if (atomicAdd(done, 1u) == gridDim.x - 1) {
    *reinterpret_cast<volatile uint64_t*>(a.ctl) = first - 1 + rounds;
    *reinterpret_cast<volatile unsigned int*>(done) = 0;
    __threadfence();
  }
}

#define AR(T, suffix)                                                                            \
  extern "C" __global__ void __launch_bounds__(512) gocomm_ar_one_##suffix(const ArArgs a) {  \
    const uint64_t first = first_epoch(a);                                                       \
    one_shot<T>(a, first);                                                                       \
    end_epoch(a, first, 1);                                                                      \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(512) gocomm_ar_two_##suffix(const ArArgs a) {  \
    const uint64_t first = first_epoch(a);                                                       \
    two_shot<T>(a, first);                                                                       \
    end_epoch(a, first, (a.nvec + a.round - 1) / a.round);                                       \
  }
AR(__nv_bfloat16, bf16)
AR(__half, f16)
AR(float, f32)
