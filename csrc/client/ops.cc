// torch.ops.gocomm: gocomm.all_to_all_v's in-process path as registered operators, so that
// the call is one dispatcher op (torch -> C++ -> kernel launch) and torch.compile can trace
// it: each has a Meta kernel that gives the output's shape without a group or a GPU.
//
//   all_to_all_v(input, in_splits, out_rows, group_name) -> (output, out_splits)
//     output: out_rows rows shaped like input's (the receive capacity; rows past
//     sum(out_splits) are undefined, and sum(out_splits) > out_rows means nothing was
//     written), out_splits: in_splits' dtype, on input's device.
//   all_to_all_v_out(input, in_splits, out!, group_name) -> out_splits
//     the same into out, whose rows are the capacity.
//
// group_name is the ProcessGroup's (pg.group_name); the group must be a gocomm group whose
// in-process all_to_all_v serves input's device, else NotImplementedError, raised before
// anything is done (gocomm.all_to_all_v caches the path per group and device, and takes
// another path on it). The ops check their arguments as gocomm.all_to_all_v documents them,
// with the errors its other paths raise (ValueError), so that its fast path checks nothing.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "backend.h"

namespace gocomm {
namespace {

// gocomm.all_to_all_v's arguments for a group of n ranks (out: null for the padded form).
void check(int64_t n, const at::Tensor& input, const at::Tensor& in_splits, const at::Tensor* out) {
  TORCH_CHECK_VALUE(input.dim() > 0, "gocomm all_to_all_v: input needs at least one dimension (rows)");
  TORCH_CHECK_VALUE(input.is_contiguous(), "gocomm all_to_all_v: input must be contiguous");
  const auto st = in_splits.scalar_type();
  TORCH_CHECK_VALUE((st == at::kInt || st == at::kLong) && in_splits.dim() == 1 && in_splits.size(0) == n,
                    "gocomm all_to_all_v: in_splits must be an int32/int64 tensor of " + std::to_string(n) +
                        " entries (one per rank), got " + dtype_name(st) + " of shape " +
                        shape_name(in_splits.sizes()));
  TORCH_CHECK_VALUE(in_splits.is_cpu() || in_splits.device() == input.device(),
                    "gocomm all_to_all_v: in_splits is on " + in_splits.device().str() + ", input on " +
                        input.device().str());
  if (out == nullptr) {
    return;
  }
  const auto rows = [](const at::Tensor& t) { return shape_name(t.sizes().slice(std::min<int64_t>(1, t.dim()))); };
  TORCH_CHECK_VALUE(out->scalar_type() == input.scalar_type() && out->device() == input.device() &&
                        out->dim() == input.dim() && out->sizes().slice(1) == input.sizes().slice(1),
                    "gocomm all_to_all_v: out (" + dtype_name(out->scalar_type()) + ", " + out->device().str() +
                        ", rows " + rows(*out) + ") does not match input (" + dtype_name(input.scalar_type()) + ", " +
                        input.device().str() + ", rows " + rows(input) + ")");
  TORCH_CHECK_VALUE(out->is_contiguous(), "gocomm all_to_all_v: out must be contiguous");
}

std::vector<int64_t> rows_like(const at::Tensor& input, int64_t rows) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.at(0) = rows;
  return shape;
}

// The op on group: its arguments checked, then its path found (NotImplementedError where the
// in-process kernel does not serve the group there), then the exchange into out, or into a
// new tensor of out_rows rows where out is null.
std::pair<at::Tensor, at::Tensor> run(const at::Tensor& input, const at::Tensor& in_splits, const at::Tensor* out,
                                      int64_t out_rows, const std::string& group) {
  Backend& b = Backend::of(group, "all_to_all_v");
  check(b.engine().size(), input, in_splits, out);
  auto path = b.a2av_path_for(input, "all_to_all_v");
  const at::Tensor o = out != nullptr ? *out : at::empty(rows_like(input, out_rows), input.options());
  return b.engine().all_to_all_v(*path, input, in_splits, o);
}

std::tuple<at::Tensor, at::Tensor> a2av_cuda(const at::Tensor& input, const at::Tensor& in_splits, int64_t out_rows,
                                             std::string group) {
  TORCH_CHECK_VALUE(out_rows >= 0, "gocomm all_to_all_v: out_rows must be >= 0, got " + std::to_string(out_rows));
  auto [o, s] = run(input, in_splits, nullptr, out_rows, group);
  return {o, s};
}

at::Tensor a2av_out_cuda(const at::Tensor& input, const at::Tensor& in_splits, at::Tensor& out, std::string group) {
  return run(input, in_splits, &out, 0, group).second;
}

std::tuple<at::Tensor, at::Tensor> a2av_meta(const at::Tensor& input, const at::Tensor& in_splits,
                                             c10::SymInt out_rows, std::string) {
  std::vector<c10::SymInt> shape(input.sym_sizes().begin(), input.sym_sizes().end());
  shape.at(0) = std::move(out_rows);
  return {at::empty_symint(shape, input.options()),
          at::empty_symint(in_splits.sym_sizes(), in_splits.options().device(input.device()))};
}

at::Tensor a2av_out_meta(const at::Tensor& input, const at::Tensor& in_splits, at::Tensor&, std::string) {
  return at::empty_symint(in_splits.sym_sizes(), in_splits.options().device(input.device()));
}

}  // namespace
}  // namespace gocomm

TORCH_LIBRARY(gocomm, m) {
  m.def("all_to_all_v(Tensor input, Tensor in_splits, SymInt out_rows, str group_name) -> (Tensor, Tensor)");
  m.def("all_to_all_v_out(Tensor input, Tensor in_splits, Tensor(a!) out, str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(gocomm, CUDA, m) {
  m.impl("all_to_all_v", &gocomm::a2av_cuda);
  m.impl("all_to_all_v_out", &gocomm::a2av_out_cuda);
}

TORCH_LIBRARY_IMPL(gocomm, Meta, m) {
  m.impl("all_to_all_v", &gocomm::a2av_meta);
  m.impl("all_to_all_v_out", &gocomm::a2av_out_meta);
}
