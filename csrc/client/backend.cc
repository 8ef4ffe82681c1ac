#include "backend.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstring>

namespace gocomm {

// One op as handed to the sidecar. inputs: one entry per descriptor buffer: the tensors
// packed into it (copied in), or nullopt for a buffer that only receives (its size comes
// from outputs). outputs: (buffer index, tensors) whose bytes are copied back from that
// buffer, in order, when the op succeeds.
struct Backend::Op {
  // What every op states: its name (errors, the flight record), wire kind and torch OpType,
  // and its timeout (unset: the group's).
  Op(std::string name_, uint8_t kind_, c10d::OpType type_, std::chrono::milliseconds timeout_ = c10d::kUnsetTimeout)
      : name(std::move(name_)), kind(kind_), timeout(timeout_), type(type_) {}
  // Its elements: t's type, and t's count unless given (a list's total).
  void elements(const at::Tensor& t, int64_t n = -1) {
    dtype = t.scalar_type();
    count = uint64_t(n < 0 ? t.numel() : n);
  }

  std::string name;
  uint8_t kind = 0;
  std::optional<at::ScalarType> dtype;
  uint64_t count = 0;
  uint8_t redop = 0;
  int32_t root = 0;
  int32_t tag = 0;
  std::vector<std::optional<std::vector<at::Tensor>>> inputs;
  std::vector<std::pair<size_t, std::vector<at::Tensor>>> outputs;
  std::vector<int64_t> splits;
  std::optional<std::vector<at::Tensor>> result;
  std::chrono::milliseconds timeout = c10d::kUnsetTimeout;
  c10d::OpType type = c10d::OpType::UNKNOWN;
};

std::string shape_name(at::IntArrayRef s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); i++) {
    r += (i ? ", " : "") + std::to_string(s[i]);
  }
  return r + (s.size() == 1 ? ",)" : ")");
}

std::string list_name(const std::vector<int64_t>& v) {
  std::string r = "[";
  for (size_t i = 0; i < v.size(); i++) {
    r += (i ? ", " : "") + std::to_string(v[i]);
  }
  return r + "]";
}

int64_t row_nbytes(const at::Tensor& t) {
  int64_t row = t.element_size();
  for (int64_t s : t.sizes().slice(1)) {
    row *= s;
  }
  return row;
}

std::string dtype_name(at::ScalarType s) {
  switch (s) {
    case at::ScalarType::Bool: return "torch.bool";
    case at::ScalarType::Byte: return "torch.uint8";
    case at::ScalarType::Char: return "torch.int8";
    case at::ScalarType::Short: return "torch.int16";
    case at::ScalarType::Int: return "torch.int32";
    case at::ScalarType::Long: return "torch.int64";
    case at::ScalarType::Half: return "torch.float16";
    case at::ScalarType::BFloat16: return "torch.bfloat16";
    case at::ScalarType::Float: return "torch.float32";
    case at::ScalarType::Double: return "torch.float64";
    case at::ScalarType::ComplexHalf: return "torch.complex32";
    case at::ScalarType::ComplexFloat: return "torch.complex64";
    case at::ScalarType::ComplexDouble: return "torch.complex128";
    case at::ScalarType::UInt16: return "torch.uint16";
    case at::ScalarType::UInt32: return "torch.uint32";
    case at::ScalarType::UInt64: return "torch.uint64";
    default: {
      std::string n = c10::toString(s);
      for (char& c : n) {
        c = char(std::tolower(static_cast<unsigned char>(c)));
      }
      return "torch." + n;
    }
  }
}

namespace {

using at::ScalarType;
using c10::intrusive_ptr;
using Tensors = std::vector<at::Tensor>;

// ----- names as Python spells them (the messages match the Python client's) -----------------

std::string layout_name(c10::Layout l) {
  switch (l) {
    case c10::kStrided: return "torch.strided";
    case c10::kSparse: return "torch.sparse_coo";
    case c10::kSparseCsr: return "torch.sparse_csr";
    case c10::kSparseCsc: return "torch.sparse_csc";
    case c10::kSparseBsr: return "torch.sparse_bsr";
    case c10::kSparseBsc: return "torch.sparse_bsc";
    case c10::kMkldnn: return "torch._mkldnn";
    case c10::kJagged: return "torch.jagged";
    default: return "torch.layout";
  }
}


}  // namespace

int wire_dtype(ScalarType s) {
  switch (s) {
    case ScalarType::Bool: return 1;
    case ScalarType::Byte: return 2;
    case ScalarType::Char: return 3;
    case ScalarType::Short: return 4;
    case ScalarType::Int: return 5;
    case ScalarType::Long: return 6;
    case ScalarType::Half: return 7;
    case ScalarType::BFloat16: return 8;
    case ScalarType::Float: return 9;
    case ScalarType::Double: return 10;
    case ScalarType::ComplexFloat: return 11;
    case ScalarType::ComplexDouble: return 12;
    case ScalarType::Float8_e4m3fn: return 13;
    case ScalarType::Float8_e5m2: return 14;
    case ScalarType::UInt16: return 15;
    case ScalarType::UInt32: return 16;
    case ScalarType::UInt64: return 17;
    default: return 0;
  }
}

namespace {

bool is_integer(ScalarType s) {
  switch (s) {
    case ScalarType::Byte:
    case ScalarType::Char:
    case ScalarType::Short:
    case ScalarType::Int:
    case ScalarType::Long:
    case ScalarType::UInt16:
    case ScalarType::UInt32:
    case ScalarType::UInt64:
      return true;
    default:
      return false;
  }
}

bool is_float8(ScalarType s) {
  return s == ScalarType::Float8_e4m3fn || s == ScalarType::Float8_e5m2;
}

const char* redop_name(uint8_t op) {
  static const char* names[] = {"", "sum", "avg", "product", "min", "max", "band", "bor", "bxor"};
  return op < 9 ? names[op] : "";
}

// Why op cannot reduce dtype on CPU tensors ("" if it can; mirrors reduce.Check).
std::string reduce_support(ScalarType s, uint8_t op) {
  const std::string d = dtype_name(s);
  if (is_float8(s)) {
    return d + " tensors can be moved but not reduced on CPU";
  }
  if (s == ScalarType::Bool) {
    return op == wire::kAvg ? "avg is not defined for bool" : "";
  }
  if (is_integer(s)) {
    return "";
  }
  if (op == wire::kBand || op == wire::kBor || op == wire::kBxor) {
    return "bitwise ops are not defined for " + d;
  }
  if (c10::isComplexType(s) && (op == wire::kMin || op == wire::kMax)) {
    return "min and max are not defined for " + d;
  }
  return "";
}

// Why op cannot reduce dtype on CUDA tensors (NCCL), "" if it can (mirrors collectives/device).
std::string cuda_reduce_support(ScalarType s, uint8_t op) {
  if (op == wire::kBand || op == wire::kBor || op == wire::kBxor) {
    return "bitwise reductions are not supported on CUDA tensors (NCCL has none)";
  }
  if (s == ScalarType::Bool) {
    return op == wire::kAvg ? "avg is not defined for bool" : "";
  }
  if (c10::isComplexType(s)) {
    return (op == wire::kSum || op == wire::kAvg)
               ? ""
               : std::string(redop_name(op)) + " is not supported for " + dtype_name(s) + " on CUDA tensors";
  }
  switch (s) {
    case ScalarType::Byte:
    case ScalarType::Char:
    case ScalarType::Int:
    case ScalarType::Long:
    case ScalarType::UInt32:
    case ScalarType::UInt64:
      return "";
    default:
      break;
  }
  if (c10::isFloatingType(s)) {
    return "";
  }
  return dtype_name(s) + " cannot be reduced on CUDA tensors (NCCL has no such type)";
}

}  // namespace

std::string reduce_refusal(ScalarType s, uint8_t op, bool cuda) {
  return cuda ? cuda_reduce_support(s, op) : reduce_support(s, op);
}

