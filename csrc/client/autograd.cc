// Autograd kernels for gocomm's operators (docs/decisions/0038-moe-autograd.md). Without one,
// torch only warns when a backward reaches an op and lets the gradient stop there, silently.
//
// all_to_all_v: its backward is all_to_all_v again, transposed. Each row of the output came
// from one rank, grouped by source rank as out_splits counts them, so sending the output's
// gradient back by out_splits returns every row's gradient to its sender, where it lands in
// the order the sender sent the rows: its input's order. Rows the sender did not send (past
// sum(in_splits)) get zeros. It is a collective, as the forward is: every rank of the group
// must backpropagate through the same calls.
//
// The MoE ops: their kernels run the op below autograd and, where a gradient is wanted, give
// the outputs a node of the backward below (calls that need no gradient pay one check);
// where there is none to give (fp8 dispatch, a combine not told the routing), torch's
// NotImplemented node, which raises at backward naming the op (as torch's fallback for ops
// without a derivative does, but typed). all_to_all_v_out, an out= op, raises at the call
// instead, as torch's out= ops do.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace gocomm {
namespace {

using at::Tensor;

bool wants_grad(std::initializer_list<const Tensor*> ins) {
  if (!c10::GradMode::is_enabled()) {
    return false;
  }
  for (const Tensor* t : ins) {
    if (t->defined() && t->requires_grad()) {
      return true;
    }
  }
  return false;
}

// Gives outs a node that raises at backward; an output that is an input (requires_grad
// already) or not of a floating type is left alone.
void no_backward(const char* op, const std::vector<Tensor>& ins, const std::vector<Tensor>& outs) {
  auto node = std::shared_ptr<torch::autograd::NotImplemented>(new torch::autograd::NotImplemented(op),
                                                               torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(ins));
  for (const Tensor& o : outs) {
    if (o.defined() && !o.requires_grad() && torch::autograd::isDifferentiableType(o.scalar_type())) {
      torch::autograd::set_history(const_cast<Tensor&>(o), node);
    }
  }
}

template <class Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// op's kernel under autograd: the device's (or Meta's), with autograd's keys excluded.
template <class Sig, class... Args>
auto below(const c10::TypedOperatorHandle<Sig>& op, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(std::forward<Args>(args)...);
}

using A2avSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, c10::SymInt, std::string);
using A2avOutSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, Tensor&, std::string);
using A2avIntoSig = Tensor(const Tensor&, const Tensor&, Tensor&, std::string);
using DispatchSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t,
                                                               int64_t, int64_t, bool, std::string, int64_t);
using CombineSig = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          std::string, const std::optional<Tensor>&, const std::optional<Tensor>&);
using DispatchLlSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                                                       int64_t, std::string);
using CombineLlSig = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t, int64_t, std::string,
                            const std::optional<Tensor>&, const std::optional<Tensor>&);

const c10::TypedOperatorHandle<A2avSig>& a2av_op() {
  static const auto op = handle<A2avSig>("gocomm::all_to_all_v");
  return op;
}

// all_to_all_v's backward (see the top of the file).
struct AllToAllVBackward : public torch::autograd::Node {
  Tensor in_splits, out_splits;  // the forward's
  c10::SymInt rows;              // the forward input's rows
  std::string group;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const Tensor& g = grads.at(0);
    if (!g.defined()) {
      return {Tensor()};
    }
    // through the dispatcher, so that a backward of the backward (create_graph) has one too
    Tensor back = std::get<0>(a2av_op().call(g.contiguous(), out_splits, rows, group));
    // row i was sent iff i < sum(in_splits); in sizes torch.compile may keep symbolic
    const c10::SymInt n = back.sym_size(0);
    const Tensor sent = at::ones_symint({n}, back.options().dtype(at::kLong))
                            .cumsum(0)
                            .le(in_splits.to(back.device(), at::kLong).sum());
    std::vector<c10::SymInt> shape(back.dim(), 1);
    shape[0] = n;
    return {at::where(sent.view_symint(shape), back, at::zeros({}, back.options()))};
  }

  std::string name() const override { return "gocomm::AllToAllVBackward"; }

  void release_variables() override {
    in_splits.reset();
    out_splits.reset();
  }
};

