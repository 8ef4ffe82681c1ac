// The per-process half of a sidecar session that every group shares: the ring, the host
// arena, the CUDA registrations (and the fd socket that takes chunks), the table of ops in
// flight and the completion thread, which reads the completion ring, copies CPU outputs back
// into the caller's tensors, frees the arena space and finishes each op's Work and Future.
#pragma once

#include <c10/core/Event.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "arena.h"
#include "cuda_driver.h"
#include "fd_channel.h"
#include "ipc_cache.h"
#include "ring.h"
#include "wire.h"
#include "work.h"

namespace gocomm {

// The first failure of an op of a group (the sidecar breaks the group then): ops that do not
// pass through the sidecar (in-process kernels) raise it instead of waiting for peers. And
// whether the group is broken for good: the sidecar reported it broken, or a CUDA op failed.
// A CUDA op's wait() only queues a wait on the stream (the stream is released when the op
// fails), so its failure would reach no caller: every later call on the group raises it.
class GroupFailure {
 public:
  void mark(const std::string& why);
  std::optional<std::string> get();
  void mark_broken(const std::string& why);
  std::optional<std::string> broken();
  // Waits up to timeout for the group to be marked broken; its cause, or none.
  std::optional<std::string> wait_broken(std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<std::string> first_;
  std::optional<std::string> broken_;
};

// One op in flight.
struct Pending {
  c10::intrusive_ptr<Work> work;  // null for ops no caller waits on (their failures are logged)
  std::string op;  // the op and its group, as errors name them ("all_reduce on group '0'")
  std::chrono::steady_clock::time_point deadline;
  std::vector<Arena::Block> allocs;  // freed when the op finished
  std::vector<std::pair<at::Tensor, const uint8_t*>> copy_out;  // (output, its bytes in the arena)
  std::vector<at::Tensor> keep;  // alive until the op finished
  // CUDA ops that unpack outputs on the caller's stream: recorded after the unpack; the Work
  // finishes once it has (the outputs are in place by then)
  std::shared_ptr<c10::Event> unpacked;
  std::shared_ptr<GroupFailure> group;
  bool cuda = false;  // a CUDA op: its failure breaks the group for good (GroupFailure)
};

// Copies n bytes between host buffers: memcpy, split over torch's intra-op threads for large
// copies (as the tensor copy_ of the former Python client was).
void copy_bytes(void* dst, const void* src, size_t n);

// The exception_ptr of a DistBackendError with message msg (what wait() raises).
std::exception_ptr dist_error(const std::string& msg);

// Triggers whose graphs are gone, queued by the graphs' user objects (on a driver thread,
// where neither CUDA nor the ring may be used) for the completion thread to drop. Shared, so
// a graph that outlives its dispatcher still has somewhere to queue.
struct DropQueue {
  std::mutex mu;
  std::vector<uint32_t> triggers;
};

class Dispatcher {
 public:
  struct Config {
    std::string ring_path;
    size_t ring_bytes = 0;
    Arena::Grow grow;
    size_t first_segment = 16 << 20;
    // The control plane's AttachDevice rpc, which binds the sidecar to this process's GPU
    // (once, by the device's UUID): the path of the shared-memory file holding the groups'
    // stream counters, which the client maps (counters).
    std::function<std::string(int device, const std::array<uint8_t, 16>& uuid)> attach_device;
    // The "gocomm" logger (level, message) and the rank it names, for what attaching found.
    std::function<void(int, const std::string&)> log;
    int rank = 0;
    // The sidecar's fd socket and this session's id and token there (Attach), for memory
    // mapped with cuMemMap (FdChannel); no socket: such memory is refused.
    std::string fd_socket;
    uint64_t session = 0;
    std::string fd_token;
  };
  // Extra time past an op's own deadline before the client stops waiting for the sidecar's
  // answer (the sidecar enforces deadlines itself; this guards against a wedged sidecar).
  static constexpr double kGrace = 30.0;

  // A Dispatcher with its completion thread running (the constructor starts none).
  static std::shared_ptr<Dispatcher> make(Config cfg);
  explicit Dispatcher(Config cfg);
  ~Dispatcher();

