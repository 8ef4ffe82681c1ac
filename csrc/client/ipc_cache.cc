#include "ipc_cache.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <new>
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
  d.mapped = cuda::mapped_memory;
  d.mapping = cuda::mapping;
  d.export_fd = cuda::export_fd;
  d.no_fd_reason = cuda::no_fd_reason;
  d.hook = attach_hook;
  return d;
}

IpcCache::IpcCache(Put put, Driver driver) : put_(std::move(put)), drv_(std::move(driver)), owner_(::getpid()) {
  sender_ = std::thread([this] { send_loop(); });
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().push_back(this);
}

void IpcCache::set_send_fds(SendFds send) {
  std::lock_guard<std::mutex> reg(reg_mu_);
  send_fds_ = std::move(send);
}

IpcCache::~IpcCache() {
  close();
}

void IpcCache::close() {
  if (::getpid() != owner_) {
    // A child forked from the process that made it: the sender was not forked, a lock a
    // parent's thread held at the fork stays held here, and the condition variable counts
    // the sender as waiting (destroying it would wait for it). Locks and condition are made
    // afresh, the sender's handle, which names no thread here (join and detach fail), is left
    // undestroyed, and nothing is sent; the registry (whose lock may be held too) keeps this
    // entry, which the process's allocator hooks never reach (no CUDA after a fork).
    new (&mu_) std::mutex();
    new (&reg_mu_) std::mutex();
    new (&cv_) std::condition_variable();
    stop_ = true;
    if (sender_.joinable()) {
      new std::thread(std::move(sender_));
    }
    return;
  }
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

bool IpcCache::known_run(cuda::DevPtr ptr, uint64_t n, wire::BufRef* out) {
  for (const Entry& e : runs_) {
    if (e.ready && ptr >= e.base && ptr + n <= e.base + e.size) {
      *out = wire::BufRef{e.segment, ptr - e.base, n};
      return true;
    }
  }
  return false;
}

wire::BufRef IpcCache::ref(cuda::DevPtr ptr, uint64_t n, size_t claim) {
  if (n == 0) {
    return wire::BufRef{wire::kCudaSegment, 0, 0};
  }
  uint64_t bid = 0;
  bool have_bid = true;
  try {
    bid = drv_.buffer_id(ptr);
  } catch (const cuda::Error&) {  // said again below where it matters (not for chunks)
    have_bid = false;
  }
  auto known = [&](wire::BufRef* out) {
    std::lock_guard<std::mutex> lock(mu_);
    if (known_run(ptr, n, out)) {
      return true;
    }
    auto it = have_bid ? entries_.find(bid) : entries_.end();
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
  // a CUDA IPC handle where the allocation has one (cudaMalloc: everything that had one before
  // chunks were taken), else the chunks where the memory was mapped with cuMemMap
  cuda::DevPtr base = 0;
  size_t size = 0;
  uint8_t handle[64];
  std::string ipc_err;
  if (have_bid) {
    try {
      drv_.allocation(ptr, &base, &size);
      drv_.ipc_handle(base, handle);
    } catch (const cuda::Error& err) {
      ipc_err = err.what();
    }
  }
  if (!have_bid || !ipc_err.empty()) {
    if (drv_.mapped(ptr)) {
      return register_chunks(ptr, n);
    }
    if (!have_bid) {
      drv_.buffer_id(ptr);  // raises the driver's error
    }
    std::string why = drv_.no_ipc_reason(ptr);
    throw std::runtime_error(
        "gocomm: this tensor's memory cannot be shared with the sidecar, which maps a CUDA tensor's allocation by "
        "its CUDA IPC handle, or its chunks by file descriptor where it was mapped with cuMemMap (" +
        ipc_err + ")" + (why.empty() ? "" : ": " + why) +
        ". Allocate the tensors handed to gocomm with torch's caching allocator (PYTORCH_CUDA_ALLOC_CONF without "
        "backend:cudaMallocAsync); see docs/decisions/0029-expandable-segments.md");
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

wire::BufRef IpcCache::register_chunks(cuda::DevPtr ptr, uint64_t n) {
  const char* const what = "gocomm: this tensor lives in memory mapped with cuMemMap (torch's expandable segments)";
  if (!hooked_) {
    throw std::runtime_error(std::string(what) +
                             ", which the sidecar maps only where torch's caching allocator reports what it unmaps, "
                             "and this allocator does not (see the message above)");
  }
  if (!send_fds_) {
    throw std::runtime_error(std::string(what) + ", and this sidecar has no fd socket to take its chunks");
  }
  // the chunks [ptr, ptr + n) spans, back to back
  std::vector<cuda::DevPtr> bases;
  std::vector<uint64_t> sizes;
  cuda::DevPtr at = ptr;
  for (;;) {
    cuda::DevPtr base = 0;
    size_t size = 0;
    drv_.mapping(at, &base, &size);
    if (size == 0 || base > at || (!bases.empty() && base != at)) {
      throw std::runtime_error(std::string(what) + ", and the driver reports a mapping of " + std::to_string(size) +
                               " bytes at " + std::to_string(base) + " for address " + std::to_string(at));
    }
    bases.push_back(base);
    sizes.push_back(size);
    if (base + size >= ptr + n) {
      break;
    }
    if (bases.size() == kMaxChunks) {
      throw std::runtime_error(std::string(what) + " and spans more than " + std::to_string(kMaxChunks) +
                               " of its chunks, more than the sidecar takes for one tensor");
    }
    at = base + size;
  }
  std::vector<int> fds;
  fds.reserve(bases.size());
  for (cuda::DevPtr b : bases) {
    try {
      fds.push_back(drv_.export_fd(b));
    } catch (const cuda::Error& err) {
      for (int fd : fds) {
        ::close(fd);
      }
      std::string why = drv_.no_fd_reason(b);
      throw std::runtime_error(std::string(what) + ", and a chunk of it cannot be exported to a file descriptor (" +
                               err.what() + ")" + (why.empty() ? "" : ": " + why) +
                               ". Unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF, or allocate the tensors "
                               "handed to gocomm with it off (torch.cuda.memory._set_allocator_settings("
                               "\"expandable_segments:False\")); see docs/decisions/0029-expandable-segments.md");
    }
  }
  const uint32_t seg = wire::kCudaSegment | next_++;
  uint64_t total = 0;
  for (uint64_t s : sizes) {
    total += s;
  }
  std::vector<uint32_t> stale;  // IPC registrations these addresses outlived, unreported (invariant 4)
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto e = entries_.begin(); e != entries_.end();) {
      if (overlaps(e->second.base, e->second.size, bases[0], total)) {
        stale.push_back(e->second.segment);
        e = entries_.erase(e);
      } else {
        ++e;
      }
    }
    runs_.push_back(Entry{seg, bases[0], total, false});
  }
  bool handed = false;  // the fds are send_fds_'s to close from its call on
  try {
    for (uint32_t s : stale) {
      put_(wire::kRecIpcDrop, wire::encode_ipc_drop(s));
    }
    handed = true;
    send_fds_(seg, fds, sizes);
  } catch (const std::exception& err) {
    if (!handed) {
      for (int fd : fds) {
        ::close(fd);
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(runs_.begin(), runs_.end(), [&](const Entry& e) { return e.segment == seg; });
    if (it != runs_.end()) {
      runs_.erase(it);
    }
    // the sidecar may have mapped it all the same (an answer that came too late): dropped,
    // as an unknown segment's drop is ignored
    drops_.push_back(seg);
    queued_++;
    cv_.notify_all();
    throw std::runtime_error(err.what());
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (Entry& e : runs_) {
    if (e.segment == seg) {
      e.ready = true;
    }
  }
  return wire::BufRef{seg, ptr - bases[0], n};
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
    for (auto e = runs_.begin(); e != runs_.end();) {
      if (overlaps(e->base, e->size, addr, size)) {
        drops_.push_back(e->segment);
        queued_++;
        any = true;
        e = runs_.erase(e);
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
  return entries_.size() + runs_.size();
}

}  // namespace gocomm
