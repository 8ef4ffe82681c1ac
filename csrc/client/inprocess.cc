#include "inprocess.h"

#include <ATen/EmptyTensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <sstream>

#include "backend.h"
#include "wire.h"

namespace gocomm::inproc {

namespace {

constexpr int kInfo = 20, kWarning = 30;  // Python logging levels
constexpr int64_t kInt31 = (int64_t(1) << 31) - 1;  // the largest value an a2av meta word carries
constexpr const char* kPeer = "a peer cannot take part";

// allreduce.cu's layout
constexpr int kArMaxBlocks = 128;
constexpr int64_t kArFlagBytes = 2 * kArMaxBlocks * kMaxRanks * 8;  // u64 [2 phases][blocks][ranks]
constexpr int64_t kArCtl = kArFlagBytes;  // the last epoch, the done count: 16 bytes
constexpr int64_t kArHead = 64 << 10;  // flags and ctl, then the halves
static_assert(kArCtl + 16 <= kArHead, "allreduce.cu's ctl words overlap the staging");
constexpr int64_t kArSlack = 256;  // two-shot's n slots of ceil(vectors / n) may pass the message
constexpr int kArThreads = 512;
static_assert(sizeof(ArArgs) == 8 * 8 * 2 + 8 * 8 + 16, "allreduce.cu's ArArgs");

// a2av_ipc.cu's layout
constexpr int kA2MaxParts = 128, kA2MaxOuts = 16;
constexpr int64_t kA2Head = 64 << 10;  // A2_HEAD: signals before it, the receive buffer after
constexpr int64_t kA2Table = 9920;  // A2_TABLE: u64 [MAX_OUTS][MAX_RANKS], the receive buffers
constexpr int64_t kFastMax = 2 << 20;  // bytes: a pair that fits goes before the meta rows are in
static_assert(sizeof(A2Args) == 8 * 8 + 5 * 8 + 7 * 8 + 2 * 8 * 8 + 8 + 16 + 8, "a2av_ipc.cu's A2Args");

// moe.cu's low-latency layout
constexpr int64_t kLlHead = 64 << 10;  // LL_HEAD: the words before it, the rows after
static_assert(sizeof(LlArgs) == 8 * 8 + 5 * 8 + 12 * 8 + 2 * 8 + 8 * 8 + 4 * 8 + 3 * 8 + 8 + 8, "moe.cu's LlArgs");

int64_t half_bytes(int64_t cap) {
  return 2 * (cap + kArSlack);
}

int64_t fast_bytes(int64_t cap, int n, int parts) {
  if (n < 2) {
    return 0;
  }
  const int64_t unit = 16 * int64_t(parts);
  return std::min(kFastMax, cap / (8 * int64_t(n))) / unit * unit;
}

// A name as Python's repr writes a plain string.
std::string repr_of(const std::string& s) {
  return "'" + s + "'";
}

// Why an exception turned a path off, as Python named it.
std::string why_of(const std::exception& e) {
  if (dynamic_cast<const cuda::Error*>(&e) != nullptr) {
    return std::string("CudaError: ") + e.what();
  }
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) {
    return std::string("RuntimeError: ") + c->what_without_backtrace();
  }
  return std::string("RuntimeError: ") + e.what();
}

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// The bytes per row of inp; raises where its rows (or out_rows, rows the caller must receive
// in full), or their size, pass what the kernel's 32-bit meta words carry.
int64_t row_bytes(const std::string& op, const at::Tensor& inp, int64_t out_rows) {
  const int64_t row = row_nbytes(inp);
  if (std::max({inp.size(0), out_rows, row}) > kInt31) {
    C10_THROW_ERROR(ValueError, "gocomm " + op + ": at most 2^31 - 1 rows of at most 2^31 - 1 bytes, got " +
                                    shape_name(inp.sizes()) +
                                    (out_rows ? " and " + std::to_string(out_rows) + " output rows" : ""));
  }
  return row;
}

[[noreturn]] void refuse_setup(const std::string& op, const std::string& group, int device) {
  TORCH_CHECK(false, "gocomm " + op + " cannot be captured yet on group " + repr_of(group) +
                         ": its first call on cuda:" + std::to_string(device) +
                         " sets up its kernel, collectively, which a capture does not allow. Call " + op +
                         " once on this group and device before capturing.");
}

// The package's bin/: beside lib/, where this library lives.
std::string bin_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&set_launch_capacity), &info) == 0 || info.dli_fname == nullptr) {
    return "bin";
  }
  std::string lib = info.dli_fname;
  auto cut = [](std::string p) {
    const auto at = p.find_last_of('/');
    return at == std::string::npos ? std::string(".") : p.substr(0, at);
  };
  return cut(cut(lib)) + "/bin";
}

std::mutex launches_mu;
std::deque<Launch> launch_record;
size_t launch_capacity = 2000;

}  // namespace

// ----- the launch record ------------------------------------------------------------------------

void set_launch_capacity(size_t n) {
  std::lock_guard<std::mutex> lock(launches_mu);
  launch_capacity = std::max<size_t>(n, 1);
  while (launch_record.size() > launch_capacity) {
    launch_record.pop_front();
  }
}

std::vector<Launch> launches() {
  std::lock_guard<std::mutex> lock(launches_mu);
  return {launch_record.begin(), launch_record.end()};
}

// ----- modules ----------------------------------------------------------------------------------

const char* const kLoadFailed = "the module does not load";

