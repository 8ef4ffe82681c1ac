#include "dispatcher.h"

#include "shm_file.h"

#include <sys/mman.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>
#include <new>

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
  cv_.notify_all();
}

std::optional<std::string> GroupFailure::wait_broken(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [this] { return broken_.has_value(); });
  return broken_;
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
      fd_(cfg_.fd_socket, cfg_.session, cfg_.fd_token),
      ipc_([this](uint16_t type, const std::vector<uint8_t>& payload) { put(type, payload); }),
      owner_(::getpid()) {
  if (fd_.configured()) {
    ipc_.set_send_fds([this](uint32_t seg, const std::vector<int>& fds, const std::vector<uint64_t>& sizes) {
      fd_.send(seg, fds, sizes);
    });
  }
}

Dispatcher::~Dispatcher() {
  close();
  if (::getpid() != owner_) {
    return;  // the parent's registrations and pages
  }
  // Unregistered before they are unmapped: a later session's pages may be mapped at the same
  // address.
  for (void* p : {static_cast<void*>(page_), static_cast<void*>(counters_host_)}) {
    if (p != nullptr) {
      try {
        cuda::host_unregister(p);
      } catch (const std::exception&) {
        // no driver left (exit): nothing to undo
      }
    }
  }
  if (counters_host_ != nullptr) {
    ::munmap(counters_host_, wire::kCounterMemBytes);
  }
}

void Dispatcher::close() {
  if (stop_.exchange(true)) {
    return;
  }
  if (::getpid() != owner_) {
    // A child forked from the process that made it: the completion thread was not forked,
    // and failing the ops would store into the parent's counter pages (its streams would
    // run past ops still in flight). The child leaves it all to the parent: its locks (a
    // parent's thread may have held one at the fork) are made afresh, later ops raise and
    // nothing goes into the parent's ring, and the thread's handle, which names no thread
    // here (join and detach fail), is left undestroyed.
    new (&mu_) std::mutex();
    new (&dev_mu_) std::mutex();
    forked_ = true;
    lost_ = "this process was forked from the one whose sidecar session this is (a child uses a sidecar of its own)";
    fd_.forget_after_fork();
    ipc_.close();
    if (thread_.joinable()) {
      new std::thread(std::move(thread_));
    }
    return;
  }
  ipc_.close();  // its sender may wait in put, which gives up once stop_ is set
  fd_.close();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  // Nothing answers this session any more: ops still in flight fail (their Work would wait
  // forever, with no completion thread to expire them) and streams waiting on its counters go
  // on, as when the sidecar is lost. Ops sent later raise at once. Where the thread did not
  // wind down (the Dispatcher destroyed under it, or this is that thread), its end is here.
  end_loop();
  fail_all("the sidecar session is closed");
}

c10::intrusive_ptr<Work> Dispatcher::submit(Pending p, wire::Desc& d) {
  return submit_record(std::move(p), d, wire::kRecOp, {});
}

c10::intrusive_ptr<Work> Dispatcher::submit_record(Pending p, wire::Desc& d, uint16_t type,
                                                   const std::vector<uint8_t>& prefix) {
  c10::intrusive_ptr<Work> work = p.work;
  try {
    send(d, [&] { return p.op; }, type, prefix);
  } catch (...) {
    release(p);  // nothing of it reached the ring: its arena blocks go back now
    throw;
  }
  if (track_delay_us_.load(std::memory_order_relaxed) != 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(track_delay_us_.exchange(0)));
  }
  track(d.seq, std::move(p));
  return work;
}

void Dispatcher::check_size(const wire::Desc& d, const std::function<std::string()>& op, size_t prefix) const {
  const size_t n = prefix + wire::kDescHeader + d.bufs.size() * wire::kBufRefSize + d.splits.size() * 8;
  if (8 + ((n + 7) & ~size_t(7)) > ring_->max_record()) {
    C10_THROW_ERROR(ValueError, "gocomm " + op() + ": its descriptor (" + std::to_string(n) +
                                    " bytes) exceeds the ring's limit of " + std::to_string(ring_->max_record()));
  }
}

