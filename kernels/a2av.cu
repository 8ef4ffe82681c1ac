// One-sided all-to-all with splits on the GPU: the NVSHMEM path of gocomm.all_to_all_v.
// Status: builds on every machine (make); not yet run on a GPU (see NOTES.md, issue 4).
//
// Every PE (one sidecar per GPU) calls gocomm_a2av with the same epoch (its op counter,
// from 1), then gocomm_a2av_copy on the same stream. No host sync anywhere: the splits
// travel on the device, and so does the overflow report.
//
// Symmetric layout (nvshmem_malloc'd once per group; n = PEs; all offsets in bytes):
//   meta   int64  [2][n][n+1]  meta[p][s] = PE s's splits to every PE, then its capacity
//                              (rows), for epochs of parity p. A PE is at most one epoch
//                              ahead of any other (it waits for every PE's row of an epoch
//                              before it sends data), so two copies never collide.
//   msig   uint64 [2][n]       msig[p][s] = epoch once PE s's meta row of that epoch landed
//   dsig   uint64 [n]          dsig[s] = epoch once PE s's rows (or its overflow note) landed
//   over   uint64 [n]          over[s] = epoch when PE s had rows for this PE that would not
//                              fit its capacity (then none of them are sent)
//   recv   row_bytes x capacity  received rows, grouped by source PE
// The caller's input and splits may live anywhere on the GPU: puts read local memory.
//
// Launch: gocomm_a2av with n blocks of 256 threads (block d sends this PE's rows for PE d;
// block 0 also publishes the row and collects the output splits), then gocomm_a2av_copy
// with any grid to move recv's rows into the caller's output.
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

extern "C" __global__ void gocomm_a2av(const char* __restrict__ in, const int64_t* __restrict__ in_splits,
                                       int64_t* __restrict__ out_splits, int32_t* __restrict__ status,
                                       A2avSym sym, int64_t capacity, int64_t row_bytes, int64_t in_rows,
                                       uint64_t epoch) {
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  const int par = (int)(epoch & 1);
  int64_t* meta = sym.meta + (int64_t)par * n * (n + 1);
  uint64_t* msig = sym.msig + par * n;
  int64_t* mine = meta + (int64_t)me * (n + 1);

  // 1. Block 0 publishes this PE's splits and capacity to every PE (itself included). Splits
  //    that are negative or add up to more rows than the input holds are never trusted: the
  //    PE sends nothing (publishes zeros) and reports status 2.
  if (blockIdx.x == 0) {
    __shared__ int valid;
    if (threadIdx.x == 0) {
      int64_t sum = 0;
      valid = 1;
      for (int j = 0; j < n; j++) {
        if (in_splits[j] < 0) valid = 0;
        sum += in_splits[j];
      }
      if (sum > in_rows) valid = 0;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) mine[j] = valid ? in_splits[j] : 0;
    if (threadIdx.x == 0) mine[n] = capacity;
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      if (p == me) {
        __threadfence();  // the row is here already: make it visible, then signal
        nvshmemx_signal_op(&msig[me], epoch, NVSHMEM_SIGNAL_SET, me);
      } else {
        nvshmem_putmem_signal_nbi(mine, mine, (n + 1) * sizeof(int64_t), &msig[me], epoch, NVSHMEM_SIGNAL_SET, p);
      }
    }
  }
  // 2. Every block waits for every PE's row of this epoch.
  for (int s = threadIdx.x; s < n; s += blockDim.x) nvshmem_signal_wait_until(&msig[s], NVSHMEM_CMP_GE, epoch);
  __syncthreads();

  // 3. Block d sends this PE's rows for PE d at d's offset for this source.
  const int d = blockIdx.x;
  if (d < n) {
    __shared__ int64_t src_off, dst_off, total;
    if (threadIdx.x == 0) {
      int64_t a = 0, b = 0, t = 0;
      for (int j = 0; j < d; j++) a += meta[(int64_t)me * (n + 1) + j];
      for (int s = 0; s < n; s++) {
        int64_t c = meta[(int64_t)s * (n + 1) + d];
        if (s < me) b += c;
        t += c;
      }
      src_off = a, dst_off = b, total = t;
    }
    __syncthreads();
    const int64_t rows = meta[(int64_t)me * (n + 1) + d];
    const int64_t cap = meta[(int64_t)d * (n + 1) + n];
    if (total > cap) {
      // PE d cannot take everything it is sent: nobody writes into it; it reports overflow.
      if (threadIdx.x == 0) {
        nvshmem_uint64_p(&sym.over[me], epoch, d);
        nvshmem_fence();
        nvshmemx_signal_op(&sym.dsig[me], epoch, NVSHMEM_SIGNAL_SET, d);
      }
    } else {
      nvshmemx_putmem_signal_nbi_block(sym.recv + dst_off * row_bytes, in + src_off * row_bytes, rows * row_bytes,
                                       &sym.dsig[me], epoch, NVSHMEM_SIGNAL_SET, d);
    }
  }

  // 4. Block 0 waits for every source and fills the output splits and the status word
  //    (0 ok, 1 this PE's capacity was too small: recv holds nothing of this epoch; 2 this
  //    PE's splits were invalid and it sent nothing).
  if (blockIdx.x == 0) {
    __shared__ int overflow;
    if (threadIdx.x == 0) overflow = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      nvshmem_signal_wait_until(&sym.dsig[s], NVSHMEM_CMP_GE, epoch);
      out_splits[s] = meta[(int64_t)s * (n + 1) + me];
      if (sym.over[s] == epoch) atomicExch(&overflow, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t sum = 0;
      bool bad = false;
      for (int j = 0; j < n; j++) {
        bad |= in_splits[j] < 0;
        sum += in_splits[j];
      }
      *status = (bad || sum > in_rows) ? 2 : overflow;
    }
  }
}

// Copies the received rows (sum of out_splits) from recv into the caller's output, 16 bytes
// at a time where both are aligned; nothing when status says overflow. (Status 2 is about
// what this PE sent: what it received is still good.)
extern "C" __global__ void gocomm_a2av_copy(char* __restrict__ out, const char* __restrict__ recv,
                                            const int64_t* __restrict__ out_splits, const int32_t* __restrict__ status,
                                            int n, int64_t row_bytes) {
  if (*status == 1) return;
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
