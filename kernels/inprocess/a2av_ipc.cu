// All-to-all with splits on the GPU in the training process: gocomm.all_to_all_v where the
// group's GPUs map each other's memory over NVLink. The compiled client
// (csrc/client/inprocess.cc) loads this module and launches gocomm_a2av_ipc on the caller's stream: one kernel launch and no
// hand-off to the sidecar, no host sync, and no host-side state that changes per op (the op
// counter lives on the GPU), so a call can be captured in a CUDA graph and replayed.
// The protocol is the sidecar's NVSHMEM kernel's (kernels/sidecar/a2av.cu) with CUDA IPC mappings in
// place of the symmetric heap, and meta words that carry their epoch in place of a signal.
//
// Every rank owns one buffer (cuMemAlloc'd by the shim, zeroed, mapped into every peer by
// CUDA IPC). Layout, in bytes from its base (R = 8 ranks at most, W = R + 4, P = 128 parts,
// O = 16 receive buffers):
//   0       ctl    u64 [8]         this rank's own words: failed (1 once an op gave up:
//                                  every later op returns at once); the rest unused
//   64      meta   u64 [2][R][W]   meta[p][s] = rank s's rows for each rank, then its
//                                  capacity (rows), row size (bytes), output (the receive
//                                  buffer it takes the rows in, or -1: recv below) and the
//                                  output's offset in it (bytes), for epochs of parity p;
//                                  written by s, each word tagged with the epoch (tagged())
//   1600    (unused, 128 bytes)
//   1728    dsig   u64 [R][P]      dsig[s][k] = stage(epoch, j + 1) once round j of part k of
//                                  s's rows for this rank landed (a part with no bytes in a
//                                  round is not signalled for it)
//   9920    table  u64 [O][R]      table[o][s] = rank s's receive buffer o, mapped here
//                                  (written by the host when the group made it)
//   10944   csig   u64 [R][P]      csig[d][k] = stage(epoch, j) once rank d copied round j - 1
//                                  of part k of this rank's rows out of its slot (invariant 5)
//   19136   epochs u64 [1024]      epochs[b] = the last op block b of this rank finished
//   27328   (free up to 64 KiB)
//   65536   recv   stage_bytes     rows from the peers, grouped by source rank, for a rank
//                                  whose output is not a receive buffer; it copies them out
//   +stage  fast   [2][n] x F      fast[p][s] = sender s's rows of an op of parity p, where
//                                  they fit F = fast_bytes (invariant 6); copied out
//
// A receive buffer (gocomm.receive_buffer) is a buffer of its own on every rank, mapped into
// every peer like this one: a rank whose output lies in one names it in its meta row, and
// the peers write their rows straight into it, with no copy out of recv.
//
// Invariants:
//   1. A rank is at most one epoch ahead of any other: no block of it ends an op before it
//      saw every rank's meta row of the epoch (every word tagged with it), and a rank
//      publishes that row at the start of its kernel, after its previous kernel (copies out
//      of recv included) ended. It sends into recv or an output only after it saw the
//      receiver's row. So two meta copies never collide, and recv needs one copy. This needs a rank's kernels to run one
//      after another: the shim orders a stream change after the previous op; graph replays
//      are ordered by the caller (as torch's NCCL ops in graphs are). Once an op gave up
//      waiting, the ranks' epochs no longer agree: every later op of the rank returns at
//      once (ctl.failed), touching no peer, and the shim aborts the group at its next call.
//   2. Blocks d*P' .. d*P'+P'-1 (P' = parts, the same on every rank) serve the pair (this
//      rank, rank d): part k sends the k-th 16-byte-rounded P'-th of this rank's bytes for d,
//      and takes the k-th part of d's bytes for this rank. Both ends cut the same byte count
//      (from the meta rows) the same way, so a part waits for exactly one signal, from the
//      same part on d, and only when its cut is not empty.
//   3. Nothing is written into out unless all of what this rank receives fits (capacity)
//      and every rank's row size is the same; a sender makes the same test for its receiver
//      from the same meta rows and sends nothing then (this matters where the receiver's
//      out is a receive buffer: the sender writes into it directly).
//   4. Every block keeps its own op counter (epochs[b]) and counts every op it runs, so the
//      blocks of a rank agree on the epoch without waiting for each other at the end (the
//      grid is the same for every op of a group).
//   5. A receiver whose rows do not fit its recv at once (its output is not a receive buffer
//      and it takes more than stage_bytes) takes them in rounds: recv holds one slot of S
//      bytes per sender (stage_bytes / n, rounded down to 16 x P'), a sender moves S bytes
//      of its rows for that receiver per round into its slot, and part k of a round waits
//      until the receiver's part k copied the previous round out (csig). Every rank decides
//      this from the same meta rows, so sender and receiver count the same rounds.
//   6. A pair whose bytes (from valid splits) fit F goes at once, before the meta rows are
//      in: the sender's part k writes its cut into the receiver's fast[parity][sender] and
//      signals round 0 as above; the receiver makes the same test from the sender's meta
//      row and copies the cut out (into any output). A sender at epoch e + 1 finished e,
//      so it saw the receiver's row of e, so the receiver finished e - 1, the last op that
//      read fast[parity of e + 1]. The receiver's capacity is not known then, so the rows
//      land in the slot even where the receiver takes nothing (invariant 3 still holds for
//      out). Decode-sized pairs save the meta round trip that way. Every block reads the
//      caller's splits at its start for this test, so they must not overlap out_splits
//      (which block 0 writes at its end; no caller's do).
//
// Meta values are 32-bit (tagged()): the shim keeps splits, capacities, row sizes and
// offsets in receive buffers below 2^31.
//
// Reports: the output splits are always written (an overflow shows as their sum passing
// the capacity). The host-mapped words at err (u32) are: [0] = 1 once a wait gave up (the
// shim aborts the group at its next call; the shim also sets it when the group broke, and
// waits then give up at once), [1] = ops whose splits this rank found invalid
// (negative, or more rows than its input: it published zeros and sent nothing), [2] = ops
// with a row size that differs between ranks (nothing written), [3] = ops where a peer sent
// other rows than the caller expected from it (expect: all_to_all_single's
// output_split_sizes; the output is not valid then, and the shim raises at a later call),
// [4..6] = the first such: the source rank + 1, the rows it sent, the rows expected.
//
// All blocks must be resident at once (they wait for each other across GPUs): the shim
// caps the grid at what the GPU holds at once (the occupancy API), on an idle GPU.
#include <stdint.h>

