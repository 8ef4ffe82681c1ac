// One-sided all-to-all with splits on the GPU: the NVSHMEM path of gocomm.all_to_all_v.
// Status: passes python/tests/test_gpu.py::test_all_to_all_v_nvshmem on 2 and 4 H200s.
//
// Every PE (one sidecar per GPU) calls gocomm_a2av with the same epoch (its op counter,
// from 1), then gocomm_a2av_copy on the same stream. No host sync anywhere: the splits
// travel on the device, and so do the overflow and error reports.
//
// Symmetric layout (nvshmem_malloc'd once per group; n = PEs; W = n + 2 words per row):
//   meta   int64  [2][n][W]    meta[p][s] = PE s's splits to every PE, its capacity (rows)
//                              and its row size (bytes), for epochs of parity p. A PE is at
//                              most one epoch ahead of any other (it waits for every PE's
//                              row of an epoch before it sends data), so two copies never
//                              collide; dsig, over and recv need only one.
//   msig   uint64 [2][n]       msig[p][s] = epoch once PE s's meta row of that epoch landed
//   dsig   uint64 [n]          dsig[s] counts the chunks PE s sent here (B per epoch, one per
//                              block of s that serves this PE): epoch * B once PE s's rows
//                              (or its overflow note) of that epoch all landed
//   over   uint64 [n]          over[s] = epoch when PE s had rows for this PE that would not
//                              fit its capacity (then none of them are sent)
//   recv   row_bytes x capacity  received rows, grouped by source PE
// The caller's input and splits may live anywhere on the GPU: puts read local memory.
//
// Status word (this PE's view of the op), bits:
//   1 OVERFLOW  what others sent would not fit this PE's capacity: nothing was written
//   2 INVALID   this PE's splits were negative or more rows than its input holds: it
//               published zeros and sent nothing (what it received is still good)
//   4 ROWSIZE   a peer's row size differs from this PE's: nothing was written
//   8 LATE      a peer did not show up before the op's timeout: the kernel gave up, and the
//               sidecar breaks the group (epochs no longer agree)
// The copy kernel writes the output only when none of 1, 4, 8 is set.
//
// Launch: gocomm_a2av with n * B blocks of 256 threads, B the same on every PE (blocks
// d*B .. d*B+B-1 each send a B-th of this PE's rows for PE d; block 0 also publishes the row
// and collects the output splits); all blocks must be resident at once (they wait for each
// other through the signals), which n * B <= 8 x the SM count guarantees on an idle GPU.
// One block per destination moved ~25 GB/s over NVLink (measured, H200): B spreads a
// destination's bytes over enough SMs to fill its link. Then gocomm_a2av_copy with any grid
// to move recv's rows into the caller's output.
#include <nvshmem.h>
#include <nvshmemx.h>
#include <stdint.h>

struct A2avSym {
  int64_t* meta;
  uint64_t* msig;
  uint64_t* dsig;
  uint64_t* over;
  char* recv;
};

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// wait_epoch spins until *sig >= epoch (a count), or until the deadline (then it sets *late). An acquire
// fence follows, so what the signal published is read fresh.
__device__ __forceinline__ void wait_epoch(uint64_t* sig, uint64_t epoch, uint64_t deadline, int* late) {
  volatile uint64_t* v = sig;
  while (*v < epoch) {
    if (now_ns() > deadline) {
      atomicExch(late, 1);
      break;
    }
  }
  __threadfence();
}

extern "C" __global__ void gocomm_a2av(const char* __restrict__ in, const int64_t* __restrict__ in_splits,
                                       int64_t* __restrict__ out_splits, int32_t* __restrict__ status,
                                       A2avSym sym, int64_t capacity, int64_t row_bytes, int64_t in_rows,
                                       uint64_t epoch, uint64_t timeout_ns) {
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
    if (threadIdx.x == 0) {
      int64_t sum = 0;
      valid = 1;
      for (int j = 0; j < n; j++) {
        int64_t s = in_splits[j];
        if (s < 0 || s > in_rows) valid = 0;  // capped before summing: no overflow
        else sum += s;
      }
      if (sum > in_rows) valid = 0;
    }
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
  //    one chunk each, and add one to d's count for this source.
  const int per = gridDim.x / n;  // B
  const int d = blockIdx.x / per, part = blockIdx.x % per;
  if (d < n && !late) {
    __shared__ int64_t src_off, dst_off;
    __shared__ int send;
    if (threadIdx.x == 0) {
      int64_t a = 0, b = 0, t = 0;
      for (int j = 0; j < d; j++) a += meta[(int64_t)me * W + j];
      for (int s = 0; s < n; s++) {
        int64_t c = meta[(int64_t)s * W + d];
        if (s < me) b += c;
        t += c;
      }
      src_off = a, dst_off = b;
      // PE d cannot take everything it is sent, or reads rows of another size: nobody
      // writes into it, and it reports which.
      send = t <= meta[(int64_t)d * W + n] && meta[(int64_t)d * W + n + 1] == row_bytes;
    }
    __syncthreads();
    const int64_t bytes = meta[(int64_t)me * W + d] * row_bytes;
    const int64_t chunk = ((bytes + per - 1) / per + 15) & ~(int64_t)15;
    const int64_t lo = min(part * chunk, bytes), hi = min(lo + chunk, bytes);
    if (!send || hi == lo) {
      if (threadIdx.x == 0) {
        if (!send && part == 0) {
          nvshmem_uint64_p(&sym.over[me], epoch, d);
          nvshmem_fence();  // the note lands before this block's count
        }
        nvshmemx_signal_op(&sym.dsig[me], 1, NVSHMEM_SIGNAL_ADD, d);
      }
    } else {
      nvshmemx_putmem_signal_nbi_block(sym.recv + dst_off * row_bytes + lo, in + src_off * row_bytes + lo, hi - lo,
                                       &sym.dsig[me], 1, NVSHMEM_SIGNAL_ADD, d);
    }
  }

  // 4. Block 0 waits for every source's B chunks and fills the output splits and the status word.
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
    __syncthreads();
    if (threadIdx.x == 0) *status = (overflow ? 1 : 0) | (valid ? 0 : 2) | (mismatch ? 4 : 0) | (late ? 8 : 0);
  }
  nvshmem_quiet();  // every put of this block complete before the kernel ends
}

// Copies the received rows (sum of out_splits) from recv into the caller's output, 16 bytes
// at a time where both are aligned; nothing when the status says nothing was received.
extern "C" __global__ void gocomm_a2av_copy(char* __restrict__ out, const char* __restrict__ recv,
                                            const int64_t* __restrict__ out_splits, const int32_t* __restrict__ status,
                                            int n, int64_t row_bytes) {
  if (*status & (1 | 4 | 8)) return;
  int64_t rows = 0;
  for (int s = 0; s < n; s++) rows += out_splits[s];
  const int64_t bytes = rows * row_bytes;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if ((((uintptr_t)out | (uintptr_t)recv) & 15) == 0) {
    const int64_t vec = bytes / 16;
    for (int64_t k = i; k < vec; k += stride) reinterpret_cast<int4*>(out)[k] = reinterpret_cast<const int4*>(recv)[k];
    for (int64_t k = vec * 16 + i; k < bytes; k += stride) out[k] = recv[k];
  } else {
    for (int64_t k = i; k < bytes; k += stride) out[k] = recv[k];
  }
}