namespace {

// Copy each packed buffer's bytes into the outputs it stands for, in order, on the current
// stream (ops whose outputs the sidecar cannot write in place: a list of tensors).
void unpack_outputs(std::vector<std::pair<at::Tensor, Tensors*>>& unpack) {
  for (auto& [buf, outs] : unpack) {
    int64_t pos = 0;
    for (auto& o : *outs) {
      o.copy_(buf.narrow(0, pos, o.numel()).view(o.sizes()));
      pos += o.numel();
    }
  }
}

// ----- argument checks (the same exception types and messages as the Python client) ---------

[[noreturn]] void value_error(const std::string& m) {
  C10_THROW_ERROR(ValueError, m);
}

[[noreturn]] void type_error(const std::string& m) {
  C10_THROW_ERROR(TypeError, m);
}

// A tensor an op can take: strided, on cpu or cuda (not refused there), of a wire dtype, and
// contiguous; or, with dense (the elementwise ops, whose bytes pair up position by position
// across ranks: all_reduce, broadcast, reduce, send, recv), contiguous in the memory format
// torch suggests for it (channels_last, channels_last_3d), as torch's NCCL backend takes them.
// Those ops move a tensor as the bytes from data_ptr() on (numel x element size), which is
// exactly its memory then (coalesced CUDA ops pack in logical order and unpack alike); the
// ranks must agree on the layout, as with NCCL. The ops that move chunks stay stricter than
// NCCL, which moves a channels_last tensor's bytes as they lie there too.
const at::Tensor& check(const std::string& refusal, const std::string& op, const std::string& name,
                        const at::Tensor& t, bool dense = false) {
  if (!t.defined()) {
    type_error("gocomm " + op + ": " + name + " must be a torch.Tensor, got None");
  }
  if (t.layout() != c10::kStrided) {
    value_error("gocomm " + op + ": " + name + " is a " + layout_name(t.layout()) +
                " tensor; only dense (strided) tensors are supported");
  }
  if (t.is_cuda()) {
    if (!refusal.empty()) {
      C10_THROW_ERROR(NotImplementedError, "gocomm " + op + ": " + name + " is on " + t.device().str() + ", " + refusal);
    }
  } else if (!t.is_cpu()) {
    value_error("gocomm " + op + ": " + name + " is on " + t.device().str() + "; gocomm serves cpu and cuda tensors");
  }
  if (wire_dtype(t.scalar_type()) == 0) {
    type_error("gocomm " + op + ": " + name + " has dtype " + dtype_name(t.scalar_type()) +
               ", which gocomm does not support");
  }
  if (!t.is_contiguous() && !(dense && t.is_contiguous(t.suggest_memory_format()))) {
    value_error("gocomm " + op + ": " + name + " must be contiguous" +
                (dense ? std::string(" (or channels_last)") : std::string()) +
                " (call .contiguous() on it)");
  }
  return t;
}

void same_dtype(const std::string& op, const std::string& name, const Tensors& ts) {
  for (size_t i = 0; i < ts.size(); i++) {
    if (ts[i].scalar_type() != ts[0].scalar_type()) {
      type_error("gocomm " + op + ": " + name + "[" + std::to_string(i) + "] has dtype " +
                 dtype_name(ts[i].scalar_type()) + ", " + name + "[0] has " + dtype_name(ts[0].scalar_type()));
    }
  }
}

void match_dtype(const std::string& op, const std::string& name, const at::Tensor& t, const at::Tensor& like) {
  if (t.scalar_type() != like.scalar_type()) {
    type_error("gocomm " + op + ": " + name + " has dtype " + dtype_name(t.scalar_type()) + ", the input has " +
               dtype_name(like.scalar_type()));
  }
  if (t.device() != like.device()) {
    value_error("gocomm " + op + ": " + name + " is on " + t.device().str() + ", the input on " + like.device().str());
  }
}

// The flat form of a gather or scatter: big holds world_size times small's elements (the
// output of all_gather_into_tensor, the input of reduce_scatter_tensor).
void world_times(const std::string& op, const std::string& big_name, const at::Tensor& big,
                 const std::string& small_name, const at::Tensor& small, int size) {
  if (big.numel() != size * small.numel()) {
    value_error("gocomm " + op + ": " + big_name + " has " + std::to_string(big.numel()) +
                " elements, want world_size * " + small_name + " numel = " + std::to_string(size) + " * " +
                std::to_string(small.numel()));
  }
}

// The low-level options' root tensor: an op takes one tensor a rank, so only 0 names one.
void root_tensor(const std::string& op, int64_t root_tensor) {
  if (root_tensor != 0) {
    value_error("gocomm " + op + ": rootTensor " + std::to_string(root_tensor) +
                " names no tensor (one tensor a rank: 0)");
  }
}

void root_in(const std::string& op, int64_t root, int size) {
  if (root < 0 || root >= size) {
    value_error("gocomm " + op + ": root rank " + std::to_string(root) + " is not in the group of " +
                std::to_string(size));
  }
}

void peer_in(const std::string& op, const std::string& name, int peer, int rank, int size) {
  if (peer < 0 || peer >= size) {
    value_error("gocomm " + op + ": " + name + "=" + std::to_string(peer) + " is not a rank of this group of " +
                std::to_string(size));
  }
  if (peer == rank) {
    value_error("gocomm " + op + ": " + name + "=" + std::to_string(peer) + " is this rank");
  }
}

std::vector<int64_t> splits_of(const std::string& op, const std::string& name, const std::vector<int64_t>& splits,
                               int64_t rows, int n) {
  if (splits.empty()) {
    if (rows % n != 0) {
      value_error("gocomm " + op + ": " + std::to_string(rows) + " rows do not split evenly over " +
                  std::to_string(n) + " ranks; pass " + name);
    }
    return std::vector<int64_t>(n, rows / n);
  }
  if (int64_t(splits.size()) != n) {
    value_error("gocomm " + op + ": " + name + " has " + std::to_string(splits.size()) + " entries, the group has " +
                std::to_string(n) + " ranks");
  }
  int64_t sum = 0;
  for (int64_t s : splits) {
    if (s < 0) {
      value_error("gocomm " + op + ": " + name + " has a negative entry: " + list_name(splits));
    }
    sum += s;
  }
  if (sum != rows) {
    value_error("gocomm " + op + ": " + name + " add up to " + std::to_string(sum) + " rows, the tensor has " +
                std::to_string(rows));
  }
  return splits;
}

int64_t numel_of(const Tensors& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    n += t.numel();
  }
  return n;
}

uint8_t lane_of(uint8_t kind) {
  return (kind == wire::kSend || kind == wire::kRecv) ? 1 : 0;
}

// Whether the in-process all_to_all kernels serve the group: the route table's choice, where
// this rank's sidecar runs CUDA ops. A group of one rank takes them whatever its node (no peer
// to reach); with CUDA refused, its table turns them to the sidecar, as gocomm.info() shows.
bool a2a_route(const Backend::Config& cfg) {
  if (!cfg.routes) {
    return false;
  }
  if (cfg.routes->alone() && !cfg.cuda_refusal.empty()) {
    cfg.routes->fall_back("all_to_all_v", "this rank's sidecar runs no CUDA ops");
  }
  return cfg.routes->a2a_inprocess();
}

}  // namespace

// ----- the group -----------------------------------------------------------------------------

Backend::Backend(std::shared_ptr<Dispatcher> dispatcher, Config cfg)
    : c10d::Backend(cfg.rank, cfg.size),
      disp_(std::move(dispatcher)),
      cfg_(std::move(cfg)),
      ar_inprocess_(cfg_.routes && cfg_.routes->ar_inprocess()),
      a2a_inprocess_(a2a_route(cfg_)),
      k_(cfg_.counter_base) {
  inproc::Engine::Hooks h;
  // the collective setup's exchanges: the group's own CPU all_gather, through the sidecar
  h.gather = [this](const at::Tensor& rec) {
    at::Tensor out = at::empty({int64_t(size_) * rec.numel()}, rec.options());
    at::Tensor in = rec;
    _allgather_base(out, in, c10d::AllgatherOptions())->wait();
    return out;
  };
  h.usable = [this] { return !closed_ && !failure_->get() && !disp_->lost(); };
  h.fall_back = [this](const std::string& op, const std::string& why) {
    if (cfg_.routes) {
      cfg_.routes->fall_back(op, why);
    }
  };
  h.log = [this](int level, const std::string& msg) {
    if (cfg_.log) {
      cfg_.log(level, msg);
    }
  };
  h.abort = [this](const std::string& why) { abort_for(why); };
  engine_ = std::make_unique<inproc::Engine>(cfg_.rank, cfg_.size, cfg_.name, cfg_.timeout_s, ar_inprocess_,
                                             a2a_inprocess_, cfg_.inprocess, std::move(h));
}