void Dispatcher::drop_untracked(uint64_t seq) {
  for (size_t i = 0; i < untracked_.size(); i++) {
    if (untracked_[i] == seq) {
      untracked_[i] = untracked_.back();
      untracked_.pop_back();
      return;
    }
  }
}

void Dispatcher::send(wire::Desc& d, const std::function<std::string()>& op, uint16_t type,
                      const std::vector<uint8_t>& prefix) {
  check_size(d, op, prefix.size());
  d.seq = ++seq_;
  std::vector<uint8_t> payload = prefix;
  const std::vector<uint8_t> desc = wire::encode(d);
  payload.insert(payload.end(), desc.begin(), desc.end());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (lost_) {
      C10_THROW_ERROR(DistBackendError, "gocomm " + op() + ": " + *lost_);
    }
    untracked_.push_back(d.seq);
  }
  try {
    if (push(type, payload) == Refused::kClosed) {
      C10_THROW_ERROR(DistBackendError, "gocomm " + op() + ": the sidecar session is closed");
    }  // kLost: not sent, and track fails the op
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    drop_untracked(d.seq);  // the caller will not track what never went out
    throw;
  }
}

Dispatcher::Refused Dispatcher::push(uint16_t type, const std::vector<uint8_t>& payload) {
  if (forked_) {
    return Refused::kLost;  // the ring is the parent's (close)
  }
  while (!ring_->submit(type, payload.data(), payload.size())) {
    if (lost()) {
      return Refused::kLost;
    }
    if (stop_) {
      return Refused::kClosed;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return Refused::kNo;
}

void Dispatcher::track(uint64_t seq, Pending p) {
  std::optional<wire::Done> early;
  std::optional<std::string> lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop_untracked(seq);
    for (size_t i = 0; i < early_.size(); i++) {
      if (early_[i].seq == seq) {
        early = std::move(early_[i]);
        early_.erase(early_.begin() + long(i));
        break;
      }
    }
    if (!early && !lost_) {
      pending_.emplace(seq, std::move(p));
      return;
    }
    if (early && p.unpacked && early->status == wire::kStatusOk && !loop_done_) {
      // Its settle waits for the unpack on the GPU: the completion thread's job, not this
      // caller's (it holds the group's stream lock, and the op is async to it). Once that
      // thread has left its loop, the caller settles it.
      later_.emplace_back(std::move(p), std::move(*early));
      early.reset();
    } else if (!early) {
      // fail_all ran before this op was tracked. The descriptor may be in the ring and the
      // sidecar (lost, maybe not yet gone) may still use its buffers: its arena blocks are
      // never reused (as fail_all's ops' are not), its tensors stay referenced (as an expired
      // op's do).
      lost = lost_;
      leaked_.push_back(std::move(p.keep));
      p.allocs.clear();
      p.copy_out.clear();
    }
  }
  if (early) {
    settle(p, *early);
    return;
  }
  if (lost) {
    finish(p, dist_error("gocomm " + p.op + ": " + *lost));
    return;
  }
  ring_->nudge();
}

void Dispatcher::put(uint16_t type, const std::vector<uint8_t>& payload) {
  switch (push(type, payload)) {
    case Refused::kNo: return;
    case Refused::kLost: throw std::runtime_error("gocomm: " + lost().value_or("the sidecar is lost"));
    case Refused::kClosed: throw std::runtime_error("gocomm: the sidecar session is closed");
  }
}

std::optional<std::string> Dispatcher::lost() {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

size_t Dispatcher::pending_count() {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size() + untracked_.size() + later_.size() + settling_;
}

std::shared_ptr<Dispatcher> Dispatcher::make(Config cfg) {
  auto d = std::make_shared<Dispatcher>(std::move(cfg));
  d->thread_ = std::thread(&Dispatcher::run, std::weak_ptr<Dispatcher>(d));
  return d;
}

void Dispatcher::run(const std::weak_ptr<Dispatcher>& weak) {
  // Each turn holds the Dispatcher: where a callback this thread runs (a Work's future) drops
  // its last other reference, the destructor runs here at the turn's end (close() then finds
  // itself on this thread and detaches it), and the next turn finds it gone and touches
  // nothing. So the thread never runs on a destroyed Dispatcher.
  auto last_check = std::chrono::steady_clock::now();
  for (;;) {
    const std::shared_ptr<Dispatcher> self = weak.lock();
    if (!self) {
      return;
    }
    if (!self->turn(last_check)) {
      self->wind_down();
      return;
    }
  }
}

bool Dispatcher::drain(bool* any) {
  return ring_->poll([&](uint16_t type, const uint8_t* p, size_t n) {
    wire::Done d;
    if (type == wire::kRecDone && wire::decode_done(p, n, &d)) {
      *any = true;
      complete(d);
    }
  });
}

bool Dispatcher::turn(std::chrono::steady_clock::time_point& last_check) {
  if (stop_) {
    return false;
  }
  settle_later();
  send_drops();
  // A lost sidecar no longer answers replays: their streams must still go on.
  const bool orphans = lost().has_value() && live_triggers() > 0;
  if (orphans) {
    orphan_triggers();
  }
  bool any = false;
  if (!drain(&any)) {
    corrupt_ = true;
    return false;
  }
  if (!any) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_check > std::chrono::seconds(1)) {
      last_check = now;
      expire(now);
    }
    ring_->wait(orphans ? 0.0005 : 0.05, [this] {
      std::lock_guard<std::mutex> lock(mu_);
      return !later_.empty();
    });
  }
  return true;
}

