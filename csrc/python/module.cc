// gocomm._C: the Python bindings of the compiled client (csrc/client), and nothing else. The
// control plane (python/gocomm) makes a Dispatcher per sidecar session and a Backend per
// group; torch calls the Backend's ops directly, never through here.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <memory>

#include "backend.h"
#include "dispatcher.h"
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

// A Work the in-process engine made in Python (a torch Work subclass): the Python object is
// kept alive with it, so that its overrides stay reachable from C++.
class HeldWork : public c10d::Work {
 public:
  HeldWork(std::shared_ptr<py::object> obj, c10::intrusive_ptr<c10d::Work> inner)
      : obj_(std::move(obj)), inner_(std::move(inner)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override { return inner_->wait(timeout); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 private:
  std::shared_ptr<py::object> obj_;
  c10::intrusive_ptr<c10d::Work> inner_;
};

// The Python state's reference to its backend, which holds the state: weak, so that the
// group's lifetime is the ProcessGroup's.
struct BackendRef {
  c10::weak_intrusive_ptr<gocomm::Backend> ref;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gocomm's compiled client: the c10d backend, the ring, the completion thread";
  py::module_::import("torch.distributed");  // registers c10d.Backend, our base class

  py::class_<gocomm::Dispatcher, std::shared_ptr<gocomm::Dispatcher>>(m, "Dispatcher")
      .def(py::init([](const std::string& ring_path, size_t ring_bytes, py::object grow, size_t first_segment,
                       py::object attach_device) {
             gocomm::Dispatcher::Config cfg;
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
             cfg.attach_device = [a](int device) {
               py::gil_scoped_acquire gil;
               return (*a)(device).cast<uint64_t>();
             };
             return std::make_shared<gocomm::Dispatcher>(std::move(cfg));
           }),
           py::arg("ring_path"), py::arg("ring_bytes"), py::arg("grow"), py::arg("first_segment"),
           py::arg("attach_device"))
      .def("fail_all", &gocomm::Dispatcher::fail_all, py::call_guard<py::gil_scoped_release>(),
           "Fail every op in flight with 'gocomm <op>: why', refuse new ones, release the stream counters.")
      .def("close", &gocomm::Dispatcher::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("lost", &gocomm::Dispatcher::lost)
      .def("pending", &gocomm::Dispatcher::pending_count)
      .def("counters", &gocomm::Dispatcher::counters, py::call_guard<py::gil_scoped_release>(),
           "The device address of the stream counters; attaches the device the first time.")
      .def("segments", [](gocomm::Dispatcher& d) { return d.arena().segments(); },
           "(id, bytes) of the host arena's segments.")
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

  py::class_<gocomm::Backend, c10d::Backend, c10::intrusive_ptr<gocomm::Backend>>(m, "Backend")
      .def(py::init([](std::shared_ptr<gocomm::Dispatcher> disp, int rank, int size, uint32_t handle, int slot,
                       std::array<uint32_t, 2> counter_base, double timeout_s, const std::string& name,
                       const std::string& cuda_refusal, bool ar_inprocess, bool a2a_inprocess, py::object inprocess,
                       py::object capturable, py::object on_shutdown, py::object on_abort, py::object state) {
             gocomm::Backend::Config cfg;
             cfg.rank = rank;
             cfg.size = size;
             cfg.handle = handle;
             cfg.slot = slot;
             cfg.counter_base = counter_base;
             cfg.timeout_s = timeout_s;
             cfg.name = name;
             cfg.cuda_refusal = cuda_refusal;
             cfg.ar_inprocess = ar_inprocess;
             cfg.a2a_inprocess = a2a_inprocess;
             if (given(inprocess)) {
               auto f = hold(std::move(inprocess));
               cfg.inprocess = [f](const std::string& op, const std::vector<at::Tensor>& ts,
                                   const std::vector<int64_t>& ints) -> c10::intrusive_ptr<c10d::Work> {
                 py::gil_scoped_acquire gil;
                 py::object w = (*f)(op, ts, ints);
                 if (w.is_none()) {
                   return {};
                 }
                 auto inner = w.cast<c10::intrusive_ptr<c10d::Work>>();
                 return c10::make_intrusive<HeldWork>(hold(std::move(w)), std::move(inner));
               };
             }
             if (given(capturable)) {
               auto f = hold(std::move(capturable));
               cfg.capturable = [f] {
                 py::gil_scoped_acquire gil;
                 return (*f)().cast<std::string>();
               };
             }
             for (auto [src, dst] : {std::pair{&on_shutdown, &cfg.on_shutdown}, std::pair{&on_abort, &cfg.on_abort}}) {
               if (given(*src)) {
                 auto f = hold(std::move(*src));
                 *dst = [f] {
                   py::gil_scoped_acquire gil;
                   (*f)();
                 };
               }
             }
             auto b = c10::make_intrusive<gocomm::Backend>(std::move(disp), std::move(cfg));
             b->user = hold(std::move(state));
             return b;
           }),
           py::arg("dispatcher"), py::arg("rank"), py::arg("size"), py::arg("handle"), py::arg("slot"),
           py::arg("counter_base"), py::arg("timeout_s"), py::arg("name"), py::arg("cuda_refusal"),
           py::arg("ar_inprocess"), py::arg("a2a_inprocess"), py::arg("inprocess"), py::arg("capturable"),
           py::arg("on_shutdown"), py::arg("on_abort"), py::arg("state"))
      .def_property_readonly("state",
                             [](gocomm::Backend& b) -> py::object {
                               auto p = std::static_pointer_cast<py::object>(b.user);
                               return p ? *p : py::none();
                             },
                             "The control plane's state of this group (gocomm._backend._Group).")
      .def_property_readonly("broken", &gocomm::Backend::broken, "The first failure of an op of this group, or None.")
      .def("mark_broken", &gocomm::Backend::mark_broken, py::arg("why"),
           "The group broke (the sidecar's report): every later call on it raises why.")
      .def_property_readonly("closed", &gocomm::Backend::closed)
      .def(
          "cuda_now",
          [](gocomm::Backend& b, const std::string& op, uint8_t kind,
             const std::vector<std::tuple<uint32_t, uint64_t, uint64_t>>& refs, std::vector<at::Tensor> keep,
             int device, uint64_t count) {
            std::vector<gocomm::wire::BufRef> bufs;
            for (auto& [s, o, n] : refs) {
              bufs.push_back(gocomm::wire::BufRef{s, o, n});
            }
            py::gil_scoped_release nogil;
            b.cuda_now(op, kind, bufs, std::move(keep), device, count);
          },
          "Hand the sidecar an op the caller's stream waits for at once (no Work).")
      .def(
          "_submit_raw",
          [](gocomm::Backend& b, const std::string& op, py::bytes payload) -> c10::intrusive_ptr<c10d::Work> {
            std::string s = payload;
            std::vector<uint8_t> v(s.begin(), s.end());
            py::gil_scoped_release nogil;
            return b.submit_raw(op, v);
          },
          "A hand-made descriptor (tests): its seq is replaced.");

  py::class_<BackendRef>(m, "BackendRef")
      .def(py::init([](const c10::intrusive_ptr<gocomm::Backend>& b) {
        return BackendRef{c10::weak_intrusive_ptr<gocomm::Backend>(b)};
      }))
      .def("get", [](BackendRef& r) -> c10::intrusive_ptr<gocomm::Backend> { return r.ref.lock(); },
           "The backend, or None once it is gone.");

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
