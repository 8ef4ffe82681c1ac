"""All-to-all with splits known only as tensors: `gocomm.all_to_all_v`.

Three paths, all in the compiled client (csrc/client/a2av.cc; the registered ops
torch.ops.gocomm.all_to_all_v / all_to_all_v_out, csrc/client/ops.cc, serve CPU and CUDA
tensors): this module only names the group. Where every rank's sidecar chose NVSHMEM (auto
does on a node whose GPUs all share NVLink with peer atomics, when NVSHMEM loads;
GOCOMM_TRANSPORT overrides), or the group has one rank (unless GOCOMM_TRANSPORT=nccl), the
rows move one-sidedly with the splits on the GPU, no host sync: by the in-process kernel on
the caller's stream (the compiled client's engine, csrc/client/inprocess.cc, any such
group), or, where that path cannot be set up or
GOCOMM_A2AV_INPROCESS=0, by the sidecar's NVSHMEM kernel (the default group only). Everywhere
else the counts are exchanged with one all_to_all, read on the host, and the rows moved with
a second on the group (NCCL grouped send/recv in the sidecar for CUDA tensors, the host engine
for CPU tensors): one host sync. (`dist.all_to_all_single` of CUDA tensors, splits known on
the host, takes the in-process kernel too where it serves the group, from the C++ backend
directly.)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _backend, _capture, _client, _sidecar

__all__ = ["all_to_all_v", "receive_buffer"]

# the ops (csrc/client/ops.cc), called as overloads: the packet's call resolves the overload
# on every call
_A2AV = torch.ops.gocomm.all_to_all_v.default
_A2AV_OUT = torch.ops.gocomm.all_to_all_v_out.default


def all_to_all_v(
    input: torch.Tensor,
    in_splits: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send input's rows to every rank of group by in_splits; receive theirs.

    Args:
        input: rows to send, grouped by destination rank (rank 0's rows first); any shape
            with at least one dimension, contiguous.
        in_splits: int32/int64 tensor of group-size entries, the rows for each rank (rows past
            their sum are not sent), on input's device or the CPU (not compiled with CUDA input).
        out: optional output buffer (same dtype, device and row shape as input); its rows
            are the capacity. A rank that would receive more rows than out holds raises
            OverflowError after the exchange and writes nothing into out; the other ranks
            are not held up.
        group: the process group (default: the world).

    Returns:
        (output, out_splits): output holds the received rows grouped by source rank (a view of out's first
        rows when out is given); out_splits, on in_splits' device with its dtype, says how many came from
        each rank. Where the splits stay on the GPU the host never learns the count: output is the whole out
        buffer (by default input's rows times the group size, at most the receive buffer,
        GOCOMM_A2A_RECV_MB, except on a group of one rank; out may be larger where the in-process kernel
        runs, which passes rows through the buffer in rounds; the sidecar's kernel refuses it), rows past
        sum(out_splits) are undefined, an overflow shows as sum(out_splits) > len(out) with nothing written
        instead of an OverflowError (to get the rows, every rank of the group repeats the call, with an out
        that fits where it overflowed: a call made on some ranks only shifts every later op), and splits
        that are negative or exceed the input make this rank send nothing (logged). Where the in-process
        kernel runs (the group's GPUs share NVLink, or it has one rank; see the module's docstring) a call
        can be captured in a CUDA graph with its input, splits (on the GPU) and out, once the group's first
        call on that device ran outside the capture (it sets the path up, collectively); replays and eager
        calls of a group are ordered by the caller, as with torch's NCCL. The sidecar's kernel cannot be
        captured (every call hands the sidecar one op, and a replayed graph would not). Differentiable
        (without out): the backward sends the output's gradient back by out_splits, a collective every rank
        must run.
    """
    # one op call: the op checks the arguments and picks the path (csrc/client/a2av.cc)
    name = (group if group is not None else dist.group.WORLD).group_name
    try:
        if out is None:
            return _A2AV(input, in_splits, -1, name)
        return _A2AV_OUT(input, in_splits, out, name)
    except RuntimeError:
        if not isinstance(input, torch.Tensor) or not isinstance(in_splits, torch.Tensor):
            raise TypeError("gocomm all_to_all_v: input and in_splits must be tensors") from None
        raise


