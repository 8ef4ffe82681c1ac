#include "moe_kernels.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "inprocess.h"

namespace gocomm::inproc::moe {

namespace {

constexpr const char* kModule = "moe.cubin";
// the fused kernels, by these addresses in resident's table too
constexpr const char* kRoutePack = "gocomm_moe_route_pack";
constexpr const char* kGroupGather = "gocomm_moe_group_gather";
constexpr int64_t kGroupSmem = (48 << 10) - 512;  // under 48 KiB, less the static scan and words

int64_t up(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The block of the kernels that take a row of nbytes (a multiple of 16) per block: a thread
// per 16 bytes, in whole warps, at most 256.
int64_t row_block(int64_t nbytes) {
  return std::min<int64_t>(256, std::max<int64_t>(32, up(nbytes / 16, 32) * 32));
}

// Queue kernel name of moe.cubin on device's current stream; sig: a letter per argument, as
// moe.cu declares them (P an address, q an int64, i an int32).
void launch_moe(int dev, const char* name, int64_t grid, int64_t block, int64_t smem, const char* sig,
                const std::vector<int64_t>& vals) {
  launch(kModule, dev, name, unsigned(grid), unsigned(block), unsigned(smem), sig, vals);
}

// How many blocks of kernel name (block threads, smem bytes of dynamic shared memory) device
// runs at once, asked of the driver once a shape (name: kRoutePack or kGroupGather, known by
// its address).
int64_t resident(int dev, const char* name, int64_t block, int64_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const char*, int64_t, int64_t>, int64_t> known;
  const auto key = std::make_tuple(dev, name, block, smem);
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(key);
  if (it == known.end()) {
    const int per_sm = cuda::blocks_per_sm(Module::get(kModule).function(dev, name), int(block), size_t(smem));
    it = known.emplace(key, int64_t(cuda::sm_count(dev)) * std::max(1, per_sm)).first;
  }
  return it->second;
}

const char* wsum_kernel(at::ScalarType s) {
  switch (s) {
    case at::kBFloat16: return "gocomm_moe_wsum_bf16";
    case at::kHalf: return "gocomm_moe_wsum_f16";
    case at::kFloat: return "gocomm_moe_wsum_f32";
    default: return nullptr;
  }
}

int64_t addr(const at::Tensor& t) {
  return int64_t(reinterpret_cast<uintptr_t>(t.data_ptr()));
}

// t's address, 0 for an empty tensor (the kernels read none of it)
int64_t addr_or_0(const at::Tensor& t) {
  return t.numel() ? addr(t) : 0;
}

}  // namespace

// The routing's outputs and scratch on x's device for t tokens, n ranks and top-k rows of xbytes,
// and the Routing naming them (moe_route_pack and its fused twin return the same five).
struct RouteOut {
  at::Tensor meta, send_order, send_rank, payload, t_idx, t_offs, mask, bcount;
  Routing r;
  RouteOut(const at::Tensor& x, int64_t t, int64_t n, int64_t k, int64_t xbytes) {
    const auto on = x.options();
    meta = at::empty({n + 2}, on.dtype(at::kLong));
    send_order = at::empty({t * n}, on.dtype(at::kLong));
    send_rank = at::empty({t * n}, on.dtype(at::kInt));
    payload = at::empty({t * n, row_layout(xbytes, k).bytes}, on.dtype(at::kByte));
    t_idx = at::empty({t * n}, on.dtype(at::kLong));
    t_offs = at::empty({t + 1}, on.dtype(at::kLong));
    mask = at::empty({t}, on.dtype(at::kByte));
    bcount = at::empty({route_blocks(t).first * (n + 2)}, on.dtype(at::kLong));
    r = Routing{addr(meta), addr(send_order), addr(send_rank), addr(t_idx), addr(t_offs), addr(mask), addr(bcount)};
  }
};

std::vector<at::Tensor> route_pack_cuda(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                                        int64_t experts, int64_t n) {
  const int64_t t = x.dim() == 2 ? x.size(0) : 0, xbytes = x.dim() == 2 ? x.size(1) * x.element_size() : 0;
  if (!x.is_cuda() || !usable(x.get_device()) || t == 0 || xbytes % 16 || !x.is_contiguous() || addr(x) % 16 ||
      idx.dim() != 2 || idx.size(1) == 0 || n > kRouteMaxRanks) {
    return {};
  }
  // the caller (moe_any.cc) made them so; the kernels read them without looking
  TORCH_CHECK_VALUE(idx.size(0) == t && w.sizes() == idx.sizes() && idx.scalar_type() == at::kLong &&
                        w.scalar_type() == at::kFloat && idx.is_contiguous() && w.is_contiguous() &&
                        idx.device() == x.device() && w.device() == x.device() && n > 0 && experts > 0 &&
                        experts % n == 0,
                    "gocomm moe_route_pack: topk_idx int64 and topk_weights float32 [T, k] contiguous on x's "
                    "device, num_experts a multiple of ranks");
  const int dev = x.get_device();
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = idx.size(1);
  RouteOut o(x, t, n, k, xbytes);
  const Routing& r = o.r;
  route(dev, addr(idx), t, k, experts, n, r, 0);
  pack(dev, addr(o.payload), addr(x), addr(idx), addr(w), r, t * n, n, k, experts, xbytes);
  // mask and bcount were made on this stream: freeing them now is safe, the caching allocator
  // reuses memory in stream order
  return {o.payload, o.meta, o.send_order, o.t_idx, o.t_offs};
}

// The grouping's outputs and scratch on recv's device for cap rows of k choices and per local
// experts, and the Grouping naming them; with n > 0 also the combine-side words (w_e, and back
// for n ranks), which the fused grouping writes too.
struct GroupOut {
  at::Tensor rows_sorted, w_sorted, tpe, e_idx, w_e, e_offs, gmeta, back, bhist;
  Grouping g;
  GroupOut(const at::Tensor& recv, int64_t cap, int64_t k, int64_t per, int64_t n) {
    const auto on = recv.options();
    rows_sorted = at::empty({cap * k}, on.dtype(at::kLong));
    w_sorted = at::empty({cap * k}, on.dtype(at::kFloat));
    tpe = at::empty({per}, on.dtype(at::kLong));
    e_idx = at::empty({cap * k}, on.dtype(at::kLong));
    e_offs = at::empty({cap + 1}, on.dtype(at::kLong));
    gmeta = at::empty({2}, on.dtype(at::kLong));
    bhist = at::empty({group_blocks(cap) * (per + 1)}, on.dtype(at::kLong));
    if (n > 0) {
      w_e = at::empty({cap * k}, on.dtype(at::kFloat));
      back = at::empty({n}, on.dtype(at::kLong));
    }
    g = Grouping{addr(rows_sorted), addr(w_sorted), addr(tpe),         addr(e_idx),  n > 0 ? addr(w_e) : 0,
                 addr(e_offs),      addr(gmeta),    n > 0 ? addr(back) : 0, addr(bhist)};
  }
};

std::vector<at::Tensor> group_cuda(const at::Tensor& recv, int64_t id_off, int64_t w_off, int64_t k, int64_t per,
                                   const at::Tensor& out_splits) {
  if (!recv.is_cuda() || !usable(recv.get_device()) || !group_threads(per) || !recv.is_contiguous() || k == 0) {
    return {};
  }
  TORCH_CHECK_VALUE(recv.dim() == 2 && recv.scalar_type() == at::kByte && k > 0 && id_off >= 0 &&
                        id_off + k * 4 <= recv.size(1) && w_off >= 0 && w_off + k * 4 <= recv.size(1),
                    "gocomm moe_group: recv [rows, row] uint8 holding k local ids at id_off and k weights at w_off");
  const int dev = recv.get_device();
  c10::cuda::CUDAGuard guard(recv.device());
  const int64_t cap = recv.size(0);
  const at::Tensor splits = out_splits.to(recv.device(), at::kLong).contiguous();
  GroupOut o(recv, cap, k, per, 0);
  group(dev, addr(recv), Row{id_off, w_off, recv.size(1)}, k, per, addr(splits), splits.numel(), cap, o.g, 0);
  return {o.rows_sorted, o.w_sorted, o.tpe, o.e_idx, o.e_offs, o.gmeta};
}

std::vector<at::Tensor> wsum_cuda(const at::Tensor& src, const at::Tensor& idx_in,
                                  const std::optional<at::Tensor>& w_in, const at::Tensor& offs_in, int64_t rows) {
  const int64_t h = src.dim() == 2 ? src.size(1) : 0;
  if (!src.is_cuda() || !usable(src.get_device()) || !wsum_kernel(src.scalar_type()) || src.dim() != 2 ||
      (h * src.element_size()) % 16 || !src.is_contiguous() || addr(src) % 16) {
    return {};
  }
  TORCH_CHECK_VALUE(rows >= 0 && offs_in.numel() == rows + 1,
                    "gocomm moe_wsum: offs holds rows + 1 offsets, got " + std::to_string(offs_in.numel()) +
                        " for " + std::to_string(rows) + " rows");
  const int dev = src.get_device();
  c10::cuda::CUDAGuard guard(src.device());
  at::Tensor out = at::empty({rows, h}, src.options());
  if (rows == 0) {
    return {out};
  }
  // made (or used) on this stream: freeing them after the launch is safe, the caching
  // allocator reuses memory in stream order
  const at::Tensor idx = idx_in.to(src.device(), at::kLong).contiguous();
  const at::Tensor offs = offs_in.to(src.device(), at::kLong).contiguous();
  at::Tensor w;
  if (w_in.has_value()) {
    w = w_in->to(src.device(), at::kFloat).contiguous();
  }
  wsum(dev, src.scalar_type(), addr(out), addr_or_0(src), addr_or_0(idx), w.defined() ? addr_or_0(w) : 0, addr(offs),
       rows, 0, h);
  return {out};
}

std::string why_not(int device) {
  return Module::get(kModule).why_not(device);
}

bool usable(int device) {
  // a device whose module loaded stays usable: the lookups below run until it has (every
  // dispatch asks, through takes)
  static std::atomic<uint64_t> loaded{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (bit != 0 && (loaded.load(std::memory_order_relaxed) & bit) != 0) {
    return true;
  }
  const std::string why = why_not(device);
  if (why.rfind(kLoadFailed, 0) == 0) {
    static std::mutex mu;
    static std::set<int> warned;
    std::lock_guard<std::mutex> lock(mu);
    if (warned.insert(device).second) {
      TORCH_WARN("gocomm: MoE kernels fall back to torch ops: ", why);
    }
  }
  if (why.empty()) {
    loaded.fetch_or(bit, std::memory_order_relaxed);
  }
  return why.empty();
}

bool takes(const at::Tensor& x, int64_t k, int64_t per) {
  const int64_t xbytes = x.dim() == 2 ? x.size(1) * x.element_size() : 1;
  return x.is_cuda() && wsum_kernel(x.scalar_type()) != nullptr && k > 0 && xbytes % 16 == 0 &&
         usable(x.get_device()) && group_threads(per) > 0;
}

at::Tensor rows_for_kernels(const at::Tensor& x) {
  const at::Tensor c = x.contiguous();
  return addr(c) % 16 == 0 ? c : c.clone();
}

Row row_layout(int64_t xbytes, int64_t k) {
  const int64_t w_off = xbytes + up(k * 4, 16) * 16;
  return {xbytes, w_off, w_off + up(k * 4, 16) * 16};
}

std::pair<int64_t, int64_t> route_blocks(int64_t t) {
  const int64_t threads = std::min<int64_t>(1024, std::max<int64_t>(32, up(t, 32) * 32));
  return {std::max<int64_t>(1, up(t, threads)), threads};
}

// about 32 rows a block (one block of 64 threads for 256 rows took 21 us where 8 blocks took 11.7)
int64_t group_blocks(int64_t cap) {
  return std::max<int64_t>(1, std::min<int64_t>(64, up(cap, 32)));
}

// the histogram is per x (threads + 1) int32 in shared memory, after per int64
int64_t group_threads(int64_t per) {
  const int64_t t =
      std::min<int64_t>(1024, ((kGroupSmem - per * 8) / (4 * std::max<int64_t>(per, 1)) - 1) / 32 * 32);
  return t >= 32 ? t : 0;
}

void check_ranks(int64_t n) {
  if (n > kRouteMaxRanks) {
    C10_THROW_ERROR(ValueError, "gocomm: the routing kernels take at most " + std::to_string(kRouteMaxRanks) +
                                    " ranks, got " + std::to_string(n));
  }
}

void check_sums(at::ScalarType dtype) {
  if (wsum_kernel(dtype) == nullptr) {
    C10_THROW_ERROR(TypeError, std::string("gocomm moe: no sums kernel for ") + c10::toString(dtype));
  }
}

void route(int dev, int64_t idx, int64_t t, int64_t k, int64_t experts, int64_t n, const Routing& r, int64_t flag) {
  check_ranks(n);
  const int64_t per = experts / n;
  const auto [grid, block] = route_blocks(t);
  if (grid == 1) {  // both passes in one launch
    launch_moe(dev, "gocomm_moe_route", 1, block, 0, "PqiqiiPPPPPPPP",
               {idx, t, k, experts, per, n, r.mask, r.bcount, r.meta, r.send_order, r.send_rank, r.t_idx, r.t_offs,
                flag});
    return;
  }
  launch_moe(dev, "gocomm_moe_route_count", grid, block, 0, "PqiqiiPP",
             {idx, t, k, experts, per, n, r.mask, r.bcount});
  launch_moe(dev, "gocomm_moe_route_place", grid, block, 0, "qiPPPPPPPP",
             {t, n, r.mask, r.bcount, r.meta, r.send_order, r.send_rank, r.t_idx, r.t_offs, flag});
}

void pack(int dev, int64_t payload, int64_t x, int64_t idx, int64_t w, const Routing& r, int64_t rows, int64_t n,
          int64_t k, int64_t experts, int64_t xbytes) {
  const Row row = row_layout(xbytes, k);
  launch_moe(dev, "gocomm_moe_pack", std::min<int64_t>(rows, 4096), row_block(xbytes), 0, "PPPPPPPiiqiqqqq",
             {payload, x, idx, w, r.meta, r.send_order, r.send_rank, n, k, experts, experts / n, xbytes, row.id_off,
              row.w_off, row.bytes});
}

void group(int dev, int64_t recv, const Row& row, int64_t k, int64_t per, int64_t out_splits, int64_t n, int64_t cap,
           const Grouping& g, int64_t flag) {
  const int64_t threads = group_threads(per), blocks = group_blocks(cap);
  const int64_t smem = per * 8 + per * (threads + 1) * 4;
  const std::vector<int64_t> args = {recv,          row.bytes, row.id_off, row.w_off, k,       per,    out_splits,
                                     n,             cap,       g.bhist,    g.rows_sorted, g.w_sorted, g.tpe, g.e_idx,
                                     g.w_e,         g.e_offs,  g.gmeta,    g.back,    flag};
  if (blocks == 1) {  // both passes in one launch
    launch_moe(dev, "gocomm_moe_group", 1, threads, smem, "PqqqiiPiqPPPPPPPPPP", args);
    return;
  }
  launch_moe(dev, "gocomm_moe_group_count", blocks, threads, per * (threads + 1) * 4, "PqqiiPiqP",
             {recv, row.bytes, row.id_off, k, per, out_splits, n, cap, g.bhist});
  launch_moe(dev, "gocomm_moe_group_place", blocks, threads, smem, "PqqqiiPiqPPPPPPPPPP", args);
}

void gather(int dev, int64_t out, int64_t src, int64_t rows, int64_t count, int64_t cap, int64_t stride,
            int64_t nbytes) {
  launch_moe(dev, "gocomm_moe_gather", std::min<int64_t>(cap, 2048), row_block(nbytes), 0, "PPPPqqq",
             {out, src, rows, count, cap, stride, nbytes});
}

void route_pack(int dev, int64_t payload, int64_t x, int64_t idx, int64_t w, int64_t t, int64_t k, int64_t experts,
                int64_t n, const Routing& r, int64_t rows, int64_t xbytes, int64_t sync, int64_t flag) {
  check_ranks(n);
  const Row row = row_layout(xbytes, k);
  int64_t routed = 0, grid = 0, block = 0;
  if (t > kRoutePackTokens) {  // routed by blocks of their own first, then packed as pack packs
    route(dev, idx, t, k, experts, n, r, flag);
    routed = 1, block = row_block(xbytes), grid = std::clamp<int64_t>(rows, 1, 4096);
  } else {  // every block routes every token: as many blocks as run at once, a thread per token
    block = std::max(route_blocks(t).second, row_block(xbytes));
    grid = std::clamp<int64_t>(rows, 1, resident(dev, kRoutePack, block, 0));
  }
  launch_moe(dev, kRoutePack, grid, block, 0, "PPPPqiqiiPPPPPPiqqqqP",
             {payload, x, idx, w, t, k, experts, experts / n, n, r.meta, r.send_order, r.send_rank, r.t_idx, r.t_offs,
              flag, routed, xbytes, row.id_off, row.w_off, row.bytes, sync});
}

void group_gather(int dev, int64_t recv, const Row& row, int64_t k, int64_t per, int64_t out_splits, int64_t n,
                  int64_t cap, const Grouping& g, int64_t flag, int64_t out, int64_t xbytes, int64_t sync) {
  // the gathering blocks have the grouping's block and shared memory: at most 256 threads, as
  // many of them as run at once beside the 2G (G where G is 1) grouping blocks
  const int64_t threads = std::min<int64_t>(group_threads(per), 256), blocks = group_blocks(cap);
  const int64_t smem = per * 8 + per * (threads + 1) * 4, rows = cap * k;
  const int64_t grid =
      (blocks == 1 ? 1 : 2 * blocks) + std::clamp<int64_t>(rows, 1, resident(dev, kGroupGather, threads, smem));
  launch_moe(dev, kGroupGather, grid, threads, smem, "PqqqiiPiqPPPPPPPPPPiPqqP",
             {recv, row.bytes, row.id_off, row.w_off, k, per, out_splits, n, cap, g.bhist, g.rows_sorted, g.w_sorted,
              g.tpe, g.e_idx, g.w_e, g.e_offs, g.gmeta, g.back, flag, blocks, out, rows, xbytes, sync});
}

std::vector<at::Tensor> route_pack_fused(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w,
                                         int64_t experts, int64_t n, const at::Tensor& sync) {
  const int64_t t = x.size(0), k = idx.size(1), xbytes = x.size(1) * x.element_size();
  TORCH_CHECK_VALUE(x.is_cuda() && x.dim() == 2 && xbytes % 16 == 0 && x.is_contiguous() && addr(x) % 16 == 0 &&
                        idx.sizes() == w.sizes() && idx.size(0) == t && idx.scalar_type() == at::kLong &&
                        w.scalar_type() == at::kFloat && idx.is_contiguous() && w.is_contiguous() &&
                        idx.device() == x.device() && w.device() == x.device() && sync.device() == x.device() &&
                        sync.numel() == kSyncWords && sync.scalar_type() == at::kInt && n > 0 &&
                        experts % n == 0 && usable(x.get_device()),
                    "gocomm route_pack_fused: as moe_route_pack takes them, and sync int32 [kSyncWords]");
  const int dev = x.get_device();
  c10::cuda::CUDAGuard guard(x.device());
  RouteOut o(x, t, n, k, xbytes);
  const Routing& r = o.r;
  route_pack(dev, addr(o.payload), addr(x), addr(idx), addr(w), t, k, experts, n, r, t * n, xbytes, addr(sync), 0);
  return {o.payload, o.meta, o.send_order, o.t_idx, o.t_offs};
}

std::vector<at::Tensor> group_gather_fused(const at::Tensor& recv, int64_t id_off, int64_t w_off, int64_t k,
                                           int64_t per, const at::Tensor& out_splits, int64_t xbytes,
                                           const at::Tensor& sync) {
  TORCH_CHECK_VALUE(recv.is_cuda() && recv.dim() == 2 && recv.scalar_type() == at::kByte && recv.is_contiguous() &&
                        k > 0 && group_threads(per) > 0 && id_off + k * 4 <= recv.size(1) &&
                        w_off + k * 4 <= recv.size(1) && xbytes % 16 == 0 && xbytes <= recv.size(1) &&
                        recv.size(1) % 16 == 0 && sync.device() == recv.device() && sync.numel() == kSyncWords &&
                        sync.scalar_type() == at::kInt && usable(recv.get_device()),
                    "gocomm group_gather_fused: as moe_group takes them, xbytes of each row's 16-byte multiple, "
                    "and sync int32 [kSyncWords]");
  const int dev = recv.get_device();
  c10::cuda::CUDAGuard guard(recv.device());
  const int64_t cap = recv.size(0);
  const at::Tensor splits = out_splits.to(recv.device(), at::kLong).contiguous();
  GroupOut o(recv, cap, k, per, splits.numel());
  at::Tensor out = at::empty({cap * k, xbytes}, recv.options().dtype(at::kByte));
  const Grouping& g = o.g;
  group_gather(dev, addr(recv), Row{id_off, w_off, recv.size(1)}, k, per, addr(splits), splits.numel(), cap, g, 0,
               addr_or_0(out), xbytes, addr(sync));
  return {o.rows_sorted, o.w_sorted, o.tpe, o.e_idx, o.e_offs, o.gmeta, o.w_e, o.back, out};
}

void wsum(int dev, at::ScalarType dtype, int64_t out, int64_t src, int64_t idx, int64_t w, int64_t offs, int64_t rows,
          int64_t nrows, int64_t h) {
  check_sums(dtype);
  launch_moe(dev, wsum_kernel(dtype), std::min<int64_t>(rows, 65535), row_block(h * c10::elementSize(dtype)), 0, "PPPPPqPq",
             {out, src, idx, w, offs, rows, nrows, h});
}

}  // namespace gocomm::inproc::moe

TORCH_LIBRARY_FRAGMENT(gocomm, m) {
  m.def("moe_route_pack(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int ranks) -> Tensor[]");
  m.def("moe_group(Tensor recv, int id_off, int w_off, int k, int per, Tensor out_splits) -> Tensor[]");
  m.def("moe_wsum(Tensor src, Tensor idx, Tensor? weights, Tensor offs, int rows) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(gocomm, CUDA, m) {
  m.impl("moe_route_pack", &gocomm::inproc::moe::route_pack_cuda);
  m.impl("moe_group", &gocomm::inproc::moe::group_cuda);
  m.impl("moe_wsum", &gocomm::inproc::moe::wsum_cuda);
}
