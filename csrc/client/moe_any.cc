// gocomm.moe's every path but the in-process one (moe.cc): the group's exchange is NCCL, the
// sidecar's NVSHMEM kernel or the host engine, or the tensors are on the CPU, or fp8, or rows
// the kernels do not take. On CUDA the kernels of moe_kernels.cc route, pack, group and sum;
// elsewhere ATen ops do (the ops moe.py ran in torch, in the same order: the same bytes). The
// exchange of dispatch is all_to_all_v_any (a2av.h); combine's exchange back is the group's
// alltoall_base (both sides know the counts by then). One function per op serves CPU and CUDA
// tensors (CompositeExplicitAutograd); no Meta kernels: these paths read counts on the host.
//
//   moe_dispatch_any(x, topk_idx, topk_weights, num_experts, fp8, max_tokens_per_rank,
//                    padded, group_name) -> Tensor[]
//     moe_check, then moe_route_any, the exchange (into max_tokens_per_rank x n rows, or the
//     receive buffer where the splits stay on the GPU), moe_receive_any. Raises under CUDA
//     graph capture (the counts cross the host), before anything is sent.
//   moe_check(x, topk_idx, topk_weights, num_experts, ranks, fp8, max_tokens_per_rank, padded)
//     raises what gocomm.moe.dispatch documents (ValueError, TypeError) for bad arguments.
//   moe_route_any(x, topk_idx, topk_weights, num_experts, ranks, fp8, trim) -> Tensor[]
//     routed: [payload [S, row] uint8, send_splits [n], x, topk_idx (int64 on x's device),
//     send_order [S] (the token of each row)] and, where the kernels routed it, [meta [n + 2],
//     t_idx, t_offs] (moe_kernels.h). trim: the kernels' payload cut to its rows and
//     send_splits on the host (one sync; the host-count exchange reads them there anyway).
//     The ATen routing syncs once (a nonzero) and raises for ids out of range; the kernels'
//     routing counts them and moe_receive_any raises after the exchange (no peer is left
//     waiting).
//   moe_receive_any(recv, recv_splits, routed, num_experts, fp8, padded_rows) -> Tensor[]
//     what the exchange of routed[0] by routed[1] gave: [tokens [N or padded_rows, H] (fp8:
//     values), scales (fp8, else empty), tokens_per_expert [E/n], handle...], the handle being
//     what moe_combine_any takes. One sync: the counts. OverflowError where more rows arrived
//     than recv holds (the splits-on-GPU paths report it in the counts).
//   moe_combine_any(y, handle, tokens, dtype, padded_rows, group_name, topk_idx=None,
//                   topk_weights=None, num_experts=0) -> [tokens, H] in dtype
//     the weighted sums per received token (float32, one rounding), the exchange back, the sums
//     per token; y has padded_rows rows where dispatch padded (only the grouped ones are read).
//     The last three (dispatch's) only its backward reads (autograd.cc).
//
// The handle: [send_order, splits (int64 [2n] on the host: sent, received by rank), rows [P]
// (the received row of each grouped row), weights [P] float32] and, where the kernels grouped
// the rows, [e_idx, e_offs, t_idx, t_offs], combine's two sums as (terms, offsets) (made in
// combine otherwise).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include <numeric>
#include <string>
#include <vector>

#include "a2av.h"
#include "backend.h"
#include "cuda_driver.h"
#include "moe_kernels.h"

namespace gocomm::inproc::moe {

void check_args(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, int64_t experts, int64_t n) {
  TORCH_CHECK_VALUE(x.dim() == 2, "gocomm moe.dispatch: x must be [tokens, hidden], got shape " + shape_name(x.sizes()));
  const int64_t t = x.size(0);
  TORCH_CHECK_VALUE(idx.dim() == 2 && idx.size(0) == t && w.sizes() == idx.sizes(),
                    "gocomm moe.dispatch: topk_idx " + shape_name(idx.sizes()) + " and topk_weights " +
                        shape_name(w.sizes()) + " must both be [" + std::to_string(t) + ", k]");
  TORCH_CHECK_TYPE(c10::isIntegralType(idx.scalar_type(), false),
                   "gocomm moe.dispatch: topk_idx must hold integers, got " + dtype_name(idx.scalar_type()));
  TORCH_CHECK_VALUE(experts > 0 && experts % n == 0, "gocomm moe.dispatch: " + std::to_string(experts) +
                                                         " experts do not spread evenly over " + std::to_string(n) +
                                                         " ranks");
}

void check_ids(const at::Tensor& idx, int64_t experts, const std::string& tail) {
  if (idx.numel() == 0) {
    return;
  }
  const auto [lo_t, hi_t] = at::aminmax(idx);
  const int64_t lo = lo_t.item<int64_t>(), hi = hi_t.item<int64_t>();
  TORCH_CHECK_VALUE(lo >= -1 && hi < experts, "gocomm moe.dispatch: topk_idx must be in [-1, " +
                                                  std::to_string(experts) + "), got " + std::to_string(lo) + ".." +
                                                  std::to_string(hi) + tail);
}

namespace {

int64_t sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t(0));
}

}  // namespace