#include "sync.cuh"

#define A2_MAX_RANKS 8
#define A2_MAX_PARTS 128
#define A2_MAX_OUTS 16
#define A2_W (A2_MAX_RANKS + 4)
#define A2_META 64
#define A2_DSIG (A2_META + 2 * A2_MAX_RANKS * A2_W * 8 + 128)
#define A2_TABLE (A2_DSIG + A2_MAX_RANKS * A2_MAX_PARTS * 8)
#define A2_CSIG (A2_TABLE + A2_MAX_OUTS * A2_MAX_RANKS * 8)
#define A2_EPOCHS (A2_CSIG + A2_MAX_RANKS * A2_MAX_PARTS * 8)
#define A2_MAX_BLOCKS 1024
#define A2_HEAD 65536
static_assert(A2_TABLE == 9920, "the layout above (and csrc/client/inprocess.cc's kA2Table)");
static_assert(A2_EPOCHS + A2_MAX_BLOCKS * 8 <= A2_HEAD, "the signals overlap recv");

struct A2Args {
  uint64_t base[A2_MAX_RANKS];  // every rank's buffer, mapped in this process
  uint64_t in, splits, out, out_splits, err;
  int64_t capacity;   // rows this rank takes (out's rows)
  int64_t row_bytes;  // bytes per row (every rank's must be the same)
  int64_t in_rows;    // rows in the input
  int64_t out_id;     // the receive buffer out lies in, or -1
  int64_t out_off;    // out's offset in it (bytes)
  int64_t stage_bytes;  // recv's size (every rank's is the same): invariant 5
  int64_t fast_bytes;   // a fast slot's size (every rank's is the same; 0: none): invariant 6
  int64_t host_splits[A2_MAX_RANKS];  // the splits where splits is 0 (known on the host)
  int64_t expect[A2_MAX_RANKS];       // the rows expected from each rank, where expecting
  uint64_t timeout_ns;
  uint32_t rank, n, parts, splits32;  // splits32: in and out splits are int32, else int64
  uint32_t expecting;                 // expect holds the caller's output splits
};

struct Ctl {
  uint64_t failed;
};

// Where sender s's rows of the op of parity par land in the rank whose buffer is base, when
// they fit a fast slot (invariant 6): after recv.
__device__ __forceinline__ char* fast_slot(const A2Args& a, uint64_t base, int par, int s) {
  return reinterpret_cast<char*>(base + A2_HEAD + a.stage_bytes + ((int64_t)par * a.n + s) * a.fast_bytes);
}

