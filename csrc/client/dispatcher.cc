#include "dispatcher.h"

#include <ATen/Parallel.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>

namespace gocomm {

void GroupFailure::mark(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!first_) {
    first_ = why;
  }
}

std::optional<std::string> GroupFailure::get() {
  std::lock_guard<std::mutex> lock(mu_);
  return first_;
}

void GroupFailure::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!first_) {
    first_ = why;
  }
  if (!broken_) {
    broken_ = why;
  }
}

std::optional<std::string> GroupFailure::broken() {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

void copy_bytes(void* dst, const void* src, size_t n) {
  constexpr int64_t kChunk = 1 << 20;
  if (n < 4 * size_t(kChunk)) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  at::parallel_for(0, int64_t(n), kChunk, [&](int64_t begin, int64_t end) {
    std::memcpy(d + begin, s + begin, size_t(end - begin));
  });
}

std::exception_ptr dist_error(const std::string& msg) {
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

namespace {

std::string what(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

Dispatcher::Dispatcher(Config cfg)
    : cfg_(std::move(cfg)),
      ring_(std::make_unique<Ring>(cfg_.ring_path, cfg_.ring_bytes)),
      arena_(std::make_unique<Arena>(cfg_.grow, cfg_.first_segment)),
      ipc_([this](uint16_t type, const std::vector<uint8_t>& payload) { put(type, payload); }) {
  thread_ = std::thread([this] { loop(); });
}

Dispatcher::~Dispatcher() {
  close();
}

void Dispatcher::close() {
  stop_ = true;
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
}

c10::intrusive_ptr<Work> Dispatcher::submit(Pending p, wire::Desc& d) {
  c10::intrusive_ptr<Work> work = p.work;
  const std::string op = p.op;
  d.seq = ++seq_;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (lost_) {
      const std::string why = *lost_;
      lock.unlock();
      release(p);
      C10_THROW_ERROR(DistBackendError, "gocomm " + op + ": " + why);
    }
    pending_.emplace(d.seq, std::move(p));
  }
  const std::vector<uint8_t> payload = wire::encode(d);
  if (8 + ((payload.size() + 7) & ~size_t(7)) > ring_->max_record()) {
    Pending gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(d.seq);
      if (it != pending_.end()) {
        gone = std::move(it->second);
        pending_.erase(it);
      }
    }
    release(gone);
    C10_THROW_ERROR(ValueError, "gocomm " + op + ": its descriptor (" + std::to_string(payload.size()) +
                                    " bytes) exceeds the ring's limit of " + std::to_string(ring_->max_record()));
  }
  while (!ring_->submit(wire::kRecOp, payload.data(), payload.size())) {
    if (lost()) {
      break;  // fail_all finishes the work
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return work;
}

void Dispatcher::put(uint16_t type, const std::vector<uint8_t>& payload) {
  while (!ring_->submit(type, payload.data(), payload.size())) {
    if (auto why = lost()) {
      throw std::runtime_error("gocomm: " + *why);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

std::optional<std::string> Dispatcher::lost() {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

size_t Dispatcher::pending_count() {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

void Dispatcher::loop() {
  auto last_check = std::chrono::steady_clock::now();
  while (!stop_) {
    bool any = false;
    const bool ok = ring_->poll([&](uint16_t type, const uint8_t* p, size_t n) {
      if (type != wire::kRecDone) {
        return;
      }
      wire::Done d;
      if (wire::decode_done(p, n, &d)) {
        any = true;
        complete(d);
      }
    });
    if (!ok) {
      fail_all("the completion queue from pgserver is corrupt");
      return;
    }
    if (!any) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_check > std::chrono::seconds(1)) {
        last_check = now;
        expire(now);
      }
      ring_->wait(0.05);
    }
  }
}

void Dispatcher::complete(const wire::Done& d) {
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(d.seq);
    if (it == pending_.end()) {
      std::fprintf(stderr, "gocomm: pgserver reported %s for unknown op %llu: %s\n",
                   d.status == wire::kStatusOk ? "success" : wire::status_name(d.status).c_str(),
                   static_cast<unsigned long long>(d.seq), d.message.c_str());
      return;
    }
    p = std::move(it->second);
    pending_.erase(it);
  }
  std::exception_ptr exc;
  try {
    if (d.status == wire::kStatusOk) {
      for (auto& [dst, src] : p.copy_out) {
        copy_bytes(dst.data_ptr(), src, dst.nbytes());
      }
      if (p.unpacked) {
        p.unpacked->synchronize();  // the copies behind the sidecar's op are short
      }
    } else {
      exc = dist_error("gocomm " + p.op + " failed (" + wire::status_name(d.status) + "): " + d.message);
    }
  } catch (...) {  // never let a copy error end the completion thread
    exc = std::current_exception();
  }
  release(p);
  if (p.work && !exc) {
    p.work->finish_op(nullptr, d.source);
    return;
  }
  finish(p, exc);
}

void Dispatcher::release(Pending& p) {
  for (const auto& b : p.allocs) {
    arena_->release(b);
  }
  p.allocs.clear();
  p.copy_out.clear();
  p.keep.clear();
}

void Dispatcher::finish(Pending& p, std::exception_ptr exc) {
  if (exc && p.group) {
    if (p.cuda) {
      p.group->mark_broken(what(exc));
    } else {
      p.group->mark(what(exc));
    }
  }
  if (p.work) {
    p.work->finish_op(exc);
  } else if (exc) {
    std::fprintf(stderr, "gocomm: %s\n", what(exc).c_str());
  }
}

void Dispatcher::expire(std::chrono::steady_clock::time_point now) {
  std::vector<Pending> late;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (now > it->second.deadline) {
        late.push_back(std::move(it->second));
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    // The sidecar may still write into these buffers: leak them rather than reuse (host
    // staging stays allocated; CUDA tensors stay referenced for good).
    for (auto& p : late) {
      leaked_.push_back(std::move(p.keep));
    }
  }
  for (auto& p : late) {
    finish(p, dist_error("gocomm " + p.op + ": pgserver did not answer within its deadline plus 30s"));
  }
}

void Dispatcher::fail_all(const std::string& why) {
  std::vector<Pending> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!lost_) {
      lost_ = why;
    }
    for (auto& [seq, p] : pending_) {
      pending.push_back(std::move(p));
    }
    pending_.clear();
  }
  int device;
  cuda::DevPtr counters;
  {
    std::lock_guard<std::mutex> lock(dev_mu_);
    device = device_;
    counters = counters_;
  }
  if (counters != 0) {  // CUDA streams waiting on this sidecar must not hang
    try {
      cuda::release_counters(device, counters, 4096);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gocomm: could not release CUDA streams waiting on the lost sidecar: %s\n", e.what());
    }
  }
  for (auto& p : pending) {
    finish(p, dist_error("gocomm " + p.op + ": " + why));
  }
}

cuda::DevPtr Dispatcher::counters(int device) {
  std::lock_guard<std::mutex> lock(dev_mu_);
  if (device_ < 0) {
    counters_ = cfg_.attach_device(device);
    device_ = device;
  } else if (device != device_) {
    C10_THROW_ERROR(ValueError, "gocomm: this process already uses cuda:" + std::to_string(device_) +
                                    "; one GPU per rank (got cuda:" + std::to_string(device) + ")");
  }
  return counters_;
}

wire::BufRef Dispatcher::cuda_ref(uint64_t ptr, uint64_t n, int device, size_t claim) {
  if (n == 0) {
    return wire::BufRef{wire::kCudaSegment, 0, 0};
  }
  counters(device);  // the sidecar takes IPC handles only once the client attached its device
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return ipc_.ref(ptr, n, claim);
}

}  // namespace gocomm
