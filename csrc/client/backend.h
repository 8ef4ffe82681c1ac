// gocomm's c10d::Backend: every op torch calls on a gocomm group runs here, from torch's
// dispatcher to the sidecar's ring, without entering Python. Per op: check the arguments
// (clear TypeError/ValueError/NotImplementedError before anything is sent), then hand the op
// to the sidecar: CPU tensors are staged in the shared arena and copied back by the
// completion thread; CUDA tensors are named by IPC registration and the op is ordered on the
// caller's current stream by the group's stream counters (docs/decisions/0004).
//
// On groups whose route table sends all_reduce or all_to_all_single of CUDA tensors to an
// in-process kernel (NVLink groups), the op is offered to the in-process engine first
// (inprocess.h), which launches its kernel on the caller's stream, also without Python.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dispatcher.h"
#include "inprocess.h"
#include "routes.h"
#include "work.h"

namespace gocomm {

// A dtype as Python spells it ("torch.float32").
std::string dtype_name(at::ScalarType s);
// A shape as Python prints a tuple ("(5,)", "(2, 3)").
std::string shape_name(at::IntArrayRef s);
// Integers as Python prints a list ("[3, 0, 5]").
std::string list_name(const std::vector<int64_t>& v);
// The bytes of one row of t (its elements past the first dimension).
int64_t row_nbytes(const at::Tensor& t);
// The wire.DType code of a torch dtype; 0 for a dtype gocomm does not carry.
int wire_dtype(at::ScalarType s);
// Why op (a wire::RedOp) cannot reduce dtype on CPU tensors (the host engine, cuda=false) or
// CUDA tensors (NCCL); "" where it can. The ops raise TypeError with it before sending.
std::string reduce_refusal(at::ScalarType s, uint8_t op, bool cuda);

// The ShmemID rpc of a rank's sidecar on device: given an empty id, rank 0's makes the
// group's NVSHMEM unique id and returns it; given rank 0's, every other rank's takes it.
using ShmemRpc = std::function<std::vector<uint8_t>(int device, const std::vector<uint8_t>& id)>;

// Carry a group's NVSHMEM unique id from rank 0's sidecar (the bootstrap's root, which makes
// it) to every other rank's through the group's Store (key gocomm/nvshmem_uid). Collective:
// each rank calls it before the group's first all_to_all_v in the sidecar's NVSHMEM kernel,
// which makes the PE with the id. A rank 0 that cannot make one says so through the Store (an
// empty id) and rethrows, so the other ranks raise at once instead of at the Store's timeout.
void exchange_shmem_id(c10d::Store& store, int rank, const std::string& group, int device, const ShmemRpc& rpc);

class Backend : public c10d::Backend {
 public:
  struct Config {
    int rank = 0;
    int size = 1;
    uint32_t handle = 0;  // the sidecar's group handle (CreateGroup)
    int slot = -1;  // the group's stream counter slot; -1: none (no CUDA ops)
    std::array<uint32_t, 2> counter_base{0, 0};  // the slot's last value per lane
    double timeout_s = 1800;
    std::string name;
    // why CUDA tensors cannot be served ("" where they can): NotImplementedError's tail
    std::string cuda_refusal;
    // the group's route table (routes.h): its choice at creation offers all_reduce and
    // all_to_all_single of CUDA tensors to the in-process engine first; the engine falls a
    // route back when a setup declines or a kernel failed; a capture refusal names what the
    // group can capture. Null: every op goes to the sidecar.
    std::shared_ptr<Routes> routes;
    inproc::Engine::Settings inprocess;
    // the "gocomm" logger (level, message), in the control plane
    std::function<void(int, const std::string&)> log;
    // the control plane's DestroyGroup and Abort rpcs (Abort's reason reaches the peers)
    std::function<void()> on_shutdown;
    std::function<void(const std::string&)> on_abort;
    // the default (world) group: the sidecar's NVSHMEM all_to_all_v kernel serves it (its PEs
    // are the world's ranks)
    bool world = false;
    // the group's torch Store: the NVSHMEM unique id of the sidecar's all_to_all_v kernel
    // travels through it (nvshmem_ready, exchange_shmem_id)
    c10::intrusive_ptr<c10d::Store> store;
    // the control plane's ShmemID rpc on device (the GPU attached first)
    ShmemRpc shmem_id;
    // makes a subgroup of this group's ranks (torch's split_group): the group's Store for it
    // (torch's prefix of the new group's name), the members' ranks in this group (sorted,
    // this rank among them), its timeout in seconds and name; returns its backend
    std::function<c10::intrusive_ptr<c10d::Backend>(const c10::intrusive_ptr<c10d::Store>&, const std::vector<int>&,
                                                    double, const std::string&)>
        on_split;
  };