Module& Module::get(const std::string& file) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Module>> all;
  std::lock_guard<std::mutex> lock(mu);
  auto& m = all[file];
  if (!m) {
    m = std::make_unique<Module>(file);
  }
  return *m;
}

Module::Module(std::string file) : path_(bin_dir() + "/" + file) {}

std::string Module::why_not(int device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = why_.find(device);
    if (it != why_.end()) {
      return it->second;
    }
  }
  std::string why;
  if (!std::ifstream(path_).good()) {
    why = path_ + " was not built (make builds it)";
  } else {
    // the modules are built for sm_90 only (Makefile's CUDA_ARCH): a cubin runs on its own arch
    int major = 0, minor = 0;
    try {
      cuda::capability(device, &major, &minor);
      if (major != 9 || minor != 0) {
        why = "the module is built for sm_90; device " + std::to_string(device) + " is sm_" + std::to_string(major) +
              std::to_string(minor);
      } else {
        function(device, "");
      }
    } catch (const cuda::Error& e) {
      why = std::string(kLoadFailed) + " on device " + std::to_string(device) + ": " + e.what();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  why_[device] = why;
  return why;
}

cuda::Function Module::function(int device, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loaded_.find(device);
  void* mod = it == loaded_.end() ? nullptr : it->second;
  if (mod == nullptr) {
    if (image_.empty()) {
      std::ifstream f(path_, std::ios::binary);
      std::ostringstream s;
      s << f.rdbuf();
      image_ = s.str();
      if (image_.empty()) {
        throw cuda::Error("cannot read " + path_);
      }
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cuda::ensure_context(device);
    mod = cuda::module_load(image_);
    loaded_[device] = mod;
  }
  return name.empty() ? nullptr : cuda::module_function(mod, name.c_str());
}

void launch(const std::string& file, int device, const std::string& name, unsigned grid, unsigned block,
            unsigned smem, const std::string& sig, const std::vector<int64_t>& vals) {
  if (sig.size() != vals.size()) {
    C10_THROW_ERROR(TypeError, "gocomm kernel launch: " + std::to_string(vals.size()) + " arguments, the kernel takes '" +
                                   sig + "'");
  }
  // kernels are looked up once per (module, device, name)
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, std::string>, cuda::Function> fns;
  cuda::Function fn = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& f = fns[{file, device, name}];
    if (f == nullptr) {
      f = Module::get(file).function(device, name);
    }
    fn = f;
  }
  std::vector<int64_t> slots(vals.size());
  std::vector<void*> params(vals.size());
  for (size_t i = 0; i < vals.size(); i++) {
    if (sig[i] == 'i') {
      const int32_t v = int32_t(vals[i]);
      std::memcpy(&slots[i], &v, 4);
    } else if (sig[i] == 'P' || sig[i] == 'q') {
      slots[i] = vals[i];
    } else {
      C10_THROW_ERROR(TypeError, "gocomm kernel launch: argument type '" + std::string(1, sig[i]) + "' (P, q or i)");
    }
    params[i] = &slots[i];
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cuda::ensure_context(device);
  cuda::launch(fn, grid, block, smem, c10::cuda::getCurrentCUDAStream(device).stream(), params.data());
}

// ----- stream order and Work ----------------------------------------------------------------------

StreamOrder::StreamOrder() : ev_(cuda::event_create()) {}

StreamOrder::~StreamOrder() {
  cuda::event_destroy(ev_);
}

void StreamOrder::before(cuda::Stream stream) {
  if (any_ && stream == stream_) {
    return;
  }
  if (any_) {
    if (!recorded_) {
      cuda::event_record(ev_, stream_);
    }
    cuda::stream_wait_event(stream, ev_);  // takes the record as it is now
  }
  stream_ = stream;
  any_ = true;
  recorded_ = false;
}

void StreamOrder::after(cuda::Stream stream, bool lasting) {
  recorded_ = !lasting;
  if (recorded_) {
    cuda::event_record(ev_, stream);
  }
}

bool lasting_stream(int device) {
  const auto dev = static_cast<c10::DeviceIndex>(device);
  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(dev);
  // an external stream's id is the one getStreamFromExternal gives its handle; torch's own
  // streams have ids of their pools (the default stream's handle is null)
  return cur.stream() == nullptr || cur.id() != c10::cuda::getStreamFromExternal(cur.stream(), dev).id();
}

at::Tensor fresh(at::IntArrayRef sizes, const at::TensorOptions& o) {
  const c10::Device d = o.device();
  const auto& ctx = at::globalContext();
  // at::empty where it does more: another device, a layout or pinning, or deterministic mode
  // (it fills new memory there)
  if (!d.is_cuda() || d.index() != c10::cuda::current_device() || o.layout() != at::kStrided || o.pinned_memory() ||
      (ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory())) {
    return at::empty(sizes, o);
  }
  return at::detail::empty_generic(sizes, c10::cuda::CUDACachingAllocator::get(),
                                   c10::DispatchKeySet(c10::DispatchKey::CUDA), o.dtype().toScalarType(),
                                   o.memory_format_opt());
}

KernelWork::KernelWork(std::vector<at::Tensor> result, cuda::Stream stream, int device, c10d::OpType type,
                       bool captured, bool lasting)
    : c10d::Work(-1, type),
      result_(std::move(result)),
      stream_(stream),
      device_(device),
      captured_(captured),
      lasting_(lasting) {
  if (!captured_ && !lasting) {
    std::lock_guard<std::mutex> lock(mu_);
    mark();
  }
}

KernelWork::~KernelWork() {
  if (ev_ != nullptr) {
    cuda::event_destroy(ev_);
  }
}

cuda::Event KernelWork::mark() {
  if (ev_ == nullptr) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    ev_ = cuda::event_create();
    cuda::event_record(ev_, stream_);
  }
  return ev_;
}

bool KernelWork::wait(std::chrono::milliseconds) {
  if (captured_) {  // on the capturing stream
    return true;
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cuda::Stream cur = c10::cuda::getCurrentCUDAStream(device_).stream();
  if (cur != stream_) {
    std::lock_guard<std::mutex> lock(mu_);
    cuda::stream_wait_event(cur, mark());
  }
  return true;
}

bool KernelWork::isCompleted() {
  if (!done_ && !captured_) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    std::lock_guard<std::mutex> lock(mu_);
    done_ = cuda::event_done(mark());
  }
  return done_ || captured_;
}

bool KernelWork::isSuccess() const {
  return done_ || captured_;
}

c10::intrusive_ptr<c10::ivalue::Future> KernelWork::getFuture() {
  std::lock_guard<std::mutex> lock(mu_);
  if (future_) {
    return future_;
  }
  const auto type = c10::ListType::create(c10::TensorType::get());
  if (captured_) {  // on the capturing stream: nothing to record or wait for outside the graph
    future_ = c10::make_intrusive<c10::ivalue::Future>(type);
    future_->markCompleted(c10::IValue(result_));
    return future_;
  }
  const auto dev = static_cast<c10::DeviceIndex>(device_);
  future_ = c10::make_intrusive<c10::ivalue::Future>(type, std::vector<c10::Device>{c10::Device(c10::kCUDA, dev)});
  // markCompleted records its event on the current stream: the kernel's where it lasts, else
  // a pool stream ordered after the event recorded right after the kernel (its own stream may
  // be gone by now)
  c10::cuda::CUDAStream on = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream_), dev);
  if (!lasting_) {
    c10::cuda::CUDAGuard device_guard(dev);
    on = c10::cuda::getStreamFromPool(false, dev);
    cuda::stream_wait_event(on.stream(), mark());
  }
  c10::cuda::CUDAStreamGuard guard(on);
  future_->markCompleted(c10::IValue(result_));
  return future_;
}