  // Hands an op to the sidecar: send, then track p. Throws where send does (p released);
  // where the sidecar was lost after the descriptor went out, returns p.work already failed.
  // Returns p.work.
  c10::intrusive_ptr<Work> submit(Pending p, wire::Desc& d);
  // submit in two steps, which the CUDA ops' path calls itself: send gives d its seq and
  // writes the descriptor (waiting for room in the ring) before the op's Pending (its Work,
  // labels) exists, so the sidecar starts on it while the caller builds that; track records
  // the Pending. The caller must call track for every seq send gave, on the same thread: a
  // completion that arrives between the two (a refusal, or an op that finished first) is
  // held until then, and where the sidecar was lost meanwhile track fails p. type and
  // prefix: the record's kind and the bytes before the descriptor (a graph op's trigger and
  // page). send throws, nothing sent, ValueError for a descriptor over the ring's limit
  // (check_size) and DistBackendError once the sidecar is lost or the session closed.
  void send(wire::Desc& d, const std::function<std::string()>& op, uint16_t type = wire::kRecOp,
            const std::vector<uint8_t>& prefix = {});
  void track(uint64_t seq, Pending p);
  // Throws send's ValueError where d (after prefix bytes) would not fit in one ring record:
  // for callers that queue stream work for an op before its descriptor goes out.
  void check_size(const wire::Desc& d, const std::function<std::string()>& op, size_t prefix = 0) const;
  // Tests: the next submit waits s seconds between send and track (so that its completion
  // comes first and track settles it).
  void delay_next_track(double s) { track_delay_us_ = int64_t(s * 1e6); }
  // The largest ring record, header included.
  size_t max_record() const { return ring_->max_record(); }
  // Writes a control record, waiting for room (throws once the session is lost or closed).
  void put(uint16_t type, const std::vector<uint8_t>& payload);
  // Fails every op in flight with "gocomm <op>: <why>", refuses new ones, and releases the
  // stream counters so that no CUDA stream stays blocked on the lost sidecar.
  void fail_all(const std::string& why);
  std::optional<std::string> lost();
  // The handle of the last group whose streams on counter slot were let go (the sidecar
  // stores it before it releases them: pg's Session.released); 0 for none.
  uint32_t released_mark(int slot) const { return slot < 0 ? 0 : ring_->mark(size_t(slot)); }
  // Stops the completion thread and fails what is still in flight, as fail_all (the session
  // closes); later calls do nothing.
  void close();

  Arena& arena() { return *arena_; }
  // The device address of the stream counters; attaches device the first time (attach).
  cuda::DevPtr counters(int device);
  // (segment, offset, length) of n bytes of CUDA memory at ptr on device (registered with the
  // sidecar on first use; the device is made current for the driver's queries).
  // claim: see IpcCache::ref.
  wire::BufRef cuda_ref(uint64_t ptr, uint64_t n, int device, size_t claim = 0);
  // The CUDA IPC registrations (see IpcCache).
  IpcCache& ipc() { return ipc_; }
  // Ops sent and not yet answered to their caller: recorded, between send and track, or
  // answered early and waiting for the completion thread's settle.
  size_t pending_count();
  // Completions that came before their op's track (tests: Dispatcher::send's hold).
  uint64_t early_count() const { return early_count_; }

  // ----- ops captured in CUDA graphs (docs/decisions/0020) -----
  // A free trigger for an op captured on device; raises where there is none, or where the
  // trigger page could not be set up (at device attach).
  uint32_t take_trigger(int device);
  // Gives back a trigger that was never registered with the sidecar.
  void give_back_trigger(uint32_t t);
  // Registers d as the op of trigger t with the sidecar and waits for its answer (no CUDA
  // call: allowed while a capture is open); raises the sidecar's refusal.
  void register_graph_op(Pending p, wire::Desc& d, uint32_t t);
  // The device addresses of T[t] (an arena page) and D[t] (the sidecar's counter memory).
  cuda::DevPtr trigger_word(uint32_t t);
  cuda::DevPtr done_word(uint32_t t);
  std::shared_ptr<DropQueue> drops() const { return drops_; }
  size_t live_triggers();

