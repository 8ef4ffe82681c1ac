#include "moe.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "backend.h"
#include "inprocess.h"
#include "moe_kernels.h"

namespace gocomm::inproc {

namespace {

int64_t up(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The workspace's named regions (each 256-byte aligned) for one shape, as byte offsets: what
// lives with the handle (ws), then what lives through the dispatch only (payload, recv).
// tokens_per_expert is a tensor of its own (an output must not alias another).
struct Carve {
  enum {
    kCounts, kSendOrder, kSendRank, kTIdx, kTOffs, kMask, kBcount, kBhist, kRowsSorted, kWSorted, kEIdx,
    kWE, kEOffs, kCsplits, kBackSplits, kSync, kN
  };
  int64_t at[kN] = {};
  int64_t size = 0, recv_splits = 0, gmeta = 0, recv = 0, big = 0;  // the payload at 0 of big

  Carve(int64_t t, int64_t n, int64_t k, int64_t per, int64_t cap, int64_t payload_bytes, int64_t recv_bytes) {
    const int64_t sizes[kN] = {
        (2 * n + 4) * 8,  // meta [n + 2] (send splits, sent, bad), recv splits [n], gmeta [2] (pairs, rows)
        t * n * 8, t * n * 4, t * n * 8, (t + 1) * 8, t, moe::route_blocks(t).first * (n + 2) * 8,
        moe::group_blocks(cap) * (per + 1) * 8,
        // a row's pairs: one per topk entry on this rank (k, duplicated ids included)
        cap * k * 8, cap * k * 4, cap * k * 8, cap * k * 4, (cap + 1) * 8,
        n * 8,  // what combine sends back to each rank (zeros after an overflow)
        n * 8,
        moe::kSyncWords * 4,  // the fused grouping's counts (moe::route_pack zeroes them, group_gather counts)
    };
    for (int i = 0; i < kN; i++) {
      at[i] = size;
      size += up(std::max<int64_t>(sizes[i], 1), 256) * 256;
    }
    recv_splits = at[kCounts] + (n + 2) * 8;
    gmeta = at[kCounts] + (2 * n + 2) * 8;
    recv = up(std::max<int64_t>(payload_bytes, 1), 256) * 256;
    big = recv + up(std::max<int64_t>(recv_bytes, 1), 256) * 256;
  }
};

// The flag words of one device: host memory the routing and grouping kernels count in (padded
// dispatches that found an id out of range [0], or overflowed [1]). The GPU only adds to them
// and the host only reads them (seen: what it reported), so none is lost.
struct Flags {
  void* host = nullptr;
  cuda::DevPtr dev = 0;
  uint32_t seen[2] = {0, 0};
};
std::mutex flags_mu;
std::map<int, Flags> flags;

// flag_word's answers for devices 0..63, which never change once made (a padded dispatch
// asks on every call)
std::atomic<cuda::DevPtr> flag_words[64];

cuda::DevPtr flag_word(int device) {
  const bool cached = device >= 0 && device < 64;
  if (cached) {
    if (const cuda::DevPtr p = flag_words[device].load(std::memory_order_acquire)) {
      return p;
    }
  }
  std::lock_guard<std::mutex> lock(flags_mu);
  auto it = flags.find(device);
  if (it != flags.end()) {
    return it->second.dev;
  }
  Flags f;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cuda::ensure_context(device);
  cuda::host_words(64, &f.host, &f.dev);
  flags[device] = f;
  if (cached) {
    flag_words[device].store(f.dev, std::memory_order_release);
  }
  return f.dev;
}

std::pair<Backend*, std::shared_ptr<A2Path>> path_of(const std::string& group, const at::Tensor& x,
                                                     const char* op) {
  Backend& b = Backend::of(group, op);
  return {&b, b.a2av_path_for(x, op)};
}

uint64_t addr(const at::Tensor& t) {
  return reinterpret_cast<uint64_t>(t.data_ptr());
}

// v as st on x's device, contiguous, as the kernels read topk_idx (int64) and topk_weights
// (float32): v itself where it is (a conversion is a dispatcher call even where nothing
// changes, so it is asked first).
at::Tensor on_x(const at::Tensor& x, const at::Tensor& v, at::ScalarType st) {
  return v.device() == x.device() && v.scalar_type() == st && v.is_contiguous() ? v : v.to(x.device(), st).contiguous();
}

// gocomm.moe.dispatch's arguments on a group of n ranks, with the errors of its other paths
// (moe_kernels' check_args; moe.py's fast path leaves them to the op); then whether the kernels
// take x (moe_kernels' takes, the rule moe.py asks through _C.moe_takes before the path is
// chosen): NotImplementedError where not, and moe.py takes its other paths. Raised before
// anything is done.
void check_dispatch(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, int64_t experts, int64_t n,
                    int64_t cap, bool padded) {
  moe::check_args(x, idx, w, experts, n);
  const int64_t t = x.size(0);
  // padded: cap is max_tokens_per_rank x n
  TORCH_CHECK_VALUE(!padded || cap >= t * n, "gocomm moe.dispatch: max_tokens_per_rank " + std::to_string(cap / n) +
                                                 " < this rank's " + std::to_string(t) + " tokens");
  TORCH_CHECK_VALUE(cap >= 0, "gocomm moe_dispatch: cap must be >= 0, got " + std::to_string(cap));
  const auto s = x.scalar_type();
  TORCH_CHECK_NOT_IMPLEMENTED(moe::takes(x, idx.size(1), experts / n),
                              "gocomm moe.dispatch: the in-process kernels do not take x (" + dtype_name(s) +
                                  ", rows of a multiple of 16 bytes) with k " +
                                  std::to_string(idx.size(1)) + " and " + std::to_string(experts / n) +
                                  " experts per rank");
}

// The low-latency mode (docs/decisions/0036): the padded dispatch's result in one launch over
// the group's low-latency buffer (inprocess.h's LlPath), combine in one launch. The fields of
// the call's workspace, as Carve lays it out for cap rows.
void ws_fields(LlArgs& a, const at::Tensor& ws, const Carve& c) {
  const uint64_t base = uint64_t(addr(ws));
  auto at_ = [&](int i) { return base + uint64_t(c.at[i]); };
  a.meta = at_(Carve::kCounts);
  a.send_order = at_(Carve::kSendOrder);
  a.send_rank = at_(Carve::kSendRank);
  a.t_idx = at_(Carve::kTIdx);
  a.t_offs = at_(Carve::kTOffs);
  a.rows_sorted = at_(Carve::kRowsSorted);
  a.w_sorted = at_(Carve::kWSorted);
  a.e_idx = at_(Carve::kEIdx);
  a.w_e = at_(Carve::kWE);
  a.e_offs = at_(Carve::kEOffs);
  a.gmeta = base + uint64_t(c.gmeta);
  a.rcount = at_(Carve::kCsplits);  // the rows received from each source
}

// A low-latency dispatch's workspace: the three-launch one's size (Carve's), from torch's
// allocator as every output, with ll_workspace_free as its DataPtr's deleter. That is how
// moe_combine tells which kernels a padded dispatch ran: the Meta kernel gives both the same
// shape (it cannot know), so the shape cannot say it.
void ll_workspace_free(void* held) {
  delete static_cast<c10::DataPtr*>(held);  // the allocator's own DataPtr frees the block
}

at::Tensor ll_workspace(int64_t bytes, const at::TensorOptions& o) {
  at::Tensor ws = fresh({bytes}, o);
  c10::StorageImpl* st = ws.storage().unsafeGetStorageImpl();
  auto held = std::make_unique<c10::DataPtr>(st->set_data_ptr(c10::DataPtr(nullptr, ws.device())));
  void* p = held->get();
  st->set_data_ptr_noswap(c10::DataPtr(p, held.release(), &ll_workspace_free, ws.device()));
  return ws;
}

bool is_ll_workspace(const at::Tensor& ws) {
  return ws.has_storage() && ws.storage().data_ptr().get_deleter() == &ll_workspace_free;
}

// The low-latency grouping's runs of rows for per local experts: a warp each, as many as
// kLlSmem holds counts for.
int64_t ll_segs(int64_t per) {
  return std::clamp<int64_t>(kLlSmem / ((per + 1) * 4), 1, kLlThreads / 32);
}

// Whether the low-latency kernels take a call's shapes (bound, k, experts a rank, packed row).
bool ll_takes(int64_t bound, int64_t k, int64_t per, const moe::Row& layout) {
  return bound <= kLlTokens && k <= kLlMaxK && per <= kLlMaxPer && layout.bytes < (int64_t(1) << 20);
}

// Whether a buffer of shape has holds a call of these shapes.
bool ll_holds(const LlShape& has, int64_t bound, const moe::Row& layout, int64_t xbytes) {
  return bound <= has.slots && layout.bytes <= has.slot_bytes && xbytes <= has.cslot_bytes;
}

// The group's low-latency buffer on a2's device where it takes a padded dispatch of these
// shapes (docs/decisions/0039): the one there, or one set up now where there is none, no
// capture is open and GOCOMM_MOE_LL_MB allows its size; else null, and the three-launch
// kernels run. None where two ranks of the group share a GPU: the one-launch kernels wait for
// every block of every rank, which must all fit on it at once (the three launches need not).
// Every rank decides alike: the group's padded calls share their shapes and the knob, whether
// ranks share a GPU is the group's (every rank's record at a2's setup), and a buffer is set up
// on every rank or declined on every rank.
std::shared_ptr<LlPath> padded_ll(Engine& e, const A2Path& a2, int64_t bound, int64_t k, int64_t per,
                                  const moe::Row& layout, int64_t xbytes) {
  const int dev = a2.device();
  if (!ll_takes(bound, k, per, layout) || a2.gpus_shared()) {
    return nullptr;
  }
  std::shared_ptr<LlPath> ll = e.ll_path(dev, LlShape{});
  const LlShape want{std::max<int64_t>(bound, 1), layout.bytes, xbytes};
  if (!ll && want.bytes(e.size()) <= e.settings().moe_ll_bytes &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    ll = e.ll_path(dev, want);  // collective at the group's first padded dispatch on dev
  }
  return ll && ll_holds(ll->shape(), bound, layout, xbytes) ? ll : nullptr;
}

// One low-latency dispatch on ll (which holds its shapes): out, tokens_per_expert and the
// workspace combine reads. The caller holds a guard of ll's device and gave idx and w as
// the kernels read them (on_x).
std::tuple<at::Tensor, at::Tensor, at::Tensor> launch_ll(LlPath& ll, const at::Tensor& x, const at::Tensor& idx,
                                                         const at::Tensor& w, int64_t experts, int64_t n, int64_t cap,
                                                         const moe::Row& layout) {
  const int64_t t = x.size(0), h = x.size(1), k = idx.size(1), per = experts / n;
  const int64_t xbytes = h * x.element_size();
  const Carve c(t, n, k, per, cap, 0, 0);
  at::Tensor ws = ll_workspace(c.size, x.options().dtype(at::kByte));
  at::Tensor tpe = fresh({per}, x.options().dtype(at::kLong));
  at::Tensor out = fresh({cap * k, h}, x.options());
  LlArgs a = ll.args();
  a.x = uint64_t(addr(x));
  a.idx = uint64_t(addr(idx));
  a.w = uint64_t(addr(w));
  a.out = uint64_t(addr(out));
  a.tpe = uint64_t(addr(tpe));
  ws_fields(a, ws, c);
  a.flag = uint64_t(flag_word(ll.device()));
  a.tokens = t, a.k = k, a.experts = experts, a.per = per, a.xbytes = xbytes;
  a.id_off = layout.id_off, a.w_off = layout.w_off, a.row_bytes = layout.bytes;
  a.cap = cap, a.hbytes = xbytes, a.segs = ll_segs(per);
  // a thread a token (the routing), a warp a run of rows (the grouping)
  ll.dispatch(a, unsigned(kLlThreads), unsigned(a.segs * (per + 1) * 4));
  return {out, tpe, ws};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_ll_cuda(const at::Tensor& x_in, const at::Tensor& topk_idx,
                                                                const at::Tensor& topk_weights, int64_t experts,
                                                                int64_t ranks, int64_t bound, std::string group) {
  const char* op = "moe.dispatch(low_latency=True)";
  auto [b, a2] = path_of(group, x_in, op);  // NotImplementedError where the group's exchange is not in-process
  const int64_t n = b->engine().size();
  TORCH_CHECK_VALUE(ranks == n, "gocomm moe_dispatch_ll: group '" + group + "' has " + std::to_string(n) +
                                    " ranks, not " + std::to_string(ranks));
  TORCH_CHECK_VALUE(bound >= 0, "gocomm moe.dispatch(low_latency=True): max_tokens_per_rank must be >= 0, got " +
                                    std::to_string(bound));
  const int64_t cap = bound * n;
  check_dispatch(x_in, topk_idx, topk_weights, experts, n, cap, true);
  const at::Tensor x = moe::rows_for_kernels(x_in);
  const int64_t h = x.size(1), k = topk_idx.size(1), per = experts / n;
  const int64_t xbytes = h * x.element_size();
  const moe::Row layout = moe::row_layout(xbytes, k);
  TORCH_CHECK_NOT_IMPLEMENTED(ll_takes(bound, k, per, layout),
                              "gocomm " + std::string(op) + ": its kernels take at most " + std::to_string(kLlTokens) +
                                  " tokens a rank, k <= " + std::to_string(kLlMaxK) + ", at most " +
                                  std::to_string(kLlMaxPer) + " experts a rank and rows under 1 MiB, got " +
                                  std::to_string(bound) + " tokens, k " + std::to_string(k) + ", " +
                                  std::to_string(per) + " experts a rank");
  const int dev = a2->device();
  auto ll = b->engine().ll_path(dev, LlShape{std::max<int64_t>(bound, 1), layout.bytes, xbytes});
  TORCH_CHECK_NOT_IMPLEMENTED(ll, "gocomm " + std::string(op) + ": group '" + group +
                                      "' declined its buffer on cuda:" + std::to_string(dev) + " (logged why)");
  const LlShape& has = ll->shape();
  TORCH_CHECK_VALUE(ll_holds(has, bound, layout, xbytes),
                    "gocomm " + std::string(op) + ": group '" + group + "''s buffer on cuda:" + std::to_string(dev) +
                        " was sized by its first low-latency or padded dispatch: max_tokens_per_rank " +
                        std::to_string(has.slots) + ", rows of " + std::to_string(has.cslot_bytes) +
                        " bytes, " + std::to_string(has.slot_bytes) + " bytes with the ids and weights; this call " +
                        "needs " + std::to_string(bound) + ", " + std::to_string(xbytes) + " and " +
                        std::to_string(layout.bytes) + " (make the first call the largest)");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  return launch_ll(*ll, x, on_x(x, topk_idx, at::kLong), on_x(x, topk_weights, at::kFloat), experts, n, cap, layout);
}

// One low-latency combine: y of dispatch's rows, ws its workspace (checked here).
at::Tensor ll_combine(Backend& b, A2Path& a2, const at::Tensor& y_in, const at::Tensor& ws, int64_t tokens,
                      int64_t cap, int64_t k, int64_t experts, const std::string& group) {
  const int64_t n = b.engine().size(), per = experts / n;
  const int dev = a2.device();
  auto ll = b.engine().ll_path(dev, LlShape{});
  TORCH_CHECK(ll, "gocomm moe.combine: no low-latency dispatch ran on group '" + group + "' on cuda:" +
                      std::to_string(dev));
  const at::Tensor y = moe::rows_for_kernels(y_in);
  const int64_t hbytes = y.size(1) * y.element_size();
  TORCH_CHECK_VALUE(hbytes % 16 == 0 && hbytes <= ll->shape().cslot_bytes && y.size(0) == cap * k,
                    "gocomm moe.combine: y must be [" + std::to_string(cap * k) + ", hidden] with rows of a " +
                        "multiple of 16 bytes, at most dispatch's x's, got " + shape_name(y.sizes()));
  moe::check_sums(y.scalar_type());
  const Carve c(tokens, n, k, per, cap, 0, 0);
  TORCH_CHECK_VALUE(ws.dim() == 1 && ws.scalar_type() == at::kByte && ws.device() == y.device() &&
                        ws.size(0) >= c.size && is_ll_workspace(ws),
                    "gocomm moe_combine_ll: dispatch's workspace on y's device, for these sizes");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  at::Tensor out = fresh({tokens, y.size(1)}, y.options());
  LlArgs a = ll->args();
  a.x = uint64_t(addr(y));
  a.out = uint64_t(addr(out));
  ws_fields(a, ws, c);
  a.tokens = tokens, a.k = k, a.experts = experts, a.per = per, a.cap = cap, a.hbytes = hbytes;
  ll->combine(a, y.scalar_type());
  return out;
}

at::Tensor combine_ll_cuda(const at::Tensor& y_in, const at::Tensor& ws, int64_t tokens, int64_t bound, int64_t k,
                           int64_t experts, std::string group, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&) {
  TORCH_CHECK_VALUE(y_in.dim() == 2, "gocomm moe.combine: y must be [rows, hidden], got shape " +
                                         shape_name(y_in.sizes()));
  auto [b, a2] = path_of(group, y_in, "moe.combine");
  return ll_combine(*b, *a2, y_in, ws, tokens, bound * b->engine().size(), k, experts, group);
}

// combine_bytes: the rows its combine will carry where wider than x's (autograd's dispatch of
// narrow rows whose combine sends back the gradient, x's width): the one-launch kernels run
// only where the group's buffer takes those too, as its combine needs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dispatch_cuda(const at::Tensor& x_in,
                                                                         const at::Tensor& topk_idx,
                                                                         const at::Tensor& topk_weights,
                                                                         int64_t experts, int64_t ranks, int64_t cap,
                                                                         bool padded, std::string group,
                                                                         int64_t combine_bytes) {
  auto [b, path] = path_of(group, x_in, "moe.dispatch");
  const int64_t n = b->engine().size();
  TORCH_CHECK_VALUE(ranks == n, "gocomm moe_dispatch: group '" + group + "' has " + std::to_string(n) +
                                    " ranks, not " + std::to_string(ranks));
  check_dispatch(x_in, topk_idx, topk_weights, experts, n, cap, padded);
  const at::Tensor x = moe::rows_for_kernels(x_in);
  // int64 ids and float32 weights on x's device, contiguous, as the kernels read them (no copy
  // where they are)
  const at::Tensor idx = on_x(x, topk_idx, at::kLong), w = on_x(x, topk_weights, at::kFloat);
  const int64_t t = x.size(0), h = x.size(1), k = idx.size(1), per = experts / n;
  moe::check_ranks(n);
  const int dev = path->device();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  const int64_t xbytes = h * x.element_size();
  const moe::Row layout = moe::row_layout(xbytes, k);
  if (padded) {  // one launch where the group's low-latency buffer takes the call (0039)
    if (auto ll = padded_ll(b->engine(), *path, cap / n, k, per, layout, std::max(xbytes, combine_bytes))) {
      auto [out, tpe, ws] = launch_ll(*ll, x, idx, w, experts, n, cap, layout);
      return {out, tpe, ws, fresh({0}, x.options().dtype(at::kLong))};
    }
  }
  const int64_t row = layout.bytes;
  const int64_t send_cap = t * std::min(n, k);
  const Carve c(t, n, k, per, cap, send_cap * row, cap * row);
  const auto bytes = x.options().dtype(at::kByte);
  at::Tensor ws = fresh({c.size}, bytes);
  at::Tensor tpe = fresh({per}, x.options().dtype(at::kLong));
  const uint64_t base = addr(ws);
  auto at_ = [&](int i) { return int64_t(base + uint64_t(c.at[i])); };
  const int64_t meta = at_(Carve::kCounts), recv_splits = int64_t(base) + c.recv_splits,
                gmeta = int64_t(base) + c.gmeta;
  // the payload and the exchange's output live only through this call (freed in stream order:
  // the kernels below are queued before any reuse)
  at::Tensor tmp = fresh({c.big}, bytes);
  const int64_t payload = int64_t(addr(tmp)), recv = payload + c.recv;
  const int64_t flag = padded ? int64_t(flag_word(dev)) : 0;  // a synced dispatch raises at once
  const int64_t xi = int64_t(addr(x)), ii = int64_t(addr(idx)), wi = int64_t(addr(w));
  const moe::Routing routing{meta,          at_(Carve::kSendOrder), at_(Carve::kSendRank), at_(Carve::kTIdx),
                             at_(Carve::kTOffs), at_(Carve::kMask),      at_(Carve::kBcount)};
  moe::route_pack(dev, payload, xi, ii, wi, t, k, experts, n, routing, send_cap, xbytes, at_(Carve::kSync), flag);
  path->exchange(uint64_t(payload), send_cap, uint64_t(meta), false, nullptr, uint64_t(recv), cap,
                 uint64_t(recv_splits), row);
  const moe::Grouping grouping{at_(Carve::kRowsSorted), at_(Carve::kWSorted), int64_t(addr(tpe)),
                               at_(Carve::kEIdx),       at_(Carve::kWE),      at_(Carve::kEOffs),
                               gmeta,                   at_(Carve::kCsplits), at_(Carve::kBhist)};
  if (padded) {  // grouped and gathered in one launch, into every row the output may need
    at::Tensor out = fresh({cap * k, h}, x.options());
    moe::group_gather(dev, recv, layout, k, per, recv_splits, n, cap, grouping, flag, int64_t(addr(out)), xbytes,
                      at_(Carve::kSync));
    return {out, tpe, ws, fresh({0}, x.options().dtype(at::kLong))};
  }
  moe::group(dev, recv, layout, k, per, recv_splits, n, cap, grouping, flag);
  const at::Tensor counts = ws.slice(0, 0, (2 * n + 4) * 8).view(at::kLong).cpu();  // the one sync
  const int64_t* v = counts.data_ptr<int64_t>();
  int64_t got = 0;
  for (int64_t r = 0; r < n; r++) {
    got += v[n + 2 + r];
  }
  // an id out of range, or more rows than cap (the exchange wrote nothing): raised after the
  // exchange, which every rank took part in
  if (v[n + 1] != 0) {
    moe::check_ids(idx, experts, " (those entries were sent nowhere)");
  }
  if (got > cap) {
    moe::raise_sent_too_many(std::vector<int64_t>(v + n + 2, v + 2 * n + 2), cap);
  }
  const int64_t rows = v[2 * n + 2];
  at::Tensor out = fresh({rows, h}, x.options());
  if (rows) {
    moe::gather(dev, int64_t(addr(out)), recv, at_(Carve::kRowsSorted), gmeta, rows, row, xbytes);
  }
  return {out, tpe, ws, counts};
}

at::Tensor combine_cuda(const at::Tensor& y_in, const at::Tensor& ws, int64_t tokens, int64_t cap, int64_t k,
                        int64_t experts, int64_t recv_rows, int64_t send_rows, std::string group,
                        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  // moe.py checked y's rows, dtype and device against dispatch's; the rest here
  TORCH_CHECK_VALUE(y_in.dim() == 2, "gocomm moe.combine: y must be [rows, hidden], got shape " +
                                         shape_name(y_in.sizes()));
  TORCH_CHECK_VALUE((y_in.size(1) * y_in.element_size()) % 16 == 0,
                    "gocomm moe.combine: y's rows must be a multiple of 16 bytes like dispatch's x, got " +
                        std::to_string(y_in.size(1)));
  auto [b, path] = path_of(group, y_in, "moe.combine");
  if (is_ll_workspace(ws)) {  // a padded dispatch that ran the low-latency kernels
    return ll_combine(*b, *path, y_in, ws, tokens, cap, k, experts, group);
  }
  const int64_t n = b->engine().size(), per = experts / n;
  const int dev = path->device();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  const at::Tensor y = moe::rows_for_kernels(y_in);
  const int64_t h = y.size(1), row = h * y.element_size();
  const Carve c(tokens, n, k, per, cap, 0, 0);
  TORCH_CHECK_VALUE(y.dim() == 2 && ws.dim() == 1 && ws.scalar_type() == at::kByte && ws.device() == y.device() &&
                        ws.size(0) >= c.size && recv_rows >= 0 && recv_rows <= cap && send_rows >= 0,
                    "gocomm moe_combine: y [rows, H] and dispatch's workspace on y's device, for these sizes");
  const uint64_t base = addr(ws);
  auto at_ = [&](int i) { return int64_t(base + uint64_t(c.at[i])); };
  const at::ScalarType dtype = y.scalar_type();
  moe::check_sums(dtype);
  at::Tensor tmp = fresh({recv_rows * h + send_rows * h}, y.options());
  const int64_t partial = int64_t(addr(tmp)), back = partial + recv_rows * row;
  if (recv_rows) {  // gmeta[1]: the rows received
    moe::wsum(dev, dtype, partial, int64_t(addr(y)), at_(Carve::kEIdx), at_(Carve::kWE), at_(Carve::kEOffs),
              recv_rows, int64_t(base) + c.gmeta + 8, h);
  }
  path->exchange(uint64_t(partial), recv_rows, uint64_t(at_(Carve::kCsplits)), false, nullptr, uint64_t(back),
                 send_rows, uint64_t(at_(Carve::kBackSplits)), row);
  at::Tensor out = fresh({tokens, h}, y.options());
  if (tokens) {
    moe::wsum(dev, dtype, int64_t(addr(out)), back, at_(Carve::kTIdx), 0, at_(Carve::kTOffs), tokens, 0, h);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dispatch_ll_meta(const at::Tensor& x, const at::Tensor& idx,
                                                                const at::Tensor&, int64_t experts, int64_t ranks,
                                                                int64_t bound, std::string) {
  TORCH_CHECK_VALUE(ranks > 0 && experts > 0 && experts % ranks == 0,
                    "gocomm moe_dispatch_ll: num_experts must spread evenly over the ranks");
  const int64_t t = x.size(0), h = x.size(1), k = idx.size(1), per = experts / ranks, cap = bound * ranks;
  const Carve c(t, ranks, k, per, cap, 0, 0);
  return {at::empty({cap * k, h}, x.options()), at::empty({per}, x.options().dtype(at::kLong)),
          at::empty({c.size}, x.options().dtype(at::kByte))};
}

at::Tensor combine_ll_meta(const at::Tensor& y, const at::Tensor&, int64_t tokens, int64_t, int64_t, int64_t,
                           std::string, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  return at::empty({tokens, y.size(1)}, y.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dispatch_meta(const at::Tensor& x, const at::Tensor& idx,
                                                                         const at::Tensor&, int64_t experts,
                                                                         int64_t ranks, int64_t cap, bool padded,
                                                                         std::string, int64_t) {
  TORCH_CHECK_NOT_IMPLEMENTED(padded, "gocomm moe_dispatch: without padded its output's rows depend on the routing");
  TORCH_CHECK_VALUE(ranks > 0 && experts > 0 && experts % ranks == 0,
                    "gocomm moe_dispatch: num_experts must spread evenly over the ranks");
  const int64_t t = x.size(0), h = x.size(1), k = idx.size(1), per = experts / ranks;
  const Carve c(t, ranks, k, per, cap, 0, 0);
  return {at::empty({cap * k, h}, x.options()), at::empty({per}, x.options().dtype(at::kLong)),
          at::empty({c.size}, x.options().dtype(at::kByte)), at::empty({0}, x.options().dtype(at::kLong))};
}

at::Tensor combine_meta(const at::Tensor& y, const at::Tensor&, int64_t tokens, int64_t, int64_t, int64_t, int64_t,
                        int64_t, std::string, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  return at::empty({tokens, y.size(1)}, y.options());
}

}  // namespace

bool moe_flags_made(int device) {
  std::lock_guard<std::mutex> lock(flags_mu);
  return flags.count(device) != 0;
}

int moe_flags_new(int device) {
  std::lock_guard<std::mutex> lock(flags_mu);
  auto it = flags.find(device);
  if (it == flags.end()) {
    return -1;
  }
  Flags& f = it->second;
  const volatile uint32_t* words = static_cast<const volatile uint32_t*>(f.host);
  const uint32_t got[2] = {words[0], words[1]};
  if (got[0] == f.seen[0] && got[1] == f.seen[1]) {
    return 0;
  }
  const int i = got[1] != f.seen[1] ? 1 : 0;  // one error per call: the other stays for the next
  f.seen[i] = got[i];
  return i + 1;
}

std::pair<bool, std::string> moe_flags_error(int device, int64_t experts) {
  switch (moe_flags_new(device)) {
    case 2:
      return {true,
              "gocomm moe: a padded dispatch on this device was sent more tokens than max_tokens_per_rank x group "
              "size; it received none, and its combine sent nothing back (a rank dispatched more than the bound)"};
    case 1:
      return {false, "gocomm moe: a padded dispatch on this device had topk_idx outside [-1, " +
                         std::to_string(experts) + ") (those entries were sent nowhere)"};
    default:
      return {false, ""};
  }
}

}  // namespace gocomm::inproc

TORCH_LIBRARY_FRAGMENT(gocomm, m) {
  m.def(
      "moe_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int ranks, int cap, bool padded, "
      "str group_name, int combine_bytes=0) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "moe_combine(Tensor y, Tensor ws, int tokens, int cap, int k, int num_experts, int recv_rows, int send_rows, "
      "str group_name, Tensor? topk_idx=None, Tensor? topk_weights=None) -> Tensor");
  m.def(
      "moe_dispatch_ll(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int ranks, int bound, "
      "str group_name) -> (Tensor, Tensor, Tensor)");
  m.def(
      "moe_combine_ll(Tensor y, Tensor ws, int tokens, int bound, int k, int num_experts, str group_name, "
      "Tensor? topk_idx=None, Tensor? topk_weights=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(gocomm, CUDA, m) {
  m.impl("moe_dispatch", &gocomm::inproc::dispatch_cuda);
  m.impl("moe_combine", &gocomm::inproc::combine_cuda);
  m.impl("moe_dispatch_ll", &gocomm::inproc::dispatch_ll_cuda);
  m.impl("moe_combine_ll", &gocomm::inproc::combine_ll_cuda);
}

TORCH_LIBRARY_IMPL(gocomm, Meta, m) {
  m.impl("moe_dispatch", &gocomm::inproc::dispatch_meta);
  m.impl("moe_combine", &gocomm::inproc::combine_meta);
  m.impl("moe_dispatch_ll", &gocomm::inproc::dispatch_ll_meta);
  m.impl("moe_combine_ll", &gocomm::inproc::combine_ll_meta);
}
