// kernels/inprocess/moe.cu's launches (moe.cubin, loaded by inprocess.cc's Module): each
// kernel's launch shape and argument types, once, for both of gocomm.moe's GPU paths. The
// in-process ops (moe.cc) launch them over one workspace; the other paths (moe_any.cc: NCCL,
// the sidecar's NVSHMEM kernel, their exchange all_to_all_v_any between the launches) call
// the bodies of three registered ops, each [] where the kernels do not take the input (then
// moe_any.cc uses ATen ops):
//
//   moe_route_pack(x, topk_idx, topk_weights, num_experts, ranks) -> Tensor[]
//     [payload [T*n, row] uint8 whose first meta[n] rows are filled, meta int64 [n+2] (rows
//     per rank, their sum, 1 if an id was out of range), send_order int64 [T*n] (the token of
//     each row), t_idx int64 [T*n], t_offs int64 [T+1] (token t's rows are
//     t_idx[t_offs[t]:t_offs[t+1]])]. topk_idx int64 and topk_weights float32 [T, k] on x's
//     device, contiguous. Two launches, no sync.
//   moe_group(recv, id_off, w_off, k, per, out_splits) -> Tensor[]
//     dispatch's receive side: recv [cap, row] uint8 as route_pack packs it, its first
//     sum(out_splits) rows received. [rows_sorted int64 [cap*k], w_sorted float32 [cap*k],
//     tokens_per_expert int64 [per], e_idx int64 [cap*k], e_offs int64 [cap+1], gmeta int64
//     [2] = (pairs, rows)]. Two launches, no sync.
//   moe_wsum(src, idx, weights, offs, rows) -> Tensor[]
//     [out [rows, H] in src's dtype]: out[r] = sum over j in [offs[r], offs[r+1]) of
//     weights[j] * src[idx[j]] in float32, rounded once (a row without terms is zero).
//     idx int64, weights float32 (None: weight 1), offs int64 [rows+1].
//
// No Meta kernels: whether the kernels take the input is known only on the device, and these
// paths read the counts on the host anyway (never captured, never traced).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gocomm::inproc::moe {

constexpr int64_t kRouteMaxRanks = 8;  // the routing kernels keep a token's ranks in a byte
// gocomm.moe.dispatch's checks of x [T, H], topk_idx and topk_weights [T, k] and num_experts on
// a group of n ranks, on every path, with the errors its docstring names (ValueError, TypeError).
void check_args(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, int64_t experts, int64_t n);
// ValueError where topk_idx holds an id outside [-1, experts) (read on the host, for what the
// GPU counted); tail ends the message.
void check_ids(const at::Tensor& idx, int64_t experts, const std::string& tail);
// Python's OverflowError for a dispatch whose rank is sent more tokens than the cap rows it
// receives into: recv, the tokens by source rank.
[[noreturn]] void raise_sent_too_many(const std::vector<int64_t>& recv, int64_t cap);
// ValueError where the routing kernels do not take n ranks (more than kRouteMaxRanks).
void check_ranks(int64_t n);
// TypeError where no sums kernel takes dtype (they take bf16, fp16 and fp32).
void check_sums(at::ScalarType dtype);

// The three ops' bodies (moe_route_pack, moe_group, moe_wsum above), which moe_any.cc's paths
// call too: each [] where the kernels do not take the input.
std::vector<at::Tensor> route_pack_cuda(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                                        int64_t experts, int64_t n);
std::vector<at::Tensor> group_cuda(const at::Tensor& recv, int64_t id_off, int64_t w_off, int64_t k, int64_t per,
                                   const at::Tensor& out_splits);
std::vector<at::Tensor> wsum_cuda(const at::Tensor& src, const at::Tensor& idx, const std::optional<at::Tensor>& w,
                                  const at::Tensor& offs, int64_t rows);

// Why the kernels do not run on device ("" where they do): the module was not built, is built
// for another architecture, or does not load there.
std::string why_not(int device);
// Whether they do; warns once per device where the module does not load.
bool usable(int device);
// Whether the in-process path's kernels take dispatch of x with k choices and per experts a
// rank (and combine of x's dtype). Only what every rank of a group shares decides it (dtype,
// row size, k, experts a rank, the module): a rank whose x alone is a strided or misaligned
// view must not take another path than its peers (they would wait for it until the timeout);
// rows_for_kernels gives the kernels such an x.
bool takes(const at::Tensor& x, int64_t k, int64_t per);
// x as the kernels read it: contiguous and 16-byte aligned (x itself where it is, else a copy).
at::Tensor rows_for_kernels(const at::Tensor& x);

// dispatch's packed row for tokens of xbytes (a multiple of 16) and k choices: x, the local
// ids (int32 [k]) at id_off, the weights (float32 [k]) at w_off; every part 16-byte aligned,
// as moe_any.cc's ATen packing lays it.
struct Row {
  int64_t id_off, w_off, bytes;
};
Row row_layout(int64_t xbytes, int64_t k);

