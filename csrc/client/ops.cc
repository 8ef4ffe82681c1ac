// torch.ops.gocomm: gocomm.all_to_all_v as registered operators, every path (a2av.h), for CUDA
// and CPU tensors, so that the call is one dispatcher op (torch -> C++ -> the exchange) and
// torch.compile can trace it: each has a Meta kernel that gives the output's shape without a
// group or a GPU.
//
//   all_to_all_v(input, in_splits, out_rows, group_name) -> (output, out_splits)
//     output: out_rows rows shaped like input's (the receive capacity; rows past
//     sum(out_splits) are undefined; on the GPU paths sum(out_splits) > out_rows means nothing
//     was written, the host-count path raises OverflowError), or with out_rows -1 the path's
//     default (all_to_all_v_any); out_splits: in_splits' dtype, on in_splits' device. Input
//     rows past sum(in_splits) are not sent.
//   all_to_all_v_out(input, in_splits, out!, group_name) -> (output, out_splits)
//     the same into out, whose rows are the capacity; output is out (the GPU paths) or a view
//     of its first rows (the host-count path: exactly the received rows).
//
// group_name is the ProcessGroup's (pg.group_name). The ops check their arguments as
// gocomm.all_to_all_v documents them (ValueError), so its wrapper checks nothing. The Meta
// kernels give out_rows rows, or out whole: the host-count path's view of out's first rows
// depends on the counts, which only the exchange learns.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "a2av.h"

namespace gocomm {
namespace {

std::tuple<at::Tensor, at::Tensor> a2av(const at::Tensor& input, const at::Tensor& in_splits, int64_t out_rows,
                                        std::string group) {
  auto [o, s] = all_to_all_v_any(input, in_splits, nullptr, out_rows, group);
  return {o, s};
}

std::tuple<at::Tensor, at::Tensor> a2av_out(const at::Tensor& input, const at::Tensor& in_splits, at::Tensor& out,
                                            std::string group) {
  auto [o, s] = all_to_all_v_any(input, in_splits, &out, -1, group);
  return {o, s};
}

// all_to_all_v_out without its alias: out written in place, out_splits returned (what
// torch.compile's functionalization takes; a custom op may not return an input's alias).
at::Tensor a2av_into(const at::Tensor& input, const at::Tensor& in_splits, at::Tensor& out, std::string group) {
  return std::get<1>(all_to_all_v_any(input, in_splits, &out, -1, group));
}

// The devices the real kernels check: a meta tensor among real ones dispatches here, where
// nothing would be exchanged.
void same_devices(const at::Tensor& input, const at::Tensor& in_splits, const at::Tensor* out) {
  check_splits_device(input, in_splits);
  TORCH_CHECK_VALUE(out == nullptr || out->device() == input.device(),
                    "gocomm all_to_all_v: out is on " + (out ? out->device().str() : "") + ", input on " +
                        input.device().str());
}

std::tuple<at::Tensor, at::Tensor> a2av_meta(const at::Tensor& input, const at::Tensor& in_splits,
                                             c10::SymInt out_rows, std::string) {
  same_devices(input, in_splits, nullptr);
  const auto rows = out_rows.maybe_as_int();
  TORCH_CHECK_NOT_IMPLEMENTED(!rows || *rows >= 0,
                              "gocomm all_to_all_v: out_rows -1 (the path's default) has no shape before the call; "
                              "pass out_rows, or out");
  std::vector<c10::SymInt> shape(input.sym_sizes().begin(), input.sym_sizes().end());
  shape.at(0) = std::move(out_rows);
  return {at::empty_symint(shape, input.options()), at::empty_symint(in_splits.sym_sizes(), in_splits.options())};
}

std::tuple<at::Tensor, at::Tensor> a2av_out_meta(const at::Tensor& input, const at::Tensor& in_splits,
                                                 at::Tensor& out, std::string) {
  same_devices(input, in_splits, &out);
  return {out, at::empty_symint(in_splits.sym_sizes(), in_splits.options())};
}

at::Tensor a2av_into_meta(const at::Tensor& input, const at::Tensor& in_splits, at::Tensor& out, std::string) {
  same_devices(input, in_splits, &out);
  return at::empty_symint(in_splits.sym_sizes(), in_splits.options());
}

}  // namespace
}  // namespace gocomm

TORCH_LIBRARY(gocomm, m) {
  m.def("all_to_all_v(Tensor input, Tensor in_splits, SymInt out_rows, str group_name) -> (Tensor, Tensor)");
  m.def("all_to_all_v_out(Tensor input, Tensor in_splits, Tensor(a!) out, str group_name) -> (Tensor(a!), Tensor)");
  m.def("all_to_all_v_into(Tensor input, Tensor in_splits, Tensor(a!) out, str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(gocomm, CUDA, m) {
  m.impl("all_to_all_v", &gocomm::a2av);
  m.impl("all_to_all_v_out", &gocomm::a2av_out);
  m.impl("all_to_all_v_into", &gocomm::a2av_into);
}

TORCH_LIBRARY_IMPL(gocomm, CPU, m) {
  m.impl("all_to_all_v", &gocomm::a2av);
  m.impl("all_to_all_v_out", &gocomm::a2av_out);
  m.impl("all_to_all_v_into", &gocomm::a2av_into);
}

TORCH_LIBRARY_IMPL(gocomm, Meta, m) {
  m.impl("all_to_all_v", &gocomm::a2av_meta);
  m.impl("all_to_all_v_out", &gocomm::a2av_out_meta);
  m.impl("all_to_all_v_into", &gocomm::a2av_into_meta);
}