std::string Backend::group_name() const {
  const std::string& uid = getGroupUid();
  return uid.empty() ? cfg_.name : uid;
}

std::string Backend::label(const std::string& op) const {
  // the description torch sets on the group (new_group's group_desc), as ProcessGroupNCCL logs it
  const std::string& desc = getGroupDesc();
  const bool said = !desc.empty() && desc != "undefined";
  return op + " on group '" + group_name() + "'" + (said ? " (" + desc + ")" : "");
}

c10::intrusive_ptr<c10d::Backend::Options> Backend::getBackendOptions() {
  return c10::make_intrusive<Options>(getBackendName(),
                                      std::chrono::milliseconds(int64_t(std::min(cfg_.timeout_s, 1e12 / 1000) * 1000)));
}

c10::intrusive_ptr<c10d::Backend> Backend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                 const std::vector<int>& ranks,
                                                 const c10::intrusive_ptr<Options>& opts) {
  TORCH_CHECK(cfg_.on_split, "gocomm split_group of group '" + group_name() + "': this group cannot make subgroups");
  refuse_if_unusable("split_group");
  if (std::find(ranks.begin(), ranks.end(), cfg_.rank) == ranks.end()) {
    return {};  // not a member: nothing to make (no communicator is split, so none to join)
  }
  std::lock_guard<std::mutex> lock(split_mu_);
  if (auto made = split_.lock(); made && split_name_ == opts->group_name) {
    split_.reset();  // its one other device type's call: no weak reference is kept past it
    return made;
  }
  auto made = cfg_.on_split(store, ranks, double(opts->timeout.count()) / 1000, opts->group_name);
  split_ = made;
  split_name_ = opts->group_name;
  return made;
}

std::string Backend::capturable() const {
  return cfg_.routes ? cfg_.routes->capturable() : "none of its ops";
}

void Backend::need_slot(const std::string& op) {
  if (cfg_.slot < 0) {
    TORCH_CHECK(false, "gocomm " + op +
                           ": this process has more groups using CUDA tensors than the sidecar has counters for");
  }
}

uint8_t Backend::redop(const char* op, const c10d::ReduceOp& want, const at::Tensor& t) {
  uint8_t code = 0;
  switch (want.op_) {
    case c10d::ReduceOp::SUM: code = wire::kSum; break;
    case c10d::ReduceOp::AVG: code = wire::kAvg; break;
    case c10d::ReduceOp::PRODUCT: code = wire::kProduct; break;
    case c10d::ReduceOp::MIN: code = wire::kMin; break;
    case c10d::ReduceOp::MAX: code = wire::kMax; break;
    case c10d::ReduceOp::BAND: code = wire::kBand; break;
    case c10d::ReduceOp::BOR: code = wire::kBor; break;
    case c10d::ReduceOp::BXOR: code = wire::kBxor; break;
    case c10d::ReduceOp::PREMUL_SUM:  // a sum of inputs the op scales first (Backend::premul)
      // the dtypes NCCL's PREMUL_SUM takes, and complex (float8 has no arithmetic to scale it)
      if ((!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) ||
          at::isFloat8Type(t.scalar_type())) {
        type_error(std::string("gocomm ") + op + ": PREMUL_SUM takes half, bfloat16, float, double or complex " +
                   "tensors, got " + dtype_name(t.scalar_type()));
      }
      if (dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(want.supplement_.get()) == nullptr) {
        value_error(std::string("gocomm ") + op + ": PREMUL_SUM without its factor (make it with "
                    "torch.distributed._make_nccl_premul_sum)");
      }
      code = wire::kSum;
      break;
    default:
      value_error(std::string("gocomm ") + op + ": reduce op RedOpType." + std::to_string(int(want.op_)) +
                  " is not supported");
  }
  const std::string why = reduce_refusal(t.scalar_type(), code, t.is_cuda());
  if (!why.empty()) {
    type_error(std::string("gocomm ") + op + ": " + why);
  }
  return code;
}

// PREMUL_SUM (torch.distributed._make_nccl_premul_sum; FSDP2 reduce-scatters gradients with it
// where a gradient divide factor is set): the sum over ranks of each rank's input times its own
// factor, as NCCL computes it. t is scaled on the caller's stream (a CPU tensor at once) and the
// op then sums: in place where the op overwrites t with its result anyway, else into a copy,
// so that the input stays as the caller left it (a reduce-scatter's input, a reduce's on the
// other ranks: NCCL scales inside its kernel, this takes a copy the size of the input). Below
// autograd, as the op itself is: the scaling is the collective's, not a step of the caller's
// graph (no grad_fn, no version bump). The factor is taken in t's dtype, as NCCL takes it, a
// float one and a tensor one alike. A destroyed or broken group raises before t is touched;
// where the op raises later, an in-place t keeps its scaled input. Other ops give t back.
at::Tensor Backend::premul(const c10d::ReduceOp& want, const at::Tensor& t, bool in_place, const std::string& op) {
  if (want.op_ != c10d::ReduceOp::PREMUL_SUM) {
    return t;
  }
  const auto* s = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(want.supplement_.get());
  TORCH_CHECK(s != nullptr, "gocomm " + op + ": PREMUL_SUM without its factor");
  refuse_if_unusable(op);
  at::AutoDispatchBelowADInplaceOrView below;
  // a float factor as a CPU scalar (which a CUDA kernel takes as an argument), a tensor one
  // (one element) where it is; either in t's dtype
  const at::Tensor f = (s->tensor_factor.defined() ? s->tensor_factor.to(t.device())
                                                   : at::scalar_tensor(s->double_factor, at::kDouble))
                           .to(t.scalar_type())
                           .reshape({});
  return in_place ? at::Tensor(t).mul_(f) : t.mul(f);
}

void Backend::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalesce_mu_);
  coalescing_ = true;
  coalesced_.clear();
}

intrusive_ptr<c10d::Work> Backend::endCoalescing() {
  std::vector<intrusive_ptr<Work>> works;
  {
    std::lock_guard<std::mutex> lock(coalesce_mu_);
    coalescing_ = false;
    works.swap(coalesced_);
  }
  return BatchWork::make("coalesced", std::move(works), {});
}

// The dispatcher's record of op, with its Work (result: the tensors the Work returns) and the
// deadline its completion thread enforces.
Pending Backend::record(const std::string& op, double t_limit) const {
  Pending p;
  p.op = label(op);
  p.deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                      std::chrono::duration<double>(t_limit + Dispatcher::kGrace));
  p.group = failure_;  // its failure breaks the group
  return p;
}

Pending Backend::pending(const Op& op, std::vector<at::Tensor> result, double t_limit) {
  Pending p = record(op.name, t_limit);
  p.work = c10::make_intrusive<Work>(p.op, std::move(result), t_limit + Dispatcher::kGrace, op.type);
  return p;
}

intrusive_ptr<Work> Backend::submit(Op& op) {
  intrusive_ptr<Work> w = submit_op(op);
  std::lock_guard<std::mutex> lock(coalesce_mu_);
  if (coalescing_) {
    coalesced_.push_back(w);
  }
  return w;
}

Backend& Backend::of(const std::string& group, const std::string& op) {
  auto pg = c10d::resolve_process_group(group);
  auto* b = dynamic_cast<Backend*>(pg->getBackend(c10::DeviceType::CUDA).get());
  if (b == nullptr) {
    C10_THROW_ERROR(ValueError, "gocomm " + op + ": group '" + group + "' is not a gocomm group");
  }
  return *b;
}