__device__ __forceinline__ int64_t* meta_row(uint64_t base, int par, int s) {
  return reinterpret_cast<int64_t*>(base + A2_META) + ((int64_t)par * A2_MAX_RANKS + s) * A2_W;
}
__device__ __forceinline__ uint64_t* dsig_of(uint64_t base, int s, int part) {
  return reinterpret_cast<uint64_t*>(base + A2_DSIG) + s * A2_MAX_PARTS + part;
}

__device__ __forceinline__ uint64_t* csig_of(uint64_t base, int s, int part) {
  return reinterpret_cast<uint64_t*>(base + A2_CSIG) + s * A2_MAX_PARTS + part;
}

// A signal value: round k of the op of this epoch (rounds < 2^24; epochs grow, so a signal
// of an earlier op is always below any of a later one).
__device__ __forceinline__ uint64_t stage(uint64_t epoch, int64_t k) { return (epoch << 24) | (uint64_t)k; }

// Spins until *sig >= want; false (and *late set) once the deadline passed or the shim set
// err[0] (give_up).
__device__ __forceinline__ bool wait_ge(const uint64_t* sig, uint64_t want, uint64_t deadline, uint64_t err, int* late) {
  for (uint32_t spins = 0; ld_acquire_sys(sig) < want; spins++) {
    if ((spins & 255) == 255 && give_up(deadline, err)) {
      atomicExch(late, 1);
      return false;
    }
  }
  return true;
}

// A meta word: the low 32 bits of the epoch over the value (32 bits, signed). An aligned
// 8-byte store lands whole, so a reader that sees this epoch in a word has its value: no
// release fence and no separate signal (one NVLink round trip less per op).
__device__ __forceinline__ uint64_t tagged(uint64_t epoch, int64_t v) {
  return (epoch << 32) | (uint64_t)(uint32_t)(int32_t)v;
}