// ----- all_reduce ---------------------------------------------------------------------------------

namespace {
const char* ar_kernel(bool one, at::ScalarType s) {
  switch (s) {
    case at::kBFloat16: return one ? "gocomm_ar_one_bf16" : "gocomm_ar_two_bf16";
    case at::kHalf: return one ? "gocomm_ar_one_f16" : "gocomm_ar_two_f16";
    default: return one ? "gocomm_ar_one_f32" : "gocomm_ar_two_f32";
  }
}
}  // namespace

ArPath::ArPath(const Engine& e, int device, const Shared& sh)
    : device_(device),
      cap_(sh.cap),
      limit_(e.settings().ar_max),
      // one-shot puts every rank's whole message in a half: n slots of it
      oneshot_(std::min<int64_t>(e.settings().ar_oneshot, sh.cap / e.size())),
      blocks_(std::min(kArMaxBlocks, e.settings().ar_blocks)),
      n_(e.size()),
      err_(static_cast<volatile uint32_t*>(sh.err_host)) {
  for (size_t p = 0; p < sh.maps.size(); p++) {
    a_.flags[p] = sh.maps[p];
    a_.stage[p] = sh.maps[p] + kArHead;
  }
  a_.err = sh.err_dev;
  a_.half = uint64_t(half_bytes(cap_));
  a_.round = uint64_t(cap_ / 16);
  a_.ctl = sh.maps[e.rank()] + kArCtl;  // zeroed by share(): no op ran yet
  a_.timeout_ns = uint64_t(e.timeout_s() * 1e9);
  a_.rank = uint32_t(e.rank());
  a_.n = uint32_t(n_);
  Module& m = Module::get("allreduce.cubin");
  for (bool one : {true, false}) {
    for (at::ScalarType s : {at::kBFloat16, at::kHalf, at::kFloat}) {
      fn_[{one, s}] = m.function(device, ar_kernel(one, s));
    }
  }
}

bool ArPath::fits(const at::Tensor& t, uint8_t redop) const {
  const auto s = t.scalar_type();
  const int64_t nb = int64_t(t.nbytes());
  return (s == at::kBFloat16 || s == at::kHalf || s == at::kFloat) && (redop == wire::kSum || redop == wire::kAvg) &&
         nb > 0 && nb <= limit_ && nb % 16 == 0 && t.device().index() == device_;
}

bool ArPath::failed() const {
  return err_[0] != 0;
}

void ArPath::give_up() {
  err_[0] = 1;
}

c10::intrusive_ptr<c10d::Work> ArPath::run(const at::Tensor& t, uint8_t redop) {
  cuda::Stream stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  // the halves and flags assume one op after another; graph replays are ordered by the
  // caller (kernels/inprocess/allreduce.cu)
  const bool cap = capturing();
  if (!cap) {
    order_.before(stream);
  }
  const int64_t nb = int64_t(t.nbytes());
  const uint64_t ptr = reinterpret_cast<uint64_t>(t.data_ptr());
  a_.in = a_.out = ptr;
  a_.nvec = uint64_t(nb / 16);
  a_.aligned = ptr % 16 == 0 ? 1 : 0;
  a_.scale = redop == wire::kAvg ? 1.0f / float(n_) : 1.0f;
  const bool one = nb <= oneshot_;
  const int64_t per_block = int64_t(kArThreads) * (one ? 1 : n_);
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(blocks_, (int64_t(a_.nvec) + per_block - 1) / per_block));
  void* arg = &a_;
  cuda::launch(fn_.at({one, t.scalar_type()}), unsigned(grid), kArThreads, 0, stream, &arg);
  const bool lasting = lasting_stream(device_);
  if (!cap) {
    order_.after(stream, lasting);
  }
  return c10::make_intrusive<KernelWork>(std::vector<at::Tensor>{t}, stream, device_, c10d::OpType::ALLREDUCE, cap,
                                         lasting);
}

