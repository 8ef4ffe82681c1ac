// Which engine runs each of a group's ops: one table per group, built once at the group's
// creation from what its ranks agreed on, consulted by every op.
//
// The facts come from each rank's sidecar (its capabilities at attach: the sparse transport it
// chose from the node's NVLink domain, NVSHMEM and GOCOMM_TRANSPORT; its host) and from the
// process's knobs (GOCOMM_AR_MAX). The table says, per op class, which engine runs it and why:
//
//   all_reduce         in-process kernel (bf16/fp16/fp32 sum/avg, a multiple of 16 bytes, up
//                      to GOCOMM_AR_MAX) where the ranks share one NVLink domain, else sidecar NCCL
//   all_to_all_single  in-process kernel there, else sidecar NCCL
//   all_to_all_v       in-process kernel there (else, where its setup declines, the sidecar's
//                      NVSHMEM kernel on the default group), else sidecar NCCL with a host
//                      count exchange
//   moe                as all_to_all_v; the in-process kernels for padded dispatch without fp8
//   other CUDA ops     sidecar NCCL
//   CPU tensors        host engine
//
// A group that spans hosts runs every CUDA op on sidecar NCCL ("spans hosts"): the in-process
// kernels and NVSHMEM serve one host's NVLink domain. Its subgroups that lie within one host
// keep the one-host paths.
//
// What depends on a call (dtype, size, a device's setup, a kernel that failed) is decided at
// the call, by the rule the table states; a kernel that failed, or a setup that declined,
// turns its route to the sidecar (fall_back, called by the in-process engine). The Backend
// reads ar_inprocess() and a2a_inprocess() once, at its creation; gocomm.info() reads table().
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace gocomm {

// The engines, as the table names them.
inline constexpr const char* kInProcess = "in-process kernel";
inline constexpr const char* kSidecarNccl = "sidecar NCCL";
inline constexpr const char* kSidecarNvshmem = "sidecar NVSHMEM";
inline constexpr const char* kHost = "host engine";

// What tells this host from another: ranks are on one host when they share the kernel (its
// boot id) and the shared-memory file system (the device number of /dev/shm's mount), so that
// each can map the other's segments. A host name is not enough: containers and network
// namespaces often share one, and two hosts may be given the same.
std::string host_id();

// One op class's engine, and why.
struct Route {
  std::string engine, reason;
};

// What a group's ranks agreed on, and the process's knobs that every rank must share.
struct Facts {
  int size = 0;  // ranks in the group
  std::vector<std::string> transports;  // the sparse transport each rank's sidecar chose
  int hosts = 1;  // the distinct hosts the ranks run on (host_id)
  int64_t ar_max = 0;  // GOCOMM_AR_MAX: the largest all_reduce the in-process kernel takes; 0: off

  // From every member's "<transport> <host>", as published through the group's Store.
  static Facts agree(const std::vector<std::string>& choices, int64_t ar_max);
};

class Routes {
 public:
  // log: the "gocomm" logger at a Python logging level (the Backend's log hook).
  using Log = std::function<void(int, const std::string&)>;

  // own_reason: why this rank's sidecar chose its transport, for the table's reasons.
  // Logs a warning where the sidecars chose differently.
  // world: the default group, which the sidecar's NVSHMEM all_to_all_v kernel serves (its PEs
  // are the world's ranks); another group's all_to_all_v falls back to sidecar NCCL.
  Routes(Facts facts, const std::string& group_name, const std::string& own_reason, const Log& log, bool world);

  const Facts& facts() const { return facts_; }
  bool world() const { return world_; }
  // The group's sparse transport: "nvshmem" where every member's sidecar chose it and all are
  // on one host (one rank on NCCL would leave the others waiting in a kernel for rows that
  // never come; the NVSHMEM path is set up for one node), else "nccl".
  const std::string& transport() const { return transport_; }
  const std::string& transport_reason() const { return transport_reason_; }
  // all_to_all_v keeps its splits on the GPU (the in-process kernel or the sidecar's NVSHMEM
  // kernel): no host count exchange.
  bool splits_on_gpu() const { return splits_on_gpu_; }
  // The sidecar's NVSHMEM kernel serves this group's all_to_all_v (the in-process kernel's
  // fallback): an NVSHMEM group that is the default one (see world).
  bool nvshmem() const { return transport_ == "nvshmem" && world_; }
  // A group of one rank on a node whose sidecar chose NCCL (one GPU): the in-process kernels
  // serve its all_to_all_single, all_to_all_v and moe all the same (no peer to reach).
  bool alone() const { return alone_; }
  // all_reduce of CUDA tensors tries the in-process kernel.
  bool ar_inprocess() const { return ar_inprocess_; }
  // all_to_all_single, all_to_all_v and moe of CUDA tensors try it.
  bool a2a_inprocess() const { return a2a_inprocess_; }

  // Turn op's in-process route ("all_reduce" or "all_to_all_v") to the sidecar for good: its
  // kernel's collective setup declined (every rank agrees), or one of its kernels failed (the
  // group is aborted). all_to_all_v takes all_to_all_single and moe along, to the sidecar's
  // NVSHMEM kernel where it serves (an NVSHMEM world group), else to sidecar NCCL.
  void fall_back(const std::string& op, const std::string& why);
  // The table, in its order: (op class, route).
  std::vector<std::pair<std::string, Route>> table() const;
  // What a CUDA graph can hold of this group's ops, in words (for error messages).
  std::string capturable() const;

 private:
  Facts facts_;
  bool world_;
  std::string transport_, transport_reason_;
  bool splits_on_gpu_ = false;
  bool alone_ = false;
  std::atomic<bool> ar_inprocess_{false}, a2a_inprocess_{false};
  mutable std::mutex mu_;  // the routes below (fall_back runs on an op's thread)
  Route all_reduce_, all_to_all_single_, all_to_all_v_, moe_, dense_, cpu_;
};

}  // namespace gocomm
