#include "a2av.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "backend.h"
#include "cuda_driver.h"
#include "wire.h"

namespace gocomm {
namespace {

std::mutex overflow_mu;
std::function<void(const std::string&)> overflow_hook;
std::atomic<bool> counts_skipped{false};

std::vector<int64_t> values(const at::Tensor& t) {  // a 1-D integer tensor's entries, on the host
  const at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// The arguments as gocomm.all_to_all_v documents them, for a group of n ranks.
void check(int64_t n, const at::Tensor& input, const at::Tensor& in_splits, const at::Tensor* out) {
  TORCH_CHECK_VALUE(input.dim() > 0, "gocomm all_to_all_v: input needs at least one dimension (rows)");
  TORCH_CHECK_VALUE(input.is_contiguous(), "gocomm all_to_all_v: input must be contiguous");
  const auto st = in_splits.scalar_type();
  TORCH_CHECK_VALUE((st == at::kInt || st == at::kLong) && in_splits.dim() == 1 && in_splits.size(0) == n,
                    "gocomm all_to_all_v: in_splits must be an int32/int64 tensor of " + std::to_string(n) +
                        " entries (one per rank), got " + dtype_name(st) + " of shape " +
                        shape_name(in_splits.sizes()));
  check_splits_device(input, in_splits);
  if (out == nullptr) {
    return;
  }
  const auto rows = [](const at::Tensor& t) { return shape_name(t.sizes().slice(std::min<int64_t>(1, t.dim()))); };
  TORCH_CHECK_VALUE(out->scalar_type() == input.scalar_type() && out->device() == input.device() &&
                        out->dim() == input.dim() && out->sizes().slice(1) == input.sizes().slice(1),
                    "gocomm all_to_all_v: out (" + dtype_name(out->scalar_type()) + ", " + out->device().str() +
                        ", rows " + rows(*out) + ") does not match input (" + dtype_name(input.scalar_type()) + ", " +
                        input.device().str() + ", rows " + rows(input) + ")");
  TORCH_CHECK_VALUE(out->is_contiguous(), "gocomm all_to_all_v: out must be contiguous");
}

at::Tensor rows_like(const at::Tensor& input, int64_t rows) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.at(0) = rows;
  return inproc::fresh(shape, input.options());
}

// The GPU paths' output: out, or out_rows rows, or by default input's rows times the group
// size, at most limit (what the receive buffer holds at once).
at::Tensor gpu_output(const at::Tensor& input, const at::Tensor* out, int64_t out_rows, int64_t n, int64_t limit) {
  if (out != nullptr) {
    return *out;
  }
  return rows_like(input, out_rows >= 0 ? out_rows : std::min(input.size(0) * n, limit));
}

bool capturing(int device) {
  return cuda::capture_info(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()).active;
}

// Path 1: the in-process kernel on the caller's stream; nothing waits for the GPU. A rank
// alone receives at most its own input's rows: its default output holds them all (rows that do
// not fit the receive buffer at once pass through it in rounds), as the host path's would.
std::pair<at::Tensor, at::Tensor> inprocess(Backend& b, inproc::A2Path& path, const at::Tensor& input,
                                            const at::Tensor& in_splits, const at::Tensor* out, int64_t out_rows) {
  const int64_t limit =
      b.getSize() == 1 ? input.size(0) : path.cap() / std::max<int64_t>(row_nbytes(input), 1);
  auto [o, s] = b.engine().all_to_all_v(path, input, in_splits, gpu_output(input, out, out_rows, b.getSize(), limit));
  return {o, in_splits.is_cuda() ? s : s.to(in_splits.device())};
}

// Path 2: the sidecar's NVSHMEM kernel, handed the op ordered on the caller's stream, which
// waits for it; nothing waits for the GPU. The receive buffer is the sidecar's
// (GOCOMM_A2A_RECV_MB): its kernel takes no out larger than that.
std::pair<at::Tensor, at::Tensor> nvshmem(Backend& b, const at::Tensor& input, const at::Tensor& in_splits,
                                          const at::Tensor* out, int64_t out_rows) {
  const int n = b.getSize(), idx = input.device().index();
  const int64_t row = row_nbytes(input);
  const int64_t limit = b.config().inprocess.a2a_recv_bytes / std::max<int64_t>(row, 1);
  const int64_t want = out != nullptr ? out->size(0) : out_rows;
  TORCH_CHECK_VALUE(want <= limit, "gocomm all_to_all_v: out holds " + std::to_string(want) +
                                       " rows, more than the receive buffer (" + std::to_string(limit) + " rows of " +
                                       std::to_string(row) + " bytes; raise GOCOMM_A2A_RECV_MB on every rank)");
  const at::Tensor o = gpu_output(input, out, out_rows, n, limit);
  b.nvshmem_ready(idx);
  const bool native = in_splits.scalar_type() == at::kLong && in_splits.is_cuda() && in_splits.is_contiguous();
  const at::Tensor splits = native ? in_splits : in_splits.to(input.device(), at::kLong).contiguous();
  // the output splits and the kernel's status word (after them) in one allocation, and no
  // fill: the kernel always writes both
  const at::Tensor words = at::empty({n + 1}, input.options().dtype(at::kLong));
  Dispatcher& d = *b.dispatcher();
  const auto ref = [&](const void* p, uint64_t nbytes) {
    return d.cuda_ref(reinterpret_cast<uint64_t>(p), nbytes, idx);
  };
  const auto* w = static_cast<const uint8_t*>(words.data_ptr());
  const std::vector<wire::BufRef> refs = {ref(input.data_ptr(), input.nbytes()), ref(splits.data_ptr(), n * 8),
                                          ref(o.data_ptr(), o.nbytes()), ref(w, n * 8), ref(w + n * 8, 4)};
  b.cuda_now("all_to_all_v", wire::kAllToAllV, refs, {input, splits, o, words}, idx, uint64_t(row));
  const at::Tensor got = words.narrow(0, 0, n);
  return {o, native ? got : got.to(in_splits.device(), in_splits.scalar_type())};
}

// Path 3: the counts cross the host. One all_to_all of the counts (on the data's device, as
// int64), read on the host (the sync), then one of the rows, both by the group's own
// alltoall_base (gocomm's backend where the group is gocomm's).
std::pair<at::Tensor, at::Tensor> host_counts(c10d::ProcessGroup& pg, Backend* b, const at::Tensor& input,
                                              const at::Tensor& in_splits, const at::Tensor* out, int64_t out_rows) {
  const auto exchange = [&](at::Tensor& to, at::Tensor& from, std::vector<int64_t> to_splits,
                            std::vector<int64_t> from_splits) {
    c10d::AllToAllOptions opts;
    (b != nullptr ? b->alltoall_base(to, from, to_splits, from_splits, opts)
                  : pg.alltoall_base(to, from, to_splits, from_splits, opts))
        ->wait();
  };
  const int me = pg.getRank();
  const std::vector<int64_t> send = values(in_splits);
  int64_t total = 0;
  bool bad = false;
  for (int64_t s : send) {
    bad |= s < 0 || s > input.size(0);  // each within the rows first: no sum that wraps
    total += s;
  }
  TORCH_CHECK_VALUE(!bad && total <= input.size(0), "gocomm all_to_all_v: in_splits " + list_name(send) +
                                                             " must be >= 0 and add up to at most input's " +
                                                             std::to_string(input.size(0)) + " rows");
  at::Tensor counts = at::tensor(send, at::kLong).to(input.device());
  at::Tensor got = at::full_like(counts, -1);  // an exchange that wrote nothing fails the check below
  if (!counts_skipped) {
    exchange(got, counts, {}, {});
  }
  const std::vector<int64_t> recv = values(got);
  if (recv.at(me) != send.at(me) || *std::min_element(recv.begin(), recv.end()) < 0) {
    // On CUDA a failed exchange lets the stream go on (its error comes with the next op);
    // counts that cannot be right must not size the data exchange.
    C10_THROW_ERROR(DistBackendError, "gocomm all_to_all_v: the count exchange returned " + list_name(recv) +
                                          " but this rank sent itself " + std::to_string(send[me]) +
                                          ": the exchange failed (the group's next op, or the sidecar's log, says why)");
  }
  int64_t rows = 0;
  for (int64_t r : recv) {
    rows += r;
  }
  const int64_t cap = out != nullptr ? out->size(0) : out_rows;
  const bool overflow = cap >= 0 && rows > cap;
  // out given: a view of its first rows; out_rows given: out_rows rows, the received ones
  // first, as on the other paths and in the Meta kernel (torch.compile traces that shape)
  at::Tensor output = out != nullptr && !overflow ? out->narrow(0, 0, rows)
                      : out_rows >= 0 && !overflow ? rows_like(input, out_rows)
                                                   : rows_like(input, rows);
  // rows past sum(in_splits) are not sent, as on the other paths (a padded output sent back)
  at::Tensor to = output.narrow(0, 0, rows), in = input.narrow(0, 0, total);
  exchange(to, in, recv, send);
  if (overflow) {
    raise_overflow("gocomm all_to_all_v: this rank receives " + std::to_string(rows) + " rows (" + list_name(recv) +
                   " by source rank) but out holds " + std::to_string(cap) + "; nothing was written into out");
  }
  return {output, got.to(in_splits.device(), in_splits.scalar_type())};
}

}  // namespace

void check_splits_device(const at::Tensor& input, const at::Tensor& in_splits) {
  TORCH_CHECK_VALUE(in_splits.is_cpu() || in_splits.device() == input.device(),
                    "gocomm all_to_all_v: in_splits is on " + in_splits.device().str() + ", input on " +
                        input.device().str());
}

std::pair<at::Tensor, at::Tensor> all_to_all_v_any(const at::Tensor& input, const at::Tensor& in_splits,
                                                   const at::Tensor* out, int64_t out_rows, const std::string& group) {
  TORCH_CHECK_VALUE(out_rows >= -1, "gocomm all_to_all_v: out_rows must be >= 0 (or -1: the path's default), got " +
                                        std::to_string(out_rows));
  const auto pg = c10d::resolve_process_group(group);
  auto* b = dynamic_cast<Backend*>(pg->getBackend(input.device().type()).get());
  check(pg->getSize(), input, in_splits, out);
  if (b == nullptr || !input.is_cuda()) {
    return host_counts(*pg, b, input, in_splits, out, out_rows);
  }
  const int idx = input.device().index();
  const auto& routes = b->config().routes;
  if (routes && routes->splits_on_gpu()) {
    // collective at the group's first call on the device (the kernel is set up then)
    if (auto path = b->engine().a2av_path(idx)) {
      return inprocess(*b, *path, input, in_splits, out, out_rows);
    }
    if (routes->nvshmem()) {
      if (capturing(idx)) {
        b->refuse_capture("all_to_all_v",
                          "it runs in the sidecar's NVSHMEM kernel, which is handed each call on the host");
      }
      return nvshmem(*b, input, in_splits, out, out_rows);
    }
  }
  if (capturing(idx)) {
    b->refuse_capture("all_to_all_v",
                      "its counts are read on the host to size the exchange (the group's transport is NCCL)");
  }
  return host_counts(*pg, b, input, in_splits, out, out_rows);
}

void raise_overflow(const std::string& msg) {
  std::function<void(const std::string&)> hook;
  {
    std::lock_guard<std::mutex> lock(overflow_mu);
    hook = overflow_hook;
  }
  if (hook) {
    hook(msg);  // throws
  }
  TORCH_CHECK(false, msg);
}

void set_overflow_hook(std::function<void(const std::string&)> raise) {
  std::lock_guard<std::mutex> lock(overflow_mu);
  overflow_hook = std::move(raise);
}

void set_count_exchange_skipped(bool skip) {
  counts_skipped = skip;
}

}  // namespace gocomm