// ----- all_to_all_v -------------------------------------------------------------------------------

A2Path::A2Path(Engine& e, int device, int parts, int threads, const Shared& sh)
    : e_(e),
      mu_(e.lock()),
      device_(device),
      threads_(threads),
      grid_(e.size() * parts),
      cap_(sh.cap),
      gpus_shared_(sh.gpus_shared),
      words_(static_cast<volatile uint32_t*>(sh.err_host)) {
  for (size_t p = 0; p < sh.maps.size(); p++) {
    a_.base[p] = sh.maps[p];
  }
  a_.err = sh.err_dev;
  // the tail of recv holds two fast slots per sender (kernels/inprocess/a2av_ipc.cu, invariant 6)
  a_.fast_bytes = fast_bytes(cap_, e.size(), parts);
  a_.stage_bytes = cap_ - 2 * int64_t(e.size()) * a_.fast_bytes;
  a_.timeout_ns = uint64_t(e.timeout_s() * 1e9);
  a_.rank = uint32_t(e.rank());
  a_.n = uint32_t(e.size());
  a_.parts = uint32_t(parts);
  fn_ = Module::get("a2av_ipc.cubin").function(device, "gocomm_a2av_ipc");
}

bool A2Path::failed() const {
  return words_[0] != 0;
}

void A2Path::give_up() {
  words_[0] = 1;
}

std::string A2Path::report() {
  static const char* what[2] = {"splits that were negative or more rows than the input (nothing sent)",
                                "row sizes that differ between ranks (nothing received)"};
  for (int i = 0; i < 2; i++) {
    const uint32_t got = words_[1 + i];
    if (got != seen_[i]) {
      e_.log(kWarning, "gocomm all_to_all_v on group " + repr_of(e_.name()) + ": " + std::to_string(got - seen_[i]) +
                           " op(s) with " + what[i]);
      seen_[i] = got;
    }
  }
  const uint32_t got = words_[3];
  if (got == seen_[2]) {
    return {};
  }
  const uint32_t n = got - seen_[2];
  seen_[2] = got;
  // the kernel writes the first one's details before its source (kernels/inprocess/a2av_ipc.cu)
  const uint32_t src = words_[4];
  std::atomic_thread_fence(std::memory_order_acquire);
  std::string first;
  if (src > 0) {
    first = ": rank " + std::to_string(src - 1) + " sent " + std::to_string(int32_t(words_[5])) +
            " rows where output_split_sizes expected " + std::to_string(int32_t(words_[6]));
  }
  return "gocomm all_to_all_single on group " + repr_of(e_.name()) + ": " + std::to_string(n) +
         " earlier call(s) received other rows than their output_split_sizes said (the ranks' splits mismatch)" +
         first + "; those outputs are not valid and the group is aborted";
}

std::pair<cuda::Stream, bool> A2Path::run_at(uint64_t in, int64_t in_rows, uint64_t splits, bool splits32,
                                                    const int64_t* host_splits, uint64_t out, int64_t out_rows,
                                                    uint64_t out_splits, int64_t row, const int64_t* expect) {
  cuda::Stream stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  // graph replays are ordered by the caller (kernels/inprocess/a2av_ipc.cu, invariant 1)
  const bool cap = capturing();
  if (!cap) {
    order_.before(stream);
  }
  a_.splits = splits;
  a_.splits32 = splits != 0 && splits32 ? 1 : 0;
  if (splits == 0 && host_splits != nullptr) {
    std::memcpy(a_.host_splits, host_splits, sizeof(int64_t) * a_.n);
  }
  a_.expecting = expect != nullptr ? 1 : 0;
  if (expect != nullptr) {
    std::memcpy(a_.expect, expect, sizeof(int64_t) * a_.n);
  }
  a_.in = in;
  a_.out = out;
  a_.out_splits = out_splits;
  // meta words carry 32-bit values (kernels/inprocess/a2av_ipc.cu): more rows than that never fit
  a_.capacity = std::min(out_rows, kInt31);
  a_.row_bytes = row;
  a_.in_rows = in_rows;
  a_.out_id = -1;
  a_.out_off = 0;
  const uint64_t nbytes = uint64_t(out_rows) * uint64_t(row);
  for (size_t o = 0; o < outputs_.size(); o++) {
    const auto [base, size] = outputs_[o];
    if (base <= out && out + nbytes <= base + uint64_t(size)) {
      a_.out_id = int64_t(o);
      a_.out_off = int64_t(out - base);
      break;
    }
  }
  void* arg = &a_;
  cuda::launch(fn_, unsigned(grid_), unsigned(threads_), 0, stream, &arg);
  if (!cap) {
    order_.after(stream, lasting_stream(device_));
  }
  return {stream, cap};
}

