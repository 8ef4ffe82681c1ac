// One-sided all-to-all with splits on the GPU: the NVSHMEM path of gocomm.all_to_all_v.
// Status: passes python/tests/test_gpu.py::test_all_to_all_v_nvshmem on 2, 4 and 8 H200s.
//
// Every PE (one sidecar per GPU) launches gocomm_a2av with the same epoch (its op counter,
// from 1); the kernel writes the caller's output itself. No host sync anywhere: the splits
// travel on the device, and so do the overflow and error reports.
//
// Symmetric layout (nvshmem_malloc'd once per group; n = PEs; W = n + 2 words per row):
//   meta   int64  [2][n][W]    meta[p][s] = PE s's splits to every PE, its capacity (rows)
//                              and its row size (bytes), for epochs of parity p. A PE is at
//                              most one epoch ahead of any other (it waits for every PE's
//                              row of an epoch before it sends data, and it publishes that
//                              row only once its previous kernel, copies included, is
//                              done), so two copies never collide; dsig, over and recv
//                              need only one.
//   msig   uint64 [2][n]       msig[p][s] = epoch once PE s's meta row of that epoch landed
//   dsig   uint64 [n]          dsig[s] counts the chunks PE s sent here (B per epoch, one per
//                              block of s that serves this PE): epoch * B once PE s's rows
//                              (or its overflow note) of that epoch all landed
//   over   uint64 [n]          over[s] = epoch when PE s had rows for this PE that would not
//                              fit its capacity (then none of them are sent)
//   local  uint64 [2]          this PE's own: local[0] counts its blocks other than block 0
//                              that finished (epoch * (grid - 1) once all of an epoch's
//                              did), local[1] = the last epoch in which one of them gave up
//   recv   row_bytes x capacity  received rows, grouped by source PE
// The caller's input, splits and output may live anywhere on this GPU: only recv and the
// signals are written from other PEs.
//
// Status word (this PE's view of the op), bits:
//   1 OVERFLOW  what others sent would not fit this PE's capacity: nothing was written
//   2 INVALID   this PE's splits were negative or more rows than its input holds: it
//               published zeros and sent nothing (what it received is still good)
//   4 ROWSIZE   a peer's row size differs from this PE's: nothing was written
//   8 LATE      a peer did not show up before the op's timeout: the kernel gave up, and the
//               sidecar breaks the group (epochs no longer agree); out may hold part of the rows.
//               Any block that gives up sets it: block 0 writes the status only after every
//               other block of this PE finished (local[0]), so a clear LATE bit means every
//               row was copied.
//
// Launch: n * B blocks (B the same on every PE), any block size that is a multiple of 32.
// Blocks d*B .. d*B+B-1 serve the pair (this PE, PE d): each sends a B-th of this PE's rows
// for d into d's receive buffer, then waits for all of d's rows for this PE and copies a
// B-th of them from the receive buffer into the caller's output, so the copy of one source
// overlaps the transfers of the others. This PE's rows for itself go from input to output
// directly. Block 0 also publishes the meta row and, last, once every other block is done,
// writes the output splits and the status word. All blocks must be resident at once (they wait for each other through the
// signals), which n * B <= the SM count guarantees on an idle GPU. The receiving side knows
// from the meta rows alone whether it can take what comes (capacity, row size), so nothing
// is written into out unless all of it fits.
//
// One block per destination moved ~25 GB/s over NVLink (measured, H200): B spreads a pair's
// bytes over enough SMs to fill its link.
#include <nvshmem.h>
#include <nvshmemx.h>
#include <stdint.h>

#include "sync.cuh"

struct A2avSym {
  int64_t* meta;
  uint64_t* msig;
  uint64_t* dsig;
  uint64_t* over;
  char* recv;
  uint64_t* local;
};