std::shared_ptr<inproc::A2Path> Backend::a2av_path_for(const at::Tensor& input, const std::string& op) {
  auto path = engine_->a2av_path(input.device().index());
  TORCH_CHECK_NOT_IMPLEMENTED(path, "gocomm " + op + ": the in-process kernel does not serve group '" + group_name() +
                                        "' on " + input.device().str() + " (its route table says why: gocomm.info())");
  return path;
}

void Backend::refuse_if_unusable(const std::string& op) {
  if (closed_) {
    value_error("gocomm " + op + ": the process group was destroyed");
  }
  refuse_if_broken(op);
}

void Backend::refuse_if_broken(const std::string& op) {
  auto why = failure_->broken();
  if (!why && disp_->released_mark(cfg_.slot) == cfg_.handle) {
    // The sidecar let the group's streams go (the group broke, or it refused an op): a stream
    // whose op had not run went on, so a caller that synced it saw wrong data and must not
    // get another op through. The mark is stored before the release, so this caller sees it;
    // the cause follows at once (the failed ops' completions, the watch stream's event).
    why = failure_->wait_broken(std::chrono::milliseconds(kCauseWaitMs));
    if (!why) {
      failure_->mark_broken("the sidecar released the group's streams (its cause did not reach this process within " +
                            std::to_string(kCauseWaitMs) + " ms; see the sidecar's log)");
      why = failure_->broken();
    }
  }
  if (why) {
    C10_THROW_ERROR(DistBackendError, "gocomm " + label(op) + " failed (aborted): the group is broken: " + *why);
  }
}

intrusive_ptr<Work> Backend::submit_op(Op& op) {
  refuse_if_unusable(op.name);
  const bool timeout_given = op.timeout.count() > 0;
  const double t_limit = timeout_given ? op.timeout.count() / 1000.0 : cfg_.timeout_s;
  const at::Tensor* first = nullptr;
  for (auto& ins : op.inputs) {
    if (ins && !ins->empty()) {
      first = &ins->front();
      break;
    }
  }
  if (first == nullptr) {
    for (auto& [i, ts] : op.outputs) {
      if (!ts.empty()) {
        first = &ts.front();
        break;
      }
    }
  }
  if (first != nullptr && first->is_cuda()) {
    return submit_cuda(op, t_limit, timeout_given);
  }
  std::map<size_t, Tensors*> out_for;
  for (auto& [i, ts] : op.outputs) {
    out_for[i] = &ts;
  }
  Pending p = pending(op, op.result ? *op.result : Tensors{}, t_limit);
  auto work = p.work;
  wire::Desc d;
  Arena& arena = disp_->arena();
  try {
    for (size_t i = 0; i < op.inputs.size(); i++) {
      const Tensors& ts = op.inputs[i] ? *op.inputs[i] : *out_for.at(i);
      size_t nbytes = 0;
      for (const auto& t : ts) {
        nbytes += t.nbytes();
      }
      Arena::Block b = arena.alloc(nbytes);
      p.allocs.push_back(b);
      d.bufs.push_back(wire::BufRef{b.segment, b.offset, nbytes});
      if (op.inputs[i]) {
        size_t pos = 0;
        for (const auto& t : ts) {
          copy_bytes(b.ptr + pos, t.data_ptr(), t.nbytes());
          pos += t.nbytes();
        }
      }
    }
  } catch (...) {
    for (const auto& b : p.allocs) {
      arena.release(b);
    }
    throw;
  }
  for (auto& [i, ts] : op.outputs) {
    const uint8_t* base = p.allocs.at(i).ptr;
    size_t pos = 0;
    for (const auto& t : ts) {
      p.copy_out.emplace_back(t, base + pos);
      pos += t.nbytes();
    }
  }
  d.group = cfg_.handle;
  d.kind = op.kind;
  d.dtype = op.dtype ? uint8_t(wire_dtype(*op.dtype)) : 0;
  d.redop = op.redop;
  d.root = op.root;
  d.tag = op.tag;
  d.count = op.count;
  d.timeout_ms = timeout_given ? uint64_t(t_limit * 1000) : 0;
  d.splits = std::move(op.splits);
  return disp_->submit(std::move(p), d);
}

intrusive_ptr<Work> Backend::submit_cuda(Op& op, double t_limit, bool timeout_given) {
  // On the current stream S: pack list inputs into a flat buffer; write ready = k to the
  // group's counter; (the sidecar waits for it, runs NCCL on the tensors' memory, writes
  // done = k). Ops with list outputs also make S wait for done and unpack, and record an
  // event for wait(); the others leave S alone until wait() makes the current stream wait
  // for done >= k. Every tensor stays referenced until the op finished, so the caching
  // allocator cannot hand its memory out while the sidecar uses it.
  need_slot(op.name);
  auto out_of = [&op](size_t i) -> Tensors* {  // buffer i's outputs, if any (ops have one or two)
    for (auto& [j, ts] : op.outputs) {
      if (j == i) {
        return &ts;
      }
    }
    return nullptr;
  };
  Tensors tensors;
  for (auto& ins : op.inputs) {
    if (ins) {
      tensors.insert(tensors.end(), ins->begin(), ins->end());
    }
  }
  for (auto& [i, ts] : op.outputs) {
    tensors.insert(tensors.end(), ts.begin(), ts.end());
  }
  const c10::Device dev = tensors.front().device();
  for (const auto& t : tensors) {
    if (t.device() != dev) {
      value_error("gocomm " + op.name + ": tensors on " + t.device().str() + " and " + dev.str() +
                  "; one op runs on one device");
    }
  }
  const int idx = dev.index();
  c10::cuda::CUDAGuard guard(dev.index());
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(dev.index());
  const uint8_t lane = lane_of(op.kind);
  // Under capture a collective becomes a graph op (capture_op); point-to-point ops raise
  // before anything is queued or sent.
  const cuda::Capture cap = cuda::capture_info(stream.stream());
  if (cap.active && lane != 0) {
    TORCH_CHECK(false, "gocomm " + op.name + " cannot be captured in a CUDA graph on group '" + group_name() +
                           "': point-to-point ops run on the sidecar's per-peer NCCL communicators, which a graph "
                           "replay does not reach. Run it outside the capture. This group can capture: " +
                           capturable() + ".");
  }
  const cuda::DevPtr counters = disp_->counters(idx) + 16 * uint64_t(cfg_.slot);
  wire::Desc d;
  Tensors keep = std::move(tensors);  // every tensor of the op, referenced until it finished
  std::vector<std::pair<at::Tensor, Tensors*>> unpack;
  at::Tensor last;
  for (size_t i = 0; i < op.inputs.size(); i++) {
    Tensors* outs = out_of(i);
    TORCH_INTERNAL_ASSERT(op.inputs[i] || outs != nullptr, "gocomm ", op.name, ": buffer ", i, " has no tensors");
    const Tensors& ts = op.inputs[i] ? *op.inputs[i] : *outs;
    at::Tensor buf;
    if (ts.size() == 1 && (outs == nullptr || (outs->size() == 1 && (*outs)[0].is_same(ts[0])))) {
      buf = ts[0];
    } else {
      buf = at::empty({numel_of(ts)}, ts[0].options());
      if (op.inputs[i]) {
        Tensors flat;
        for (const auto& t : *op.inputs[i]) {
          flat.push_back(t.reshape({-1}));
        }
        at::cat_out(buf, flat);
      }
      if (outs != nullptr) {
        unpack.emplace_back(buf, outs);
      }
      keep.push_back(buf);
    }
    // the device is current (guard) and attached (counters above): the cache directly
    d.bufs.push_back(disp_->ipc().ref(reinterpret_cast<uint64_t>(buf.data_ptr()), buf.nbytes()));
    last = buf;
  }
  Tensors result = op.result ? *op.result : (last.defined() ? Tensors{last} : Tensors{});
  d.group = cfg_.handle;
  d.kind = op.kind;
  d.dtype = op.dtype ? uint8_t(wire_dtype(*op.dtype)) : 0;
  d.redop = op.redop;
  d.root = op.root;
  d.tag = op.tag;
  d.count = op.count;
  d.timeout_ms = timeout_given ? uint64_t(t_limit * 1000) : 0;
  d.splits = std::move(op.splits);
  d.device = wire::kDeviceCuda;
  if (cap.active) {
    return capture_op(op, d, stream, cap.graph, unpack, result, idx);
  }
  // Before any stream work for the op: a descriptor refused after its done wait was queued
  // would leave the stream waiting for a value only a later op writes.
  disp_->check_size(d, [&] { return label(op.name); });
  const cuda::DevPtr ready = counters + 8 * lane, done = ready + 4;
  if (!unpack.empty()) {
    Pending p = pending(op, result, t_limit);
    auto work = p.work;
    p.cuda = true;
    p.keep = std::move(keep);
    work->cuda_device = dev.index();
    std::lock_guard<std::mutex> lock(cuda_mu_);
    const uint32_t k = ++k_[lane];
    d.stream_value = k;
    cuda::write_value(stream.stream(), ready, k);
    // Queued before the descriptor goes out, so the unpack event is recorded before the
    // sidecar can report the op done (the completion waits for it).
    cuda::wait_value(stream.stream(), done, k);
    unpack_outputs(unpack);
    auto ev = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    ev->record(stream);
    p.unpacked = ev;
    work->cuda_wait = [ev](const c10::cuda::CUDAStream& s) { ev->block(s); };
    disp_->submit(std::move(p), d);
    return work;
  }
  // The descriptor first, then the write of ready = k: the sidecar takes the op and starts on
  // it while this thread queues the write and builds the Work (Dispatcher::send, track), so
  // their host steps overlap and the op reaches the GPU sooner. Nothing can be reported done
  // before the write reached the GPU, but a completion (a refusal, or the op itself where
  // this thread is held up) can come before track, which then settles it.
  // Where a step after send throws, the op is in the ring all the same: its tensors stay
  // referenced until the sidecar answers it.
  auto track_failed = [&] {
    Pending gone = record(op.name, t_limit);  // no Work: its failure breaks the group
    gone.keep = std::move(keep);
    gone.cuda = true;
    disp_->track(d.seq, std::move(gone));
  };
  uint32_t k;
  {
    std::lock_guard<std::mutex> lock(cuda_mu_);
    k = ++k_[lane];
    d.stream_value = k;
    disp_->send(d, [&] { return label(op.name); });
    try {
      cuda::write_value(stream.stream(), ready, k);
    } catch (...) {
      track_failed();
      throw;
    }
  }
  Pending p;
  try {
    p = pending(op, result, t_limit);
  } catch (...) {
    track_failed();
    throw;
  }
  auto work = p.work;
  p.cuda = true;
  p.keep = std::move(keep);
  work->cuda_device = dev.index();
  work->cuda_wait = [done, k](const c10::cuda::CUDAStream& s) {
    c10::cuda::CUDAGuard g(s.device_index());
    cuda::wait_value(s.stream(), done, k);
  };
  disp_->track(d.seq, std::move(p));
  return work;
}