void raise_sent_too_many(const std::vector<int64_t>& recv, int64_t cap) {
  raise_overflow("gocomm moe.dispatch: this rank is sent " + std::to_string(sum(recv)) + " tokens (" + list_name(recv) +
                 " by source rank), more than max_tokens_per_rank x group size = " + std::to_string(cap) +
                 "; nothing was received");
}

namespace {

constexpr int64_t kFp8Block = 128;  // channels per scale in fp8 dispatch (moe.FP8_BLOCK)
constexpr double kFp8Max = 448.0;   // largest finite float8_e4m3fn

// routed's and the handle's entries
enum { kPayload, kSendSplits, kX, kIdx, kSendOrder, kMeta, kTIdx, kTOffs };
enum { kHSendOrder, kHSplits, kHRows, kHWeights, kHEIdx, kHEOffs, kHTIdx, kHTOffs };

// A packed row's parts, as (elements per row, dtype): x (fp8: its values, then a float32 scale
// per kFp8Block channels), the local expert ids (int32 [k]) and the weights (float32 [k]).
std::vector<std::pair<int64_t, at::ScalarType>> parts_of(int64_t h, at::ScalarType dtype, int64_t k, bool fp8) {
  if (fp8) {
    return {{h, at::kFloat8_e4m3fn}, {h / kFp8Block, at::kFloat}, {k, at::kInt}, {k, at::kFloat}};
  }
  return {{h, dtype}, {k, at::kInt}, {k, at::kFloat}};
}

// Each part's byte offset in a packed row, 16-byte aligned, and (last) the row's size: it
// depends on the parts' widths and dtypes only, so every rank packs the same way (for x of
// a non-fp8 dtype, what moe_kernels' row_layout gives).
std::vector<int64_t> offsets_of(const std::vector<std::pair<int64_t, at::ScalarType>>& parts) {
  std::vector<int64_t> offs;
  int64_t at = 0;
  for (const auto& [width, dtype] : parts) {
    offs.push_back(at);
    at += (width * int64_t(c10::elementSize(dtype)) + 15) / 16 * 16;
  }
  offs.push_back(at);
  return offs;
}

// The part at byte offset off of buf's rows, width elements of dtype (a view).
at::Tensor unpack(const at::Tensor& buf, int64_t off, int64_t width, at::ScalarType dtype) {
  return buf.slice(1, off, off + width * int64_t(c10::elementSize(dtype))).view(dtype);
}

void check(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights, int64_t experts,
           int64_t n, bool fp8, std::optional<int64_t> max_tokens, bool padded) {
  check_args(x, topk_idx, topk_weights, experts, n);
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK_VALUE(!fp8 || h % kFp8Block == 0, "gocomm moe.dispatch: fp8 needs hidden (" + std::to_string(h) +
                                                    ") to be a multiple of " + std::to_string(kFp8Block));
  TORCH_CHECK_VALUE(!padded || max_tokens.has_value(),
                    "gocomm moe.dispatch: padded needs max_tokens_per_rank (it sizes the output)");
  TORCH_CHECK_VALUE(!max_tokens.has_value() || *max_tokens >= t, "gocomm moe.dispatch: max_tokens_per_rank " +
                                                                     std::to_string(max_tokens.value_or(0)) +
                                                                     " < this rank's " + std::to_string(t) + " tokens");
}

// dispatch's routing and packing in ATen ops (CPU tensors, fp8, rows the kernels do not take):
// [payload, send_splits, send_order]. Syncs once (the nonzero).
std::vector<at::Tensor> route_aten(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w32, int64_t experts,
                                   int64_t n, bool fp8) {
  const int64_t t = x.size(0), h = x.size(1), k = idx.size(1), per = experts / n;
  // Only ops that need no host sync until the one nonzero: a token's destinations as a [T, n]
  // mask, filled by scatter (a boolean index would sync twice); entries out of range choose
  // nothing here and raise below.
  const at::Tensor ok = idx.ge(0).logical_and(idx.lt(experts));
  const at::Tensor dest = at::where(ok, idx.floor_divide(per), n);  // [T, K] rank of each expert; n: none
  const at::Tensor hit = at::zeros({t, n + 1}, x.options().dtype(at::kBool)).scatter_(1, dest, true).slice(1, 0, n);
  const at::Tensor send_splits = hit.sum(0);
  const at::Tensor pairs = hit.t().nonzero();  // (rank, token), by rank then token: the sync
  check_ids(idx, experts, "");
  const at::Tensor send_order = pairs.select(1, 1);
  const at::Tensor dest_rows = pairs.select(1, 0).unsqueeze(1);
  const at::Tensor mine = dest.index_select(0, send_order).eq(dest_rows);
  const at::Tensor local = at::where(mine, idx.index_select(0, send_order) - dest_rows * per, -1).to(at::kInt);
  const at::Tensor wts = at::where(mine, w32.index_select(0, send_order), 0.0);
  // One exchange moves each token with its routing (local expert ids and weights) in the same
  // row, so the receiver needs no second exchange and no counts beforehand.
  std::vector<at::Tensor> parts;
  if (fp8) {
    const at::Tensor blocks = x.index_select(0, send_order).to(at::kFloat).view({-1, h / kFp8Block, kFp8Block});
    const at::Tensor scale = blocks.abs().amax(2).clamp_min(1e-12) / kFp8Max;  // [S, H/128]
    parts = {(blocks / scale.unsqueeze(2)).to(at::kFloat8_e4m3fn).view({-1, h}), scale, local, wts};
  } else {
    parts = {x.index_select(0, send_order), local, wts};
  }
  const std::vector<int64_t> offs = offsets_of(parts_of(h, x.scalar_type(), k, fp8));
  const int64_t rows = send_order.size(0);
  at::Tensor payload = at::empty({rows, offs.back()}, x.options().dtype(at::kByte));
  for (size_t i = 0; rows && i < parts.size(); i++) {  // each part [S, width], contiguous
    payload.slice(1, offs[i], offs[i] + parts[i].size(1) * parts[i].element_size()).copy_(parts[i].view(at::kByte));
  }
  return {payload, send_splits, send_order};
}

std::vector<at::Tensor> route_any(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                                  int64_t experts, int64_t n, bool fp8, bool trim) {
  TORCH_CHECK_VALUE(x.dim() == 2 && n > 0 && experts > 0 && experts % n == 0,
                    "gocomm moe_route_any: x [tokens, hidden], num_experts a multiple of ranks");
  const at::Tensor idx = topk_idx.to(x.device(), at::kLong).contiguous();
  const at::Tensor w32 = topk_weights.to(x.device(), at::kFloat).contiguous();
  // the kernels ([] where they do not take x: ATen routes it)
  std::vector<at::Tensor> routed = x.is_cuda() && !fp8 ? route_pack_cuda(x, idx, w32, experts, n)
                                                       : std::vector<at::Tensor>{};
  if (routed.empty()) {
    auto r = route_aten(x, idx, w32, experts, n, fp8);
    return {r[0], r[1], x, idx, r[2]};
  }
  // Two kernels routed and packed on the GPU; ids out of range chose nothing there and raise
  // after the exchange (every rank takes part in it, so none is left waiting).
  at::Tensor payload = routed[0], meta = routed[1], send_splits = meta.slice(0, 0, n);
  if (trim) {  // NCCL and the host engine read the splits on the host anyway
    const at::Tensor m = meta.cpu();
    payload = payload.slice(0, 0, m.data_ptr<int64_t>()[n]);
    send_splits = m.slice(0, 0, n).clone();
  }
  return {payload, send_splits, x, idx, routed[2], meta, routed[3], routed[4]};
}

// dispatch's grouping by expert in ATen ops (one more sync, a nonzero): [the received row of
// each grouped row, its weight, tokens per expert].
std::vector<at::Tensor> group_aten(const at::Tensor& local_ids, const at::Tensor& recv_w, int64_t per) {
  const at::Tensor recv_local = local_ids.to(at::kLong);
  const at::Tensor nz = recv_local.ge(0).nonzero();
  const at::Tensor r_rows = nz.select(1, 0), r_k = nz.select(1, 1);
  const at::Tensor experts = recv_local.index({r_rows, r_k});
  const at::Tensor order =
      at::argsort(experts * std::max<int64_t>(1, recv_local.size(0)) + r_rows, /*stable=*/true, 0, false);
  // bincount would sync for the largest id
  const at::Tensor tpe = at::zeros({per}, recv_local.options()).index_add_(0, experts, at::ones_like(experts));
  return {r_rows.index_select(0, order), recv_w.index({r_rows, r_k}).index_select(0, order), tpe};
}

std::vector<at::Tensor> receive_any(const at::Tensor& recv_in, const at::Tensor& recv_splits,
                                    const std::vector<at::Tensor>& routed, int64_t experts, bool fp8,
                                    int64_t padded_rows) {
  TORCH_CHECK_VALUE(routed.size() == kMeta || routed.size() == kTOffs + 1,
                    "gocomm moe_receive_any: routed is what moe_route_any returned");
  const at::Tensor &x = routed[kX], &idx = routed[kIdx];
  const bool kernels = routed.size() > kMeta;
  const int64_t n = routed[kSendSplits].numel(), h = x.size(1), k = idx.size(1), per = experts / n;
  const auto parts = parts_of(h, x.scalar_type(), k, fp8);
  const std::vector<int64_t> offs = offsets_of(parts);
  const at::Tensor recv_t = recv_splits.to(x.device(), at::kLong);
  // Routed on the GPU: grouped by expert there too, before the one read of the counts.
  const std::vector<at::Tensor> grouped =
      kernels ? group_cuda(recv_in, offs[1], offs[2], k, per, recv_t) : std::vector<at::Tensor>{};
  std::vector<at::Tensor> first = {kernels ? routed[kMeta] : routed[kSendSplits].to(x.device()), recv_t};
  if (!grouped.empty()) {
    first.push_back(grouped.back());
  }
  const at::Tensor counts_t = at::cat(first).cpu();
  const int64_t* c = counts_t.data_ptr<int64_t>();
  const int64_t recv_at = kernels ? n + 2 : n;
  const std::vector<int64_t> send(c, c + n), recv(c + recv_at, c + recv_at + n);
  at::Tensor send_order = routed[kSendOrder];
  if (kernels) {
    send_order = send_order.slice(0, 0, c[n]);
    if (c[n + 1] != 0) {
      check_ids(idx, experts, " (those entries were sent nowhere)");
    }
  }
  const int64_t rows = sum(recv);
  if (rows > recv_in.size(0)) {  // the NVSHMEM path reports overflow in the counts
    raise_sent_too_many(recv, recv_in.size(0));
  }
  std::vector<at::Tensor> got;
  std::vector<at::Tensor> handle;
  at::Tensor tpe;
  if (!grouped.empty()) {
    const int64_t pairs = c[counts_t.numel() - 2];
    tpe = grouped[2];
    // only the x part of the received rows is cut out; the kernels read the rest through
    // their offsets
    got = {unpack(recv_in, offs[0], h, x.scalar_type())};
    handle = {send_order,
              at::Tensor(),
              grouped[0].slice(0, 0, pairs),
              grouped[1].slice(0, 0, pairs),
              grouped[3].slice(0, 0, pairs),
              grouped[4].slice(0, 0, rows + 1),
              routed[kTIdx],  // read within t_offs only
              routed[kTOffs]};
  } else {
    const at::Tensor r = recv_in.slice(0, 0, rows);
    for (size_t i = 0; i < parts.size(); i++) {
      got.push_back(unpack(r, offs[i], parts[i].first, parts[i].second));
    }
    auto g = group_aten(got[got.size() - 2], got.back(), per);
    tpe = g[2];
    handle = {send_order, at::Tensor(), g[0], g[1]};
    got.resize(got.size() - 2);
  }
  std::vector<int64_t> both = send;
  both.insert(both.end(), recv.begin(), recv.end());
  handle[kHSplits] = at::tensor(both, at::kLong);
  const at::Tensor& rows_sorted = handle[kHRows];
  std::vector<at::Tensor> out;
  for (const at::Tensor& part : got) {
    at::Tensor o = part.index_select(0, rows_sorted);
    if (padded_rows) {  // the same shapes as where nothing syncs: the most rows, the grouped ones first
      at::Tensor full = at::empty({padded_rows, o.size(1)}, o.options());
      full.slice(0, 0, o.size(0)).copy_(o);
      o = full;
    }
    out.push_back(o);
  }
  if (!fp8) {
    out.push_back(at::empty({0}, x.options()));
  }
  out.push_back(tpe);
  out.insert(out.end(), handle.begin(), handle.end());
  return out;
}

// t's rows sent to the group's ranks by send, received by recv: the group's all_to_all_single
// (both sides know the counts).
at::Tensor move(const at::Tensor& t, std::vector<int64_t> send, std::vector<int64_t> recv, const std::string& group) {
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = sum(recv);
  at::Tensor out = at::empty(shape, t.options());
  at::Tensor in = t;
  c10d::resolve_process_group(group)->alltoall_base(out, in, recv, send)->wait();
  return out;
}

// keys' rows as (terms, offsets): the indices that sort keys, and where each of 0..n starts.
std::pair<at::Tensor, at::Tensor> csr(const at::Tensor& keys, int64_t n) {
  const at::Tensor order = at::argsort(keys, /*stable=*/true, 0, false);
  return {order, at::searchsorted(keys.index_select(0, order), at::arange(n + 1, keys.options()))};
}

at::Tensor combine_any(const at::Tensor& y_in, const std::vector<at::Tensor>& handle, int64_t tokens,
                       at::ScalarType dtype, int64_t padded_rows, const std::string& group,
                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK_VALUE(handle.size() == kHWeights + 1 || handle.size() == kHTOffs + 1,
                    "gocomm moe_combine_any: handle is what moe_receive_any returned");
  const at::Tensor &send_order = handle[kHSendOrder], &rows_sorted = handle[kHRows], &weights = handle[kHWeights];
  const int64_t rows_y = padded_rows ? padded_rows : rows_sorted.size(0);
  TORCH_CHECK_VALUE(y_in.dim() == 2 && y_in.size(0) == rows_y, "gocomm moe.combine: y must be [" +
                                                                   std::to_string(rows_y) +
                                                                   ", hidden] (dispatch's rows), got " +
                                                                   shape_name(y_in.sizes()));
  const at::Tensor y = padded_rows ? y_in.slice(0, 0, rows_sorted.size(0)) : y_in;
  const int64_t h = y.size(1);
  const at::Tensor sp = handle[kHSplits];
  const int64_t n = sp.numel() / 2;
  const int64_t* s = sp.data_ptr<int64_t>();
  const std::vector<int64_t> sent(s, s + n), received(s + n, s + 2 * n);
  const int64_t rows = sum(received);
  if (y.is_cuda() && y.scalar_type() == dtype && usable(y.get_device())) {
    // Two launches of one kernel ([] where it does not take the rows), each reading its input
    // once: every received token's expert rows weighted and summed (float32, one rounding),
    // sent back, then every token's partial sums added up in rank order.
    at::Tensor e_idx, e_offs, t_idx, t_offs;
    if (handle.size() > kHEIdx) {
      e_idx = handle[kHEIdx], e_offs = handle[kHEOffs], t_idx = handle[kHTIdx], t_offs = handle[kHTOffs];
    } else {
      std::tie(e_idx, e_offs) = csr(rows_sorted, rows);
      std::tie(t_idx, t_offs) = csr(send_order, tokens);
    }
    auto partial = wsum_cuda(y.contiguous(), e_idx, weights.index_select(0, e_idx), e_offs, rows);
    if (!partial.empty()) {
      auto out = wsum_cuda(move(partial[0], received, sent, group), t_idx, std::nullopt, t_offs, tokens);
      if (!out.empty()) {
        return out[0];
      }
    }
  }
  at::Tensor partial = at::zeros({rows, h}, y.options().dtype(at::kFloat));
  partial.index_add_(0, rows_sorted, y.to(at::kFloat) * weights.unsqueeze(1));
  const at::Tensor back = move(partial.to(dtype), received, sent, group);
  at::Tensor out = at::zeros({tokens, h}, y.options().dtype(at::kFloat));
  out.index_add_(0, send_order, back.to(at::kFloat));
  return out.to(dtype);
}

std::vector<at::Tensor> dispatch_any(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                                     int64_t experts, bool fp8, std::optional<int64_t> max_tokens, bool padded,
                                     const std::string& group) {
  const auto pg = c10d::resolve_process_group(group);
  const int64_t n = pg->getSize();
  check(x, topk_idx, topk_weights, experts, n, fp8, max_tokens, padded);
  // the exchange's path, as all_to_all_v_any takes it: with the splits on the GPU (the
  // in-process kernel, the sidecar's NVSHMEM kernel) or the counts through the host
  auto* b = dynamic_cast<Backend*>(pg->getBackend(x.device().type()).get());
  bool on_gpu = false;
  if (b != nullptr && x.is_cuda()) {
    const int dev = x.get_device();
    const auto& routes = b->config().routes;
    on_gpu = routes && routes->splits_on_gpu() && (b->engine().a2av_path(dev) != nullptr || routes->nvshmem());
    if (cuda::capture_info(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream()).active) {
      b->refuse_capture("moe.dispatch",
                        "on this group (or with fp8, or this shape) its exchange reads the counts on the host");
    }
  }
  const std::vector<at::Tensor> routed = route_any(x, topk_idx, topk_weights, experts, n, fp8, !on_gpu);
  const at::Tensor& payload = routed[kPayload];
  const int64_t row = payload.size(1);
  at::Tensor out;  // the receive capacity: the bound, or the receive buffer where nothing syncs
  if (max_tokens.has_value()) {
    out = at::empty({*max_tokens * n, row}, payload.options());
  } else if (on_gpu) {
    out = at::empty({b->config().inprocess.a2a_recv_bytes / std::max<int64_t>(row, 1), row}, payload.options());
  }
  const auto [recv, recv_splits] =
      all_to_all_v_any(payload, routed[kSendSplits], out.defined() ? &out : nullptr, -1, group);
  return receive_any(recv, recv_splits, routed, experts, fp8, padded ? *max_tokens * n * topk_idx.size(1) : 0);
}

}  // namespace
}  // namespace gocomm::inproc::moe