void Dispatcher::wind_down() {
  if (corrupt_) {
    fail_all("the completion queue from pgserver is corrupt");
  } else {
    bool any = false;
    drain(&any);  // answers that came before the close settle their ops as answered (close fails the rest)
  }
  end_loop();
}

void Dispatcher::end_loop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    loop_done_ = true;  // track settles inline from now on: nothing would drain later_
  }
  settle_later();
}

void Dispatcher::settle_later() {
  std::vector<std::pair<Pending, wire::Done>> todo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (later_.empty()) {
      return;
    }
    todo.swap(later_);
    settling_ = todo.size();  // still pending until each one's settle begins
  }
  for (auto& [p, d] : todo) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      settling_--;
    }
    settle(p, d);
  }
}

void Dispatcher::complete(const wire::Done& d) {
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(d.seq);
    if (it == pending_.end()) {
      for (uint64_t s : untracked_) {
        if (s == d.seq) {  // sent, its Pending not yet recorded: track settles it
          early_.push_back(d);
          early_count_++;
          return;
        }
      }
      std::fprintf(stderr, "gocomm: pgserver reported %s for unknown op %llu: %s\n",
                   d.status == wire::kStatusOk ? "success" : wire::status_name(d.status).c_str(),
                   static_cast<unsigned long long>(d.seq), d.message.c_str());
      return;
    }
    p = std::move(it->second);
    pending_.erase(it);
  }
  settle(p, d);
}

void Dispatcher::settle(Pending& p, const wire::Done& d) {
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
      // The sidecar may still use these buffers (gone from this session's view, not
      // necessarily dead): never reused, as an expired op's.
      leaked_.push_back(std::move(p.keep));
      pending.push_back(std::move(p));
    }
    pending_.clear();
  }
  // CUDA streams waiting on this sidecar must not hang: every done word goes 2^30 past its
  // ready word, and replays waiting for D[t] go on (later ones: orphan_triggers). CPU stores
  // into the shared counter pages, no CUDA call: a stream stuck on a counter cannot hold
  // them up, as it could a copy queued on any stream of this process.
  uint32_t* words = nullptr;
  {
    std::lock_guard<std::mutex> lock(dev_mu_);
    words = counters_host_;
  }
  if (words != nullptr) {
    for (size_t i = 0; i + 1 < wire::kTriggerOffset / 4; i += 2) {
      const uint32_t ready = __atomic_load_n(&words[i], __ATOMIC_ACQUIRE);
      __atomic_store_n(&words[i + 1], ready + (1u << 30), __ATOMIC_RELEASE);
    }
    if (live_triggers() > 0) {
      for (uint32_t t = 0; t < wire::kTriggerSlots; t++) {
        __atomic_store_n(&words[wire::kTriggerOffset / 4 + t], 1u, __ATOMIC_RELEASE);
      }
    }
  }
  for (auto& p : pending) {
    finish(p, dist_error("gocomm " + p.op + ": " + why));
  }
}

