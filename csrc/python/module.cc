// gocomm._C: the Python bindings of the compiled client (csrc/client), and nothing else. The
// control plane (python/gocomm) makes a Dispatcher per sidecar session and a Backend per
// group; torch calls the Backend's ops directly, never through here.
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <mutex>

#include "a2av.h"
#include "backend.h"
#include "cuda_driver.h"
#include "dispatcher.h"
#include "fd_channel.h"
#include "ipc_cache.h"
#include "moe.h"
#include "moe_kernels.h"
#include "process.h"
#include "routes.h"
#include "wire.h"

namespace py = pybind11;

namespace {

// A Python object a C++ callback holds: released with the GIL held, whichever thread drops it
// (left alone once the interpreter is gone).
std::shared_ptr<py::object> hold(py::object o) {
  return std::shared_ptr<py::object>(new py::object(std::move(o)), [](py::object* p) {
    if (!Py_IsInitialized()) {
      return;
    }
    py::gil_scoped_acquire gil;
    delete p;
  });
}

bool given(const py::object& o) {
  return !o.is_none();
}

// The "gocomm" logger's log(level, message) as the client calls it (at group setup and when a
// route falls back: rare), or nothing where log is None.
std::function<void(int, const std::string&)> logger(py::object log) {
  if (!given(log)) {
    return {};
  }
  auto f = hold(std::move(log));
  return [f](int level, const std::string& msg) {
    py::gil_scoped_acquire gil;
    (*f)(level, msg);
  };
}

// The control plane's ShmemID rpc, rpc(device, id) -> id (bytes), as the client calls it (once
// per group, at its first call of the sidecar's NVSHMEM kernel).
gocomm::ShmemRpc shmem_rpc(py::object rpc) {
  auto f = hold(std::move(rpc));
  return [f](int device, const std::vector<uint8_t>& id) {
    py::gil_scoped_acquire gil;
    auto out = (*f)(device, py::bytes(reinterpret_cast<const char*>(id.data()), id.size())).cast<std::string>();
    return std::vector<uint8_t>(out.begin(), out.end());
  };
}

// Python's OverflowError, thrown from C++: torch's error translation (which its ops' callers
// go through) raises an exception of python_type().
struct OverflowError : torch::PyTorchError {
  using PyTorchError::PyTorchError;
  PyObject* python_type() override { return PyExc_OverflowError; }
};

// The Python state's reference to its backend, which holds the state: weak, so that the
// group's lifetime is the ProcessGroup's.
struct BackendRef {
  c10::weak_intrusive_ptr<gocomm::Backend> ref;
};

// An IpcCache over a fake driver and ring (python/tests/test_ipc_cache.py): allocations are
// (base, size) with a fresh buffer id each; the ring records (type, segment) and can be made
// to hold its writers, as a full ring does. Chunks (memory mapped with cuMemMap) are
// allocations of their own whose fds are memory files (memfd) named gocomm-probe-<base>; their
// registrations go to a fake sidecar that records them, in the ring's record list as
// (kFdRecord, segment), and closes the fds, or, once connect was called, over a real fd socket.
class IpcCacheProbe {
 public:
  static constexpr uint16_t kFdRecord = 0xfd;