def _capacity_rows(x: torch.Tensor, k: int) -> int:
    """The most rows of x's tokens (top-k k) the sidecar's all-to-all receive buffer holds (gocomm.moe)."""
    sc = _sidecar.current()
    if sc is None:
        raise RuntimeError("gocomm: no sidecar yet: the all-to-all's receive buffer is the sidecar's setting")
    return sc.a2a.recv_bytes // max(_client.C.moe_row_bytes(x.shape[1] * x.element_size(), k), 1)


def _device_path(g, x: torch.Tensor):
    """How gocomm.moe's exchange of x on g moves rows with splits on the GPU, as all_to_all_v
    chooses (csrc/client/a2av.cc): the in-process kernel (a gocomm._C.A2Path, remembered in
    _backend.served for moe.dispatch's fast path), the sidecar's NVSHMEM kernel (True), or not
    at all (None: the counts go through the host). Collective at a group's first call on a
    device (the kernel is set up then), so every caller calls it where all ranks do."""
    st = _backend.state(g)
    routes = getattr(st, "_routes", None)
    if not x.is_cuda or routes is None or not routes.splits_on_gpu:
        return None
    idx = x.get_device()
    path = st._a2av_path(idx)
    if path is not None:
        if (g, idx) not in _backend.served:
            _backend.served[g, idx] = _backend.Served(st, g.group_name, st.size())
        return path
    return True if routes.nvshmem else None


def receive_buffer(
    rows: int,
    row_shape: tuple[int, ...] = (),
    dtype: torch.dtype = torch.bfloat16,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A tensor that all_to_all_v on group receives into with no copy: where the shim's kernel
    serves the group, the peers write their rows straight into it, where into any other out
    they write into a receive buffer that this rank then copies out of (about 15% of the
    time of a prefill-sized exchange on H200s). Pass it, or a view of it, as out, call after
    call (as torch's all_to_all_vdev wants symmetric memory). Elsewhere it is a plain
    torch.empty, so code that uses it runs on every transport.

    Collective: every rank of group calls it at the same point (the ranks map each other's
    buffers), outside any CUDA graph capture. If any rank asks for more than 2 GiB, every
    rank gets a plain tensor. Each rank may ask for a different number of rows. The memory is outside torch's
    allocator and stays for the life of the process; at most 16 per group and device.

    Args:
        rows: rows it holds (the receive capacity when passed as out).
        row_shape: each row's shape.
        dtype: the rows' dtype.
        group: the process group (default: the world).
        device: the CUDA device (default: the current one).

    Returns:
        An uninitialized tensor of shape (rows, *row_shape).
    """
    g = group if group is not None else dist.group.WORLD
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda" or rows < 0:
        raise ValueError(f"gocomm receive_buffer: needs a CUDA device and rows >= 0, got {dev} and {rows}")
    shape = (rows, *row_shape)
    if _capture.capturing():
        raise RuntimeError(
            "gocomm receive_buffer: collective setup (the ranks map each other's buffers); call it before capturing"
        )
    path = _device_path(g, torch.empty(0, dtype=dtype, device=dev))
    if path is None or path is True:
        return torch.empty(shape, dtype=dtype, device=dev)
    nbytes = rows * math.prod(row_shape) * torch.empty(0, dtype=dtype).element_size()
    # collective: every rank maps every rank's buffer; more than 2 GiB (the kernel's offsets
    # are 32-bit) or a rank that cannot take part gives every rank a plain tensor
    t = _backend.state(g)._ref.get().receive_buffer(dev.index, nbytes)
    if t is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    return t.view(dtype).view(shape)