namespace {

// A graph's user object (Dispatcher::DropQueue): its destructor queues the trigger's drop.
struct GraphTrigger {
  std::shared_ptr<DropQueue> queue;
  uint32_t t;
};

void drop_trigger(void* arg) {
  auto* g = static_cast<GraphTrigger*>(arg);
  {
    std::lock_guard<std::mutex> lock(g->queue->mu);
    g->queue->triggers.push_back(g->t);
  }
  delete g;
}

}  // namespace

intrusive_ptr<Work> Backend::capture_op(Op& op, wire::Desc& d, const c10::cuda::CUDAStream& stream, void* graph,
                                        std::vector<std::pair<at::Tensor, Tensors*>>& unpack, const Tensors& result,
                                        int device) {
  // docs/decisions/0020: the op is registered with the sidecar once, under a trigger t, and
  // the graph holds three stream memory operations: D[t] = 0, T[t] = 1, wait for D[t] == 1.
  // The sidecar's watcher sees T[t], runs the op on the group's graph lane and writes D[t]
  // after it. The buffers named in d are the graph's for its lifetime (the caller's tensors,
  // and packed ones from the graph's private pool), as with torch's NCCL.
  if (graph == nullptr) {
    TORCH_CHECK(false, "gocomm " + op.name + ": the CUDA graph capture on this stream was invalidated");
  }
  const uint32_t t = disp_->take_trigger(device);
  Pending p;
  p.work = c10::make_intrusive<Work>(label(op.name) + " (registering a captured op)", Tensors{}, Dispatcher::kGrace,
                                     op.type);
  p.op = label(op.name) + " captured in a CUDA graph";
  p.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(int(Dispatcher::kGrace));
  try {
    disp_->register_graph_op(std::move(p), d, t);
  } catch (...) {
    // refused (the sidecar keeps nothing) or lost (its triggers went with it)
    disp_->give_back_trigger(t);
    throw;
  }
  // From here the sidecar holds the op until the graph is gone.
  // the drop is queued when the graph is gone, or at once where this fails
  cuda::retain_user_object(graph, drop_trigger, new GraphTrigger{disp_->drops(), t});
  const cuda::DevPtr done = disp_->done_word(t);
  cuda::write_value(stream.stream(), done, 0);
  cuda::write_value(stream.stream(), disp_->trigger_word(t), 1);
  cuda::wait_value_eq(stream.stream(), done, 1);
  unpack_outputs(unpack);
  // The capturing stream already waits for the op: wait() has nothing left to do.
  auto work = c10::make_intrusive<Work>(label(op.name), result, cfg_.timeout_s, op.type);
  work->cuda_wait = [](const c10::cuda::CUDAStream&) {};
  work->finish_op(nullptr);
  return work;
}

void Backend::cuda_now(const std::string& op, uint8_t kind, const std::vector<wire::BufRef>& bufs, Tensors keep,
                       int device, uint64_t count) {
  refuse_if_unusable(op);
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    refuse_capture(op, "it runs in the sidecar's NVSHMEM kernel, which is handed each call on the host");
  }
  need_slot(op);
  const cuda::DevPtr counters = disp_->counters(device) + 16 * uint64_t(cfg_.slot);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  const uint8_t lane = lane_of(kind);
  Pending p = record(op, cfg_.timeout_s);
  p.cuda = true;
  wire::Desc d;
  d.group = cfg_.handle;
  d.kind = kind;
  d.dtype = uint8_t(wire_dtype(keep.at(0).scalar_type()));
  d.count = count;
  d.bufs = bufs;
  d.device = wire::kDeviceCuda;
  p.keep = std::move(keep);
  const cuda::DevPtr ready = counters + 8 * lane, done = ready + 4;
  std::lock_guard<std::mutex> lock(cuda_mu_);
  const uint32_t k = ++k_[lane];
  cuda::write_value(stream.stream(), ready, k);
  d.stream_value = k;
  disp_->submit(std::move(p), d);
  cuda::wait_value(stream.stream(), done, k);
}

void Backend::refuse_capture(const std::string& op, const std::string& why) const {
  TORCH_CHECK(false, "gocomm " + op + " cannot be captured in a CUDA graph on group '" + group_name() + "': " + why +
                         ", so a replay would not run it. Run it outside the capture. This group can capture: " +
                         capturable() + ".");
}

void Backend::nvshmem_ready(int device) {
  std::lock_guard<std::mutex> lock(nvshmem_mu_);
  if (nvshmem_ready_) {
    return;
  }
  TORCH_CHECK(cfg_.shmem_id && cfg_.store, "gocomm all_to_all_v on group '" + group_name() +
                                                "': the sidecar's NVSHMEM kernel has no setup (no control plane)");
  exchange_shmem_id(*cfg_.store, cfg_.rank, group_name(), device, cfg_.shmem_id);
  nvshmem_ready_ = true;
}

void exchange_shmem_id(c10d::Store& store, int rank, const std::string& group, int device, const ShmemRpc& rpc) {
  const std::string key = "gocomm/nvshmem_uid";
  if (rank == 0) {
    std::vector<uint8_t> id;
    try {
      id = rpc(device, {});
    } catch (...) {
      store.set(key, std::vector<uint8_t>{});
      throw;
    }
    store.set(key, id);
    return;
  }
  auto id = store.get(key);
  TORCH_CHECK(!id.empty(), "gocomm all_to_all_v on group '" + group +
                               "': rank 0 could not make the NVSHMEM unique id (its error says why)");
  rpc(device, id);
}