cuda::DevPtr Dispatcher::counters(int device) {
  std::lock_guard<std::mutex> lock(dev_mu_);
  if (device_ < 0) {
    counters_ = attach(device);
    device_ = device;
    setup_triggers();
  } else if (device != device_) {
    C10_THROW_ERROR(ValueError, "gocomm: this process already uses cuda:" + std::to_string(device_) +
                                    "; one GPU per rank (got cuda:" + std::to_string(device) + ")");
  }
  return counters_;
}

cuda::DevPtr Dispatcher::attach(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cuda::ensure_context(device);
  const std::string path = cfg_.attach_device(device, cuda::device_uuid(device));
  // The counters: a shared-memory file of the sidecar's (docs/decisions/0004), mapped,
  // unlinked (both processes hold it now) and registered for this process's streams.
  SharedFile f;
  try {
    f = map_shared_file(path, wire::kCounterMemBytes, "the sidecar's stream counters");
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, e.what());
  }
  cuda::DevPtr counters = 0;
  try {
    if (f.file_bytes != wire::kCounterMemBytes) {
      C10_THROW_ERROR(DistBackendError, "gocomm: the sidecar's stream counters " + path + " hold " +
                                            std::to_string(f.file_bytes) + " bytes, want " +
                                            std::to_string(wire::kCounterMemBytes));
    }
    counters = cuda::host_register(f.data, wire::kCounterMemBytes);
  } catch (...) {
    ::munmap(f.data, wire::kCounterMemBytes);
    throw;
  }
  counters_host_ = reinterpret_cast<uint32_t*>(f.data);
  // under MPS a rank and its sidecar share the GPU's context; without it every hand-off
  // switches contexts: what each sidecar op costs (docs/decisions/0002-mps.md)
  if (cfg_.log && cuda::mps_client(device)) {
    cfg_.log(20, "gocomm: rank " + std::to_string(cfg_.rank) +
                     " is an MPS client: a hand-off to its sidecar costs ~10 us back to back, ~19 us alone "
                     "(measured on H200, docs/decisions/0002-mps.md)");
  } else if (cfg_.log) {
    cfg_.log(30, "gocomm: rank " + std::to_string(cfg_.rank) +
                     " is not an MPS client: each op's hand-off to its sidecar costs a GPU context switch (~0.29 ms "
                     "measured on H200, vs ~10-19 us under MPS). Start the job with `python -m gocomm.launch --mps "
                     "-- <torchrun args>`.");
  }
  return counters;
}

wire::BufRef Dispatcher::cuda_ref(uint64_t ptr, uint64_t n, int device, size_t claim) {
  if (n == 0) {
    return wire::BufRef{wire::kCudaSegment, 0, 0};
  }
  counters(device);  // the sidecar takes IPC handles only once the client attached its device
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return ipc_.ref(ptr, n, claim);
}

// ----- ops captured in CUDA graphs ---------------------------------------------------------------

void Dispatcher::setup_triggers() {
  // Here, not at the first capture: pinning host memory is no call to make while a capture
  // is open. A failure is kept and raised by the first capture, not by eager ops.
  constexpr size_t kPage = 4096;
  try {
    page_block_ = arena_->alloc(2 * kPage);
    const size_t skew = (kPage - reinterpret_cast<uintptr_t>(page_block_.ptr) % kPage) % kPage;
    page_ = reinterpret_cast<uint32_t*>(page_block_.ptr + skew);
    std::memset(page_, 0, kPage);
    page_segment_ = page_block_.segment;
    page_offset_ = page_block_.offset + skew;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    page_dev_ = cuda::host_register(page_, kPage);
    for (uint32_t t = wire::kTriggerSlots; t-- > 0;) {
      free_.push_back(t);
    }
  } catch (const std::exception& e) {
    page_error_ = e.what();
    page_ = nullptr;
  }
}