  IpcCacheProbe() {
    gocomm::IpcCache::Driver d;
    d.buffer_id = [this](gocomm::cuda::DevPtr p) { return find(p).bid; };
    d.allocation = [this](gocomm::cuda::DevPtr p, gocomm::cuda::DevPtr* base, size_t* size) {
      const Alloc& a = find(p);
      *base = a.base;
      *size = a.size;
    };
    d.ipc_handle = [this](gocomm::cuda::DevPtr base, uint8_t* out) {
      if (!find(base).ipc) {
        throw gocomm::cuda::Error("cuIpcGetMemHandle: invalid argument");
      }
      std::memset(out, 0, 64);
    };
    d.no_ipc_reason = [](gocomm::cuda::DevPtr) { return std::string("it comes from a stream-ordered memory pool"); };
    d.mapped = [this](gocomm::cuda::DevPtr p) { return find(p).chunk; };
    d.mapping = d.allocation;
    d.export_fd = [this](gocomm::cuda::DevPtr base) {
      if (!find(base).fd) {
        throw gocomm::cuda::Error("cuMemExportToShareableHandle: invalid argument");
      }
      int fd = memfd_create(("gocomm-probe-" + std::to_string(base)).c_str(), MFD_CLOEXEC);
      if (fd < 0) {
        throw gocomm::cuda::Error("memfd_create failed");
      }
      return fd;
    };
    d.no_fd_reason = [](gocomm::cuda::DevPtr) {
      return std::string("it was created with no exportable handle (TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0)");
    };
    d.hook = [this] { return hooked_.load(); };
    cache_ = std::make_unique<gocomm::IpcCache>(
        [this](uint16_t type, const std::vector<uint8_t>& payload) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [this] { return !held_ || closing_; });
          if (closing_) {
            throw std::runtime_error("the ring is closed");
          }
          uint32_t seg = 0;
          std::memcpy(&seg, payload.data(), 4);
          records_.emplace_back(type, seg);
        },
        std::move(d));
    cache_->set_send_fds([this](uint32_t seg, const std::vector<int>& fds, const std::vector<uint64_t>& sizes) {
      if (channel_) {
        channel_->send(seg, fds, sizes);
        std::lock_guard<std::mutex> lock(mu_);
        records_.emplace_back(kFdRecord, seg);
        return;
      }
      std::vector<std::string> names;
      for (int fd : fds) {
        char buf[256] = {0};
        ssize_t n = readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf, sizeof buf - 1);
        names.emplace_back(buf, n > 0 ? static_cast<size_t>(n) : 0);
        ::close(fd);
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (refuse_) {
        throw std::runtime_error("gocomm: the sidecar could not map this tensor's memory chunks: refused (fake)");
      }
      records_.emplace_back(kFdRecord, seg);
      sent_[seg] = std::make_pair(names, sizes);
    });
  }
  ~IpcCacheProbe() { close(); }

  uint64_t alloc(uint64_t base, uint64_t size, bool ipc) {
    std::lock_guard<std::mutex> lock(mu_);
    allocs_[base] = Alloc{base, size, ++bid_, ipc, false, false};
    return bid_;
  }
  // count chunks of size bytes mapped back to back from base; exportable: whether they have
  // a POSIX fd handle
  void map_chunks(uint64_t base, uint64_t size, int count, bool exportable) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < count; i++) {
      allocs_[base + i * size] = Alloc{base + i * size, size, ++bid_, false, true, exportable};
    }
  }
  void free(uint64_t base) {
    std::lock_guard<std::mutex> lock(mu_);
    allocs_.erase(base);
  }
  std::vector<std::pair<uint16_t, uint32_t>> records() {
    std::lock_guard<std::mutex> lock(mu_);
    return records_;
  }
  // What the fake sidecar got for segment seg: the files its fds named, and the lengths.
  std::pair<std::vector<std::string>, std::vector<uint64_t>> sent(uint32_t seg) {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_.at(seg);
  }
  void refuse(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    refuse_ = on;
  }
  void set_hooked(bool on) { hooked_ = on; }
  // Registrations go over the fd socket at path from now on.
  void connect(const std::string& path, uint64_t session, const std::string& token, double timeout_s) {
    channel_ = std::make_unique<gocomm::FdChannel>(path, session, token, timeout_s);
  }
  void hold(bool on) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ = on;
    }
    cv_.notify_all();
  }
  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    cache_->close();
  }
  gocomm::IpcCache& cache() { return *cache_; }

 private:
  struct Alloc {
    uint64_t base, size, bid;
    bool ipc, chunk, fd;
  };
  Alloc find(gocomm::cuda::DevPtr p) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [base, a] : allocs_) {
      if (p >= base && p < base + a.size) {
        return a;
      }
    }
    throw gocomm::cuda::Error("cuPointerGetAttribute: invalid value (no allocation there)");
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Alloc> allocs_;
  uint64_t bid_ = 0;
  std::vector<std::pair<uint16_t, uint32_t>> records_;
  std::map<uint32_t, std::pair<std::vector<std::string>, std::vector<uint64_t>>> sent_;
  bool held_ = false, closing_ = false, refuse_ = false;
  std::atomic<bool> hooked_{true};
  std::unique_ptr<gocomm::FdChannel> channel_;  // set before any registration (tests)
  std::unique_ptr<gocomm::IpcCache> cache_;  // last: destroyed first
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gocomm's compiled client: the c10d backend, the ring, the completion thread";
  py::module_::import("torch.distributed");  // registers c10d.Backend, our base class

  py::class_<gocomm::Dispatcher, std::shared_ptr<gocomm::Dispatcher>>(m, "Dispatcher")
      .def(py::init([](const std::string& ring_path, size_t ring_bytes, py::object grow, size_t first_segment,
                       py::object attach_device, const std::string& fd_socket, uint64_t session,
                       const std::string& fd_token, int rank, py::object log) {
             gocomm::Dispatcher::Config cfg;
             cfg.fd_socket = fd_socket;
             cfg.session = session;
             cfg.fd_token = fd_token;
             cfg.ring_path = ring_path;
             cfg.ring_bytes = ring_bytes;
             cfg.first_segment = first_segment;
             auto g = hold(std::move(grow));
             cfg.grow = [g](size_t bytes) {
               py::gil_scoped_acquire gil;
               auto t = (*g)(bytes).cast<std::tuple<uint32_t, std::string, size_t>>();
               return gocomm::Arena::NewSegment{std::get<0>(t), std::get<1>(t), std::get<2>(t)};
             };
             auto a = hold(std::move(attach_device));
             cfg.attach_device = [a](int device, const std::array<uint8_t, 16>& uuid) {
               py::gil_scoped_acquire gil;
               return (*a)(device, py::bytes(reinterpret_cast<const char*>(uuid.data()), uuid.size()))
                   .cast<std::string>();
             };
             cfg.rank = rank;
             cfg.log = logger(std::move(log));
             return gocomm::Dispatcher::make(std::move(cfg));
           }),
           py::arg("ring_path"), py::arg("ring_bytes"), py::arg("grow"), py::arg("first_segment"),
           py::arg("attach_device"), py::arg("fd_socket") = "", py::arg("session") = 0, py::arg("fd_token") = "",
           py::arg("rank") = 0, py::arg("log") = py::none())
      .def("fail_all", &gocomm::Dispatcher::fail_all, py::call_guard<py::gil_scoped_release>(),
           "Fail every op in flight with 'gocomm <op>: why', refuse new ones, release the stream counters.")
      .def("close", &gocomm::Dispatcher::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("lost", &gocomm::Dispatcher::lost)
      .def("pending", &gocomm::Dispatcher::pending_count)
      .def("early", &gocomm::Dispatcher::early_count,
           "Completions that came before their op was recorded (tests of Dispatcher::send's hold).")
      .def("delay_next_track", &gocomm::Dispatcher::delay_next_track, py::arg("seconds"),
           "Tests: the next op waits this long between sending its descriptor and recording it.")
      .def("max_record", &gocomm::Dispatcher::max_record, "The largest ring record, header included.")
      .def("arena_free", [](gocomm::Dispatcher& d) { return d.arena().free_bytes(); },
           "Bytes free in the host arena.")
      .def("live_triggers", &gocomm::Dispatcher::live_triggers,
           "Triggers in use: ops captured in CUDA graphs that are alive (docs/decisions/0020).")
      .def("counters", &gocomm::Dispatcher::counters, py::call_guard<py::gil_scoped_release>(),
           "The device address of the stream counters; attaches the device the first time.")
      .def("segments", [](gocomm::Dispatcher& d) { return d.arena().segments(); },
           "(id, bytes) of the host arena's segments.")
      .def("cuda_segments", [](gocomm::Dispatcher& d) { return d.ipc().size(); },
           "How many CUDA allocations are registered with the sidecar.")
      .def_property_readonly("cuda_hooked", [](gocomm::Dispatcher& d) { return d.ipc().hooked(); },
                             "Whether torch's CUDA allocator reports the memory it frees (so its registrations "
                             "are dropped at once).")
      .def("flush_cuda_drops", [](gocomm::Dispatcher& d, double timeout_s) { return d.ipc().flush(timeout_s); },
           py::call_guard<py::gil_scoped_release>(), py::arg("timeout_s"),
           "Wait until the drops of freed CUDA allocations are in the ring; False on timeout.")
      .def(
          "cuda_ref",
          [](gocomm::Dispatcher& d, uint64_t ptr, uint64_t n, int device, size_t claim) {
            py::gil_scoped_release nogil;
            auto r = d.cuda_ref(ptr, n, device, claim);
            return std::make_tuple(r.segment, r.offset, r.length);
          },
          py::arg("ptr"), py::arg("n"), py::arg("device"), py::arg("claim") = 0,
          "(segment, offset, length) naming n bytes of CUDA memory at ptr (registered with the sidecar once). "
          "claim (tests only): the size an allocation registered now claims instead of the driver's.");

  // A group's route table (csrc/client/routes.h), made by the control plane at the group's
  // creation and handed to its Backend; gocomm.info() and the sparse and MoE APIs read it.
  py::class_<gocomm::Routes, std::shared_ptr<gocomm::Routes>> routes(m, "Routes");
  routes
      .def(py::init([](const std::vector<std::string>& choices, int64_t ar_max, const std::string& group_name,
                       const std::string& own_reason, py::object log, bool world) {
             return std::make_shared<gocomm::Routes>(gocomm::Facts::agree(choices, ar_max), group_name, own_reason,
                                                     logger(std::move(log)), world);
           }),
           py::arg("choices"), py::arg("ar_max"), py::arg("group_name") = "", py::arg("own_reason") = "",
           py::arg("log") = py::none(), py::arg("world") = true,
           "The table from every member's \"<transport> <host>\" (as published through the group's Store) and "
           "GOCOMM_AR_MAX; own_reason: why this rank's sidecar chose its transport; log: the gocomm logger's log; "
           "world: the default group (the one the sidecar's NVSHMEM kernel serves).")
      .def_property_readonly("world", &gocomm::Routes::world)
      .def_property_readonly("nvshmem", &gocomm::Routes::nvshmem,
                             "The sidecar's NVSHMEM kernel serves the group's all_to_all_v (an NVSHMEM world group).")
      .def_property_readonly("size", [](const gocomm::Routes& r) { return r.facts().size; })
      .def_property_readonly("hosts", [](const gocomm::Routes& r) { return r.facts().hosts; },
                             "How many hosts the group's ranks are on.")
      .def_property_readonly("transport", &gocomm::Routes::transport)
      .def_property_readonly("transport_reason", &gocomm::Routes::transport_reason)
      .def_property_readonly("splits_on_gpu", &gocomm::Routes::splits_on_gpu)
      .def_property_readonly("ar_inprocess", &gocomm::Routes::ar_inprocess)
      .def_property_readonly("a2a_inprocess", &gocomm::Routes::a2a_inprocess)
      .def("fall_back", &gocomm::Routes::fall_back, py::arg("op"), py::arg("why"))
      .def(
          "table",
          [](const gocomm::Routes& r) {
            py::dict d;
            for (const auto& [op, route] : r.table()) {
              d[py::str(op)] = py::make_tuple(route.engine, route.reason);
            }
            return d;
          },
          "{op class: (engine, reason)}, for gocomm.info().")
      .def("capturable", &gocomm::Routes::capturable,
           "What a CUDA graph can hold of this group's ops, in words (for error messages).");
  // the engines, as the table names them
  routes.attr("INPROCESS") = gocomm::kInProcess;
  routes.attr("SIDECAR_NCCL") = gocomm::kSidecarNccl;
  routes.attr("SIDECAR_NVSHMEM") = gocomm::kSidecarNvshmem;
  routes.attr("HOST") = gocomm::kHost;
  m.def(
      "exchange_shmem_id",
      [](c10::intrusive_ptr<c10d::Store> store, int rank, const std::string& group, int device, py::object rpc) {
        auto f = shmem_rpc(std::move(rpc));
        py::gil_scoped_release nogil;  // the Store waits for rank 0
        gocomm::exchange_shmem_id(*store, rank, group, device, f);
      },
      py::arg("store"), py::arg("rank"), py::arg("group"), py::arg("device"), py::arg("rpc"),
      "Carry a group's NVSHMEM unique id through its Store, as its backend does at its first call of the "
      "sidecar's NVSHMEM kernel: rpc(device, id) is the ShmemID rpc (tests).");
  m.def("nccl_path", &gocomm::nccl_path,
        "The libnccl this process has loaded (torch's), else the one torch's wheel would load, else \"\".");
  m.def("host_id", &gocomm::host_id, "What tells this host from another (boot id / the /dev/shm mount's device).");

  py::class_<gocomm::Backend, c10d::Backend, c10::intrusive_ptr<gocomm::Backend>>(m, "Backend")
      .def(py::init([](std::shared_ptr<gocomm::Dispatcher> disp, int rank, int size, uint32_t handle, int slot,
                       std::array<uint32_t, 2> counter_base, double timeout_s, const std::string& name,
                       const std::string& cuda_refusal, std::shared_ptr<gocomm::Routes> routes,
                       py::object knobs, py::object a2a, py::object log, py::object on_shutdown, py::object on_abort,
                       py::object state, bool world, c10::intrusive_ptr<c10d::Store> store,
                       py::object shmem_id, py::object on_split) {
             gocomm::Backend::Config cfg;
             cfg.rank = rank;
             cfg.size = size;
             cfg.handle = handle;
             cfg.slot = slot;
             cfg.counter_base = counter_base;
             cfg.timeout_s = timeout_s;
             cfg.name = name;
             cfg.cuda_refusal = cuda_refusal;
             cfg.routes = std::move(routes);
             // the in-process engine's settings: the knobs the sidecar read for the client
             // (pb.ClientKnobs) and its sparse all-to-all's (pb.A2AConfig), which the kernel shares
             auto& st = cfg.inprocess;
             st.ar_max = knobs.attr("ar_max").cast<int64_t>();
             st.ar_stage = knobs.attr("ar_stage").cast<int64_t>();
             st.ar_oneshot = knobs.attr("ar_oneshot").cast<int64_t>();
             st.ar_blocks = knobs.attr("ar_blocks").cast<int>();
             st.a2av = knobs.attr("a2av_inprocess").cast<bool>();
             st.moe_ll_bytes = knobs.attr("moe_ll_bytes").cast<int64_t>();
             st.a2a_recv_bytes = a2a.attr("recv_bytes").cast<int64_t>();
             st.a2a_threads = a2a.attr("threads").cast<int>();
             st.a2a_blocks = a2a.attr("blocks").cast<int>();
             cfg.log = logger(std::move(log));
             if (given(on_shutdown)) {
               cfg.on_shutdown = [f = hold(std::move(on_shutdown))] {
                 py::gil_scoped_acquire gil;
                 (*f)();
               };
             }
             if (given(on_abort)) {
               cfg.on_abort = [f = hold(std::move(on_abort))](const std::string& why) {
                 py::gil_scoped_acquire gil;
                 (*f)(why);
               };
             }
             cfg.world = cfg.routes ? cfg.routes->world() : world;  // the table's word where there is one
             if (given(shmem_id)) {
               cfg.store = std::move(store);
               cfg.shmem_id = shmem_rpc(std::move(shmem_id));
             }
             if (given(on_split)) {
               cfg.on_split = [f = hold(std::move(on_split))](const c10::intrusive_ptr<c10d::Store>& s,
                                                              const std::vector<int>& ranks, double timeout_s,
                                                              const std::string& name) {
                 py::gil_scoped_acquire gil;
                 return c10::intrusive_ptr<c10d::Backend>(
                     (*f)(s, ranks, timeout_s, name).cast<c10::intrusive_ptr<gocomm::Backend>>());
               };
             }
             auto b = c10::make_intrusive<gocomm::Backend>(std::move(disp), std::move(cfg));
             b->user = hold(std::move(state));
             return b;
           }),
           py::arg("dispatcher"), py::arg("rank"), py::arg("size"), py::arg("handle"), py::arg("slot"),
           py::arg("counter_base"), py::arg("timeout_s"), py::arg("name"), py::arg("cuda_refusal"),
           py::arg("routes"), py::arg("knobs"), py::arg("a2a"), py::arg("log"), py::arg("on_shutdown"), py::arg("on_abort"),
           py::arg("state"), py::arg("world") = false, py::arg("store") = nullptr, py::arg("shmem_id") = py::none(),
           py::arg("on_split") = py::none())
      .def_property_readonly("state",
                             [](gocomm::Backend& b) -> py::object {
                               auto p = std::static_pointer_cast<py::object>(b.user);
                               return p ? *p : py::none();
                             },
                             "The control plane's state of this group (gocomm._backend._Group).")
      .def_property_readonly(
          "options", [](gocomm::Backend&) { return py::none(); },
          "What torch's split_group copies as a subgroup's options: none, so that split() is handed the group's own "
          "(getBackendOptions: its timeout), gocomm's settings being its GOCOMM_* variables.")
      .def_property_readonly("broken", &gocomm::Backend::broken, "The first failure of an op of this group, or None.")
      .def("mark_broken", &gocomm::Backend::mark_broken, py::arg("why"),
           "The group broke (the sidecar's report): every later call on it raises why.")
      .def_property_readonly("closed", &gocomm::Backend::closed)
      .def_property_readonly("world", [](gocomm::Backend& b) { return b.config().world; },
                             "Whether this is the default group's backend.")
      .def_property_readonly(
          "settings",
          [](gocomm::Backend& b) {
            const auto& c = b.config();
            const auto& st = c.inprocess;
            return py::dict(py::arg("cuda_refusal") = c.cuda_refusal, py::arg("ar_max") = st.ar_max,
                            py::arg("ar_stage") = st.ar_stage, py::arg("ar_oneshot") = st.ar_oneshot,
                            py::arg("ar_blocks") = st.ar_blocks, py::arg("a2av") = st.a2av,
                            py::arg("a2a_recv_bytes") = st.a2a_recv_bytes, py::arg("a2a_threads") = st.a2a_threads,
                            py::arg("a2a_blocks") = st.a2a_blocks, py::arg("moe_ll_bytes") = st.moe_ll_bytes);
          },
          "What the backend took from the sidecar at attach: the CUDA refusal and the in-process engine's settings.")
      .def(
          "a2av_path",
          [](gocomm::Backend& b, int device) { return b.engine().a2av_path(device); },
          py::call_guard<py::gil_scoped_release>(),
          "The in-process all_to_all_v path on device (set up, collectively, at the first call there), or None "
          "where the group does not take it.")
      .def(
          "ar_path", [](gocomm::Backend& b, int device) { return b.engine().ar_path(device); },
          "The in-process all_reduce path on device, or None where it is not set up there.")
      .def(
          "ll_shape",
          [](gocomm::Backend& b, int device) -> py::object {
            auto ll = b.engine().ll_path(device, gocomm::inproc::LlShape{});
            if (!ll) {
              return py::none();
            }
            const auto& s = ll->shape();
            return py::make_tuple(s.slots, s.slot_bytes, s.cslot_bytes);
          },
          "The group's low-latency MoE buffer on device, (slots a source, dispatch and combine slot bytes), or "
          "None where none is set up.")
      .def(
          "receive_buffer",
          [](gocomm::Backend& b, int device, int64_t nbytes) -> py::object {
            at::Tensor t;
            {
              py::gil_scoped_release nogil;
              t = b.engine().receive_buffer(device, nbytes);
            }
            return t.defined() ? py::cast(t) : py::none();
          },
          "Collective: nbytes (uint8) the peers' in-process all_to_all_v writes into, or None.")
      .def(
          "sidecar_broke", [](gocomm::Backend& b) { b.engine().sidecar_broke(); }, py::call_guard<py::gil_scoped_release>(),
          "The sidecar reports the group broken: in-process kernels stop waiting for peers.")
      .def(
          "_submit_raw",
          [](gocomm::Backend& b, const std::string& op, py::bytes payload,
             double track_after) -> c10::intrusive_ptr<c10d::Work> {
            std::string s = payload;
            std::vector<uint8_t> v(s.begin(), s.end());
            py::gil_scoped_release nogil;
            return b.submit_raw(op, v, track_after);
          },
          py::arg("op"), py::arg("payload"), py::arg("track_after") = -1.0,
          "A hand-made descriptor (tests): its seq is replaced. track_after >= 0: sent as CUDA ops are, "
          "the op recorded that many seconds after the descriptor went out.");

  namespace ip = gocomm::inproc;
  py::class_<ip::ArPath, std::shared_ptr<ip::ArPath>>(m, "ArPath", "A group's in-process all_reduce on one device.")
      .def_property_readonly("oneshot", &ip::ArPath::oneshot, "The largest message one-shot takes (bytes).")
      .def_property_readonly("cap", &ip::ArPath::cap, "Bytes of the message per two-shot round.")
      .def("failed", &ip::ArPath::failed, "Whether a kernel of this path gave up waiting for a peer.");
  py::class_<ip::A2Path, std::shared_ptr<ip::A2Path>>(m, "A2Path",
                                                       "A group's in-process all_to_all_v on one device.")
      .def_property_readonly("idx", &ip::A2Path::device)
      .def("failed", &ip::A2Path::failed, "Whether a kernel of this path gave up waiting for a peer.")
      .def_property_readonly("cap", &ip::A2Path::cap, "The receive buffer's bytes.")
      .def_property_readonly("outputs", &ip::A2Path::outputs, "Receive buffers: (address here, bytes).");
  m.def(
      "inprocess_launches",
      [] {
        py::list out;
        for (const auto& l : ip::launches()) {
          py::dict d;
          d["group"] = l.group;
          d["op"] = l.op;
          d["dtype"] = l.dtype;
          d["bytes"] = l.bytes;
          d["device"] = l.device;
          d["launched"] = l.launched;
          out.append(d);
        }
        return out;
      },
      "The in-process engine's last kernel launches, oldest first.");
  m.def("set_launch_capacity", &ip::set_launch_capacity, "How many launches the record keeps.");
  m.def(
      "module_why_not",
      [](const std::string& file, int device) {
        py::gil_scoped_release nogil;
        return ip::Module::get(file).why_not(device);
      },
      "Why the kernels of the package's cubin file do not run on device ('' where they do).");
  // these may warn (the module does not load): torch's wrapper makes that a Python warning
  m.def("moe_usable", torch::wrap_pybind_function_no_gil(&ip::moe::usable), py::arg("device"),
        "Whether the MoE kernels (moe.cubin) run on device; warns once where the module does not load.");
  m.def("moe_takes", torch::wrap_pybind_function_no_gil(&ip::moe::takes), py::arg("x"), py::arg("k"), py::arg("per"),
        "Whether moe.dispatch's in-process path takes x with k choices and per experts a rank (and combine of "
        "x's dtype): bf16, fp16 or fp32 rows of a multiple of 16 bytes, contiguous, on a device the kernels run on.");
  m.def(
      "moe_row_bytes", [](int64_t xbytes, int64_t k) { return ip::moe::row_layout(xbytes, k).bytes; },
      py::arg("xbytes"), py::arg("k"), "dispatch's packed row's bytes for tokens of xbytes and k choices.");
  m.def("moe_route_pack_fused", torch::wrap_pybind_function_no_gil(&ip::moe::route_pack_fused), py::arg("x"),
        py::arg("topk_idx"), py::arg("topk_weights"), py::arg("experts"), py::arg("ranks"), py::arg("sync"),
        "For the tests: moe_route_pack's outputs by the in-process dispatch's fused launch; it zeroes sync.");
  m.def("moe_group_gather_fused", torch::wrap_pybind_function_no_gil(&ip::moe::group_gather_fused), py::arg("recv"),
        py::arg("id_off"), py::arg("w_off"), py::arg("k"), py::arg("per"), py::arg("out_splits"), py::arg("xbytes"),
        py::arg("sync"),
        "For the tests: moe_group's outputs, then w_e, back and the gathered rows, by the in-process dispatch's "
        "fused launch (sync: zeroed by moe_route_pack_fused).");
  m.def("moe_flags_made", &ip::moe_flags_made, py::arg("device"),
        "Whether a padded moe.dispatch ran on device (gocomm.moe.check waits for the GPU only then).");
  m.def(
      "moe_raise_new",
      [](int device, int64_t experts) {
        const auto [overflow, msg] = ip::moe_flags_error(device, experts);
        if (overflow) {
          PyErr_SetString(PyExc_OverflowError, msg.c_str());
          throw py::error_already_set();
        }
        if (!msg.empty()) {
          throw py::value_error(msg);
        }
      },
      py::arg("device"), py::arg("experts"),
      "Raise what padded moe.dispatch calls on device found on the GPU since the last call, one error per call "
      "(the other stays for the next): OverflowError (a rank was sent more than its bound), ValueError (an id "
      "outside [-1, experts)).");
  m.def(
      "cuda_ipc_probe",
      [](int device) {
        uint8_t h[64];
        {
          py::gil_scoped_release nogil;
          c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
          gocomm::cuda::ensure_context(device);
          gocomm::cuda::ipc_handle(gocomm::cuda::mem_alloc_zeroed(1 << 20), h);  // the process exits after
        }
        return py::bytes(reinterpret_cast<const char*>(h), 64);
      },
      "The CUDA IPC handle of a fresh 1 MiB allocation on device (gocomm doctor's check).");
  py::class_<IpcCacheProbe>(m, "_IpcCacheProbe", "An IpcCache over a fake driver and ring (tests).")
      .def(py::init<>())
      .def("alloc", &IpcCacheProbe::alloc, py::arg("base"), py::arg("size"), py::arg("ipc") = true,
           "A fake allocation [base, base + size); returns its buffer id.")
      .def("map_chunks", &IpcCacheProbe::map_chunks, py::arg("base"), py::arg("size"), py::arg("count"),
           py::arg("exportable") = true,
           "count fake chunks of size bytes mapped with cuMemMap back to back from base (with a POSIX fd handle "
           "where exportable).")
      .def("sent", &IpcCacheProbe::sent, "(files the fds named, lengths) the fake sidecar got for a segment.")
      .def("refuse", &IpcCacheProbe::refuse, "Make the fake sidecar refuse registrations of chunks.")
      .def("set_hooked", &IpcCacheProbe::set_hooked, "Whether torch's allocator takes the hook (fake).")
      .def("connect", &IpcCacheProbe::connect, py::arg("path"), py::arg("session"), py::arg("token"),
           py::arg("timeout_s") = 10.0, "Send registrations of chunks over the real fd socket at path.")
      .def_readonly_static("FD_RECORD", &IpcCacheProbe::kFdRecord)
      .def("free", &IpcCacheProbe::free, "Forget the fake allocation at base (torch reports nothing).")
      .def(
          "ref",
          [](IpcCacheProbe& p, uint64_t ptr, uint64_t n) {
            py::gil_scoped_release nogil;
            auto r = p.cache().ref(ptr, n);
            return std::make_tuple(r.segment, r.offset, r.length);
          },
          "IpcCache::ref.")
      .def_static(
          "released", [](uint64_t addr, size_t size) { gocomm::IpcCache::released(addr, size); },
          "What torch's allocator hook calls for a segment it frees or unmaps: every live cache drops what the range "
          "overlaps.")
      .def("records", &IpcCacheProbe::records, "(type, segment) of every record written, in order.")
      .def("hold", &IpcCacheProbe::hold, py::call_guard<py::gil_scoped_release>(),
           "Make the ring's writers wait (a full ring) or let them go.")
      .def("flush", [](IpcCacheProbe& p, double t) { return p.cache().flush(t); },
           py::call_guard<py::gil_scoped_release>())
      .def("size", [](IpcCacheProbe& p) { return p.cache().size(); })
      .def("close", &IpcCacheProbe::close, py::call_guard<py::gil_scoped_release>());

  py::class_<BackendRef>(m, "BackendRef")
      .def(py::init([](const c10::intrusive_ptr<gocomm::Backend>& b) {
        return BackendRef{c10::weak_intrusive_ptr<gocomm::Backend>(b)};
      }))
      .def("get", [](BackendRef& r) -> c10::intrusive_ptr<gocomm::Backend> { return r.ref.lock(); },
           "The backend, or None once it is gone.");

  // gocomm.all_to_all_v's OverflowError, raised by the compiled client (a2av.h)
  gocomm::set_overflow_hook([](const std::string& msg) { throw OverflowError(msg); });
  m.def("_skip_count_exchange", &gocomm::set_count_exchange_skipped, py::arg("skip"),
        "Tests: all_to_all_v's host-count path skips its count exchange, as one that failed silently.");

  // the wire format as the client encodes it (python/tests/test_wire.py pins it to Go's)
  m.def("wire_dtype", &gocomm::wire_dtype, "The wire.DType code of a dtype (0: not carried).");
  m.def("reduce_refusal", &gocomm::reduce_refusal, py::arg("dtype"), py::arg("op"), py::arg("cuda"),
        "Why op cannot reduce dtype (on CUDA tensors if cuda), or '' where it can.");
  m.def("status_name", &gocomm::wire::status_name);
  m.def(
      "encode_desc",
      [](uint64_t seq, uint32_t group, uint8_t kind, uint8_t dtype, uint8_t redop, uint8_t device, int32_t root,
         int32_t tag, uint64_t count, uint64_t timeout_ms, uint32_t stream_value,
         const std::vector<std::tuple<uint32_t, uint64_t, uint64_t>>& bufs, const std::vector<int64_t>& splits) {
        gocomm::wire::Desc d;
        d.seq = seq, d.group = group, d.kind = kind, d.dtype = dtype, d.redop = redop, d.device = device;
        d.root = root, d.tag = tag, d.count = count, d.timeout_ms = timeout_ms, d.stream_value = stream_value;
        for (auto& [s, o, n] : bufs) {
          d.bufs.push_back(gocomm::wire::BufRef{s, o, n});
        }
        d.splits = splits;
        auto b = gocomm::wire::encode(d);
        return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
      },
      "An op descriptor as the client writes it into the ring.");
  m.def("decode_done", [](py::bytes payload) {
    std::string s = payload;
    gocomm::wire::Done d;
    if (!gocomm::wire::decode_done(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &d)) {
      throw py::value_error("a completion is at least 16 bytes");
    }
    return std::make_tuple(d.seq, d.status, d.source, d.message);
  });
  m.attr("REC_OP") = gocomm::wire::kRecOp;
  m.attr("REC_DONE") = gocomm::wire::kRecDone;
  m.attr("REC_IPC") = gocomm::wire::kRecIpc;
  m.attr("REC_IPC_DROP") = gocomm::wire::kRecIpcDrop;
  m.attr("REC_GRAPH_OP") = gocomm::wire::kRecGraphOp;
  m.attr("REC_GRAPH_DROP") = gocomm::wire::kRecGraphDrop;
  m.attr("GRAPH_OP_HEADER") = gocomm::wire::kGraphOpHeader;
  m.attr("TRIGGER_SLOTS") = gocomm::wire::kTriggerSlots;
  m.attr("TRIGGER_OFFSET") = gocomm::wire::kTriggerOffset;
  m.attr("CUDA_SEGMENT") = gocomm::wire::kCudaSegment;
  m.attr("DEVICE_HOST") = gocomm::wire::kDeviceHost;
  m.attr("DEVICE_CUDA") = gocomm::wire::kDeviceCuda;
  namespace w = gocomm::wire;
  py::dict kinds;
  for (auto [name, kind] : std::initializer_list<std::pair<const char*, uint8_t>>{
           {"ALL_REDUCE", w::kAllReduce}, {"BROADCAST", w::kBroadcast}, {"REDUCE", w::kReduce},
           {"ALL_GATHER", w::kAllGather}, {"REDUCE_SCATTER", w::kReduceScatter}, {"ALL_TO_ALL", w::kAllToAll},
           {"GATHER", w::kGather}, {"SCATTER", w::kScatter}, {"SEND", w::kSend}, {"RECV", w::kRecv},
           {"BARRIER", w::kBarrier}, {"ALL_TO_ALL_V", w::kAllToAllV}}) {
    kinds[name] = kind;
  }
  m.attr("KINDS") = kinds;
  py::dict redops;
  for (auto [name, op] : std::initializer_list<std::pair<const char*, uint8_t>>{
           {"SUM", w::kSum}, {"AVG", w::kAvg}, {"PRODUCT", w::kProduct}, {"MIN", w::kMin}, {"MAX", w::kMax},
           {"BAND", w::kBand}, {"BOR", w::kBor}, {"BXOR", w::kBxor}}) {
    redops[name] = op;
  }
  m.attr("REDOPS") = redops;
}