  Backend(std::shared_ptr<Dispatcher> dispatcher, Config cfg);

  const std::string getBackendName() const override { return "gocomm"; }
  // split_group (which DeviceMesh takes where the default group was given a device_id): a new
  // gocomm group of the members, made as new_group makes one (no communicator is split)
  bool supportsSplitting() const override { return bool(cfg_.on_split); }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  // batch_isend_irecv hands each op over on its own (the sidecar orders p2p per peer and
  // direction, docs/decisions/0004); startCoalescing/endCoalescing still serve
  // _coalescing_manager(device=...): the ops between run as they come, one Work for all.
  bool supportsCoalescing() const override { return false; }
  // Torch's sequence numbers: the collectives issued on this group (p2p ops not counted),
  // from 0 as ProcessGroupNCCL's. TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend in torch's
  // ProcessGroupWrapper, which needs them to compare each collective's fingerprint across
  // ranks before it runs (and raises naming the ranks that disagree).
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_collective_.load(std::memory_order_relaxed); }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Leave the group: the control plane's DestroyGroup; later ops raise.
  void shutdown() override;
  // Torch dropped its last reference: the Python objects the group's callbacks hold go (the
  // control plane's _Group, whose BackendRef is a weak reference back here: a cycle that kept
  // both alive, with the group's Store and so the rendezvous port), and the Store.
  void release_resources() override;
  // Fail everything pending on the group, on this rank and its peers, then leave it.
  void abort() override;
  // abort(), with why as the reason the peers raise with.
  void abort_for(const std::string& why);

  // An op whose caller waits at once and never sees a Work (the sparse all-to-all in the
  // sidecar's NVSHMEM kernel): bufs already named (Dispatcher::cuda_ref), keep alive until
  // the op finished; the caller's current stream on device waits for it before this
  // returns. Its failure is logged (the sidecar breaks the group, so the next op raises).
  void cuda_now(const std::string& op, uint8_t kind, const std::vector<wire::BufRef>& bufs,
                std::vector<at::Tensor> keep, int device, uint64_t count);
  // Hand the group's NVSHMEM unique id to this rank's sidecar (exchange_shmem_id) at the
  // group's first call of the sidecar's NVSHMEM kernel (collective: every rank calls it
  // there); again after one that raised.
  void nvshmem_ready(int device);
  // Raise for op of CUDA tensors under graph capture; why says what runs it instead of an
  // in-process kernel. The group stays usable: nothing was queued or sent.
  [[noreturn]] void refuse_capture(const std::string& op, const std::string& why) const;
  // A hand-made descriptor (tests): payload's first 8 bytes are replaced by the seq. With
  // track_after_s >= 0 it goes as a CUDA op's does (Dispatcher::send, then track), the
  // caller sleeping that long between the two, so that a refusal comes before track.
  c10::intrusive_ptr<Work> submit_raw(const std::string& op, const std::vector<uint8_t>& payload,
                                      double track_after_s = -1);

