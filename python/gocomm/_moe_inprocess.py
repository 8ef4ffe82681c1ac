"""gocomm.moe where the group's exchange runs in this process (the compiled client's
all_to_all_v kernel: GPUs that share NVLink): dispatch and combine are one registered op each,
torch.ops.gocomm.moe_dispatch / moe_combine (csrc/client/moe.cc), which launch route, pack,
exchange, group and gather, and the weighted sums, the exchange back and the sums, over one
workspace. A padded dispatch reads nothing on the host; the errors it finds on the GPU are
counted in host-mapped words (gocomm._C.moe_flags_new) and raised later."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _backend, _client, _sidecar

# the ops (csrc/client/moe.cc), called as overloads: the packet's call resolves the overload
_DISPATCH = torch.ops.gocomm.moe_dispatch.default
_COMBINE = torch.ops.gocomm.moe_combine.default


@dataclass
class _InProcess:
    """dispatch's handle where the exchange runs in this process: the workspace ws (the routing
    dispatch made on the GPU) and the sizes moe_combine takes."""

    group: dist.ProcessGroup | None
    name: str  # the group's name, which the ops take
    device: int
    tokens: int
    dtype: torch.dtype
    ws: torch.Tensor
    k: int
    experts: int
    cap: int  # rows the exchange received into, at most
    y_rows: int  # rows combine's y has (dispatch's output)
    recv_rows: int  # rows combine sends back, at most
    send_rows: int  # rows this rank sent, at most (combine receives as many)
    send_splits: list[int] | None = None  # known after a dispatch that synced
    recv_splits: list[int] | None = None


def _capacity_rows(row_bytes: int) -> int:
    """The most rows of row_bytes the sidecar's all-to-all receive buffer holds."""
    sc = _sidecar.current()
    if sc is None:
        raise RuntimeError("gocomm: no sidecar yet: the all-to-all's receive buffer is the sidecar's setting")
    return sc.a2a.recv_bytes // max(row_bytes, 1)


def _device_path(g, x: torch.Tensor):
    """How dispatch's exchange of x on g moves rows with splits on the GPU: the in-process
    kernel (a gocomm._C.A2Path, remembered in _backend.served for dispatch's fast path), the
    sidecar's NVSHMEM kernel (True), or not at all (None: the counts go through the host), as
    gocomm.all_to_all_v chooses (csrc/client/a2av.cc). Collective at a group's first call on a
    device (the kernel is set up then), so every caller calls it where all ranks do."""
    st = _backend.state(g)
    routes = getattr(st, "_routes", None)
    if not x.is_cuda or routes is None or not routes.splits_on_gpu:
        return None
    idx = x.get_device()
    path = st._a2av_path(idx)
    if path is not None:
        if (g, idx) not in _backend.served:
            _backend.served[g, idx] = _backend.Served(st, g.group_name, st.size(), path.cap)
        return path
    return True if g is dist.group.WORLD else None


def raise_new(device: int, experts: int) -> None:
    """Raise for what padded dispatches on device found on the GPU since the last call (once
    each, one per call)."""
    got = _client.C.moe_flags_new(device)
    if got == 2:
        raise OverflowError(
            "gocomm moe: a padded dispatch on this device was sent more tokens than max_tokens_per_rank x "
            "group size; it received none, and its combine sent nothing back (a rank dispatched more than "
            "the bound)"
        )
    if got == 1:
        raise ValueError(
            f"gocomm moe: a padded dispatch on this device had topk_idx outside [-1, {experts}) "
            "(those entries were sent nowhere)"
        )


def _dispatch_inprocess(group, fast: _backend.Served, x, topk_idx, topk_weights, experts: int, cap: int, padded: bool):
    """dispatch where the exchange is the in-process kernel: one op, which checks the arguments
    and converts topk_idx / topk_weights where they are not int64 / float32 on x's device; no
    host sync when padded (else one, in the op, to size the output). cap: the rows the exchange
    takes. NotImplementedError where the kernels do not take x, or no longer serve the group
    (nothing was done)."""
    n = fast.size
    out, tpe, ws, counts = _DISPATCH(x, topk_idx, topk_weights, experts, n, cap, padded, fast.name)
    t, k = x.shape[0], topk_idx.shape[1]
    hd = _InProcess(group, fast.name, x.get_device(), t, x.dtype, ws, k, experts, cap, cap * k, cap, t * min(n, k))
    if padded:
        return out, tpe, hd
    counts = counts.tolist()
    send, bad, recv_n = counts[:n], counts[n + 1], counts[n + 2 : 2 * n + 2]
    if bad:
        lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
        raise ValueError(
            f"gocomm moe.dispatch: topk_idx must be in [-1, {experts}), got {lo}..{hi} "
            "(those entries were sent nowhere)"
        )
    if sum(recv_n) > cap:  # the exchange wrote nothing
        raise OverflowError(
            f"gocomm moe.dispatch: this rank is sent {sum(recv_n)} tokens ({recv_n} by source rank), more than "
            f"max_tokens_per_rank x group size = {cap}; nothing was received"
        )
    hd.y_rows, hd.recv_rows, hd.send_rows = counts[2 * n + 2], counts[2 * n + 3], counts[n]
    hd.send_splits, hd.recv_splits = send, recv_n
    return out, tpe, hd


def _combine_inprocess(y: torch.Tensor, hd: _InProcess) -> torch.Tensor:
    """combine after _dispatch_inprocess: one op (the expert side's weighted sums, the exchange
    back, the token side's sums) from the routing dispatch left on the GPU; no sync."""
    if y.dim() != 2 or y.shape[0] != hd.y_rows:
        raise ValueError(f"gocomm moe.combine: y must be [{hd.y_rows}, hidden] (dispatch's rows), got {tuple(y.shape)}")
    if y.dtype != hd.dtype or y.get_device() != hd.device:
        raise ValueError(
            f"gocomm moe.combine: y must be {hd.dtype} on cuda:{hd.device} like dispatch's x, got {y.dtype} on {y.device}"
        )
    # the op checks the rest (rows of a multiple of 16 bytes)
    out = _COMBINE(y, hd.ws, hd.tokens, hd.cap, hd.k, hd.experts, hd.recv_rows, hd.send_rows, hd.name)
    if hd.send_splits is None:  # padded: what the GPU found, after this pair's last exchange
        raise_new(hd.device, hd.experts)
    return out