std::tuple<Tensor, Tensor> a2av(const Tensor& input, const Tensor& splits, c10::SymInt rows, std::string group) {
  const bool grad = wants_grad({&input});
  std::tuple<Tensor, Tensor> out = below(a2av_op(), input, splits, std::move(rows), group);
  if (grad) {
    auto node = std::shared_ptr<AllToAllVBackward>(new AllToAllVBackward(), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(input));
    node->in_splits = splits;
    node->out_splits = std::get<1>(out);
    node->rows = input.sym_size(0);
    node->group = std::move(group);
    torch::autograd::set_history(std::get<0>(out), node);
  }
  return out;
}

const char* const kNoOutBackward =
    "gocomm all_to_all_v with out= has no backward (as torch's out= ops): call it on tensors that need no "
    "gradient, or under torch.no_grad()";

std::tuple<Tensor, Tensor> a2av_out(const Tensor& input, const Tensor& splits, Tensor& out, std::string group) {
  static const auto op = handle<A2avOutSig>("gocomm::all_to_all_v_out");
  TORCH_CHECK(!wants_grad({&input, &out}), kNoOutBackward);
  return below(op, input, splits, out, std::move(group));
}

Tensor a2av_into(const Tensor& input, const Tensor& splits, Tensor& out, std::string group) {
  static const auto op = handle<A2avIntoSig>("gocomm::all_to_all_v_into");
  TORCH_CHECK(!wants_grad({&input, &out}), kNoOutBackward);
  return below(op, input, splits, out, std::move(group));
}

// ----- the MoE ops' backward (docs/decisions/0038-moe-autograd.md) ---------------------------
//
// Row p of dispatch's output is token t's copy for one of its top-k slots j (expert e), and
// combine returns out[t] = sum_j w[t, j] * y[p(t, j)]. With g the gradient of a result:
//   dispatch: grad_x[t] = sum of grad_recv over t's rows, a combine with unit weights along the
//     same routing (the handle of a dispatch of a narrow zero tensor with unit weights);
//   combine: grad_y[p] = w[t, j] * g[t] and grad_w[t, j] = g[t] . y[p]: [g | ids | w] is
//     dispatched along the same routing with unit weights; each row's expert (from its place
//     among tokens_per_expert) names its slot j among the ids; the dot products go back by a
//     combine of that dispatch's handle, each in its slot's column.
// Every path groups rows in one order (local expert, source rank, token), so the backward's
// dispatches line up with the forward's rows. Where the forward was padded on the in-process
// path, they run on its ops (moe_dispatch / moe_combine, padded: nothing waits for the GPU);
// else, or where that path no longer serves the group, on moe_dispatch_any / moe_combine_any
// (the same exchange, counts through the host where it reads them). A backward is a
// collective every rank of the group runs, as the forward is, and every rank takes the same
// ops: the forward's path and bound are the group's.
// combine learns the routing (topk_idx) and gets its edge to topk_weights from the arguments
// gocomm.moe passes it; called without them, a backward through it raises.

using DispatchAnyOp = std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t, bool,
                                          std::optional<int64_t>, bool, const std::string&);
using CombineAnyOp = Tensor(const Tensor&, const std::vector<Tensor>&, int64_t, at::ScalarType, int64_t,
                            const std::string&, const std::optional<Tensor>&, const std::optional<Tensor>&, int64_t);

const c10::TypedOperatorHandle<DispatchAnyOp>& dispatch_any_op() {
  static const auto op = handle<DispatchAnyOp>("gocomm::moe_dispatch_any");
  return op;
}

const c10::TypedOperatorHandle<CombineAnyOp>& combine_any_op() {
  static const auto op = handle<CombineAnyOp>("gocomm::moe_combine_any");
  return op;
}

int64_t group_size(const std::string& group) {
  return c10d::resolve_process_group(group)->getSize();
}

const c10::TypedOperatorHandle<DispatchSig>& dispatch_op() {
  static const auto op = handle<DispatchSig>("gocomm::moe_dispatch");
  return op;
}

const c10::TypedOperatorHandle<CombineSig>& combine_op() {
  static const auto op = handle<CombineSig>("gocomm::moe_combine");
  return op;
}

// What a backward's dispatch gave: its rows, tokens_per_expert, and the handle its combine
// takes (the in-process op's workspace, or the _any op's handle tensors).
struct Dispatched {
  Tensor rows, tpe, ws;
  std::vector<Tensor> any;  // empty where the in-process op ran
};