// acquire_sys orders what follows after the load that saw a signal: the signal was released by
// another GPU (a fence at system scope there), so the acquire is at system scope too (the PTX
// memory model's fence pattern: relaxed load, then fence).
__device__ __forceinline__ void acquire_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// wait_epoch spins until *sig >= epoch (a count), or until the deadline (then it sets *late and
// returns 0). An acquire fence follows, so what the signal published is read fresh.
__device__ __forceinline__ int wait_epoch(uint64_t* sig, uint64_t epoch, uint64_t deadline, int* late) {
  volatile uint64_t* v = sig;
  while (*v < epoch) {
    if (now_ns() > deadline) {
      atomicExch(late, 1);
      return 0;
    }
  }
  acquire_sys();
  return 1;
}

extern "C" __global__ void gocomm_a2av(const char* __restrict__ in, const int64_t* __restrict__ in_splits,
                                       char* __restrict__ out, int64_t* __restrict__ out_splits,
                                       int32_t* __restrict__ status, A2avSym sym, int64_t capacity,
                                       int64_t row_bytes, int64_t in_rows, uint64_t epoch, uint64_t timeout_ns,
                                       int direct) {
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  const int W = n + 2;
  const int par = (int)(epoch & 1);
  int64_t* meta = sym.meta + (int64_t)par * n * W;
  uint64_t* msig = sym.msig + par * n;
  int64_t* mine = meta + (int64_t)me * W;
  const uint64_t deadline = now_ns() + timeout_ns;
  __shared__ int late, valid;
  if (threadIdx.x == 0) late = 0;

  // 1. Block 0 publishes this PE's splits, capacity and row size to every PE (itself too).
  //    Invalid splits are never trusted: the PE publishes zeros and sends nothing.
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) valid = splits_valid((uint64_t)in_splits, n, false, in_rows);
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) mine[j] = valid ? in_splits[j] : 0;
    if (threadIdx.x == 0) {
      mine[n] = capacity;
      mine[n + 1] = row_bytes;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      if (p == me) {
        __threadfence();  // the row is here already: make it visible, then signal
        nvshmemx_signal_op(&msig[me], epoch, NVSHMEM_SIGNAL_SET, me);
      } else {
        nvshmem_putmem_signal_nbi(mine, mine, W * sizeof(int64_t), &msig[me], epoch, NVSHMEM_SIGNAL_SET, p);
      }
    }
  }
  // 2. Every block waits for every PE's row of this epoch.
  __syncthreads();
  for (int s = threadIdx.x; s < n; s += blockDim.x) wait_epoch(&msig[s], epoch, deadline, &late);
  __syncthreads();

  // 3. Blocks d*B .. d*B+B-1 send this PE's rows for PE d, at d's offset for this source,
  //    one chunk each, and add one to d's count for this source; then take their chunk of
  //    d's rows for this PE into the output.
  const int per = gridDim.x / n;  // B
  const int d = blockIdx.x / per, part = blockIdx.x % per;
  if (d < n && !late) {
    __shared__ int64_t src_off, dst_off, in_off, in_rows_from_d;
    __shared__ int send, take;
    if (threadIdx.x == 0) {
      int64_t a = 0, b = 0, t = 0, u = 0, c_in = 0;
      int ok = 1;
      for (int j = 0; j < d; j++) a += meta[(int64_t)me * W + j];
      for (int s = 0; s < n; s++) {
        int64_t c = meta[(int64_t)s * W + d];
        if (s < me) b += c;
        t += c;
        int64_t r = meta[(int64_t)s * W + me];  // what s sends this PE
        if (s < d) u += r;
        c_in += r;
        if (meta[(int64_t)s * W + n + 1] != row_bytes) ok = 0;
      }
      src_off = a, dst_off = b, in_off = u;
      in_rows_from_d = meta[(int64_t)d * W + me];
      // PE d cannot take everything it is sent, or reads rows of another size: nobody
      // writes into it, and it reports which.
      send = t <= meta[(int64_t)d * W + n] && meta[(int64_t)d * W + n + 1] == row_bytes;
      take = ok && c_in <= capacity;  // the same test, as every source makes it for this PE
    }
    __syncthreads();
    const int64_t bytes = meta[(int64_t)me * W + d] * row_bytes;
    const int64_t chunk = ((bytes + per - 1) / per + 15) & ~(int64_t)15;
    const int64_t lo = min(part * chunk, bytes), hi = min(lo + chunk, bytes);
    if (d == me) {
      // this PE's rows for itself: input to output, no receive buffer
      if (take && hi > lo) block_copy(out + dst_off * row_bytes + lo, in + src_off * row_bytes + lo, hi - lo);
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        nvshmemx_signal_op(&sym.dsig[me], 1, NVSHMEM_SIGNAL_ADD, me);
      }
    } else if (!send || hi == lo) {
      if (threadIdx.x == 0) {
        if (!send && part == 0) {
          nvshmem_uint64_p(&sym.over[me], epoch, d);
          nvshmem_fence();  // the note lands before this block's count
        }
        nvshmemx_signal_op(&sym.dsig[me], 1, NVSHMEM_SIGNAL_ADD, d);
      }
    } else {
      char* peer = direct ? (char*)nvshmem_ptr(sym.recv, d) : nullptr;
      if (peer != nullptr) {
        // NVLink: store straight into the peer's buffer, then publish with one signal
        block_copy(peer + dst_off * row_bytes + lo, in + src_off * row_bytes + lo, hi - lo);
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence_system();
          nvshmemx_signal_op(&sym.dsig[me], 1, NVSHMEM_SIGNAL_ADD, d);
        }
      } else {
        nvshmemx_putmem_signal_nbi_block(sym.recv + dst_off * row_bytes + lo, in + src_off * row_bytes + lo,
                                         hi - lo, &sym.dsig[me], 1, NVSHMEM_SIGNAL_ADD, d);
      }
    }
    // take this block's part of d's rows for this PE, once all of them landed (a block that
    // gives up waiting says so through late, which block 0 reports)
    if (d != me && take && in_rows_from_d > 0) {
      __shared__ int got;
      if (threadIdx.x == 0) got = wait_epoch(&sym.dsig[d], epoch * (uint64_t)per, deadline, &late);
      __syncthreads();
      if (got) {
        const int64_t rb = in_rows_from_d * row_bytes;
        const int64_t rc = ((rb + per - 1) / per + 15) & ~(int64_t)15;
        const int64_t rlo = min(part * rc, rb), rhi = min(rlo + rc, rb);
        if (rhi > rlo) block_copy(out + in_off * row_bytes + rlo, sym.recv + in_off * row_bytes + rlo, rhi - rlo);
      }
    }
  }

  // 4. Every other block tells block 0 it is done (and whether it gave up); block 0 waits for
  //    every source's B chunks and for its own PE's blocks, then fills the output splits and
  //    the status word.
  __syncthreads();
  if (blockIdx.x != 0 && threadIdx.x == 0) {
    if (late) atomicMax((unsigned long long*)&sym.local[1], (unsigned long long)epoch);
    __threadfence();  // this block's copies (and its note) before its count
    atomicAdd((unsigned long long*)&sym.local[0], 1ull);
  }
  if (blockIdx.x == 0) {
    __shared__ int overflow, mismatch;
    if (threadIdx.x == 0) overflow = 0, mismatch = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      if (!late) wait_epoch(&sym.dsig[s], epoch * (uint64_t)per, deadline, &late);
      out_splits[s] = meta[(int64_t)s * W + me];
      if (sym.over[s] == epoch) atomicExch(&overflow, 1);
      if (meta[(int64_t)s * W + n + 1] != row_bytes) atomicExch(&mismatch, 1);
    }
    if (threadIdx.x == 0) {
      // the other blocks end by themselves (each has the deadline): no deadline needed here
      volatile uint64_t* v = &sym.local[0];
      while (*v < epoch * (uint64_t)(gridDim.x - 1)) {
      }
      __threadfence();
      if (sym.local[1] == epoch) late = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) *status = (overflow ? 1 : 0) | (valid ? 0 : 2) | (mismatch ? 4 : 0) | (late ? 8 : 0);
  }
  nvshmem_quiet();  // every put of this block complete before the kernel ends
}