  bool closed() const { return closed_; }
  // The in-process engine (its paths set up at a group's first call on a device).
  inproc::Engine& engine() { return *engine_; }
  // The gocomm backend of the group named group (torch.ops.gocomm take groups by name);
  // raises naming op where the group is not a gocomm group.
  static Backend& of(const std::string& group, const std::string& op);
  // Its in-process all_to_all_v path on input's device; raises NotImplementedError naming op
  // where the route table does not send the group's all_to_all_v there (or no longer does: the
  // group destroyed or broken), before the op has done anything, so that a caller that cached
  // the path (python/gocomm/moe.py) can forget it and take another.
  std::shared_ptr<inproc::A2Path> a2av_path_for(const at::Tensor& input, const std::string& op);
  // The first failure of an op of this group, if any.
  std::optional<std::string> broken() { return failure_->get(); }
  // The group broke (the sidecar said so on its watch stream): every later call raises why.
  void mark_broken(const std::string& why) { failure_->mark_broken(why); }
  const Config& config() const { return cfg_; }
  std::string group_name() const;  // as torch named the group (its creator's name before)
  std::string capturable() const;  // what the group can capture, for a refusal's message
  std::shared_ptr<Dispatcher> dispatcher() const { return disp_; }
  // What the bindings keep with the backend (the Python state of the group).
  std::shared_ptr<void> user;

  struct Op;  // one descriptor's worth of an op (backend.cc)

 private:
  c10::intrusive_ptr<Work> submit(Op& op);  // submit_op, and remembered while coalescing
  c10::intrusive_ptr<Work> submit_op(Op& op);
  c10::intrusive_ptr<Work> submit_cuda(Op& op, double t_limit, bool timeout_given);
  // the dispatcher's record of op: its label, deadline (t_limit and the grace) and group, with
  // no Work; pending adds its Work (returning result)
  Pending record(const std::string& op, double t_limit) const;
  Pending pending(const Op& op, std::vector<at::Tensor> result, double t_limit);
  // submit_cuda's path while the stream captures a CUDA graph (docs/decisions/0020)
  c10::intrusive_ptr<Work> capture_op(Op& op, wire::Desc& d, const c10::cuda::CUDAStream& stream, void* graph,
                                      std::vector<std::pair<at::Tensor, std::vector<at::Tensor>*>>& unpack,
                                      const std::vector<at::Tensor>& result, int device);
  uint8_t redop(const char* op, const c10d::ReduceOp& want, const at::Tensor& t);
  // t scaled for PREMUL_SUM (in place, or a copy), else t itself (backend.cc)
  at::Tensor premul(const c10d::ReduceOp& want, const at::Tensor& t, bool in_place, const std::string& op);
  void need_slot(const std::string& op);
  // Raises once the group is broken (GroupFailure): a CUDA op's failure reaches no wait().
  // Also once the sidecar marked the group's counter slot released (Dispatcher::released_mark),
  // waiting up to kCauseWaitMs for the cause to arrive.
  void refuse_if_broken(const std::string& op);
  // Raises once the group is destroyed (ValueError), then as refuse_if_broken.
  void refuse_if_unusable(const std::string& op);
  static constexpr int kCauseWaitMs = 2000;
  // "<op> on group '<name>'": how a Work's errors name the op (op, group, then the cause)
  std::string label(const std::string& op) const;

  std::shared_ptr<Dispatcher> disp_;
  Config cfg_;
  const bool ar_inprocess_, a2a_inprocess_;  // the route table's choice at creation
  std::unique_ptr<inproc::Engine> engine_;
  std::shared_ptr<GroupFailure> failure_ = std::make_shared<GroupFailure>();
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> seq_collective_{0};
  std::mutex cuda_mu_;  // keeps a lane's value, its stream write and its descriptor in step
  std::array<uint32_t, 2> k_;
  std::mutex coalesce_mu_;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<Work>> coalesced_;
  std::mutex nvshmem_mu_;
  bool nvshmem_ready_ = false;
  // the last subgroup split made, by name: torch's splitGroup asks each device type's backend,
  // which is this one for both cpu and cuda, and must get one group (held weakly: torch owns it)
  std::mutex split_mu_;
  std::string split_name_;
  c10::weak_intrusive_ptr<c10d::Backend> split_{c10::intrusive_ptr<c10d::Backend>()};
};

}  // namespace gocomm