// The routing kernels' grid and block for t tokens (a thread per token).
std::pair<int64_t, int64_t> route_blocks(int64_t t);
// The grouping kernels' grid for at most cap received rows.
int64_t group_blocks(int64_t cap);
// The grouping kernels' block for per local experts; 0 where per is too many.
int64_t group_threads(int64_t per);

// The launches, by address, on device's current stream (moe.cu says what each buffer holds).

// What routing writes: meta [n+2], send_order [t*n], send_rank int32 [t*n], t_idx [t*n], t_offs
// [t+1]; mask (t bytes) and bcount (route_blocks(t).first x (n+2) int64) are its scratch.
struct Routing {
  int64_t meta, send_order, send_rank, t_idx, t_offs, mask, bcount;
};
// gocomm_moe_route_count and _place (one launch where one block takes every token) for t
// tokens of k choices among experts, n ranks (check_ranks); flag: 0 or a host word that counts
// padded dispatches' ids out of range.
void route(int dev, int64_t idx, int64_t t, int64_t k, int64_t experts, int64_t n, const Routing& r, int64_t flag);
// gocomm_moe_pack: payload (rows of row_layout(xbytes, k), at most `rows` of them) gets the r.meta[n]
// rows routing placed.
void pack(int dev, int64_t payload, int64_t x, int64_t idx, int64_t w, const Routing& r, int64_t rows, int64_t n,
          int64_t k, int64_t experts, int64_t xbytes);

// What grouping writes (w_e and back: 0 for none); bhist holds group_blocks(cap) x (per+1) int64.
struct Grouping {
  int64_t rows_sorted, w_sorted, tpe, e_idx, w_e, e_offs, gmeta, back, bhist;
};
// gocomm_moe_group_count and _place (one launch where one block takes every row): recv holds
// at most cap rows of row bytes, the first sum(out_splits[:n]) received; flag as route's.
void group(int dev, int64_t recv, const Row& row, int64_t k, int64_t per, int64_t out_splits, int64_t n, int64_t cap,
           const Grouping& g, int64_t flag);
// gocomm_moe_gather: out[p] = the first nbytes of src's row rows[p] (rows stride apart), for p
// below the int64 count at address count and below cap.
void gather(int dev, int64_t out, int64_t src, int64_t rows, int64_t count, int64_t cap, int64_t stride,
            int64_t nbytes);

// The fused launches of the in-process dispatch (moe.cc): three launches a dispatch with the
// exchange, where route, pack, group and gather take five or six. sync: kSyncWords uint32 of
// the dispatch's own workspace, which route_pack zeroes and group_gather, queued after it on
// the same stream, counts in (moe.cu's gocomm_moe_route_pack says why that is sound).
constexpr int64_t kSyncWords = 4;  // moe.cu's kSyncWords
// route, then pack (rows: the payload's most rows), in one launch of gocomm_moe_route_pack
// where t <= kRoutePackTokens; beyond, route's two launches, then route_pack packing from them.
constexpr int64_t kRoutePackTokens = 1024;  // moe.cu's kRoutePackTokens
void route_pack(int dev, int64_t payload, int64_t x, int64_t idx, int64_t w, int64_t t, int64_t k, int64_t experts,
                int64_t n, const Routing& r, int64_t rows, int64_t xbytes, int64_t sync, int64_t flag);
// group, then gather of the first xbytes of each recv row into out (cap x k rows of xbytes, the
// padded output), in one launch of gocomm_moe_group_gather.
void group_gather(int dev, int64_t recv, const Row& row, int64_t k, int64_t per, int64_t out_splits, int64_t n,
                  int64_t cap, const Grouping& g, int64_t flag, int64_t out, int64_t xbytes, int64_t sync);
// For the tests: the fused launches on tensors, against moe_route_pack and moe_group: route_pack_fused
// gives moe_route_pack's outputs (sync: kSyncWords int32 on x's device, zeroed by the launch);
// group_gather_fused gives moe_group's, then w_e, back [n] and out [rows x k, xbytes] uint8 (sync: as
// route_pack_fused left it).
std::vector<at::Tensor> route_pack_fused(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                                         int64_t experts, int64_t n, const at::Tensor& sync);
std::vector<at::Tensor> group_gather_fused(const at::Tensor& recv, int64_t id_off, int64_t w_off, int64_t k,
                                           int64_t per, const at::Tensor& out_splits, int64_t xbytes,
                                           const at::Tensor& sync);
// gocomm_moe_wsum_<dtype> (check_sums): rows is the most rows,
// nrows (0: none) the address of an int64 count on the GPU that may cut them.
void wsum(int dev, at::ScalarType dtype, int64_t out, int64_t src, int64_t idx, int64_t w, int64_t offs, int64_t rows,
          int64_t nrows, int64_t h);

}  // namespace gocomm::inproc::moe
