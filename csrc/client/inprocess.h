// The in-process engine: all_reduce and all_to_all_v by kernels this process launches itself
// on the caller's stream, between GPUs that map each other's memory over NVLink (a group's
// sparse transport is NVSHMEM). No sidecar on the op's path and no Python: torch calls the
// Backend, the Backend calls the Engine, the Engine launches.
//
//   all_reduce: kernels/inprocess/allreduce.cu (docs/decisions/0007): one-shot up to
//     GOCOMM_AR_ONESHOT bytes, two-shot above, in rounds through staging of a fixed size.
//   all_to_all_v: kernels/inprocess/a2av_ipc.cu (0008, 0009, 0010): the rows pushed into the
//     peers' receive buffers; all_to_all_single, gocomm.all_to_all_v and moe use it.
//
// Each path is set up collectively at the group's first call on a device (share(): every
// rank allocates its buffer, the ranks swap CUDA IPC handles through the group's own CPU
// all_gather, and agree); any rank that cannot take part turns the path off for the whole
// group (the route falls back to the sidecar, logged). Setup is refused under CUDA graph
// capture. A kernel that gave up waiting for a peer sets a word in pinned host memory; the
// group's next call of that op aborts the group and raises.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cuda_driver.h"

namespace gocomm::inproc {

// ----- the flight recorder's part: the last kernel launches of this process ------------------

struct Launch {
  std::string group, op, dtype;
  uint64_t bytes = 0;
  int device = 0;
  double launched = 0;  // seconds since the epoch
};
// How many launches the record keeps (GOCOMM_TRACE_BUFFER_SIZE, the sidecar's reading).
void set_launch_capacity(size_t n);
// The record, oldest first.
std::vector<Launch> launches();

// ----- the package's cubins ---------------------------------------------------------------------

// A cubin in the package's bin/ (make copies it from kernels/build), loaded once per device.
class Module {
 public:
  // The module of that file name (one per process).
  static Module& get(const std::string& file);
  explicit Module(std::string file);
  const std::string& path() const { return path_; }
  // Why its kernels do not run on device ("" where they do): not built, built for another
  // architecture, or does not load there (that reason starts with kLoadFailed). Asked once.
  std::string why_not(int device);
  // The kernel name on device (the module is loaded into the device's context once).
  cuda::Function function(int device, const std::string& name);

 private:
  std::string path_;
  std::mutex mu_;
  std::string image_;
  std::map<int, void*> loaded_;
  std::map<int, std::string> why_;
};
extern const char* const kLoadFailed;

// Queue kernel name of module file on device's current stream; sig: a letter per argument
// (P an address, q an int64, i an int32), vals the values (the MoE kernels' launcher).
void launch(const std::string& file, int device, const std::string& name, unsigned grid, unsigned block,
            unsigned smem, const std::string& sig, const std::vector<int64_t>& vals);

// ----- what a path keeps on the caller's streams ------------------------------------------------

// Keeps one group's kernels on a device one after another when the caller changes streams:
// the kernels' epochs and shared buffers assume it. An op queued on a stream other than the
// previous op's waits for the previous op's event. Events come from a ring, so an event a
// caller keeps (a Work's) answers for its op or a later one, never an earlier one. Used under
// the engine's lock, in the device's context.
class StreamOrder {
 public:
  StreamOrder();
  ~StreamOrder();
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;
  // Called before each op (not while capturing): where stream is not the previous op's, it
  // waits for that one's work: an event recorded on it now (everything queued there so far:
  // ordered later, never earlier), or right after the previous op where that stream may not
  // outlive it (after()). No event is recorded per op on torch's own streams.
  void before(cuda::Stream stream);
  // Called after each op (not while capturing); lasting: lasting_stream(stream).
  void after(cuda::Stream stream, bool lasting);