// The routing of a forward dispatch, as its backward re-runs it.
struct Routing {
  Tensor idx;  // topk_idx [T, k]
  int64_t experts = 0, tokens = 0;
  std::optional<int64_t> bound;  // max_tokens_per_rank where the rows were padded to it
  std::string group;
  bool inproc = false;  // the forward ran the in-process ops (moe.cc)
  int64_t version = 0;  // idx's when the forward ran (version_of), or -1: not tracked

  // idx's version (it shares topk_idx's counter); -1 for an inference tensor, which has none
  static int64_t version_of(const Tensor& idx) { return idx.is_inference() ? -1 : idx._version(); }

  // The routing is the forward's: topk_idx changed in place since would replay another, so
  // the backward raises, as torch's saved tensors do.
  void check_unchanged() const {
    TORCH_CHECK(version < 0 || idx._version() == version,
                "gocomm moe backward: topk_idx was modified by an inplace operation after the forward (its version "
                "is ",
                idx._version(), ", it was ", version, "); the backward replays the forward's routing");
  }

  int64_t padded_rows() const { return bound ? *bound * group_size(group) * idx.size(1) : 0; }
  // dispatch of z (float32, columns a multiple of 4) along the routing with unit weights;
  // combine_bytes: the rows of the combine that will take its handle, where wider than z's
  Dispatched dispatch(const Tensor& z, int64_t combine_bytes = 0) const {
    const Tensor ones = at::ones(idx.sizes(), z.options().dtype(at::kFloat));
    if (inproc && bound) {
      const int64_t n = group_size(group);
      try {
        auto [rows, tpe, ws, counts] =
            dispatch_op().call(z, idx, ones, experts, n, *bound * n, true, group, combine_bytes);
        return {rows, tpe, ws, {}};
      } catch (const c10::NotImplementedError&) {  // the path no longer serves the group
      }
    }
    std::vector<Tensor> got = dispatch_any_op().call(z, idx, ones, experts, false, bound, bound.has_value(), group);
    return {got[0], got[2], Tensor(), std::vector<Tensor>(got.begin() + 3, got.end())};
  }
  // combine of rows by dispatch()'s handle: [tokens, columns] in dtype
  Tensor combine(const Tensor& rows, const Dispatched& d, at::ScalarType dtype) const {
    if (d.any.empty()) {
      const int64_t n = group_size(group), k = idx.size(1), cap = *bound * n;
      return combine_op()
          .call(rows.to(dtype).contiguous(), d.ws, tokens, cap, k, experts, cap, tokens * std::min(n, k), group,
                std::nullopt, std::nullopt);
    }
    return combine_any_op().call(rows.contiguous(), d.any, tokens, dtype, padded_rows(), group, std::nullopt,
                                 std::nullopt, 0);
  }
};

struct MoeDispatchBackward : public torch::autograd::Node {
  Routing r;
  at::ScalarType dtype = at::kFloat;  // x's

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const Tensor& g = grads.at(0);
    if (!g.defined()) {
      return {Tensor()};
    }
    r.check_unchanged();
    // a unit-weight handle of the same routing (16 bytes a row: every path takes it), for a
    // combine of g's rows in x's dtype
    const Dispatched got =
        r.dispatch(at::zeros({r.tokens, 4}, g.options().dtype(at::kFloat)), g.size(1) * c10::elementSize(dtype));
    return {r.combine(g, got, dtype)};
  }
  std::string name() const override { return "gocomm::MoeDispatchBackward"; }
  void release_variables() override { r.idx.reset(); }
};