TORCH_LIBRARY_FRAGMENT(gocomm, m) {
  m.def(
      "moe_check(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int ranks, bool fp8, "
      "int? max_tokens_per_rank, bool padded) -> ()");
  m.def(
      "moe_dispatch_any(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, bool fp8, "
      "int? max_tokens_per_rank, bool padded, str group_name) -> Tensor[]");
  m.def(
      "moe_route_any(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int ranks, bool fp8, "
      "bool trim) -> Tensor[]");
  m.def(
      "moe_receive_any(Tensor recv, Tensor recv_splits, Tensor[] routed, int num_experts, bool fp8, "
      "int padded_rows) -> Tensor[]");
  m.def(
      "moe_combine_any(Tensor y, Tensor[] handle, int tokens, ScalarType dtype, int padded_rows, str group_name, "
      "Tensor? topk_idx=None, Tensor? topk_weights=None, int num_experts=0) -> Tensor");
}

// one function for either device: the CUDA kernels where they take the rows, ATen elsewhere
TORCH_LIBRARY_IMPL(gocomm, CompositeExplicitAutograd, m) {
  m.impl("moe_check", &gocomm::inproc::moe::check);
  m.impl("moe_route_any", &gocomm::inproc::moe::route_any);
  m.impl("moe_receive_any", &gocomm::inproc::moe::receive_any);
}