intrusive_ptr<Work> Backend::submit_raw(const std::string& op, const std::vector<uint8_t>& payload,
                                      double track_after_s) {
  // Decoded back into a Desc so that the dispatcher's encoder writes it (with its seq).
  auto get64 = [&](size_t at) {
    uint64_t v = 0;
    std::memcpy(&v, payload.data() + at, 8);
    return v;
  };
  TORCH_CHECK(payload.size() >= wire::kDescHeader, "gocomm: a descriptor is at least 56 bytes");
  wire::Desc d;
  std::memcpy(&d.group, payload.data() + 8, 4);
  d.kind = payload[12];
  d.dtype = payload[13];
  d.redop = payload[14];
  d.device = payload[15];
  std::memcpy(&d.root, payload.data() + 16, 4);
  std::memcpy(&d.tag, payload.data() + 20, 4);
  d.count = get64(24);
  d.timeout_ms = get64(32);
  uint16_t nbufs;
  uint32_t nsplits;
  std::memcpy(&nbufs, payload.data() + 40, 2);
  std::memcpy(&nsplits, payload.data() + 44, 4);
  std::memcpy(&d.stream_value, payload.data() + 48, 4);
  TORCH_CHECK(payload.size() == wire::kDescHeader + nbufs * wire::kBufRefSize + nsplits * 8,
              "gocomm: descriptor length does not match its buffers and splits");
  size_t at = wire::kDescHeader;
  for (uint16_t i = 0; i < nbufs; i++, at += wire::kBufRefSize) {
    wire::BufRef r;
    std::memcpy(&r.segment, payload.data() + at, 4);
    r.offset = get64(at + 8);
    r.length = get64(at + 16);
    d.bufs.push_back(r);
  }
  for (uint32_t i = 0; i < nsplits; i++, at += 8) {
    d.splits.push_back(int64_t(get64(at)));
  }
  auto work =
      c10::make_intrusive<Work>(label(op), Tensors{}, cfg_.timeout_s + Dispatcher::kGrace, c10d::OpType::UNKNOWN);
  Pending p;
  p.work = work;
  p.op = label(op);
  p.deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   std::chrono::duration<double>(cfg_.timeout_s + Dispatcher::kGrace));
  if (track_after_s < 0) {
    return disp_->submit(std::move(p), d);
  }
  disp_->send(d, [&] { return label(op); });
  std::this_thread::sleep_for(std::chrono::duration<double>(track_after_s));
  disp_->track(d.seq, std::move(p));
  return work;
}

// ----- collectives -----------------------------------------------------------------------------

namespace {

const at::Tensor& single(const std::string& refusal, const std::string& op, const std::string& name,
                         const Tensors& ts, bool dense = false) {
  if (ts.size() != 1) {
    value_error("gocomm " + op + ": expected exactly one " + name + " per call, got " + std::to_string(ts.size()));
  }
  return check(refusal, op, name, ts[0], dense);
}

const Tensors& tensor_list(const std::string& refusal, const std::string& op, const std::string& name,
                           const Tensors& ts, bool dense = false) {
  for (size_t i = 0; i < ts.size(); i++) {
    check(refusal, op, name + "[" + std::to_string(i) + "]", ts[i], dense);
  }
  return ts;
}

// The one list of size tensors shaped like `like` that list-style collectives take. Tensors
// that differ in size from rank to rank (which ProcessGroupNCCL takes as one broadcast or
// reduce a root) are refused: a rank can check only its own entry, so a wrong size elsewhere
// would send ops its peers never match, where refusing raises on every rank before sending.
const Tensors& output_list(const std::string& refusal, const std::string& op, const std::string& name,
                           const std::vector<Tensors>& lists, const at::Tensor& like, int size) {
  if (lists.size() != 1) {
    value_error("gocomm " + op + ": expected one " + name);
  }
  const Tensors& ts = tensor_list(refusal, op, name, lists[0]);
  if (int64_t(ts.size()) != size) {
    value_error("gocomm " + op + ": " + name + " has " + std::to_string(ts.size()) + " tensors, the group has " +
                std::to_string(size) + " ranks");
  }
  for (size_t i = 0; i < ts.size(); i++) {
    const std::string n = name + "[" + std::to_string(i) + "]";
    match_dtype(op, n, ts[i], like);
    if (ts[i].numel() != like.numel()) {
      value_error("gocomm " + op + ": " + n + " has " + std::to_string(ts[i].numel()) + " elements (shape " +
                  shape_name(ts[i].sizes()) + "), want " + std::to_string(like.numel()) + " (shape " + shape_name(like.sizes()) +
                  ")");
    }
  }
  return ts;
}

// The *_tensor_coalesced forms: one op per (output, input) pair, waited for as one Work.
template <typename Each>
intrusive_ptr<c10d::Work> pairwise(const char* name, Tensors& outputs, Tensors& inputs, const Each& each) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "gocomm ", name, ": ", outputs.size(), " outputs and ",
                    inputs.size(), " inputs");
  std::vector<intrusive_ptr<Work>> works;
  for (size_t i = 0; i < outputs.size(); i++) {
    works.push_back(c10::static_intrusive_pointer_cast<Work>(each(outputs[i], inputs[i])));
  }
  return BatchWork::make(name, std::move(works), outputs);
}

}  // namespace

intrusive_ptr<c10d::Work> Backend::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor& t = single(cfg_.cuda_refusal, "all_reduce", "tensor", tensors, true);
  const uint8_t code = redop("all_reduce", opts.reduceOp, t);
  premul(opts.reduceOp, t, true, "all_reduce");
  if (ar_inprocess_ && t.is_cuda()) {
    if (auto w = engine_->all_reduce(t, code)) {
      return w;
    }
  }
  Op op("all_reduce", wire::kAllReduce, c10d::OpType::ALLREDUCE, opts.timeout);
  op.elements(t);
  op.redop = code;
  op.inputs = {Tensors{t}};
  op.outputs = {{0, {t}}};
  op.result = Tensors{t};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::allreduce_sparse(Tensors& tensors, const c10d::AllreduceOptions&) {
  single(cfg_.cuda_refusal, "all_reduce", "tensor", tensors);  // raises: not strided
  value_error("gocomm all_reduce: only dense (strided) tensors are supported");
}

intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const std::string name = "all_reduce_coalesced";
  const Tensors& ts = tensor_list(cfg_.cuda_refusal, name, "tensors", tensors, true);
  if (ts.empty()) {
    return BatchWork::make(name, {}, {});
  }
  same_dtype(name, "tensors", ts);
  Op op(name, wire::kAllReduce, c10d::OpType::ALLREDUCE_COALESCED, opts.timeout);
  op.elements(ts[0], numel_of(ts));
  op.redop = redop(name.c_str(), opts.reduceOp, ts[0]);
  for (const auto& t : ts) {
    premul(opts.reduceOp, t, true, name);
  }
  op.inputs = {ts};
  op.outputs = {{0, ts}};
  op.result = ts;
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor& t = single(cfg_.cuda_refusal, "broadcast", "tensor", tensors, true);
  root_in("broadcast", opts.rootRank, size_);
  root_tensor("broadcast", opts.rootTensor);
  const bool me = opts.rootRank == rank_;
  Op op("broadcast", wire::kBroadcast, c10d::OpType::BROADCAST, opts.timeout);
  op.elements(t);
  op.root = int32_t(opts.rootRank);
  if (me) {
    op.inputs = {Tensors{t}};
  } else {
    op.inputs = {std::nullopt};
    op.outputs = {{0, {t}}};
  }
  op.result = Tensors{t};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor& t = single(cfg_.cuda_refusal, "reduce", "tensor", tensors, true);
  const uint8_t code = redop("reduce", opts.reduceOp, t);
  root_in("reduce", opts.rootRank, size_);
  root_tensor("reduce", opts.rootTensor);
  Op op("reduce", wire::kReduce, c10d::OpType::REDUCE, opts.timeout);
  op.elements(t);
  op.redop = code;
  op.root = int32_t(opts.rootRank);
  // the root's t takes the result; the others' stays as it was (NCCL's reduce)
  op.inputs = {Tensors{premul(opts.reduceOp, t, opts.rootRank == rank_, "reduce")}};
  if (opts.rootRank == rank_) {
    op.outputs = {{0, {t}}};
  }
  op.result = Tensors{t};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                             const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor& t = single(cfg_.cuda_refusal, "all_gather", "tensor", inputs);
  const Tensors& outs = output_list(cfg_.cuda_refusal, "all_gather", "tensor_list", outputs, t, size_);
  Op op("all_gather", wire::kAllGather, c10d::OpType::ALLGATHER, opts.timeout);
  op.elements(t);
  op.inputs = {Tensors{t}, std::nullopt};
  op.outputs = {{1, outs}};
  op.result = outs;
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const std::string name = "all_gather_into_tensor";
  check(cfg_.cuda_refusal, name, "input_tensor", input);
  check(cfg_.cuda_refusal, name, "output_tensor", output);
  match_dtype(name, "output_tensor", output, input);
  world_times(name, "output_tensor", output, "input", input, size_);
  Op op(name, wire::kAllGather, c10d::OpType::_ALLGATHER_BASE, opts.timeout);
  op.elements(input);
  op.inputs = {Tensors{input}, std::nullopt};
  op.outputs = {{1, {output}}};
  op.result = Tensors{output};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                                   const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  return pairwise("all_gather_into_tensor_coalesced", outputs, inputs,
                  [&](at::Tensor& out, at::Tensor& in) { return _allgather_base(out, in, opts); });
}

