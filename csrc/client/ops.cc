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
// in-process all_to_all_v serves input's device (gocomm.all_to_all_v checks that first).
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "backend.h"

namespace gocomm {
namespace {

std::pair<at::Tensor, at::Tensor> run(const at::Tensor& input, const at::Tensor& in_splits, const at::Tensor& out,
                                      const std::string& group) {
  Backend& b = Backend::of(group, "all_to_all_v");
  return b.engine().all_to_all_v(*b.a2av_path_for(input, "all_to_all_v"), input, in_splits, out);
}

std::vector<int64_t> rows_like(const at::Tensor& input, int64_t rows) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.at(0) = rows;
  return shape;
}

std::tuple<at::Tensor, at::Tensor> a2av_cuda(const at::Tensor& input, const at::Tensor& in_splits, int64_t out_rows,
                                             std::string group) {
  TORCH_CHECK_VALUE(out_rows >= 0, "gocomm all_to_all_v: out_rows must be >= 0, got " + std::to_string(out_rows));
  auto [o, s] = run(input, in_splits, at::empty(rows_like(input, out_rows), input.options()), group);
  return {o, s};
}

at::Tensor a2av_out_cuda(const at::Tensor& input, const at::Tensor& in_splits, at::Tensor& out, std::string group) {
  return run(input, in_splits, out, group).second;
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