 private:
  c10::intrusive_ptr<Work> submit_record(Pending p, wire::Desc& d, uint16_t type, const std::vector<uint8_t>& prefix);
  void setup_triggers();  // at attach (dev_mu_ held)
  void send_drops();  // the completion thread: drops queued by destroyed graphs
  void orphan_triggers();  // the completion thread, once the sidecar is lost
  // The completion thread: turns while the Dispatcher lives and is not closed, then winds down
  // (a last drain of the queue, or fail_all where it is corrupt; later_ settled).
  static void run(const std::weak_ptr<Dispatcher>& weak);
  bool turn(std::chrono::steady_clock::time_point& last_check);  // false: stop
  void wind_down();
  void end_loop();  // no completion thread from now on: later_ settled, track settles inline
  bool drain(bool* any);  // the completions in the queue; false where it is corrupt
  bool corrupt_ = false;  // the completion thread's own
  void complete(const wire::Done& d);
  void settle(Pending& p, const wire::Done& d);  // p's completion d (p out of pending_)
  void settle_later();  // the completion thread: early completions track handed it (later_)
  void drop_untracked(uint64_t seq);  // seq leaves untracked_ (mu_ held)
  // Puts one record into the ring, waiting while it is full, unless the sidecar is lost or the
  // session closed meanwhile.
  enum class Refused { kNo, kLost, kClosed };
  Refused push(uint16_t type, const std::vector<uint8_t>& payload);
  void expire(std::chrono::steady_clock::time_point now);
  void release(Pending& p);
  static void finish(Pending& p, std::exception_ptr exc);

  Config cfg_;
  std::unique_ptr<Ring> ring_;
  std::unique_ptr<Arena> arena_;
  FdChannel fd_;  // before ipc_, which sends through it
  IpcCache ipc_;
  std::atomic<uint64_t> seq_{0};
  std::mutex mu_;
  std::unordered_map<uint64_t, Pending> pending_;
  std::vector<uint64_t> untracked_;  // sent, not yet tracked (send, track)
  std::vector<wire::Done> early_;  // their completions that came first
  std::atomic<uint64_t> early_count_{0};  // such completions so far
  // Early completions whose settle waits for the GPU (an unpack event): track leaves them to
  // the completion thread rather than block its caller, who may hold the group's stream lock.
  std::vector<std::pair<Pending, wire::Done>> later_;
  size_t settling_ = 0;  // taken out of later_, their settle not yet begun
  bool loop_done_ = false;  // the completion thread left its loop: track settles inline
  std::atomic<int64_t> track_delay_us_{0};  // delay_next_track
  std::optional<std::string> lost_;
  std::vector<std::vector<at::Tensor>> leaked_;  // buffers of ops never answered: never reused
  // Binds the sidecar to device (Config::attach_device) and maps the stream counters' file it
  // answers with, registered for the device (dev_mu_ held).
  cuda::DevPtr attach(int device);
  std::mutex dev_mu_;
  int device_ = -1;
  cuda::DevPtr counters_ = 0;
  uint32_t* counters_host_ = nullptr;  // the same words, mapped here (fail_all stores to them)
  std::atomic<bool> stop_{false};
  std::thread thread_;
  // the process that made it: a child forked from it (its copy of the session, the ring and
  // the counter pages are the parent's) fails, sends and stores nothing at close, and
  // nothing after (forked_)
  int owner_;
  std::atomic<bool> forked_{false};
  // graph triggers (dev_mu_): the page (an arena block, pinned and mapped for the device),
  // which triggers are live, and the free ones
  Arena::Block page_block_;
  uint32_t page_segment_ = 0;
  size_t page_offset_ = 0;
  uint32_t* page_ = nullptr;
  cuda::DevPtr page_dev_ = 0;
  std::string page_error_;
  std::vector<bool> live_ = std::vector<bool>(wire::kTriggerSlots);
  std::vector<uint32_t> free_;
  std::shared_ptr<DropQueue> drops_ = std::make_shared<DropQueue>();
};

}  // namespace gocomm