// The exchanging ops on real tensors only: torch.compile's fake tensors reach their Meta
// kernels, which raise NotImplementedError (their rows depend on the routing, or on counts
// read on the host), so Dynamo breaks the graph there and runs them eagerly, never the
// exchange on meta tensors.
namespace gocomm::inproc::moe {
namespace {
std::vector<at::Tensor> dispatch_any_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
                                          std::optional<int64_t>, bool, const std::string&) {
  C10_THROW_ERROR(NotImplementedError, "gocomm moe_dispatch_any: its outputs' shapes are known after the exchange "
                                       "only (a graph break; on the in-process path moe_dispatch(padded=True) traces)");
}

at::Tensor combine_any_meta(const at::Tensor&, const std::vector<at::Tensor>&, int64_t, at::ScalarType, int64_t,
                            const std::string&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            int64_t) {
  C10_THROW_ERROR(NotImplementedError, "gocomm moe_combine_any: runs eagerly, after its dispatch (a graph break)");
}
}  // namespace
}  // namespace gocomm::inproc::moe

TORCH_LIBRARY_IMPL(gocomm, CPU, m) {
  m.impl("moe_dispatch_any", &gocomm::inproc::moe::dispatch_any);
  m.impl("moe_combine_any", &gocomm::inproc::moe::combine_any);
}

TORCH_LIBRARY_IMPL(gocomm, CUDA, m) {
  m.impl("moe_dispatch_any", &gocomm::inproc::moe::dispatch_any);
  m.impl("moe_combine_any", &gocomm::inproc::moe::combine_any);
}

TORCH_LIBRARY_IMPL(gocomm, Meta, m) {
  m.impl("moe_dispatch_any", &gocomm::inproc::moe::dispatch_any_meta);
  m.impl("moe_combine_any", &gocomm::inproc::moe::combine_any_meta);
}