 private:
  cuda::Event ev_;
  cuda::Stream stream_ = nullptr;
  bool any_ = false;
  bool recorded_ = false;  // ev_ holds the record after the last op on stream_
};

// Whether the current stream of device is torch's own (its default stream or one of its
// pools', kept for the process's life), so an event may be recorded on it later. A stream
// torch wraps from another library (torch.cuda.ExternalStream) may be destroyed by its owner
// once the call returned.
bool lasting_stream(int device);

// A new tensor of o's dtype on o's CUDA device where that is the current device: at::empty's
// result without its dispatcher call and device guard, 0.9 us less host time per allocation
// under MPS (docs/perf.md, "What an output allocation costs"). Elsewhere (another device, a
// layout or pinning, deterministic mode's fill) at::empty.
at::Tensor fresh(at::IntArrayRef sizes, const at::TensorOptions& o);

// A kernel the engine queued on stream (captured: queued while capturing a graph). wait()
// makes the current stream wait, as torch's NCCL work does, and is_completed() asks, through
// an event recorded on stream at the first call that needs one: it answers for everything
// queued on stream by then (later, never early). On torch's own streams nothing is recorded
// for a caller that never asks (a synchronous op's, on the same stream); on a stream that may
// not outlive the call the event is recorded at once. get_future() is a CUDA future completed
// at once, its event on stream (on a pool stream ordered after the kernel where stream is not
// torch's), as ProcessGroupNCCL's: its wait() and then() order the caller's streams after the
// kernel and never block the host (DDP's hooks take it right after each bucket's all_reduce).
class KernelWork : public c10d::Work {
 public:
  // lasting: lasting_stream(device); where not, the event is recorded now.
  KernelWork(std::vector<at::Tensor> result, cuda::Stream stream, int device, c10d::OpType type, bool captured,
             bool lasting);
  ~KernelWork() override;
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override { return nullptr; }
  std::vector<at::Tensor> result() override { return result_; }
  void synchronize() override { wait(); }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  cuda::Event mark();  // the event, recorded on stream_ at the first call (mu_ held)
  std::vector<at::Tensor> result_;
  std::mutex mu_;
  cuda::Event ev_ = nullptr;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  cuda::Stream stream_;
  int device_;
  bool captured_;
  bool lasting_;
  std::atomic<bool> done_{false};
};

// What share() gives a rank: every rank's buffer mapped into this process (maps[rank] is its
// own), the smallest capacity any rank offered, and a zeroed 64-byte block of pinned host
// memory its kernels report into.
struct Shared {
  std::vector<uint64_t> maps;
  int64_t cap = 0;
  bool gpus_shared = false;  // two ranks of the group run on one GPU
  void* err_host = nullptr;
  cuda::DevPtr err_dev = 0;
};

class Engine;

// kernels/inprocess/allreduce.cu's ArArgs, field for field.
constexpr int kMaxRanks = 8;
struct ArArgs {
  uint64_t stage[kMaxRanks];
  uint64_t flags[kMaxRanks];
  uint64_t in, out, err, nvec, round, half, timeout_ns, ctl;
  float scale;
  uint32_t rank, n, aligned;
};

// kernels/inprocess/a2av_ipc.cu's A2Args, field for field.
struct A2Args {
  uint64_t base[kMaxRanks];
  uint64_t in, splits, out, out_splits, err;
  int64_t capacity, row_bytes, in_rows, out_id, out_off, stage_bytes, fast_bytes;
  int64_t host_splits[kMaxRanks];
  int64_t expect[kMaxRanks];
  uint64_t timeout_ns;
  uint32_t rank, n, parts, splits32;
  uint32_t expecting;
};

// One group's all_reduce on one device.
class ArPath {
 public:
  ArPath(const Engine& e, int device, const Shared& sh);
  bool fits(const at::Tensor& t, uint8_t redop) const;
  bool failed() const;
  void give_up();
  // Queue the all_reduce of t (in place) on the current stream, under the engine's lock.
  c10::intrusive_ptr<c10d::Work> run(const at::Tensor& t, uint8_t redop);
  int64_t cap() const { return cap_; }
  int64_t oneshot() const { return oneshot_; }