std::pair<cuda::Stream, bool> A2Path::exchange(uint64_t in, int64_t in_rows, uint64_t splits, bool splits32,
                                                      const int64_t* host_splits, uint64_t out, int64_t out_rows,
                                                      uint64_t out_splits, int64_t row, const int64_t* expect) {
  std::lock_guard<std::mutex> lock(mu_);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  return run_at(in, in_rows, splits, splits32, host_splits, out, out_rows, out_splits, row, expect);
}

int A2Path::add_output(const std::vector<uint64_t>& maps, int64_t nbytes) {
  if (outputs_.size() >= size_t(kA2MaxOuts)) {
    TORCH_CHECK(false, "gocomm receive_buffer: at most " + std::to_string(kA2MaxOuts) + " per group and device");
  }
  const int o = int(outputs_.size());
  uint64_t row[kMaxRanks] = {};
  std::copy(maps.begin(), maps.end(), row);
  cuda::copy_to_device(a_.base[a_.rank] + kA2Table + uint64_t(o) * kMaxRanks * 8, row, sizeof(row));
  outputs_.emplace_back(maps[a_.rank], nbytes);
  return o;
}

// ----- the low-latency MoE path ----------------------------------------------------------------------

int64_t LlShape::bytes(int n) const {
  return kLlHead + 2 * int64_t(n) * slots * (slot_bytes + cslot_bytes);
}

LlPath::LlPath(Engine& e, int device, const Shared& sh, LlShape shape, int grid)
    : mu_(e.lock()),
      device_(device),
      grid_(grid),
      shape_(shape),
      words_(static_cast<volatile uint32_t*>(sh.err_host)) {
  for (size_t p = 0; p < sh.maps.size(); p++) {
    base_.base[p] = sh.maps[p];
  }
  base_.err = sh.err_dev;
  base_.slots = shape.slots;
  base_.slot_bytes = shape.slot_bytes;
  base_.cslot_bytes = shape.cslot_bytes;
  base_.crows = kLlHead + 2 * int64_t(e.size()) * shape.slots * shape.slot_bytes;
  base_.timeout_ns = uint64_t(e.timeout_s() * 1e9);
  base_.rank = uint32_t(e.rank());
  base_.n = uint32_t(e.size());
  Module& m = Module::get("moe.cubin");
  dispatch_fn_ = m.function(device, "gocomm_moe_ll_dispatch");
  combine_fn_[0] = m.function(device, "gocomm_moe_ll_combine_bf16");
  combine_fn_[1] = m.function(device, "gocomm_moe_ll_combine_f16");
  combine_fn_[2] = m.function(device, "gocomm_moe_ll_combine_f32");
}

bool LlPath::failed() const {
  return words_[0] != 0;
}

void LlPath::give_up() {
  words_[0] = 1;
}

void LlPath::run(cuda::Function fn, LlArgs& a, unsigned block, unsigned smem) {
  std::lock_guard<std::mutex> lock(mu_);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cuda::Stream stream = c10::cuda::getCurrentCUDAStream(device_).stream();
  // graph replays are ordered by the caller (moe.cu's low-latency section)
  const bool cap = capturing();
  if (!cap) {
    order_.before(stream);
  }
  void* arg = &a;
  cuda::launch(fn, unsigned(grid_), block, smem, stream, &arg);
  if (!cap) {
    order_.after(stream, lasting_stream(device_));
  }
}

void LlPath::dispatch(LlArgs a, unsigned block, unsigned smem) {
  run(dispatch_fn_, a, block, smem);
}

void LlPath::combine(LlArgs a, at::ScalarType dtype) {
  const int i = dtype == at::kBFloat16 ? 0 : dtype == at::kHalf ? 1 : 2;
  // a thread per 16 bytes of a row, at most 256 (the rows loop)
  const int64_t vec = std::max<int64_t>(1, a.hbytes / 16);
  run(combine_fn_[i], a, unsigned(std::min<int64_t>(256, (vec + 31) / 32 * 32)), 0);
}

// ----- the engine -----------------------------------------------------------------------------------

Engine::Engine(int rank, int size, std::string name, double timeout_s, bool ar, bool a2a, Settings s, Hooks h)
    : rank_(rank),
      size_(size),
      name_(std::move(name)),
      timeout_s_(timeout_s),
      ar_on_(ar),
      a2a_on_(a2a),
      s_(s),
      h_(std::move(h)) {}

void Engine::log(int level, const std::string& msg) const {
  if (h_.log) {
    h_.log(level, msg);
  }
}

void Engine::record(const std::string& op, const at::Tensor& t, int device) const {
  Launch l;
  l.group = name_;
  l.op = op;
  l.dtype = dtype_name(t.scalar_type()).substr(6);  // without "torch."
  l.bytes = t.nbytes();
  l.device = device;
  l.launched = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::lock_guard<std::mutex> lock(launches_mu);
  launch_record.push_back(std::move(l));
  while (launch_record.size() > launch_capacity) {
    launch_record.pop_front();
  }
}

bool Engine::open() const {
  return !sidecar_broken_ && (!h_.usable || h_.usable());
}

void Engine::fail_kernel(const std::string& op) {
  char t[64];
  std::snprintf(t, sizeof(t), "%.0f", timeout_s_);
  fail_group("gocomm " + op + " on group " + repr_of(name_) + ": an earlier " + op + " timed out after " + t +
             "s waiting for a peer; its result was not valid and the group is aborted");
}