struct MoeCombineBackward : public torch::autograd::Node {
  Routing r;
  torch::autograd::SavedVariable y_, w_;  // the experts' outputs, topk_weights

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const Tensor& g = grads.at(0);
    if (!g.defined()) {
      return {Tensor(), Tensor()};
    }
    r.check_unchanged();
    const Tensor y = y_.unpack(), w = w_.unpack();
    const auto pg = c10d::resolve_process_group(r.group);
    const int64_t k = r.idx.size(1), h = g.size(1), per = r.experts / pg->getSize();
    const auto f32 = g.options().dtype(at::kFloat);
    // [g | ids | w], columns padded to a multiple of 4 (rows of 16 bytes, as the kernels take)
    const int64_t pad = (4 - (h + 2 * k) % 4) % 4;
    const Tensor z = at::cat({g.to(at::kFloat), r.idx.to(f32), w.to(f32), at::zeros({g.size(0), pad}, f32)}, 1);
    const Dispatched got = r.dispatch(z);
    const Tensor& rz = got.rows;  // y's rows: g, the token's ids and weights
    const int64_t rows = rz.size(0);
    // each row's local expert (rows past the grouped ones: none), its global id, its slot
    const Tensor ends = got.tpe.to(rz.device()).cumsum(0);
    const Tensor p = at::arange(rows, f32.dtype(at::kLong));
    const Tensor e = at::bucketize(p, ends, /*out_int32=*/false, /*right=*/true);
    const Tensor ids = rz.slice(1, h, h + k);
    // the slots whose id is this row's expert: one, or c where the token named the expert c
    // times; its c rows then share those slots' weights and dot products evenly (exact where
    // the expert gives its c copies of the token one output, as a row-wise expert does)
    const Tensor match = ids.eq((e + pg->getRank() * per).to(at::kFloat).unsqueeze(1)).to(at::kFloat);
    const Tensor c = match.sum(1);
    // rows past the grouped ones (padded outputs) hold whatever the memory held, NaN too:
    // selected away, not multiplied by 0
    const Tensor has = c.gt(0).logical_and(e.lt(per));
    const Tensor zero = at::zeros({}, f32);
    const Tensor share = at::where(has, c.clamp_min(1).reciprocal(), zero);
    const Tensor wp = at::where(has, (rz.slice(1, h + k, h + 2 * k) * match).sum(1) * share, zero);
    const Tensor gy = rz.slice(1, 0, h);
    const Tensor grad_y = at::where(has.unsqueeze(1), gy * wp.unsqueeze(1), zero).to(y.scalar_type());
    // g[t] . y[p] of each row, in its slots' columns (padded to 16 bytes), summed back
    const Tensor dot = at::where(has, (gy * y.to(at::kFloat)).sum(1) * share, zero);
    const Tensor d = at::cat({match * dot.unsqueeze(1), at::zeros({rows, (k + 3) / 4 * 4 - k}, f32)}, 1);
    const Tensor gw = r.combine(d, got, at::kFloat).slice(1, 0, k).to(w.scalar_type());
    return {grad_y, gw};
  }
  std::string name() const override { return "gocomm::MoeCombineBackward"; }
  void release_variables() override {
    y_.reset_data();
    w_.reset_data();
    r.idx.reset();
  }
};

