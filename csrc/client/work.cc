#include "work.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>

namespace gocomm {

Work::Work(std::string op, std::vector<at::Tensor> result, double limit_s, c10d::OpType type)
    : c10d::Work(-1, type),
      op_(std::move(op)),
      result_(std::move(result)),
      limit_(limit_s),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors())) {}

bool Work::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

bool Work::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr Work::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_;
}

int Work::sourceRank() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return source_;
}

std::vector<at::Tensor> Work::result() {
  return result_;
}

void Work::synchronize() {
  wait();
}

void Work::finish_op(std::exception_ptr exc, int source) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) {
      return;
    }
    completed_ = true;
    exception_ = exc;
    source_ = source;
  }
  cv_.notify_all();
  if (exc) {
    future_->setError(exc);
  } else {
    future_->markCompleted(c10::IValue(result_));
  }
}

bool Work::wait(std::chrono::milliseconds timeout) {
  if (cuda_wait) {
    if (std::exception_ptr e = exception()) {
      std::rethrow_exception(e);
    }
    cuda_wait(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(cuda_device)));
    return true;
  }
  double limit = limit_;
  const bool caller = timeout != kNoTimeout && timeout.count() > 0 && timeout.count() / 1000.0 < limit_;
  if (caller) {
    limit = timeout.count() / 1000.0;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  const bool done = cv_.wait_for(lock, std::chrono::duration<double>(limit), [this] { return completed_; });
  if (!done) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.3g", limit);
    if (caller) {  // the caller's own bound: the op goes on, and a later wait() can still get it
      C10_THROW_ERROR(DistBackendError, "gocomm " + op_ + ": not completed within wait()'s timeout of " + secs +
                                            "s; the op is still running (the group's timeout bounds it), and a " +
                                            "later wait() returns its result");
    }
    C10_THROW_ERROR(DistBackendError, "gocomm " + op_ + ": no completion from pgserver within " + secs +
                                          "s (the sidecar enforces op deadlines itself; it may be wedged)");
  }
  if (exception_) {
    std::rethrow_exception(exception_);
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> Work::getFuture() {
  if (!cuda_wait || cuda_device < 0) {
    return future_;
  }
  std::lock_guard<std::mutex> lock(cuda_future_mu_);
  if (!cuda_future_ && exception()) {  // known to have failed: the future says so
    return future_;
  }
  if (!cuda_future_) {
    const auto dev = static_cast<c10::DeviceIndex>(cuda_device);
    c10::cuda::CUDAGuard device_guard(dev);
    c10::cuda::CUDAStream on = c10::cuda::getStreamFromPool(false, dev);
    cuda_wait(on);
    // markCompleted records the future's event on the current stream: the one that waits
    c10::cuda::CUDAStreamGuard guard(on);
    cuda_future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                            std::vector<c10::Device>{c10::Device(c10::kCUDA, dev)});
    cuda_future_->markCompleted(c10::IValue(result_));
  }
  return cuda_future_;
}

namespace {

double longest(const std::vector<c10::intrusive_ptr<Work>>& works) {
  double l = 1.0;
  for (const auto& w : works) {
    l = std::max(l, w->limit());
  }
  return works.empty() ? 1.0 : l;
}

}  // namespace

BatchWork::BatchWork(std::string op, std::vector<c10::intrusive_ptr<Work>> works, std::vector<at::Tensor> result)
    : Work(std::move(op), std::move(result), longest(works), c10d::OpType::COALESCED), works_(std::move(works)) {}

c10::intrusive_ptr<BatchWork> BatchWork::make(std::string op, std::vector<c10::intrusive_ptr<Work>> works,
                                              std::vector<at::Tensor> result) {
  auto batch = c10::make_intrusive<BatchWork>(std::move(op), std::move(works), std::move(result));
  if (batch->works_.empty()) {
    batch->finish_op(nullptr);
    return batch;
  }
  // CUDA ops of one device (not captured): the batch's future is a CUDA future too, its
  // stream waiting for every op
  int dev = batch->works_.front()->cuda_device;
  for (auto& w : batch->works_) {
    if (!w->cuda_wait || w->cuda_device != dev) {
      dev = -1;
    }
  }
  if (dev >= 0) {
    batch->cuda_device = dev;
    BatchWork* self = batch.get();  // cuda_wait is called only through the batch
    batch->cuda_wait = [self](const c10::cuda::CUDAStream& s) {
      for (auto& w : self->works_) {
        w->cuda_wait(s);
      }
    };
  }
  // The children's futures hold the callbacks (each holding the batch) until they ran.
  auto remaining = std::make_shared<std::atomic<size_t>>(batch->works_.size());
  for (auto& w : batch->works_) {
    w->done_future()->addCallback([self = batch, remaining](c10::ivalue::Future&) {
      if (remaining->fetch_sub(1) != 1) {
        return;
      }
      std::exception_ptr exc;
      for (auto& c : self->works_) {
        if (auto e = c->exception()) {
          exc = e;
          break;
        }
      }
      self->finish_op(exc);
    });
  }
  return batch;
}

bool BatchWork::wait(std::chrono::milliseconds timeout) {
  // the caller's timeout bounds the batch, not each of its works
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (auto& w : works_) {
    auto left = timeout;
    if (timeout != kNoTimeout && timeout.count() > 0) {
      left = std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                         end - std::chrono::steady_clock::now()));
    }
    w->wait(left);
  }
  return true;
}

}  // namespace gocomm