void Engine::fail_group(const std::string& why) {
  try {
    if (h_.abort) {
      h_.abort(why);
    }
  } catch (const std::exception& e) {
    log(kWarning, "gocomm: aborting group " + repr_of(name_) + ": " + e.what());
  }
  C10_THROW_ERROR(DistBackendError, why);
}

void Engine::sidecar_broke() {
  sidecar_broken_ = true;
  std::lock_guard<std::mutex> lock(setup_mu_);
  for (auto& [d, p] : ar_) {
    if (p) {
      p->give_up();
    }
  }
  for (auto& [d, p] : a2_) {
    if (p) {
      p->give_up();
    }
  }
  for (auto& [d, p] : ll_) {
    if (p) {
      p->give_up();
    }
  }
}

template <typename P, typename Setup>
std::shared_ptr<P> Engine::path_at(std::map<int, std::shared_ptr<P>>& paths, int device, const std::string& op,
                                   const std::string& captured, Setup setup) {
  std::unique_lock<std::mutex> lock(setup_mu_);
  auto it = paths.find(device);
  if (it != paths.end()) {
    return it->second;
  }
  lock.unlock();  // the setup is collective: it waits for the peers
  if (capturing()) {
    refuse_setup(captured, name_, device);
  }
  std::shared_ptr<P> path = setup(device);
  lock.lock();
  paths[device] = path;
  lock.unlock();
  if (!path && !op.empty()) {
    h_.fall_back(op, "the in-process kernel's setup declined on cuda:" + std::to_string(device) + " (logged why)");
  }
  return path;
}

std::shared_ptr<ArPath> Engine::ar_path(int device) {
  std::lock_guard<std::mutex> lock(setup_mu_);
  auto it = ar_.find(device);
  return it == ar_.end() ? nullptr : it->second;
}

c10::intrusive_ptr<c10d::Work> Engine::all_reduce(const at::Tensor& t, uint8_t redop) {
  if (!ar_on_ || !open()) {
    return {};  // the sidecar path raises (destroyed group, the group's error, sidecar lost)
  }
  const int idx = t.device().index();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(idx));
  auto path = path_at(ar_, idx, "all_reduce", "all_reduce", [this](int d) { return setup_ar(d); });
  if (!path || !path->fits(t, redop)) {
    return {};
  }
  if (path->failed()) {
    h_.fall_back("all_reduce", "an earlier all_reduce kernel timed out; the group is aborted");
    fail_kernel("all_reduce");
  }
  c10::intrusive_ptr<c10d::Work> w;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w = path->run(t, redop);
  }
  record("all_reduce", t, idx);
  return w;
}

std::shared_ptr<A2Path> Engine::a2av_path(int idx) {
  if (!a2a_on_ || !open()) {
    return nullptr;  // the other paths raise (destroyed group, the group's error, sidecar lost)
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(idx));
  auto path = path_at(a2_, idx, "all_to_all_v", "all_to_all_v / all_to_all_single",
                      [this](int d) { return setup_a2(d); });
  if (path && path->failed()) {
    h_.fall_back("all_to_all_v", "an earlier all_to_all_v kernel timed out; the group is aborted");
    fail_kernel("all_to_all_v");
  }
  if (path) {
    const std::string why = path->report();
    if (!why.empty()) {
      h_.fall_back("all_to_all_v", "an earlier all_to_all_single's splits mismatched; the group is aborted");
      fail_group(why);
    }
  }
  return path;
}

std::shared_ptr<LlPath> Engine::ll_path(int idx, const LlShape& want) {
  if (!a2a_on_ || !open()) {
    return nullptr;
  }
  static const std::string op = "moe.dispatch(low_latency=True)";
  std::shared_ptr<LlPath> path;
  if (want.slots == 0) {  // a lookup (combine): nothing is set up
    std::lock_guard<std::mutex> lock(setup_mu_);
    auto it = ll_.find(idx);
    path = it == ll_.end() ? nullptr : it->second;
  } else {  // no route to fall back: moe.dispatch takes the padded path where this is null
    path = path_at(ll_, idx, "", op, [&](int d) { return setup_ll(d, want); });
  }
  if (path && path->failed()) {
    fail_kernel(op);
  }
  return path;
}

c10::intrusive_ptr<c10d::Work> Engine::all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                                         const std::vector<int64_t>& ins,
                                                         const std::vector<int64_t>& outs) {
  if (output.device() != input.device()) {
    C10_THROW_ERROR(ValueError, "gocomm all_to_all_single: output is on " + output.device().str() + ", input on " +
                                    input.device().str());
  }
  auto path = a2av_path(input.device().index());
  if (!path) {
    return {};
  }
  const int64_t row = row_bytes("all_to_all_single", input, output.size(0));
  const auto es = path->exchange(reinterpret_cast<uint64_t>(input.data_ptr()), input.size(0), 0, false, ins.data(),
                                 reinterpret_cast<uint64_t>(output.data_ptr()), output.size(0), 0, row, outs.data());
  record("all_to_all_single", input, path->device());
  return c10::make_intrusive<KernelWork>(std::vector<at::Tensor>{output}, es.first, path->device(),
                                         c10d::OpType::ALLTOALL_BASE, es.second, lasting_stream(path->device()));
}

