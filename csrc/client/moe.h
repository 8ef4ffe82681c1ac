// gocomm.moe's in-process path (the group's exchange is the compiled client's all_to_all_v
// kernel: GPUs that share NVLink) as registered operators, so that a dispatch or a combine is
// one dispatcher op: torch -> C++ -> the launches (kernels/inprocess/moe.cu and a2av_ipc.cu),
// no Python between them. The ops check the arguments, and raise NotImplementedError before
// doing anything where the kernels do not take x or the path no longer serves the group
// (moe.py then takes the others, moe_any.cc); _C.moe_raise_new raises the errors a padded
// dispatch found on the GPU.
//
//   moe_dispatch(x, topk_idx, topk_weights, num_experts, ranks, cap, padded, group_name)
//       -> (recv, tokens_per_expert, ws, counts)
//     route, pack, exchange, group and gather over one workspace ws (combine reads the
//     routing there). ranks: the group's size (the Meta kernel's too). cap: the rows the
//     exchange receives at most. padded: recv has cap x k rows and nothing waits for the GPU
//     (errors are counted in the device's flag words); else one sync: counts is int64 [2n + 4]
//     on the host (meta [n + 2], recv splits [n], pairs, rows received) and recv has the
//     pairs' rows, or, after the exchange, ValueError (an id out of range) or OverflowError
//     (more tokens than cap) where the counts say so.
//     A padded counts is an empty int64 tensor on x's device. Meta kernel: the padded form.
//     topk_idx: any integer dtype, topk_weights: any float dtype, either on any device
//     (copied as int64 / float32 to x's device where they are not so).
//   moe_combine(y, ws, tokens, cap, k, num_experts, recv_rows, send_rows, group_name,
//               topk_idx=None, topk_weights=None) -> out
//     the weighted sums per received token, the exchange back, the sums per token: [tokens,
//     hidden] in y's dtype. recv_rows and send_rows bound what the exchange moves each way.
//     topk_idx / topk_weights (dispatch's): only its backward reads them (autograd.cc).
//   moe_dispatch_ll(x, topk_idx, topk_weights, num_experts, ranks, bound, group_name)
//       -> (recv, tokens_per_expert, ws)
//   moe_combine_ll(y, ws, tokens, bound, k, num_experts, group_name, topk_idx=None,
//                  topk_weights=None) -> out
//     the low-latency mode (docs/decisions/0036): padded's result in one launch each way over
//     the group's LlPath buffer (inprocess.h); NotImplementedError where it cannot run (no
//     in-process exchange, more than kLlTokens tokens, k over kLlMaxK, the buffer declined).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace gocomm::inproc {

// What padded dispatches on device found on the GPU since the last call, one error per call
// (the other stays for the next): 2 a rank was sent more than its bound, 1 an id out of
// range, 0 nothing new, -1 no padded dispatch ran on device (no flag words there).
int moe_flags_new(int device);
// Whether a padded dispatch ran on device (it made the device's flag words).
bool moe_flags_made(int device);
// The error for what moe_flags_new(device) found, as gocomm.moe raises it ("" where nothing is
// new): whether it is Python's OverflowError (else ValueError), and its message.
std::pair<bool, std::string> moe_flags_error(int device, int64_t experts);

}  // namespace gocomm::inproc