uint32_t Dispatcher::take_trigger(int device) {
  counters(device);
  std::lock_guard<std::mutex> lock(dev_mu_);
  if (!page_error_.empty()) {
    C10_THROW_ERROR(DistBackendError, "gocomm: the trigger page for ops in CUDA graphs could not be set up: " + page_error_);
  }
  if (free_.empty()) {
    C10_THROW_ERROR(DistBackendError, "gocomm: more than " + std::to_string(wire::kTriggerSlots) +
                                          " sidecar ops are captured in the CUDA graphs alive in this process");
  }
  const uint32_t t = free_.back();
  free_.pop_back();
  live_[t] = true;
  return t;
}

void Dispatcher::give_back_trigger(uint32_t t) {
  std::lock_guard<std::mutex> lock(dev_mu_);
  if (t < live_.size() && live_[t]) {
    live_[t] = false;
    free_.push_back(t);
  }
}

size_t Dispatcher::live_triggers() {
  std::lock_guard<std::mutex> lock(dev_mu_);
  return wire::kTriggerSlots - (page_ == nullptr ? wire::kTriggerSlots : free_.size());
}

cuda::DevPtr Dispatcher::trigger_word(uint32_t t) {
  std::lock_guard<std::mutex> lock(dev_mu_);
  return page_dev_ + 4 * uint64_t(t);
}

cuda::DevPtr Dispatcher::done_word(uint32_t t) {
  std::lock_guard<std::mutex> lock(dev_mu_);
  return counters_ + wire::kTriggerOffset + 4 * uint64_t(t);
}

void Dispatcher::register_graph_op(Pending p, wire::Desc& d, uint32_t t) {
  std::vector<uint8_t> prefix(wire::kGraphOpHeader);
  uint32_t seg;
  uint64_t off;
  {
    std::lock_guard<std::mutex> lock(dev_mu_);
    seg = page_segment_;
    off = page_offset_;
  }
  std::memcpy(prefix.data(), &t, 4);
  std::memcpy(prefix.data() + 4, &seg, 4);
  std::memcpy(prefix.data() + 8, &off, 8);
  c10::intrusive_ptr<Work> work = p.work;
  submit_record(std::move(p), d, wire::kRecGraphOp, prefix);
  work->wait();  // a host wait for this process's own sidecar: no CUDA call, no peer
}

void Dispatcher::send_drops() {
  std::vector<uint32_t> ts;
  {
    std::lock_guard<std::mutex> lock(drops_->mu);
    ts.swap(drops_->triggers);
  }
  for (uint32_t t : ts) {
    if (!lost()) {
      std::vector<uint8_t> payload(4);
      std::memcpy(payload.data(), &t, 4);
      try {
        put(wire::kRecGraphDrop, payload);
      } catch (const std::exception&) {
        // lost meanwhile: the sidecar's triggers went with it
      }
    }
    give_back_trigger(t);  // after the drop: the sidecar reads it before any new registration
  }
}

void Dispatcher::orphan_triggers() {
  std::lock_guard<std::mutex> lock(dev_mu_);
  if (page_ == nullptr || counters_host_ == nullptr) {
    return;
  }
  for (uint32_t t = 0; t < wire::kTriggerSlots; t++) {
    if (live_[t] && __atomic_load_n(&page_[t], __ATOMIC_ACQUIRE) != 0) {
      __atomic_store_n(&page_[t], 0, __ATOMIC_RELEASE);
      // a CPU store into the shared counter pages (see fail_all)
      __atomic_store_n(&counters_host_[wire::kTriggerOffset / 4 + t], 1u, __ATOMIC_RELEASE);
    }
  }
}

}  // namespace gocomm