std::pair<at::Tensor, at::Tensor> Engine::all_to_all_v(A2Path& path, const at::Tensor& input,
                                                       const at::Tensor& in_splits, const at::Tensor& out) {
  const int64_t row = row_bytes("all_to_all_v", input, 0);
  // any out: rows that do not fit recv at once pass through it in rounds
  const at::Tensor splits = in_splits.is_cuda() && in_splits.is_contiguous()
                                ? in_splits
                                : in_splits.to(input.device()).contiguous();
  at::Tensor out_splits = fresh({size_}, splits.options());
  path.exchange(reinterpret_cast<uint64_t>(input.data_ptr()), input.size(0),
                 reinterpret_cast<uint64_t>(splits.data_ptr()), splits.scalar_type() == at::kInt, nullptr,
                 reinterpret_cast<uint64_t>(out.data_ptr()), out.size(0), reinterpret_cast<uint64_t>(out_splits.data_ptr()),
                 row);
  record("all_to_all_v", input, path.device());
  return {out, out_splits};
}

std::shared_ptr<ArPath> Engine::setup_ar(int idx) {
  const int64_t cap = s_.ar_stage, limit = s_.ar_max;
  std::string why;
  try {
    why = Module::get("allreduce.cubin").why_not(idx);
  } catch (const std::exception& e) {  // any failure turns the path off for the group
    why = why_of(e);
  }
  // what every rank must share: the launch shape (ranks that differ would wait forever)
  const std::string shape =
      std::to_string(std::min(kArMaxBlocks, s_.ar_blocks)) + " " + std::to_string(s_.ar_oneshot) + " " +
      std::to_string(limit);
  int64_t settings = int64_t(1469598103934665603ull);  // FNV-1a of shape
  for (unsigned char c : shape) {
    settings = int64_t((uint64_t(settings) ^ c) * 1099511628211ull);
  }
  auto sh = share(idx, "all_reduce", why, cap, kArHead + 2 * half_bytes(cap), settings);
  if (!sh) {
    return nullptr;
  }
  auto path = std::make_shared<ArPath>(*this, idx, *sh);
  log(kInfo, "gocomm group " + repr_of(name_) + ": all_reduce up to " + std::to_string(limit) +
                 " bytes in this process, in rounds of " + std::to_string(sh->cap) + " (IPC peers, device " +
                 std::to_string(idx) + ")");
  return path;
}

std::shared_ptr<A2Path> Engine::setup_a2(int idx) {
  std::string why;
  const int n = size_, threads = s_.a2a_threads;
  int parts = 0;
  try {
    if (!s_.a2av) {
      why = "GOCOMM_A2AV_INPROCESS=0";
    } else if (n > kMaxRanks) {
      why = "more than " + std::to_string(kMaxRanks) + " ranks";
    } else {
      why = Module::get("a2av_ipc.cubin").why_not(idx);
    }
    if (why.empty()) {
      // the blocks wait for each other: at most what the GPU holds at once
      const int room =
          cuda::blocks_per_sm(Module::get("a2av_ipc.cubin").function(idx, "gocomm_a2av_ipc"), threads) *
          cuda::sm_count(idx);
      parts = std::min(kA2MaxParts, std::max(1, std::min(s_.a2a_blocks, room) / n));
    }
  } catch (const std::exception& e) {  // any failure turns the path off for the group
    why = why_of(e);
  }
  // the launch shape, and GOCOMM_MOE_LL_MB: padded dispatch decides by it on every rank alike
  // (ranks that differ would not meet at the low-latency buffer's setup)
  auto sh = share(idx, "all_to_all_v", why, s_.a2a_recv_bytes, kA2Head + s_.a2a_recv_bytes,
                  (int64_t(parts) << 16) | threads | ((s_.moe_ll_bytes >> 20) << 24));
  if (!sh) {
    return nullptr;
  }
  auto path = std::make_shared<A2Path>(*this, idx, parts, threads, *sh);
  log(kInfo, "gocomm group " + repr_of(name_) + ": all_to_all_v in this process (IPC peers, device " +
                 std::to_string(idx) + ", " + std::to_string(sh->cap >> 20) + " MiB receive buffer)");
  return path;
}

std::shared_ptr<LlPath> Engine::setup_ll(int idx, const LlShape& want) {
  std::string why;
  int grid = 0;
  try {
    if (size_ > kMaxRanks) {
      why = "more than " + std::to_string(kMaxRanks) + " ranks";
    } else {
      why = Module::get("moe.cubin").why_not(idx);
    }
    if (why.empty()) {
      // the blocks wait for each other: at most what the GPU holds at once, at the largest
      // block and shared memory a launch takes
      Module& m = Module::get("moe.cubin");
      const int per_sm =
          std::min(cuda::blocks_per_sm(m.function(idx, "gocomm_moe_ll_dispatch"), int(kLlThreads), size_t(kLlSmem)),
                   cuda::blocks_per_sm(m.function(idx, "gocomm_moe_ll_combine_f32"), int(kLlThreads)));
      grid = std::min(s_.a2a_blocks, per_sm * cuda::sm_count(idx));
      if (grid < 1) {
        why = "its kernels do not fit on the GPU";
      }
    }
  } catch (const std::exception& e) {  // any failure turns the path off for the group
    why = why_of(e);
  }
  // the ranks agree on the strides and the grid (share() compares the settings word)
  const int64_t settings = (want.slots << 44) ^ (want.slot_bytes << 22) ^ want.cslot_bytes ^ (int64_t(grid) << 56);
  const int64_t nbytes = want.bytes(size_);
  auto sh = share(idx, "moe.dispatch(low_latency=True)", why, nbytes, nbytes, settings);
  if (!sh) {
    return nullptr;
  }
  log(kInfo, "gocomm group " + repr_of(name_) + ": low-latency MoE kernels on cuda:" + std::to_string(idx) + " (" +
                 std::to_string(want.slots) + " tokens a rank, " + std::to_string((nbytes + (1 << 20) - 1) >> 20) +
                 " MiB buffer)");
  return std::make_shared<LlPath>(*this, idx, *sh, want, grid);
}

