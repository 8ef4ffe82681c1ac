// Autograd kernels for gocomm's operators, which have no derivative yet
// (docs/decisions/0038-moe-autograd.md). Without one, torch's own fallback only warns when a
// backward reaches such an op and lets the gradient stop there, silently. Each kernel here
// runs the op below autograd; where a gradient is wanted it gives the op's floating outputs a
// node that raises at backward, naming the op (torch's NotImplemented, as its fallback for
// ops without a derivative would, but unboxed: calls that need no gradient pay one check).
// all_to_all_v_out, an out= op, raises at the call instead, as torch's out= ops do.
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

using A2avSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, c10::SymInt, std::string);
using A2avOutSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, Tensor&, std::string);
using DispatchSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t,
                                                               int64_t, int64_t, bool, std::string);
using CombineSig = Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          std::string);
using DispatchAnySig = std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t, bool,
                                           std::optional<int64_t>, bool, const std::string&);
using CombineAnySig = Tensor(const Tensor&, const std::vector<Tensor>&, int64_t, at::ScalarType, int64_t,
                             const std::string&);

std::tuple<Tensor, Tensor> a2av(const Tensor& input, const Tensor& splits, c10::SymInt rows, std::string group) {
  static const auto op = handle<A2avSig>("gocomm::all_to_all_v");
  const bool grad = wants_grad({&input});
  std::tuple<Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.call(input, splits, std::move(rows), std::move(group));
  }
  if (grad) {
    no_backward("gocomm::all_to_all_v", {input}, {std::get<0>(out)});
  }
  return out;
}

std::tuple<Tensor, Tensor> a2av_out(const Tensor& input, const Tensor& splits, Tensor& out, std::string group) {
  static const auto op = handle<A2avOutSig>("gocomm::all_to_all_v_out");
  TORCH_CHECK(!wants_grad({&input, &out}),
              "gocomm all_to_all_v with out= has no backward (as torch's out= ops): call it on tensors that need no "
              "gradient, or under torch.no_grad()");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(input, splits, out, std::move(group));
}

std::tuple<Tensor, Tensor, Tensor, Tensor> dispatch(const Tensor& x, const Tensor& idx, const Tensor& w,
                                                    int64_t experts, int64_t ranks, int64_t cap, bool padded,
                                                    std::string group) {
  static const auto op = handle<DispatchSig>("gocomm::moe_dispatch");
  const bool grad = wants_grad({&x, &w});
  std::tuple<Tensor, Tensor, Tensor, Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.call(x, idx, w, experts, ranks, cap, padded, std::move(group));
  }
  if (grad) {
    no_backward("gocomm::moe_dispatch", {x, w}, {std::get<0>(out)});
  }
  return out;
}

Tensor combine(const Tensor& y, const Tensor& ws, int64_t tokens, int64_t cap, int64_t k, int64_t experts,
               int64_t recv_rows, int64_t send_rows, std::string group) {
  static const auto op = handle<CombineSig>("gocomm::moe_combine");
  const bool grad = wants_grad({&y});
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.call(y, ws, tokens, cap, k, experts, recv_rows, send_rows, std::move(group));
  }
  if (grad) {
    no_backward("gocomm::moe_combine", {y}, {out});
  }
  return out;
}

std::vector<Tensor> dispatch_any(const Tensor& x, const Tensor& idx, const Tensor& w, int64_t experts, bool fp8,
                                 std::optional<int64_t> bound, bool padded, const std::string& group) {
  static const auto op = handle<DispatchAnySig>("gocomm::moe_dispatch_any");
  const bool grad = wants_grad({&x, &w});
  std::vector<Tensor> out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.call(x, idx, w, experts, fp8, bound, padded, group);
  }
  if (grad) {
    no_backward("gocomm::moe_dispatch_any", {x, w}, out);
  }
  return out;
}

Tensor combine_any(const Tensor& y, const std::vector<Tensor>& handle_, int64_t tokens, at::ScalarType dtype,
                   int64_t rows, const std::string& group) {
  static const auto op = handle<CombineAnySig>("gocomm::moe_combine_any");
  const bool grad = wants_grad({&y});
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.call(y, handle_, tokens, dtype, rows, group);
  }
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
  m.impl("moe_dispatch_any", &gocomm::dispatch_any);
  m.impl("moe_combine_any", &gocomm::combine_any);
}
