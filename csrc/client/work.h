// What a gocomm op returns: a c10d::Work finished by the completion thread when the
// sidecar's completion arrives (CPU ops: outputs copied into the caller's tensors by then), or,
// for a CUDA op, one whose wait() makes the caller's current stream wait for the op, as
// ProcessGroupNCCL's does. Its Future holds the op's result tensors: completed with the
// sidecar's answer for a CPU op, a CUDA future completed at once for a CUDA op (cuda_device).
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace gocomm {

class Work : public c10d::Work {
 public:
  // limit_s: how long wait() waits for the sidecar's answer before it gives up.
  Work(std::string op, std::vector<at::Tensor> result, double limit_s, c10d::OpType type);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  // CPU: block until the outputs are in place (at most the op's limit, or timeout if shorter).
  // CUDA: make the current stream wait for the op and return at once.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Called once by the completion side: exc null for success.
  void finish_op(std::exception_ptr exc, int source = -1);

  // CUDA ops: queues a stream's wait for the op (set before the Work is returned).
  std::function<void(const c10::cuda::CUDAStream&)> cuda_wait;
  // CUDA ops not captured in a graph: the op's device. get_future() is then a CUDA future, as
  // ProcessGroupNCCL's: completed at once, its event on a pool stream that waits for the op, so
  // its wait() and then() order the caller's streams after the op and never block the host
  // (DDP's hooks take it after each bucket). Elsewhere it is the host completion below.
  int cuda_device = -1;
  // Completed on the host when the sidecar's answer came (CPU ops: outputs in place), with
  // the op's error if it failed: what BatchWork counts.
  c10::intrusive_ptr<c10::ivalue::Future> done_future() { return future_; }
  const std::string& op() const { return op_; }
  double limit() const { return limit_; }

 private:
  std::string op_;
  std::vector<at::Tensor> result_;
  double limit_;
  int source_ = -1;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex cuda_future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> cuda_future_;  // made at the first get_future()
};

// A Work standing for several (the coalesced forms made of one op per tensor): finished
// when all are; wait() waits on each.
class BatchWork : public Work {
 public:
  static c10::intrusive_ptr<BatchWork> make(std::string op, std::vector<c10::intrusive_ptr<Work>> works,
                                            std::vector<at::Tensor> result);
  BatchWork(std::string op, std::vector<c10::intrusive_ptr<Work>> works, std::vector<at::Tensor> result);
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;

 private:
  std::vector<c10::intrusive_ptr<Work>> works_;
};

}  // namespace gocomm