at::Tensor Engine::receive_buffer(int idx, int64_t nbytes) {
  auto path = a2av_path(idx);
  if (!path) {
    return {};
  }
  // more than 2 GiB (the kernel's offsets are 32-bit): a plain tensor on every rank (share
  // is collective, so the ranks agree)
  const std::string big =
      nbytes > kInt31 ? std::to_string(nbytes) + " bytes, more than the 2 GiB a receive buffer holds" : "";
  auto sh = share(idx, "receive_buffer", big, nbytes, big.empty() ? std::max<int64_t>(nbytes, 256) : 0, 0);
  if (!sh) {
    return {};
  }
  std::string why;
  at::Tensor t;
  try {
    {
      std::lock_guard<std::mutex> lock(mu_);
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(idx));
      path->add_output(sh->maps, nbytes);
    }
    t = at::from_blob(reinterpret_cast<void*>(sh->maps[rank_]), {nbytes},
                      at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(idx)));
  } catch (const c10::Error& e) {  // every rank must hear of it (below)
    why = e.what_without_backtrace();
  } catch (const std::exception& e) {
    why = e.what();
  }
  // every rank's table names the buffer before any kernel uses it; all raise or none does
  if (!agree(why.empty())) {
    TORCH_CHECK(false, "gocomm receive_buffer: " + (why.empty() ? std::string("a peer could not register its buffer")
                                                                : why));
  }
  return t;
}

bool Engine::agree(bool ok) {
  at::Tensor rec = at::full({1}, ok ? 1 : 0, at::TensorOptions().dtype(at::kByte));
  at::Tensor all = h_.gather(rec);
  const uint8_t* p = all.data_ptr<uint8_t>();
  for (int r = 0; r < size_; r++) {
    if (p[r] == 0) {
      return false;
    }
  }
  return true;
}

void Engine::say(const std::string& what, const std::string& why) {
  if (rank_ == 0 || why != kPeer) {
    log(kInfo, "gocomm group " + repr_of(name_) + ": " + what + " goes through the sidecar: " + why);
  }
}

std::optional<Shared> Engine::share(int idx, const std::string& what, std::string why, int64_t cap, int64_t nbytes,
                                    int64_t settings) {
  // every rank's record: IPC handle (64), cap (int64), settings (int64), ok, GPU uuid (16)
  constexpr int kRec = 104;
  at::Tensor rec = at::zeros({kRec}, at::TensorOptions().dtype(at::kByte));
  uint8_t* r = rec.data_ptr<uint8_t>();
  Shared sh;
  cuda::DevPtr buf = 0;
  if (why.empty()) {
    try {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(idx));
      cuda::ensure_context(idx);
      // outside torch's allocator, so that its IPC handle names it alone; kept for the life of
      // the process, as a peer may map it after this group is gone
      buf = cuda::mem_alloc_zeroed(size_t(nbytes));
      cuda::host_words(64, &sh.err_host, &sh.err_dev);
      cuda::ipc_handle(buf, r);
      std::memcpy(r + 64, &cap, 8);
      std::memcpy(r + 72, &settings, 8);
      r[80] = 1;
      const auto uuid = cuda::device_uuid(idx);
      std::memcpy(r + 88, uuid.data(), uuid.size());
    } catch (const std::exception& e) {  // any failure turns the path off for the group
      why = why_of(e);
    }
  }
  at::Tensor all = h_.gather(rec);
  const uint8_t* recs = all.data_ptr<uint8_t>();
  bool all_ok = true, same = true;
  int64_t first = 0, least = cap;
  for (int p = 0; p < size_; p++) {
    const uint8_t* q = recs + p * kRec;
    int64_t c = 0, s = 0;
    std::memcpy(&c, q + 64, 8);
    std::memcpy(&s, q + 72, 8);
    all_ok = all_ok && q[80] != 0;
    if (p == 0) {
      first = s;
    }
    same = same && s == first;
    least = std::min(least, c);
  }
  if (!why.empty() || !all_ok || !same) {
    agree(false);
    say(what, !why.empty() ? why : !all_ok ? std::string(kPeer)
                                             : std::string("the ranks' settings differ (the same on every rank)"));
    return std::nullopt;
  }
  bool ok = true;
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(idx));
    for (int p = 0; p < size_; p++) {
      sh.maps.push_back(p == rank_ ? buf : cuda::ipc_open(recs + p * kRec));
    }
  } catch (const std::exception& e) {
    why = "mapping a peer's buffer: " + why_of(e);
    ok = false;
  }
  if (!agree(ok)) {
    say(what, !why.empty() ? why : "a peer could not map the buffers");
    return std::nullopt;
  }
  sh.cap = least;
  for (int p = 0; p < size_; p++) {  // any two ranks (every rank reads the same records)
    for (int q = p + 1; q < size_; q++) {
      sh.gpus_shared = sh.gpus_shared || std::memcmp(recs + p * kRec + 88, recs + q * kRec + 88, 16) == 0;
    }
  }
  {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(idx));
    c10::cuda::device_synchronize();  // the zeroed buffer is in place before any peer's kernel
  }
  agree(true);
  return sh;
}

}  // namespace gocomm::inproc