 private:
  int device_;
  int64_t cap_, limit_, oneshot_;
  int blocks_, n_;
  volatile uint32_t* err_;
  ArArgs a_{};
  std::map<std::pair<bool, at::ScalarType>, cuda::Function> fn_;
  StreamOrder order_;
};

// One group's all_to_all_v on one device (also all_to_all_single's and moe's exchange).
class A2Path {
 public:
  A2Path(Engine& e, int device, int parts, int threads, const Shared& sh);
  int device() const { return device_; }
  int64_t cap() const { return cap_; }
  // Whether two ranks of the group run on one GPU (their kernels then share it).
  bool gpus_shared() const { return gpus_shared_; }
  bool failed() const;
  void give_up();
  // Log what the kernels found since the last call (they cannot raise). Returns why the
  // group must fail where an op received other rows than its caller expected (empty if none).
  std::string report();
  // Queue an exchange of rows of row bytes on the current stream, under the engine's lock:
  // splits 0 takes host_splits (the host's, at most kMaxRanks); splits32: the splits (and
  // out_splits) are int32, else int64; out's out_rows rows are the capacity. Where out lies
  // in a receive buffer the peers write into it; elsewhere the rows pass through recv.
  // expect: the rows the caller expects from each rank (all_to_all_single's output splits,
  // checked on the GPU and reported by report()), or null. Returns the op's stream and
  // whether it was capturing.
  std::pair<cuda::Stream, bool> run_at(uint64_t in, int64_t in_rows, uint64_t splits, bool splits32,
                                       const int64_t* host_splits, uint64_t out, int64_t out_rows,
                                       uint64_t out_splits, int64_t row, const int64_t* expect = nullptr);
  // run_at under the engine's lock, on device (the MoE path's exchanges and the engine's).
  std::pair<cuda::Stream, bool> exchange(uint64_t in, int64_t in_rows, uint64_t splits, bool splits32,
                                         const int64_t* host_splits, uint64_t out, int64_t out_rows,
                                         uint64_t out_splits, int64_t row, const int64_t* expect = nullptr);
  // Record a receive buffer (every rank's, mapped here) in the table the kernel reads; its
  // number. No rank may use it before every rank has (the caller's collective).
  int add_output(const std::vector<uint64_t>& maps, int64_t nbytes);
  std::vector<std::pair<uint64_t, int64_t>> outputs() const { return outputs_; }