intrusive_ptr<c10d::Work> Backend::allgather_coalesced(std::vector<Tensors>& output_lists, Tensors& input_list,
                                                       const c10d::AllgatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  // output_lists[r][j] receives rank r's input_list[j]: one all_gather of every input packed
  // end to end (rank r's block of the result is its inputs in order, which is
  // output_lists[r] flattened in order). CPU tensors only, as torch's NCCL backend has no
  // all_gather_coalesced either.
  const std::string name = "all_gather_coalesced";
  const Tensors& ins = tensor_list(cfg_.cuda_refusal, name, "input_tensor_list", input_list);
  for (const auto& t : ins) {
    if (t.is_cuda()) {
      C10_THROW_ERROR(NotImplementedError,
                      "gocomm " + name +
                          ": CUDA tensors are not supported (torch's NCCL backend has no all_gather_coalesced "
                          "either); use all_gather_into_tensor, or all_gather per tensor");
    }
  }
  same_dtype(name, "input_tensor_list", ins);
  if (int64_t(output_lists.size()) != size_) {
    value_error("gocomm " + name + ": output_tensor_lists has " + std::to_string(output_lists.size()) +
                " lists, want one per rank (" + std::to_string(size_) + ")");
  }
  Tensors outs;
  for (size_t r = 0; r < output_lists.size(); r++) {
    const std::string lname = "output_tensor_lists[" + std::to_string(r) + "]";
    const Tensors& ts = tensor_list(cfg_.cuda_refusal, name, lname, output_lists[r]);
    if (ts.size() != ins.size()) {
      value_error("gocomm " + name + ": " + lname + " has " + std::to_string(ts.size()) +
                  " tensors, input_tensor_list " + std::to_string(ins.size()));
    }
    for (size_t j = 0; j < ts.size(); j++) {
      const std::string n = lname + "[" + std::to_string(j) + "]";
      match_dtype(name, n, ts[j], ins[j]);
      if (ts[j].numel() != ins[j].numel()) {
        value_error("gocomm " + name + ": " + n + " has " + std::to_string(ts[j].numel()) +
                    " elements, input_tensor_list[" + std::to_string(j) + "] has " + std::to_string(ins[j].numel()));
      }
    }
    outs.insert(outs.end(), ts.begin(), ts.end());
  }
  if (ins.empty()) {
    return BatchWork::make(name, {}, {});
  }
  Op op(name, wire::kAllGather, c10d::OpType::ALLGATHER_COALESCED, opts.timeout);
  op.elements(ins[0], numel_of(ins));
  op.inputs = {ins, std::nullopt};
  op.outputs = {{1, outs}};
  op.result = outs;
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                                  const c10d::ReduceScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor& out = single(cfg_.cuda_refusal, "reduce_scatter", "output", outputs);
  if (inputs.size() != 1) {
    value_error("gocomm reduce_scatter: expected one input list");
  }
  const Tensors& ins = output_list(cfg_.cuda_refusal, "reduce_scatter", "input_list", inputs, out, size_);
  Op op("reduce_scatter", wire::kReduceScatter, c10d::OpType::REDUCE_SCATTER, opts.timeout);
  op.elements(out);
  op.redop = redop("reduce_scatter", opts.reduceOp, out);
  Tensors scaled;
  for (const auto& t : ins) {
    scaled.push_back(premul(opts.reduceOp, t, false, "reduce_scatter"));
  }
  op.inputs = {scaled, std::nullopt};
  op.outputs = {{1, {out}}};
  op.result = Tensors{out};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::ReduceScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const std::string name = "reduce_scatter_tensor";
  check(cfg_.cuda_refusal, name, "input", input);
  check(cfg_.cuda_refusal, name, "output", output);
  match_dtype(name, "output", output, input);
  world_times(name, "input", input, "output", output, size_);
  Op op(name, wire::kReduceScatter, c10d::OpType::_REDUCE_SCATTER_BASE, opts.timeout);
  op.elements(output);
  op.redop = redop(name.c_str(), opts.reduceOp, output);
  op.inputs = {Tensors{premul(opts.reduceOp, input, false, name)}, std::nullopt};
  op.outputs = {{1, {output}}};
  op.result = Tensors{output};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  return pairwise("reduce_scatter_tensor_coalesced", outputs, inputs,
                  [&](at::Tensor& out, at::Tensor& in) { return _reduce_scatter_base(out, in, opts); });
}

intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_splits,
                                                 std::vector<int64_t>& input_splits,
                                                 const c10d::AllToAllOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const std::string name = "all_to_all_single";
  check(cfg_.cuda_refusal, name, "input", input);
  check(cfg_.cuda_refusal, name, "output", output);
  match_dtype(name, "output", output, input);
  const int n = size_, me = rank_;
  if (input.dim() == 0 || output.dim() == 0) {
    value_error("gocomm " + name + ": input and output need at least one dimension to split");
  }
  if (input.sizes().slice(1) != output.sizes().slice(1)) {
    value_error("gocomm " + name + ": output rows have shape " + shape_name(output.sizes().slice(1)) + ", input rows " +
                shape_name(input.sizes().slice(1)) + "; they must match");
  }
  int64_t row = 1;
  for (int64_t s : input.sizes().slice(1)) {
    row *= s;
  }
  if (input.size(0) == 0) {
    row = std::max<int64_t>(row, 1);
  }
  const std::vector<int64_t> ins = splits_of(name, "input_split_sizes", input_splits, input.size(0), n);
  const std::vector<int64_t> outs = splits_of(name, "output_split_sizes", output_splits, output.size(0), n);
  if (ins[me] != outs[me]) {
    value_error("gocomm " + name + ": rank " + std::to_string(me) + " sends itself " + std::to_string(ins[me]) +
                " rows (input_split_sizes) but expects " + std::to_string(outs[me]) + " (output_split_sizes)");
  }
  if (input.is_cuda() && a2a_inprocess_) {
    if (auto w = engine_->all_to_all_single(output, input, ins, outs)) {
      return w;
    }
  }
  Op op(name, wire::kAllToAll, c10d::OpType::ALLTOALL_BASE, opts.timeout);
  op.dtype = input.scalar_type();
  op.result = Tensors{output};
  if (input.is_cpu() && n > 1 && ins[me] != 0) {
    // This rank's own block never leaves the process: copy it directly and stage only the
    // blocks for the peers (one copy instead of three through shared memory).
    auto blocks = [&](const at::Tensor& t, const std::vector<int64_t>& splits) {
      Tensors bs;
      int64_t off = 0;
      for (int j = 0; j < n; j++) {
        if (j != me) {
          bs.push_back(t.narrow(0, off, splits[j]));
        }
        off += splits[j];
      }
      return bs;
    };
    int64_t out_off = 0, in_off = 0;
    for (int j = 0; j < me; j++) {
      out_off += outs[j];
      in_off += ins[j];
    }
    output.narrow(0, out_off, outs[me]).copy_(input.narrow(0, in_off, ins[me]));
    op.inputs = {blocks(input, ins), std::nullopt};
    op.outputs = {{1, blocks(output, outs)}};
    for (int j = 0; j < n; j++) {
      op.splits.push_back(j == me ? 0 : ins[j] * row);
    }
    for (int j = 0; j < n; j++) {
      op.splits.push_back(j == me ? 0 : outs[j] * row);
    }
    return submit(op);
  }
  op.inputs = {Tensors{input}, std::nullopt};
  op.outputs = {{1, {output}}};
  for (int64_t s : ins) {
    op.splits.push_back(s * row);
  }
  for (int64_t s : outs) {
    op.splits.push_back(s * row);
  }
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const std::string name = "all_to_all";
  const Tensors& ins = tensor_list(cfg_.cuda_refusal, name, "input_tensor_list", inputs);
  const Tensors& outs = tensor_list(cfg_.cuda_refusal, name, "output_tensor_list", outputs);
  const int n = size_, me = rank_;
  if (int64_t(ins.size()) != n || int64_t(outs.size()) != n) {
    value_error("gocomm " + name + ": " + std::to_string(ins.size()) + " inputs and " + std::to_string(outs.size()) +
                " outputs, want " + std::to_string(n) + " each");
  }
  same_dtype(name, "input_tensor_list", ins);
  for (const auto& o : outs) {
    match_dtype(name, "output_tensor_list", o, ins[0]);
  }
  if (ins[me].numel() != outs[me].numel()) {
    value_error("gocomm " + name + ": input " + std::to_string(me) + " has " + std::to_string(ins[me].numel()) +
                " elements but output " + std::to_string(me) + " has " + std::to_string(outs[me].numel()));
  }
  Op op(name, wire::kAllToAll, c10d::OpType::ALLTOALL, opts.timeout);
  op.dtype = ins[0].scalar_type();
  op.result = outs;
  if (ins[0].is_cpu() && n > 1) {
    // as in all_to_all_single: the own block is copied directly, not staged
    outs[me].copy_(ins[me].view(outs[me].sizes()));
    Tensors pi, po;
    for (int j = 0; j < n; j++) {
      if (j != me) {
        pi.push_back(ins[j]);
        po.push_back(outs[j]);
      }
    }
    op.inputs = {pi, std::nullopt};
    op.outputs = {{1, po}};
    for (int j = 0; j < n; j++) {
      op.splits.push_back(j == me ? 0 : ins[j].numel());
    }
    for (int j = 0; j < n; j++) {
      op.splits.push_back(j == me ? 0 : outs[j].numel());
    }
    return submit(op);
  }
  op.inputs = {ins, std::nullopt};
  op.outputs = {{1, outs}};
  for (const auto& t : ins) {
    op.splits.push_back(t.numel());
  }
  for (const auto& t : outs) {
    op.splits.push_back(t.numel());
  }
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::gather(std::vector<Tensors>& outputs, Tensors& inputs,
                                          const c10d::GatherOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor& t = single(cfg_.cuda_refusal, "gather", "tensor", inputs);
  root_in("gather", opts.rootRank, size_);
  Op op("gather", wire::kGather, c10d::OpType::GATHER, opts.timeout);
  op.elements(t);
  op.root = int32_t(opts.rootRank);
  if (opts.rootRank == rank_) {
    const Tensors& outs = output_list(cfg_.cuda_refusal, "gather", "gather_list", outputs, t, size_);
    op.inputs = {Tensors{t}, std::nullopt};
    op.outputs = {{1, outs}};
    op.result = outs;
  } else {
    for (const auto& o : outputs) {
      if (!o.empty()) {
        value_error("gocomm gather: gather_list must be given on the destination rank only");
      }
    }
    op.inputs = {Tensors{t}};
    op.result = Tensors{};
  }
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                           const c10d::ScatterOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor& t = single(cfg_.cuda_refusal, "scatter", "tensor", outputs);
  root_in("scatter", opts.rootRank, size_);
  Op op("scatter", wire::kScatter, c10d::OpType::SCATTER, opts.timeout);
  op.elements(t);
  op.root = int32_t(opts.rootRank);
  if (opts.rootRank == rank_) {
    const Tensors& ins = output_list(cfg_.cuda_refusal, "scatter", "scatter_list", inputs, t, size_);
    op.inputs = {std::nullopt, ins};
  } else {
    for (const auto& i : inputs) {
      if (!i.empty()) {
        value_error("gocomm scatter: scatter_list must be given on the source rank only");
      }
    }
    op.inputs = {std::nullopt};
  }
  op.outputs = {{0, {t}}};
  op.result = Tensors{t};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  Op op("barrier", wire::kBarrier, c10d::OpType::BARRIER, opts.timeout);
  return submit(op);
}

void Backend::monitoredBarrier(const c10d::BarrierOptions& opts, bool) {
  seq_collective_.fetch_add(1, std::memory_order_relaxed);
  Op op("monitored_barrier", wire::kBarrier, c10d::OpType::BARRIER, opts.timeout);
  submit(op)->wait();
}

// ----- point to point ------------------------------------------------------------------------

intrusive_ptr<c10d::Work> Backend::send(Tensors& tensors, int dst, int tag) {
  const at::Tensor& t = single(cfg_.cuda_refusal, "send", "tensor", tensors, true);
  peer_in("send", "dst", dst, rank_, size_);
  Op op("send", wire::kSend, c10d::OpType::SEND);
  op.elements(t);
  op.root = dst;
  op.tag = tag;
  op.inputs = {Tensors{t}};
  op.result = Tensors{t};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::recv(Tensors& tensors, int src, int tag) {
  const at::Tensor& t = single(cfg_.cuda_refusal, "recv", "tensor", tensors, true);
  peer_in("recv", "src", src, rank_, size_);
  Op op("recv", wire::kRecv, c10d::OpType::RECV);
  op.elements(t);
  op.root = src;
  op.tag = tag;
  op.inputs = {std::nullopt};
  op.outputs = {{0, {t}}};
  op.result = Tensors{t};
  return submit(op);
}

intrusive_ptr<c10d::Work> Backend::recvAnysource(Tensors& tensors, int tag) {
  const at::Tensor& t = single(cfg_.cuda_refusal, "recv", "tensor", tensors, true);
  if (t.is_cuda()) {
    value_error("gocomm recv: a CUDA tensor needs a source rank (NCCL has no receive from any rank)");
  }
  Op op("recv", wire::kRecv, c10d::OpType::RECVANYSOURCE);
  op.elements(t);
  op.root = -1;
  op.tag = tag;
  op.inputs = {std::nullopt};
  op.outputs = {{0, {t}}};
  op.result = Tensors{t};
  return submit(op);
}

// ----- lifetime ------------------------------------------------------------------------------

void Backend::shutdown() {
  if (closed_.exchange(true)) {
    return;
  }
  if (cfg_.on_shutdown) {
    cfg_.on_shutdown();  // the control plane's leave, which knows a lost or closed sidecar
  }
}

void Backend::release_resources() {
  user.reset();
  cfg_.on_shutdown = nullptr;
  cfg_.on_abort = nullptr;
  cfg_.shmem_id = nullptr;
  cfg_.on_split = nullptr;  // holds the control plane's group, which refers back to this backend
  cfg_.store.reset();
  std::lock_guard<std::mutex> lock(split_mu_);
  split_.reset();
}

void Backend::abort() {
  abort_for("abort()");
}

void Backend::abort_for(const std::string& why) {
  if (closed_ || disp_->lost()) {
    return;
  }
  if (cfg_.on_abort) {
    cfg_.on_abort(why);
  }
  shutdown();
}

}  // namespace gocomm