extern "C" __global__ void __launch_bounds__(512) gocomm_a2av_ipc(const A2Args a) {
  const int me = a.rank, n = a.n;
  const uint64_t mine = a.base[me];
  Ctl* ctl = reinterpret_cast<Ctl*>(mine);
  if (*reinterpret_cast<volatile uint64_t*>(&ctl->failed)) return;  // invariant 1
  // this block's op counter (invariant 4): every block counts every op, so all agree
  uint64_t* my_epoch = reinterpret_cast<uint64_t*>(mine + A2_EPOCHS) + blockIdx.x;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(my_epoch) + 1;
  const int par = (int)(epoch & 1);
  const uint64_t deadline = now_ns() + a.timeout_ns;
  __shared__ int late, valid;
  // splits known on the host (all_to_all_single) come in the arguments
  __shared__ int64_t hs[A2_MAX_RANKS];
  const bool on_host = a.splits == 0;
  if (on_host && threadIdx.x < n) hs[threadIdx.x] = a.host_splits[threadIdx.x];
  __syncthreads();
  const uint64_t splits = on_host ? reinterpret_cast<uint64_t>(hs) : a.splits;
  const bool splits32 = !on_host && a.splits32;
  if (threadIdx.x == 0) late = 0, valid = splits_valid(splits, n, splits32, a.in_rows);
  __syncthreads();

  // 1. Block 0 publishes this rank's row to every rank (itself too): thread p writes rank
  //    p's copy. Invalid splits are never trusted: zeros are sent.
  if (blockIdx.x == 0 && threadIdx.x < n) {
    const int p = threadIdx.x;
    volatile uint64_t* row = reinterpret_cast<volatile uint64_t*>(meta_row(a.base[p], par, me));
    for (int j = 0; j < n; j++) row[j] = tagged(epoch, valid ? split_at(splits, j, splits32) : 0);
    row[n] = tagged(epoch, a.capacity);
    row[n + 1] = tagged(epoch, a.row_bytes);
    row[n + 2] = tagged(epoch, a.out_id);
    row[n + 3] = tagged(epoch, a.out_off);
  }

  // 2. A pair whose bytes fit a fast slot goes now, before any meta row is in (invariant 6):
  //    part k of this rank's rows for d into d's slot (par, this rank), then its signal.
  const int d = blockIdx.x / a.parts, part = blockIdx.x % a.parts;
  const int64_t rb = a.row_bytes;
  bool fast_sent = false;
  if (d < n && d != me && valid && a.fast_bytes > 0) {
    int64_t src = 0;
    for (int j = 0; j < d; j++) src += split_at(splits, j, splits32);
    // the count as its meta word carries it (32 bits), so d's test in step 4 sees the same
    const int64_t bytes = (int64_t)(int32_t)split_at(splits, d, splits32) * rb;
    if (bytes > 0 && bytes <= a.fast_bytes) {
      fast_sent = true;
      const int64_t chunk = ((bytes + a.parts - 1) / a.parts + 15) & ~(int64_t)15;
      const int64_t lo = min(part * chunk, bytes), hi = min(lo + chunk, bytes);
      if (hi > lo) {
        block_copy(fast_slot(a, a.base[d], par, me) + lo, reinterpret_cast<const char*>(a.in) + src * rb + lo, hi - lo);
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence_system();
          st_release_sys(dsig_of(a.base[d], me, part), stage(epoch, 1));
        }
      }
    }
  }

  // 3. Every block waits for every rank's row of this epoch (in its own buffer): thread s
  //    reads row s's words until each carries this epoch, into shared memory.
  __shared__ int64_t rows[A2_MAX_RANKS][A2_W];
  if (threadIdx.x < n) {
    const int s = threadIdx.x;
    const volatile uint64_t* row = reinterpret_cast<const volatile uint64_t*>(meta_row(mine, par, s));
    for (int j = 0; j < n + 4 && !late; j++) {
      uint64_t w;
      for (uint32_t spins = 0; ((w = row[j]) >> 32) != (epoch & 0xffffffffull); spins++) {
        if ((spins & 255) == 255 && give_up(deadline, a.err)) {
          atomicExch(&late, 1);
          break;
        }
      }
      rows[s][j] = (int64_t)(int32_t)(uint32_t)w;
    }
  }
  __syncthreads();

  // 4. The pair (this rank, d), part k: send, then take, round by round (invariants 2, 5, 6).
  if (d < n && !late) {
    __shared__ int64_t src_off, dst_off, in_off, from_d, to_d;
    __shared__ uint64_t dst_base;  // where d takes this rank's rows: its recv or its output
    __shared__ int send, take, staged_d, staged_me, fast_in, ok;
    if (threadIdx.x == 0) {
      int64_t src = 0, dst = 0, in = 0, total_d = 0, c_in = 0;
      int same = 1;
      for (int s = 0; s < n; s++) {
        const int64_t* m = rows[s];
        if (s == me)
          for (int j = 0; j < d; j++) src += m[j];
        if (s < me) dst += m[d];
        total_d += m[d];
        if (s < d) in += m[me];
        c_in += m[me];
        if (m[n + 1] != rb) same = 0;
      }
      const int64_t* md = rows[d];
      src_off = src, dst_off = dst, in_off = in;
      from_d = md[me];
      to_d = rows[me][d];
      const int64_t o = md[n + 2];
      dst_base = o >= 0 && o < A2_MAX_OUTS
                     ? reinterpret_cast<const uint64_t*>(mine + A2_TABLE)[o * A2_MAX_RANKS + d] + md[n + 3]
                     : a.base[d] + A2_HEAD;
      send = same && total_d <= md[n] && !fast_sent;  // d's own test, invariant 3
      take = same && c_in <= a.capacity;
      const int64_t fb = from_d * rb;
      fast_in = d != me && fb > 0 && fb <= a.fast_bytes;  // d's test in step 2
      staged_d = !(o >= 0 && o < A2_MAX_OUTS) && total_d * rb > a.stage_bytes;
      staged_me = a.out_id < 0 && c_in * rb > a.stage_bytes;
    }
    __syncthreads();
    const int64_t bytes = to_d * rb;
    const char* in = reinterpret_cast<const char*>(a.in) + src_off * rb;
    char* out = reinterpret_cast<char*>(a.out);
    if (d == me) {
      // this rank's rows for itself: input to output, no staging
      const int64_t chunk = ((bytes + a.parts - 1) / a.parts + 15) & ~(int64_t)15;
      const int64_t lo = min(part * chunk, bytes), hi = min(lo + chunk, bytes);
      if (take && hi > lo) block_copy(out + in_off * rb + lo, in + lo, hi - lo);
    } else {
      // One round moves a pair's bytes, or slot bytes per round through the sender's slot
      // where the receiver's rows do not fit its recv at once (invariant 5). In rounds, part
      // k always has the same slot / P' bytes of the slot (fewer in the last round), so the
      // receiver's part k freeing them is all the sender's part k waits for. A pair that
      // went in step 2 has one round, out of the fast slot (invariant 6).
      const int64_t slot = a.stage_bytes / n / (16 * a.parts) * (16 * a.parts);
      const int64_t rbytes = from_d * rb;
      const bool staged_in = staged_me && !fast_in;
      const int64_t sq = staged_d ? slot : max(bytes, (int64_t)1);
      const int64_t rq = staged_in ? slot : max(rbytes, (int64_t)1);
      const int64_t ks = send ? (bytes + sq - 1) / sq : 0, kr = take ? (rbytes + rq - 1) / rq : 0;
      char* to = staged_d ? reinterpret_cast<char*>(a.base[d] + A2_HEAD) + me * slot
                          : reinterpret_cast<char*>(dst_base) + dst_off * rb;
      const char* from = fast_in     ? fast_slot(a, mine, par, d)
                         : staged_in ? reinterpret_cast<const char*>(mine + A2_HEAD) + d * slot
                                     : reinterpret_cast<const char*>(mine + A2_HEAD) + in_off * rb;
      const bool copy_out = a.out_id < 0 || fast_in;
      for (int64_t k = 0; k < max(ks, kr); k++) {
        if (k < ks) {
          const int64_t len = min(sq, bytes - k * sq);
          const int64_t chunk = staged_d ? slot / a.parts : ((len + a.parts - 1) / a.parts + 15) & ~(int64_t)15;
          const int64_t lo = min(part * chunk, len), hi = min(lo + chunk, len);
          if (hi > lo) {
            if (threadIdx.x == 0) ok = k == 0 || wait_ge(csig_of(mine, d, part), stage(epoch, k), deadline, a.err, &late);
            __syncthreads();
            if (!ok) break;
            block_copy(to + lo, in + k * sq + lo, hi - lo);
            __syncthreads();
            if (threadIdx.x == 0) {
              __threadfence_system();
              st_release_sys(dsig_of(a.base[d], me, part), stage(epoch, k + 1));
            }
          }
        }
        if (k < kr) {
          const int64_t len = min(rq, rbytes - k * rq);
          const int64_t chunk = staged_in ? slot / a.parts : ((len + a.parts - 1) / a.parts + 15) & ~(int64_t)15;
          const int64_t lo = min(part * chunk, len), hi = min(lo + chunk, len);
          if (hi > lo) {
            if (threadIdx.x == 0) ok = wait_ge(dsig_of(mine, d, part), stage(epoch, k + 1), deadline, a.err, &late);
            __syncthreads();
            if (!ok) break;
            if (copy_out) block_copy(out + in_off * rb + k * rq + lo, from + lo, hi - lo);
            if (k + 1 < kr) {  // d may send its next round into the slot
              __syncthreads();
              if (threadIdx.x == 0) st_release_sys(csig_of(a.base[d], me, part), stage(epoch, k + 1));
            }
          }
        }
        __syncthreads();
      }
    }
  }

  // 5. Block 0 writes the output splits and counts what it found; a block that gave up
  //    waiting marks the rank failed (invariant 1); every block counts the op (invariant 4).
  __syncthreads();
  if (blockIdx.x == 0) {
    __shared__ int mismatch, unexpected;  // unexpected: the first rank that sent other rows, or n
    if (threadIdx.x == 0) mismatch = 0, unexpected = n;
    __syncthreads();
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      const int64_t* m = rows[s];
      if (!a.out_splits) {
      } else if (splits32) {
        reinterpret_cast<int32_t*>(a.out_splits)[s] = (int32_t)m[me];
      } else {
        reinterpret_cast<int64_t*>(a.out_splits)[s] = m[me];
      }
      if (m[n + 1] != rb) mismatch = 1;
      if (a.expecting && m[me] != a.expect[s]) atomicMin(&unexpected, s);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      volatile uint32_t* err = reinterpret_cast<volatile uint32_t*>(a.err);
      if (!valid) err[1] = err[1] + 1;
      if (mismatch) err[2] = err[2] + 1;
      if (unexpected < n) {
        if (err[4] == 0) {  // the first: the host reads the source last
          err[5] = (uint32_t)rows[unexpected][me];
          err[6] = (uint32_t)a.expect[unexpected];
          __threadfence_system();
          err[4] = unexpected + 1;
          __threadfence_system();  // the host reads [3], then [4]
        }
        err[3] = err[3] + 1;
      }
      if (!valid || mismatch || unexpected < n) __threadfence_system();  // the host reads the words
    }
  }
  if (threadIdx.x == 0) {
    if (late) {
      reinterpret_cast<volatile uint32_t*>(a.err)[0] = 1;
      *reinterpret_cast<volatile uint64_t*>(&ctl->failed) = 1;
      __threadfence_system();
    }
    *reinterpret_cast<volatile uint64_t*>(my_epoch) = epoch;
  }
}