 private:
  const Engine& e_;
  std::mutex& mu_;  // the engine's
  int device_, threads_, grid_;
  int64_t cap_;
  bool gpus_shared_;
  volatile uint32_t* words_;  // late, invalid ops, row-size ops, unexpected ops and the first's details
  uint32_t seen_[3] = {0, 0, 0};
  A2Args a_{};
  cuda::Function fn_;
  StreamOrder order_;
  std::vector<std::pair<uint64_t, int64_t>> outputs_;  // receive buffers: (address here, bytes)
};

// kernels/inprocess/moe.cu's LlArgs, field for field.
struct LlArgs {
  uint64_t base[kMaxRanks];
  uint64_t x, idx, w, out, tpe;
  uint64_t meta, send_order, send_rank, t_idx, t_offs, rows_sorted, w_sorted, e_idx, w_e, e_offs, gmeta, rcount;
  uint64_t flag, err;
  int64_t tokens, k, experts, per, xbytes, id_off, w_off, row_bytes;
  int64_t slots, slot_bytes, cslot_bytes, crows;
  int64_t cap, hbytes, segs;
  uint64_t timeout_ns;
  uint32_t rank, n;
};

// What the low-latency kernels take (moe.cu): at most kLlTokens tokens a rank (a thread each
// in a block of kLlThreads), k up to kLlMaxK (a lane each), per up to kLlMaxPer local experts;
// the grouping's counts, runs x (per + 1) int32, fit kLlSmem bytes of dynamic shared memory
// (beside ~26 KiB of static).
constexpr int64_t kLlTokens = 1024, kLlThreads = 1024, kLlMaxK = 32, kLlMaxPer = 1024, kLlSmem = 20 << 10;

// The strides of a group's low-latency buffer on a device: slots per source (the largest
// max_tokens_per_rank), bytes of a dispatch slot (a packed row) and of a combine slot (a
// row of x). Fixed by the group's first low-latency dispatch there, the same on every rank.
struct LlShape {
  int64_t slots = 0, slot_bytes = 0, cslot_bytes = 0;
  int64_t bytes(int n) const;  // the buffer's size for n ranks
};

// One group's low-latency MoE kernels on one device (docs/decisions/0036,
// kernels/inprocess/moe.cu's gocomm_moe_ll_*): a buffer every peer maps, one launch a
// dispatch and one a combine.
class LlPath {
 public:
  LlPath(Engine& e, int device, const Shared& sh, LlShape shape, int grid);
  int device() const { return device_; }
  const LlShape& shape() const { return shape_; }
  bool failed() const;
  void give_up();
  // The path's fields of a launch (the buffers, strides, rank, timeout); the call fills the rest.
  LlArgs args() const { return base_; }
  // Launch the dispatch (a: args() with the call's fields) on the current stream, block
  // threads and smem bytes of shared memory, under the engine's lock.
  void dispatch(LlArgs a, unsigned block, unsigned smem);
  // Launch the combine of y's dtype.
  void combine(LlArgs a, at::ScalarType dtype);

 private:
  void run(cuda::Function fn, LlArgs& a, unsigned block, unsigned smem);
  std::mutex& mu_;  // the engine's
  int device_, grid_;
  LlShape shape_;
  volatile uint32_t* words_;
  LlArgs base_{};
  cuda::Function dispatch_fn_, combine_fn_[3];
  StreamOrder order_;
};

class Engine {
 public:
  // What the engine takes from the control plane's knobs (python/gocomm/_config.py) and the
  // sidecar (its all-to-all settings); the same on every rank (share() checks the launch shapes).
  struct Settings {
    int64_t ar_max = 0;  // GOCOMM_AR_MAX: the largest message the all_reduce path takes; 0: off
    int64_t ar_stage = 32 << 20;  // GOCOMM_AR_STAGE
    int64_t ar_oneshot = 0;  // GOCOMM_AR_ONESHOT
    int ar_blocks = 128;  // GOCOMM_AR_BLOCKS
    bool a2av = true;  // GOCOMM_A2AV_INPROCESS
    int64_t a2a_recv_bytes = 512 << 20;  // GOCOMM_A2A_RECV_MB
    int a2a_threads = 256;  // GOCOMM_A2AV_THREADS
    int a2a_blocks = 128;  // GOCOMM_A2AV_BLOCKS
    int64_t moe_ll_bytes = 256 << 20;  // GOCOMM_MOE_LL_MB: padded dispatch's own low-latency buffer
  };
  struct Hooks {
    // the group's CPU all_gather (through the sidecar): every rank's rec, rank order
    std::function<at::Tensor(const at::Tensor&)> gather;
    // whether ops of the group may still run here (not destroyed, not broken, sidecar there)
    std::function<bool()> usable;
    // turn op's route to the sidecar, saying why (the route table, gocomm.info())
    std::function<void(const std::string&, const std::string&)> fall_back;
    // log at a Python logging level (20 info, 30 warning) through the "gocomm" logger
    std::function<void(int, const std::string&)> log;
    // abort the group (its peers too), saying why
    std::function<void(const std::string&)> abort;
  };

  Engine(int rank, int size, std::string name, double timeout_s, bool ar, bool a2a, Settings s, Hooks h);

