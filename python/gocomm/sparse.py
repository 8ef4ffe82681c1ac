"""All-to-all with splits known only as tensors: `gocomm.all_to_all_v`.

Three paths. Where every rank's sidecar chose NVSHMEM (auto does on a node whose GPUs all
share NVLink with peer atomics, when NVSHMEM loads; GOCOMM_TRANSPORT overrides), the rows move
one-sidedly with the splits on the GPU, no host sync: by the in-process kernel on the
caller's stream (the compiled client's engine, csrc/client/inprocess.cc, any such group), or, where that path cannot be set up or
GOCOMM_A2AV_INPROCESS=0, by the sidecar's NVSHMEM kernel (the default group only). Everywhere else
the counts are exchanged with one all_to_all, read on the host, and the rows moved with
`all_to_all_single` on the group (NCCL grouped send/recv in the sidecar for CUDA tensors,
the host engine for CPU tensors): one host sync. (`dist.all_to_all_single` of CUDA tensors,
splits known on the host, takes the in-process kernel too where it serves the group, from
the C++ backend directly.)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _backend, _capture, _client, _sidecar, _wire

__all__ = ["all_to_all_v", "receive_buffer"]

_SPLIT_DTYPES = (torch.int32, torch.int64)
# the in-process path's ops (csrc/client/ops.cc), called as overloads: the packet's call
# resolves the overload on every call
_A2AV = torch.ops.gocomm.all_to_all_v.default
_A2AV_OUT = torch.ops.gocomm.all_to_all_v_out.default


def _device_path(g, input: torch.Tensor):
    """How all_to_all_v of input on g moves rows with splits on the GPU: the in-process kernel
    (a gocomm._C.A2Path, remembered in _backend.served for the fast paths), the sidecar's
    NVSHMEM kernel (True), or not at all (None: the counts go through the host). Collective at
    a group's first call on a device (the shim's kernel is set up then), so every caller calls
    it where all ranks do."""
    st = _backend.state(g)
    routes = getattr(st, "_routes", None)
    if not input.is_cuda or routes is None or not routes.splits_on_gpu:
        return None
    idx = input.get_device()
    path = st._a2av_path(idx)
    if path is not None:
        if (g, idx) not in _backend.served:
            _backend.served[g, idx] = _backend.Served(st, g.group_name, st.size(), path.cap)
        return path
    return True if g is dist.group.WORLD else None


def _inprocess(fast: _backend.Served, input, in_splits, out):
    """all_to_all_v in the in-process kernel: one registered op (csrc/client/ops.cc), which
    checks the arguments; nothing here waits for the GPU. NotImplementedError where the kernel
    no longer serves the group (nothing was done)."""
    if out is None:  # input's rows times the group size, at most what recv holds at once
        rows = input.shape[0] if input.dim() else 0  # a 0-d input: the op raises
        row = input.element_size() * math.prod(input.shape[1:])
        out, out_splits = _A2AV(input, in_splits, min(rows * fast.size, fast.cap // max(row, 1)), fast.name)
    else:
        out_splits = _A2AV_OUT(input, in_splits, out, fast.name)
    return out, out_splits if in_splits.is_cuda else out_splits.cpu()


def _capacity_rows(row_bytes: int) -> int:
    """The most rows of row_bytes the NVSHMEM path can receive."""
    sc = _sidecar.current()
    if sc is None:
        raise RuntimeError("gocomm: no sidecar yet: the all-to-all's receive buffer is the sidecar's setting")
    return sc.a2a.recv_bytes // max(row_bytes, 1)


def _output(n, input, out, row, limit):
    """The device paths' output: out (at most limit rows), or input's rows times the group
    size (at most limit rows, what the receive buffer holds)."""
    if out is None:
        return torch.empty((min(input.shape[0] * n, limit), *input.shape[1:]), dtype=input.dtype, device=input.device)
    if out.shape[0] > limit:
        raise ValueError(
            f"gocomm all_to_all_v: out holds {out.shape[0]} rows, more than the receive buffer "
            f"({limit} rows of {row} bytes; raise GOCOMM_A2A_RECV_MB on every rank)"
        )
    return out


def _nvshmem(g, n, input, in_splits, out):
    """all_to_all_v in the sidecar's NVSHMEM kernel: nothing in it waits for the GPU. Every
    torch op and view costs tens of microseconds of host time on a loaded host, and decode
    calls this once per layer: the path makes as few as it can."""
    row = input.element_size() * math.prod(input.shape[1:])
    out = _output(n, input, out, row, _capacity_rows(row))
    g._shmem_id(input.device)
    native = in_splits.dtype == torch.int64 and in_splits.is_cuda and in_splits.is_contiguous()
    splits64 = in_splits if native else in_splits.to(input.device, torch.int64)
    # the output splits and the kernel's status word (after them) in one allocation, and no
    # fill: the kernel always writes both; the status is named by address, not by a view
    words = torch.empty(n + 1, dtype=torch.int64, device=input.device)
    idx = input.get_device()
    sc = g._sc
    wp = words.data_ptr()
    refs = [
        sc.cuda_ref(input.data_ptr(), input.numel() * input.element_size(), idx),
        sc.cuda_ref(splits64.data_ptr(), n * 8, idx),
        sc.cuda_ref(out.data_ptr(), out.numel() * out.element_size(), idx),
        sc.cuda_ref(wp, n * 8, idx),
        sc.cuda_ref(wp + n * 8, 4, idx),
    ]
    g._cuda_now("all_to_all_v", _wire.ALL_TO_ALL_V, refs, [input, splits64, out, words], idx, row)
    out_splits = words[:n]
    return out, out_splits if native else out_splits.to(device=in_splits.device, dtype=in_splits.dtype)


def _host_counts(g, input, in_splits, out):
    """all_to_all_v where the counts cross the host (NCCL, the host engine): one all_to_all of
    the counts, read on the host (the sync), then all_to_all_single of the rows."""
    send = in_splits.tolist()
    if any(s < 0 for s in send) or sum(send) != input.shape[0]:
        raise ValueError(
            f"gocomm all_to_all_v: in_splits {send} must be >= 0 and add up to input's {input.shape[0]} rows"
        )
    # The counts travel on the data's device (the group serves both), as int64.
    counts = torch.tensor(send, dtype=torch.int64, device=input.device)
    got = torch.full_like(counts, -1)  # an exchange that wrote nothing fails the check below
    dist.all_to_all_single(got, counts, group=g)
    recv = got.tolist()
    me = dist.get_rank(g)
    if recv[me] != send[me] or min(recv) < 0:
        # On CUDA a failed exchange lets the stream go on (its error comes with the next op);
        # counts that cannot be right must not size the data exchange.
        raise dist.DistBackendError(
            f"gocomm all_to_all_v: the count exchange returned {recv} but this rank sent itself {send[me]}: "
            "the exchange failed (the group's next op, or the sidecar's log, says why)"
        )
    rows = sum(recv)
    overflow = out is not None and rows > out.shape[0]
    if out is not None and not overflow:
        output = out.narrow(0, 0, rows)
    else:
        output = torch.empty((rows, *input.shape[1:]), dtype=input.dtype, device=input.device)
    dist.all_to_all_single(output, input, recv, send, group=g)
    if overflow:
        raise OverflowError(
            f"gocomm all_to_all_v: this rank receives {rows} rows ({recv} by source rank) but out holds "
            f"{out.shape[0]}; nothing was written into out"
        )
    return output, got.to(device=in_splits.device, dtype=in_splits.dtype)


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
        in_splits: int32/int64 tensor of group-size entries, the rows for each rank, on
            input's device (or the CPU).
        out: optional output buffer (same dtype, device and row shape as input); its rows
            are the capacity. A rank that would receive more rows than out holds raises
            OverflowError after the exchange and writes nothing into out; the other ranks
            are not held up.
        group: the process group (default: the world).

    Returns:
        (output, out_splits): output holds the received rows grouped by source rank (a view
        of out's first rows when out is given); out_splits, on in_splits' device with its
        dtype, says how many came from each rank. On the NVSHMEM path the host never learns
        the count: output is the whole out buffer (by default input's rows times the group
        size, at most the receive buffer, GOCOMM_A2A_RECV_MB; a given out may be larger
        where the in-process kernel runs: rows that do not fit the receive buffer at once pass
        through it in rounds; the sidecar's kernel refuses it), rows past
        sum(out_splits) are undefined, an overflow shows as sum(out_splits) > len(out) with
        nothing written instead of an OverflowError (to get the rows, every rank of the
        group repeats the call, with an out that fits where it overflowed: a call made on
        some ranks only shifts every later op), and splits that are negative or exceed
        the input make this rank send nothing (logged). Where the in-process kernel runs (the
        group's GPUs share NVLink; see the module's docstring) a call can be captured in a
        CUDA graph with its input, splits (on the GPU) and out, once the group's first call
        on that device ran outside the capture (it sets the path up, collectively); replays
        and eager calls of a group are ordered by the caller, as with torch's NCCL. The
        sidecar's kernel cannot be captured (every call hands the sidecar one op, and a
        replayed graph would not).
    """
    g = group if group is not None else dist.group.WORLD
    if isinstance(input, torch.Tensor) and isinstance(in_splits, torch.Tensor):
        # the fast path: the group's in-process kernel serves input's device (found at an
        # earlier call); the op checks the arguments
        fast = _backend.served.get((g, input.get_device()))
        if fast is not None:
            try:
                return _inprocess(fast, input, in_splits, out)
            except NotImplementedError:  # the path is gone (destroyed, broken): the others say why
                _backend.served.pop((g, input.get_device()), None)
    n = dist.get_world_size(g)
    if not isinstance(input, torch.Tensor) or not isinstance(in_splits, torch.Tensor):
        raise TypeError("gocomm all_to_all_v: input and in_splits must be tensors")
    if input.dim() == 0:
        raise ValueError("gocomm all_to_all_v: input needs at least one dimension (rows)")
    if not input.is_contiguous():
        raise ValueError("gocomm all_to_all_v: input must be contiguous")
    if in_splits.dtype not in _SPLIT_DTYPES or in_splits.shape != (n,):
        raise ValueError(
            f"gocomm all_to_all_v: in_splits must be an int32/int64 tensor of {n} entries (one per rank), "
            f"got {in_splits.dtype} of shape {tuple(in_splits.shape)}"
        )
    if in_splits.device.type != "cpu" and in_splits.device != input.device:
        raise ValueError(f"gocomm all_to_all_v: in_splits is on {in_splits.device}, input on {input.device}")
    if out is not None:
        if out.dtype != input.dtype or out.device != input.device or out.shape[1:] != input.shape[1:]:
            raise ValueError(
                f"gocomm all_to_all_v: out ({out.dtype}, {out.device}, rows {tuple(out.shape[1:])}) does not "
                f"match input ({input.dtype}, {input.device}, rows {tuple(input.shape[1:])})"
            )
        if not out.is_contiguous():
            raise ValueError("gocomm all_to_all_v: out must be contiguous")
    path = _device_path(g, input)
    if isinstance(path, _client.C.A2Path):
        return _inprocess(_backend.served[g, input.get_device()], input, in_splits, out)
    if input.is_cuda and _capture.capturing():
        _capture.refuse(
            "all_to_all_v",
            g,
            _capture.SIDECAR_NVSHMEM
            if path is True
            else "its counts are read on the host to size the exchange (the group's transport is NCCL)",
        )
    if path is True:
        return _nvshmem(_backend.state(g), n, input, in_splits, out)
    return _host_counts(g, input, in_splits, out)


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
    if not isinstance(path, _client.C.A2Path):
        return torch.empty(shape, dtype=dtype, device=dev)
    nbytes = rows * math.prod(row_shape) * torch.empty(0, dtype=dtype).element_size()
    # collective: every rank maps every rank's buffer; more than 2 GiB (the kernel's offsets
    # are 32-bit) or a rank that cannot take part gives every rank a plain tensor
    t = _backend.state(g)._ref.get().receive_buffer(path.idx, nbytes)
    if t is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    return t.view(dtype).view(shape)
