#include "ipc_cache.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>

namespace gocomm {
namespace {

// The live caches the allocator hook tells (lock order: the allocator's lock, then this,
// then a cache's mu_). Never destroyed: the allocator may free a segment while the process's
// statics are being destroyed at exit.
std::mutex& registry_mu() {
  static auto* mu = new std::mutex;
  return *mu;
}

std::vector<IpcCache*>& registry() {
  static auto* caches = new std::vector<IpcCache*>;
  return *caches;
}

bool attach_hook() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    try {
      alloc::attachAllocatorTraceTracker([](const alloc::TraceEntry& te) {
        if (te.action_ == alloc::TraceEntry::SEGMENT_FREE || te.action_ == alloc::TraceEntry::SEGMENT_UNMAP) {
          IpcCache::released(te.addr_, te.size_);
        }
      });
      ok = true;
    } catch (const c10::Error& e) {  // cudaMallocAsync and pluggable allocators take no tracker
      std::fprintf(stderr,
                   "gocomm: torch's CUDA allocator (%s) does not report the memory it frees (%s); memory the "
                   "sidecar mapped is given back only when its addresses are reused\n",
                   alloc::name().c_str(), e.what_without_backtrace());
    }
  });
  return ok;
}

bool overlaps(cuda::DevPtr base, size_t size, cuda::DevPtr addr, size_t n) {
  return base < addr + n && addr < base + size;
}

}  // namespace

IpcCache::Driver IpcCache::Driver::real() {
  Driver d;
  d.buffer_id = cuda::buffer_id;
  d.allocation = cuda::allocation;
  d.ipc_handle = [](cuda::DevPtr base, uint8_t* out) { cuda::ipc_handle(base, out); };
  d.no_ipc_reason = cuda::no_ipc_reason;
  d.hook = attach_hook;
  return d;
}

IpcCache::IpcCache(Put put, Driver driver) : put_(std::move(put)), drv_(std::move(driver)) {
  sender_ = std::thread([this] { send_loop(); });
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().push_back(this);
}

IpcCache::~IpcCache() {
  close();
}

void IpcCache::close() {
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto& r = registry();
    r.erase(std::remove(r.begin(), r.end(), this), r.end());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (sender_.joinable()) {
    if (sender_.get_id() == std::this_thread::get_id()) {
      sender_.detach();
    } else {
      sender_.join();
    }
  }
}

wire::BufRef IpcCache::ref(cuda::DevPtr ptr, uint64_t n, size_t claim) {
  if (n == 0) {
    return wire::BufRef{wire::kCudaSegment, 0, 0};
  }
  const uint64_t bid = drv_.buffer_id(ptr);
  auto known = [&](wire::BufRef* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(bid);
    if (it == entries_.end() || !it->second.ready) {
      return false;
    }
    *out = wire::BufRef{it->second.segment, ptr - it->second.base, n};
    return true;
  };
  wire::BufRef r;
  if (known(&r)) {
    return r;
  }
  hooked_ = drv_.hook();  // outside every lock of ours: attaching takes the allocator's locks
  std::lock_guard<std::mutex> reg(reg_mu_);
  if (known(&r)) {  // registered by another thread meanwhile
    return r;
  }
  cuda::DevPtr base = 0;
  size_t size = 0;
  drv_.allocation(ptr, &base, &size);
  uint8_t handle[64];
  try {
    drv_.ipc_handle(base, handle);
  } catch (const cuda::Error& err) {
    std::string why = drv_.no_ipc_reason(ptr);
    throw std::runtime_error(
        "gocomm: this tensor's memory cannot be shared with the sidecar, which maps a CUDA tensor's allocation by "
        "its CUDA IPC handle (" +
        std::string(err.what()) + ")" + (why.empty() ? "" : ": " + why) +
        ". Only memory from cudaMalloc has one: unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF, or allocate "
        "the tensors handed to gocomm with it off (torch.cuda.memory._set_allocator_settings("
        "\"expandable_segments:False\")); see docs/decisions/0028-expandable-segments-refused.md");
  }
  const uint32_t seg = wire::kCudaSegment | next_++;
  std::vector<uint32_t> stale;  // registrations this allocation replaced unreported (invariant 4)
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto e = entries_.begin(); e != entries_.end();) {
      if (overlaps(e->second.base, e->second.size, base, size)) {
        stale.push_back(e->second.segment);
        e = entries_.erase(e);
      } else {
        ++e;
      }
    }
    entries_[bid] = Entry{seg, base, size, false};
  }
  try {
    for (uint32_t s : stale) {
      put_(wire::kRecIpcDrop, wire::encode_ipc_drop(s));
    }
    put_(wire::kRecIpc, wire::encode_ipc(seg, claim ? claim : size, handle));
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(bid);
    if (it != entries_.end() && it->second.segment == seg) {
      entries_.erase(it);
    }
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(bid);
  if (it != entries_.end() && it->second.segment == seg) {
    it->second.ready = true;
  }
  return wire::BufRef{seg, ptr - base, n};
}

void IpcCache::released(cuda::DevPtr addr, size_t size) {
  try {
    std::lock_guard<std::mutex> lock(registry_mu());
    for (IpcCache* c : registry()) {
      c->forget(addr, size);
    }
  } catch (...) {  // nothing may escape into torch's allocator
  }
}

void IpcCache::forget(cuda::DevPtr addr, size_t size) {
  bool any = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto e = entries_.begin(); e != entries_.end();) {
      if (overlaps(e->second.base, e->second.size, addr, size)) {
        drops_.push_back(e->second.segment);
        queued_++;
        any = true;
        e = entries_.erase(e);
      } else {
        ++e;
      }
    }
  }
  if (any) {
    cv_.notify_all();
  }
}

void IpcCache::send_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !drops_.empty(); });
    if (stop_) {
      return;
    }
    std::vector<uint32_t> batch;
    batch.swap(drops_);
    lock.unlock();
    {
      std::lock_guard<std::mutex> reg(reg_mu_);  // after the registration (invariant 3)
      for (uint32_t seg : batch) {
        try {
          put_(wire::kRecIpcDrop, wire::encode_ipc_drop(seg));
        } catch (const std::exception&) {
          // the session is lost or closing: the sidecar unmaps all of its segments then
        }
      }
    }
    lock.lock();
    sent_ += batch.size();
    cv_.notify_all();
  }
}

bool IpcCache::flush(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = queued_;
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return sent_ >= target || stop_; }) &&
         sent_ >= target;
}

size_t IpcCache::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace gocomm