// dispatch's recv gets a MoeDispatchBackward where x needs a gradient (topk_weights gets its
// own through combine).
void dispatch_backward(const Tensor& x, const Tensor& idx, int64_t experts, std::optional<int64_t> bound,
                       const std::string& group, const Tensor& recv, bool inproc) {
  if (!wants_grad({&x})) {
    return;
  }
  auto node = std::shared_ptr<MoeDispatchBackward>(new MoeDispatchBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  node->r = Routing{idx.detach(), experts, x.size(0), bound, group, inproc, Routing::version_of(idx)};
  node->dtype = x.scalar_type();
  torch::autograd::set_history(const_cast<Tensor&>(recv), node);
}

// combine's out gets a MoeCombineBackward where y or topk_weights needs a gradient, given the
// routing (else the node that raises at backward); bound() gives the forward dispatch's bound
// where its rows were padded (asked only then: it may look the group up).
void combine_backward(const char* op, const Tensor& y, const std::optional<Tensor>& idx,
                      const std::optional<Tensor>& w, int64_t experts, int64_t tokens,
                      const std::function<std::optional<int64_t>()>& bound, const std::string& group,
                      const Tensor& out, bool inproc) {
  const Tensor wt = w.has_value() ? *w : Tensor();
  if (!wants_grad({&y, &wt})) {
    return;
  }
  if (!idx.has_value() || !wt.defined() || experts <= 0) {
    no_backward(op, {y}, {out});
    return;
  }
  auto node = std::shared_ptr<MoeCombineBackward>(new MoeCombineBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(y, wt));
  node->r = Routing{idx->detach(), experts, tokens, bound(), group, inproc, Routing::version_of(*idx)};
  node->y_ = torch::autograd::SavedVariable(y, false);
  node->w_ = torch::autograd::SavedVariable(wt, false);
  torch::autograd::set_history(const_cast<Tensor&>(out), node);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> dispatch(const Tensor& x, const Tensor& idx, const Tensor& w,
                                                    int64_t experts, int64_t ranks, int64_t cap, bool padded,
                                                    std::string group, int64_t combine_bytes) {
  auto out = below(dispatch_op(), x, idx, w, experts, ranks, cap, padded, group, combine_bytes);
  dispatch_backward(x, idx, experts, padded ? std::optional<int64_t>(cap / std::max<int64_t>(ranks, 1)) : std::nullopt,
                    group, std::get<0>(out), true);
  return out;
}

Tensor combine(const Tensor& y, const Tensor& ws, int64_t tokens, int64_t cap, int64_t k, int64_t experts,
               int64_t recv_rows, int64_t send_rows, std::string group, const std::optional<Tensor>& idx,
               const std::optional<Tensor>& w) {
  Tensor out = below(combine_op(), y, ws, tokens, cap, k, experts, recv_rows, send_rows, group, idx, w);
  // padded: y has every row the bound allows (the forward's cap is the bound x the group)
  combine_backward(
      "gocomm::moe_combine", y, idx, w, experts, tokens,
      [&]() { return y.size(0) == cap * k ? std::optional<int64_t>(cap / group_size(group)) : std::nullopt; }, group,
      out, true);
  return out;
}

std::tuple<Tensor, Tensor, Tensor> dispatch_ll(const Tensor& x, const Tensor& idx, const Tensor& w, int64_t experts,
                                              int64_t ranks, int64_t bound, std::string group) {
  static const auto op = handle<DispatchLlSig>("gocomm::moe_dispatch_ll");
  auto out = below(op, x, idx, w, experts, ranks, bound, group);
  dispatch_backward(x, idx, experts, bound, group, std::get<0>(out), true);
  return out;
}

Tensor combine_ll(const Tensor& y, const Tensor& ws, int64_t tokens, int64_t bound, int64_t k, int64_t experts,
                  std::string group, const std::optional<Tensor>& idx, const std::optional<Tensor>& w) {
  static const auto op = handle<CombineLlSig>("gocomm::moe_combine_ll");
  Tensor out = below(op, y, ws, tokens, bound, k, experts, group, idx, w);
  combine_backward(
      "gocomm::moe_combine_ll", y, idx, w, experts, tokens, [&]() { return std::optional<int64_t>(bound); }, group,
      out, true);
  return out;
}

std::vector<Tensor> dispatch_any(const Tensor& x, const Tensor& idx, const Tensor& w, int64_t experts, bool fp8,
                                 std::optional<int64_t> bound, bool padded, const std::string& group) {
  std::vector<Tensor> out = below(dispatch_any_op(), x, idx, w, experts, fp8, bound, padded, group);
  if (fp8) {  // no backward: its tokens are quantized (values and scales)
    if (wants_grad({&x})) {
      no_backward("gocomm::moe_dispatch_any", {x}, {out.at(0), out.at(1)});
    }
    return out;
  }
  dispatch_backward(x, idx, experts, padded ? bound : std::nullopt, group, out.at(0), false);
  return out;
}

Tensor combine_any(const Tensor& y, const std::vector<Tensor>& handle_, int64_t tokens, at::ScalarType dtype,
                   int64_t rows, const std::string& group, const std::optional<Tensor>& idx,
                   const std::optional<Tensor>& w, int64_t experts) {
  Tensor out = below(combine_any_op(), y, handle_, tokens, dtype, rows, group, idx, w, experts);
  // padded to the bound: rows = bound x group x k
  auto bound = [&]() {
    return rows > 0 && idx.has_value()
               ? std::optional<int64_t>(rows / (group_size(group) * std::max<int64_t>(idx->size(1), 1)))
               : std::nullopt;
  };
  combine_backward("gocomm::moe_combine_any", y, idx, w, experts, tokens, bound, group, out, false);
  return out;
}

}  // namespace
}  // namespace gocomm

TORCH_LIBRARY_IMPL(gocomm, Autograd, m) {
  m.impl("all_to_all_v", &gocomm::a2av);
  m.impl("all_to_all_v_out", &gocomm::a2av_out);
  m.impl("all_to_all_v_into", &gocomm::a2av_into);
  m.impl("moe_dispatch", &gocomm::dispatch);
  m.impl("moe_combine", &gocomm::combine);
  m.impl("moe_dispatch_ll", &gocomm::dispatch_ll);
  m.impl("moe_combine_ll", &gocomm::combine_ll);
  m.impl("moe_dispatch_any", &gocomm::dispatch_any);
  m.impl("moe_combine_any", &gocomm::combine_any);
}
