// gocomm.all_to_all_v: every path, for C++ callers (the registered ops, ops.cc; gocomm.moe's
// exchange) and, through the ops, for python/gocomm/sparse.py's wrapper.
//
// The path is chosen per call, as the group's route table says (routes.h):
//   1. the in-process kernel (inprocess.h) where the table keeps the splits on the GPU and the
//      engine serves input's device (set up, collectively, at the group's first call there):
//      no host sync, the output is the whole out buffer;
//   2. else, on the default (world) group with the splits on the GPU, the sidecar's NVSHMEM
//      kernel (Backend::cuda_now): no host sync either; its NVSHMEM unique id is carried between
//      the ranks once per group, by the control plane's setup hook (Backend::Config);
//   3. else the counts cross the host: one all_to_all of the counts, read on the host (the
//      sync), then one all_to_all of the rows, both by the group's own alltoall_base (the
//      sidecar's NCCL for CUDA tensors, the host engine for CPU tensors); the output is out_rows
//      rows where given (the received ones first), else exactly the received rows.
// Paths 2 and 3 of CUDA tensors raise under CUDA graph capture (a replay would not reach the
// sidecar), before anything is queued or sent.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <utility>

namespace gocomm {

// all_to_all_v of input's rows by in_splits (one int32/int64 entry per rank, on input's device
// or the CPU) on the group named group (its pg.group_name).
//   out: the output buffer (input's dtype, device and row shape, contiguous), or null.
//   out_rows: with out null, the output's rows (every path; rows past sum(out_splits)
//     undefined); -1: the path's default (in-process and NVSHMEM: input's rows times the group
//     size, at most what the receive buffer holds; host counts: exactly the received rows). A
//     host-count exchange given out_rows >= 0 raises OverflowError, as with an out of that many
//     rows, where more arrive.
// Input rows past sum(in_splits) are not sent (a padded output goes back as it is); splits that
// add up to more than input's rows raise ValueError on the host-count path, and make this rank
// send nothing on the GPU paths (their kernels check them).
// Returns (output, out_splits): on the GPU paths output is the whole out buffer (rows past
// sum(out_splits) undefined; an overflow shows as sum(out_splits) > its rows, nothing written);
// on the host-count path a view of out's first rows, or a new tensor of out_rows rows (where
// given) or of exactly the received rows (OverflowError where out is too small, after the
// exchange, with nothing written into out). out_splits is on in_splits' device with its dtype.
// Argument errors raise ValueError before anything is sent.
std::pair<at::Tensor, at::Tensor> all_to_all_v_any(const at::Tensor& input, const at::Tensor& in_splits,
                                                   const at::Tensor* out, int64_t out_rows, const std::string& group);

// in_splits on input's device or the CPU, as every path takes them (ValueError naming both).
void check_splits_device(const at::Tensor& input, const at::Tensor& in_splits);

// Raise Python's OverflowError with msg: through the hook the Python module sets (it can name
// Python's exception types; this library cannot), else as a c10::Error.
[[noreturn]] void raise_overflow(const std::string& msg);
void set_overflow_hook(std::function<void(const std::string&)> raise);

// Tests: while set, the host-count path's count exchange is skipped, as an exchange that failed
// without raising (CUDA's, whose error comes with the stream's next op) leaves the counts; the
// call must then raise DistBackendError before sizing the rows' exchange.
void set_count_exchange_skipped(bool skip);

}  // namespace gocomm