  // all_reduce of a CUDA tensor, or null where the in-process kernel does not take it.
  c10::intrusive_ptr<c10d::Work> all_reduce(const at::Tensor& t, uint8_t redop);
  // all_to_all_single of CUDA tensors (ins, outs: the checked input and output splits), or
  // null. Rows received other than outs say make a later call of the group raise (report()).
  c10::intrusive_ptr<c10d::Work> all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                                   const std::vector<int64_t>& ins, const std::vector<int64_t>& outs);
  // gocomm.all_to_all_v's in-process path (the caller checked the arguments and found the
  // path: ops.cc): (out, out_splits on input's device); out's rows are the capacity.
  std::pair<at::Tensor, at::Tensor> all_to_all_v(A2Path& path, const at::Tensor& input, const at::Tensor& in_splits,
                                                 const at::Tensor& out);
  // The all_to_all_v path on device (set up, collectively, at the first call there), or null
  // where the group does not take it. Raises (and aborts the group) once one of its kernels
  // gave up waiting for a peer.
  std::shared_ptr<A2Path> a2av_path(int device);
  // all_reduce's path on device, or null where it is not set up (or declined) there.
  std::shared_ptr<ArPath> ar_path(int device);
  // The low-latency MoE path on device, set up (collectively) at the group's first call there
  // for want's strides (want.slots 0: only looked up); null where the group does not take it
  // (logged why: peers that cannot map it, ranks that asked for different strides). Raises
  // (and aborts the group) once one of its kernels gave up waiting for a peer.
  std::shared_ptr<LlPath> ll_path(int device, const LlShape& want);
  // gocomm.receive_buffer (collective; the a2av path is set up on device): a uint8 tensor of
  // nbytes the peers write into, or an undefined tensor where the ranks did not agree on one.
  at::Tensor receive_buffer(int device, int64_t nbytes);
  // The sidecar reports the group broken: in-process kernels waiting for a peer give up now,
  // and later calls go to the sidecar (which raises with the cause).
  void sidecar_broke();
  std::mutex& lock() { return mu_; }

  // for the paths
  int rank() const { return rank_; }
  int size() const { return size_; }
  double timeout_s() const { return timeout_s_; }
  const Settings& settings() const { return s_; }
  const std::string& name() const { return name_; }
  void log(int level, const std::string& msg) const;
  void record(const std::string& op, const at::Tensor& t, int device) const;

 private:
  std::shared_ptr<ArPath> setup_ar(int device);
  std::shared_ptr<A2Path> setup_a2(int device);
  std::shared_ptr<LlPath> setup_ll(int device, const LlShape& want);
  // paths[device], set up (collectively: setup(device)) at the group's first call there; a
  // declined setup falls the route of op back (op "": none, the caller falls back itself).
  // Raises, naming captured, where that first call is captured.
  template <typename P, typename Setup>
  std::shared_ptr<P> path_at(std::map<int, std::shared_ptr<P>>& paths, int device, const std::string& op,
                             const std::string& captured, Setup setup);
  bool open() const;
  [[noreturn]] void fail_kernel(const std::string& op);
  // Abort the group (its peers too) and raise DistBackendError, both saying why.
  [[noreturn]] void fail_group(const std::string& why);
  // Collective (every rank calls it at the same op): see the file's top.
  std::optional<Shared> share(int device, const std::string& what, std::string why, int64_t cap, int64_t nbytes,
                              int64_t settings);
  bool agree(bool ok);
  void say(const std::string& what, const std::string& why);

  int rank_, size_;
  std::string name_;
  double timeout_s_;
  std::atomic<bool> ar_on_, a2a_on_;
  std::atomic<bool> sidecar_broken_{false};
  Settings s_;
  Hooks h_;
  std::mutex mu_;  // the paths' launches and tables
  std::mutex setup_mu_;  // the maps below
  std::map<int, std::shared_ptr<ArPath>> ar_;  // null: declined on that device
  std::map<int, std::shared_ptr<A2Path>> a2_;
  std::map<int, std::shared_ptr<LlPath>> ll_;
};

}  // namespace gocomm::inproc
