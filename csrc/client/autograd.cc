// Autograd kernels for gocomm's operators (docs/decisions/0038-moe-autograd.md). Without one,
// torch only warns when a backward reaches an op and lets the gradient stop there, silently.
//
// all_to_all_v: its backward is all_to_all_v again, transposed. Each row of the output came
// from one rank, grouped by source rank as out_splits counts them, so sending the output's
// gradient back by out_splits returns every row's gradient to its sender, where it lands in
// the order the sender sent the rows: its input's order. Rows the sender did not send (past
// sum(in_splits), where a GPU path allows them) get zeros. It is a collective, as the forward
// is: every rank of the group must backpropagate through the same calls.
//
// The MoE ops have no derivative yet: their kernels run the op below autograd and, where a
// gradient is wanted, give the floating outputs torch's NotImplemented node, which raises at
// backward naming the op (as torch's fallback for ops without a derivative does, but typed:
// calls that need no gradient pay one check). all_to_all_v_out, an out= op, raises at the
// call instead, as torch's out= ops do.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

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
using DispatchSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t,
                                                               int64_t, int64_t, bool, std::string);
using CombineSig = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          std::string);
using DispatchAnySig = std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t, bool,
                                           std::optional<int64_t>, bool, const std::string&);
using DispatchLlSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                                                       int64_t, std::string);
using CombineLlSig = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t, int64_t, std::string);
using CombineAnySig = Tensor(const Tensor&, const std::vector<Tensor>&, int64_t, at::ScalarType, int64_t,
                             const std::string&);

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

std::tuple<Tensor, Tensor> a2av_out(const Tensor& input, const Tensor& splits, Tensor& out, std::string group) {
  static const auto op = handle<A2avOutSig>("gocomm::all_to_all_v_out");
  TORCH_CHECK(!wants_grad({&input, &out}),
              "gocomm all_to_all_v with out= has no backward (as torch's out= ops): call it on tensors that need no "
              "gradient, or under torch.no_grad()");
  return below(op, input, splits, out, std::move(group));
}

std::tuple<Tensor, Tensor, Tensor, Tensor> dispatch(const Tensor& x, const Tensor& idx, const Tensor& w,
                                                    int64_t experts, int64_t ranks, int64_t cap, bool padded,
                                                    std::string group) {
  static const auto op = handle<DispatchSig>("gocomm::moe_dispatch");
  const bool grad = wants_grad({&x, &w});
  std::tuple<Tensor, Tensor, Tensor, Tensor> out = below(op, x, idx, w, experts, ranks, cap, padded, std::move(group));
  if (grad) {
    no_backward("gocomm::moe_dispatch", {x, w}, {std::get<0>(out)});
  }
  return out;
}

Tensor combine(const Tensor& y, const Tensor& ws, int64_t tokens, int64_t cap, int64_t k, int64_t experts,
               int64_t recv_rows, int64_t send_rows, std::string group) {
  static const auto op = handle<CombineSig>("gocomm::moe_combine");
  const bool grad = wants_grad({&y});
  Tensor out = below(op, y, ws, tokens, cap, k, experts, recv_rows, send_rows, std::move(group));
  if (grad) {
    no_backward("gocomm::moe_combine", {y}, {out});
  }
  return out;
}

std::tuple<Tensor, Tensor, Tensor> dispatch_ll(const Tensor& x, const Tensor& idx, const Tensor& w, int64_t experts,
                                              int64_t ranks, int64_t bound, std::string group) {
  static const auto op = handle<DispatchLlSig>("gocomm::moe_dispatch_ll");
  const bool grad = wants_grad({&x, &w});
  std::tuple<Tensor, Tensor, Tensor> out = below(op, x, idx, w, experts, ranks, bound, std::move(group));
  if (grad) {
    no_backward("gocomm::moe_dispatch_ll", {x, w}, {std::get<0>(out)});
  }
  return out;
}

Tensor combine_ll(const Tensor& y, const Tensor& ws, int64_t tokens, int64_t bound, int64_t k, int64_t experts,
                  std::string group) {
  static const auto op = handle<CombineLlSig>("gocomm::moe_combine_ll");
  const bool grad = wants_grad({&y});
  Tensor out = below(op, y, ws, tokens, bound, k, experts, std::move(group));
  if (grad) {
    no_backward("gocomm::moe_combine_ll", {y}, {out});
  }
  return out;
}

std::vector<Tensor> dispatch_any(const Tensor& x, const Tensor& idx, const Tensor& w, int64_t experts, bool fp8,
                                 std::optional<int64_t> bound, bool padded, const std::string& group) {
  static const auto op = handle<DispatchAnySig>("gocomm::moe_dispatch_any");
  const bool grad = wants_grad({&x, &w});
  std::vector<Tensor> out = below(op, x, idx, w, experts, fp8, bound, padded, group);
  if (grad) {
    no_backward("gocomm::moe_dispatch_any", {x, w}, out);
  }
  return out;
}

Tensor combine_any(const Tensor& y, const std::vector<Tensor>& handle_, int64_t tokens, at::ScalarType dtype,
                   int64_t rows, const std::string& group) {
  static const auto op = handle<CombineAnySig>("gocomm::moe_combine_any");
  const bool grad = wants_grad({&y});
  Tensor out = below(op, y, handle_, tokens, dtype, rows, group);
  if (grad) {
    no_backward("gocomm::moe_combine_any", {y}, {out});
  }
  return out;
}

}  // namespace
}  // namespace gocomm

TORCH_LIBRARY_IMPL(gocomm, Autograd, m) {
  m.impl("all_to_all_v", &gocomm::a2av);
  m.impl("all_to_all_v_out", &gocomm::a2av_out);
  m.impl("moe_dispatch", &gocomm::dispatch);
  m.impl("moe_combine", &gocomm::combine);
  m.impl("moe_dispatch_ll", &gocomm::dispatch_ll);
  m.impl("moe_combine_ll", &gocomm::combine_ll);
  m.impl("moe_dispatch_any", &gocomm::dispatch_any);
  m.impl("moe_combine_any", &gocomm::combine_any);
}
