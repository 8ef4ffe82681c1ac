#include "routes.h"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <set>

#include "inprocess.h"

namespace gocomm {

namespace {

constexpr int kWarning = 30;  // Python logging's level

std::string trim(std::string s) {
  const char* space = " \t\r\n";
  s.erase(s.find_last_not_of(space) + 1);
  s.erase(0, s.find_first_not_of(space));
  return s;
}

// The transports, as Python prints a sorted list of strings: ['nccl', 'nvshmem'].
std::string list_of(const std::set<std::string>& kinds) {
  std::string r = "[";
  for (const auto& k : kinds) {
    r += (r.size() > 1 ? ", '" : "'") + k + "'";
  }
  return r + "]";
}

}  // namespace

std::string host_id() {
  std::string boot = "no-boot-id";
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  if (std::string line; f && std::getline(f, line)) {
    boot = trim(line);
  }
  std::string shm = "no-shm";
  struct stat st {};
  if (::stat("/dev/shm", &st) == 0) {
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%llx", static_cast<unsigned long long>(st.st_dev));
    shm = hex;
  }
  return boot + "/" + shm;
}

Facts Facts::agree(const std::vector<std::string>& choices, int64_t ar_max) {
  Facts f;
  f.size = int(choices.size());
  std::set<std::string> hosts;
  for (const auto& c : choices) {
    const size_t sp = c.find(' ');
    f.transports.push_back(c.substr(0, sp));
    hosts.insert(sp == std::string::npos ? "" : c.substr(sp + 1));
  }
  f.hosts = int(hosts.size());
  f.ar_max = ar_max;
  return f;
}

Routes::Routes(Facts facts, const std::string& group_name, const std::string& own_reason, const Log& log,
               bool world)
    : facts_(std::move(facts)), world_(world) {
  const std::set<std::string> kinds(facts_.transports.begin(), facts_.transports.end());
  const std::string hosts = std::to_string(facts_.hosts);
  std::string why;
  if (facts_.hosts > 1) {
    // NCCL picks the network between hosts (IB, RoCE, sockets, a net plugin); the in-process
    // kernels and NVSHMEM are set up for one host's NVLink domain
    transport_ = "nccl";
    why = "the group spans " + hosts + " hosts: NCCL between them (no in-process kernels, no NVSHMEM)";
  } else if (kinds == std::set<std::string>{"nvshmem"}) {
    transport_ = "nvshmem";
    why = "every rank's sidecar chose NVSHMEM (one NVLink domain with peer atomics) on one host";
  } else {
    transport_ = "nccl";
    if (kinds.count("nvshmem")) {
      why = "the sidecars chose " + list_of(kinds);
      if (log) {
        log(kWarning, "gocomm group '" + group_name + "': " + why + "; all_to_all_v takes NCCL");
      }
    } else {
      why = "the sidecars chose NCCL (" +
            (own_reason.empty() ? std::string("their GPUs do not share NVLink, or NVSHMEM cannot run")
                                : "this rank's: " + own_reason) +
            ")";
    }
  }
  transport_reason_ = why;
  const int n = facts_.size;
  // One rank alone needs no link to any peer: the in-process kernels move its rows within its
  // own memory, whatever the sidecar chose for the node (NCCL on a one-GPU node), unless NCCL
  // was asked for (GOCOMM_TRANSPORT=nccl: its sidecar's reason, sparse/engine.go's Choose).
  const bool forced_nccl = own_reason.rfind("forced by GOCOMM_TRANSPORT=nccl", 0) == 0;
  alone_ = n == 1 && facts_.hosts == 1 && transport_ != "nvshmem" && !forced_nccl;
  if (alone_) {
    transport_reason_ += "; one rank alone: its all-to-alls need no link to a peer (their routes say where they run)";
  }
  splits_on_gpu_ = transport_ == "nvshmem" || alone_;
  const int max = inproc::kMaxRanks;  // the most ranks the in-process kernels take
  const std::string too_many =
      std::to_string(n) + " ranks, more than the kernel's " + std::to_string(max);
  std::string ar_why, a2a_why;
  if (!splits_on_gpu_) {
    ar_why = a2a_why = why;
  } else {
    if (n < 2) {
      ar_why = "one rank: nothing to reduce across";
    } else if (n > max) {
      ar_why = too_many;
    } else if (facts_.ar_max <= 0) {
      ar_why = "GOCOMM_AR_MAX=0";
    }
    if (n > max) {
      a2a_why = too_many;
    }
  }
  ar_inprocess_ = ar_why.empty();
  a2a_inprocess_ = a2a_why.empty();
  all_reduce_ = ar_inprocess_ ? Route{kInProcess,
                                      "the ranks share one NVLink domain; bf16/fp16/fp32 sum/avg of a multiple of 16 "
                                      "bytes up to GOCOMM_AR_MAX, the rest (and where the kernel's setup declines) "
                                      "sidecar NCCL"}
                              : Route{kSidecarNccl, ar_why};
  all_to_all_single_ =
      a2a_inprocess_ ? Route{kInProcess, alone_ ? "one rank: its rows move within its own memory (sidecar NCCL where "
                                                  "the kernel's setup declines, or with GOCOMM_TRANSPORT=nccl)"
                                                : "the ranks share one NVLink domain (sidecar NCCL where the kernel's "
                                                  "setup declines)"}
                     : Route{kSidecarNccl, a2a_why};
  if (a2a_inprocess_ && alone_) {
    all_to_all_v_ = {kInProcess,
                     "one rank: its rows move within its own memory; where the kernel's setup declines (or with "
                     "GOCOMM_TRANSPORT=nccl) sidecar NCCL with a host count exchange"};
  } else if (a2a_inprocess_) {
    all_to_all_v_ = {kInProcess,
                     "the ranks share one NVLink domain; where the kernel's setup declines (GOCOMM_A2AV_INPROCESS=0 "
                     "on a rank), the sidecar's NVSHMEM kernel on the default group, else sidecar NCCL with a host "
                     "count exchange"};
  } else if (nvshmem()) {
    all_to_all_v_ = {kSidecarNvshmem, a2a_why + ": the sidecar's NVSHMEM kernel (this is the default group)"};
  } else if (splits_on_gpu_) {
    all_to_all_v_ = {kSidecarNccl, a2a_why +
                                       ": sidecar NCCL with a host count exchange (the sidecar's NVSHMEM kernel "
                                       "serves the default group only)"};
  } else {
    all_to_all_v_ = {kSidecarNccl, why + ": the counts go through the host (one sync)"};
  }
  moe_ = {all_to_all_v_.engine,
          std::string("as all_to_all_v") +
              (a2a_inprocess_ ? ": the in-process kernels for padded dispatch without fp8 of the shapes they take, "
                                "else one host sync"
                              : " (one host sync)")};
  dense_ = {kSidecarNccl, "every other op of CUDA tensors"};
  cpu_ = facts_.hosts > 1
             ? Route{kHost, "CPU tensors: the group spans " + hosts +
                                " hosts: the sidecars' host engine over TCP, payloads inline between hosts (by "
                                "reference only between sidecars that proved they share one host)"}
             : Route{kHost, "CPU tensors: the sidecars' host engine over TCP and shared memory"};
}

void Routes::fall_back(const std::string& op, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (op == "all_reduce") {
    ar_inprocess_ = false;
    all_reduce_ = {kSidecarNccl, why};
    return;
  }
  a2a_inprocess_ = false;
  all_to_all_single_ = {kSidecarNccl, why};
  all_to_all_v_ = {nvshmem() ? kSidecarNvshmem : kSidecarNccl, why};
  moe_ = {all_to_all_v_.engine, "as all_to_all_v (one host sync): " + why};
}

std::vector<std::pair<std::string, Route>> Routes::table() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {{"all_reduce", all_reduce_}, {"all_to_all_single", all_to_all_single_}, {"all_to_all_v", all_to_all_v_},
          {"moe", moe_},           {"other CUDA ops", dense_},           {"CPU tensors", cpu_}};
}

std::string Routes::capturable() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string r;
  if (ar_inprocess_) {
    r += "all_reduce (sum, avg; bf16, fp16, fp32; a multiple of 16 bytes) in-process, ";
  }
  if (a2a_inprocess_) {
    r += "all_to_all_single in-process, gocomm.all_to_all_v, gocomm.moe.dispatch(padded=True) and combine, ";
  }
  // docs/decisions/0020: a collective on sidecar NCCL is registered at capture and run by the
  // sidecar's graph lane at each replay
  r += "the collectives on sidecar NCCL (all_reduce, broadcast, reduce, all_gather(_into_tensor), "
       "reduce_scatter(_tensor), all_to_all(_single), gather, scatter and their coalesced forms); not send/recv";
  if (!a2a_inprocess_) {
    r += ", gocomm.all_to_all_v or moe.dispatch without the in-process kernels";
  }
  return r;
}

}  // namespace gocomm
