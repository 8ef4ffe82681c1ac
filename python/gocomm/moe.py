"""Mixture-of-Experts token exchange: `dispatch` sends each token once to every rank that
holds one of its top-k experts and groups what arrives by local expert; `combine` sends the
experts' outputs back and sums them, weighted, in the original token order.

    recv, tokens_per_expert, handle = gocomm.moe.dispatch(x, topk_idx, topk_weights, num_experts)
    y = run_local_experts(recv, tokens_per_expert)          # rows grouped by local expert
    out = gocomm.moe.combine(y, handle)                     # [tokens, hidden], x's dtype

Experts are spread evenly: rank r holds experts [r * E/n, (r+1) * E/n). A token whose k
experts live on two ranks is sent twice, once per rank (deduplicated per rank, as DeepEP
does), and appears on the receiving rank once per local expert it chose. topk_idx entries of
-1 choose nothing.

Each token travels once per destination rank with its routing (local expert ids and weights)
in the same row: one `gocomm.all_to_all_v` per dispatch, one per combine. On CUDA, gocomm's
own kernels (kernels/inprocess/moe.cu, launched on the caller's stream) route and pack the tokens, group
what arrives by expert, and do combine's weighted sums; elsewhere, and for fp8, torch ops do.

Where the group's exchange is the in-process kernel (the compiled client's: GPUs that share
NVLink; this path is one registered op per call, torch.ops.gocomm.moe_dispatch / moe_combine
of the compiled client, csrc/client/moe.cc), dispatch is three launches over one workspace (up to
1024 tokens: route and pack fused, the exchange, group and gather fused; padded=False groups and
gathers apart, around its sync), and combine three launches (weighted sums per received token,
exchange back, sums per token) from what dispatch left on the GPU. dispatch reads the
counts on the host once, to size its output; with padded=True it never does (its output has
the most rows max_tokens_per_rank allows), so dispatch and combine can be captured in one
CUDA graph. Elsewhere (NCCL, the sidecar's NVSHMEM kernel, the host engine) the counts cross
the host once more, as all_to_all_v needs; there the kernels run as three other ops of the
compiled client around the exchange (torch.ops.gocomm.moe_route_pack, moe_group and moe_wsum,
csrc/client/moe_kernels.cc, where every kernel's launch shape lives once for both paths).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _backend, _capture, _client
from ._moe_inprocess import _combine_inprocess, _dispatch_inprocess, _InProcess, raise_new
from .sparse import _capacity_rows, _device_path, all_to_all_v

__all__ = ["Handle", "check", "combine", "dispatch"]

FP8_BLOCK = 128  # channels per scale in fp8 dispatch
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class Handle:
    """What combine needs to send the experts' outputs back (opaque to callers)."""

    group: dist.ProcessGroup | None
    tokens: int  # tokens on this rank (rows of x)
    dtype: torch.dtype
    send_order: torch.Tensor  # [S] token index of each row sent, grouped by destination rank
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    rows: torch.Tensor  # [N] received row of each grouped row
    weights: torch.Tensor  # [N] float32 weight of each grouped row
    sums: tuple | None = None  # combine's sums as (terms, offsets) pairs, made on first use
    padded_rows: int = 0  # rows of a padded dispatch's output (combine takes y of that many)


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    *,
    group: dist.ProcessGroup | None = None,
    fp8: bool = False,
    max_tokens_per_rank: int | None = None,
    padded: bool = False,
):
    """Send tokens to the ranks of their experts; group what arrives by local expert.

    Args:
        x: [T, H] tokens (bf16 typically), contiguous.
        topk_idx: [T, K] integer expert ids in [0, num_experts), or -1 for none.
        topk_weights: [T, K] weights (any float dtype), used by combine.
        num_experts: total experts; a multiple of the group size.
        group: the process group (default: the world).
        fp8: send float8_e4m3fn values with one float32 scale per FP8_BLOCK channels
            (H must be a multiple of FP8_BLOCK); the received tokens are returned as
            (values, scales) for an fp8 expert GEMM.
        max_tokens_per_rank: the most tokens any rank of the group dispatches; it bounds
            what this rank can receive (each token comes at most once per rank). On the
            NVSHMEM path, where nothing learns the counts before the exchange, it sizes the
            receive buffer; without it the buffer is the sidecar's whole receive capacity
            (GOCOMM_A2A_RECV_MB). A rank that is sent more raises OverflowError.
        padded: no host sync (needs max_tokens_per_rank): recv has its most rows,
            max_tokens_per_rank x group size x k, expert e's tokens at rows
            sum(tokens_per_expert[:e]) onwards and rows past their total undefined, so
            shapes do not depend on the routing and the call can be captured in a CUDA graph
            (once a first call ran outside the capture: it sets the group's exchange up).
            combine then takes y of that many rows. Where the group's all-to-all runs in
            this process (its GPUs share NVLink; see gocomm.all_to_all_v), nothing waits for
            the GPU. An id out of range (sent nowhere), or more tokens sent to a rank than
            its bound (that rank receives none, and combine's sums of the tokens sent to it
            are undefined), is found on the GPU and raises ValueError / OverflowError at the
            end of a later combine of a padded dispatch on that rank's device (after that
            combine's exchange, so no peer is left waiting), or in gocomm.moe.check(), which
            waits for the GPU first. Elsewhere the result is the same, after one sync, and
            such errors raise in dispatch.

    Returns:
        (recv, tokens_per_expert, handle): recv holds the received tokens grouped by local
        expert (expert 0's first), one row per (token, local expert) pair, or a pair
        (fp8 values [N, H], scales [N, H / FP8_BLOCK]) with fp8; tokens_per_expert is an
        int64 tensor of E/n counts on x's device; handle is for combine.
    """
    g = group if group is not None else dist.group.WORLD
    if padded and not fp8 and max_tokens_per_rank is not None:
        # the fast path: the group's in-process kernels serve x's device (found at an earlier
        # dispatch); the op checks the arguments and converts topk_idx / topk_weights
        fast = _backend.served.get((g, x.get_device()))
        if fast is not None and fast.moe:
            try:
                return _dispatch_inprocess(
                    group, fast, x, topk_idx, topk_weights, num_experts, max_tokens_per_rank * fast.size, True
                )
            except NotImplementedError:  # the kernels do not take x (dtype, alignment), or the path is gone
                _backend.served.pop((g, x.get_device()), None)
    n = dist.get_world_size(g)
    if x.dim() != 2:
        raise ValueError(f"gocomm moe.dispatch: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    t, h = x.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != t or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"gocomm moe.dispatch: topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [{t}, k]"
        )
    if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
        raise TypeError(f"gocomm moe.dispatch: topk_idx must hold integers, got {topk_idx.dtype}")
    if num_experts <= 0 or num_experts % n:
        raise ValueError(f"gocomm moe.dispatch: {num_experts} experts do not spread evenly over {n} ranks")
    if fp8 and h % FP8_BLOCK:
        raise ValueError(f"gocomm moe.dispatch: fp8 needs hidden ({h}) to be a multiple of {FP8_BLOCK}")
    if padded and max_tokens_per_rank is None:
        raise ValueError("gocomm moe.dispatch: padded needs max_tokens_per_rank (it sizes the output)")
    if max_tokens_per_rank is not None and max_tokens_per_rank < t:
        raise ValueError(f"gocomm moe.dispatch: max_tokens_per_rank {max_tokens_per_rank} < this rank's {t} tokens")
    dev = x.device
    k = topk_idx.shape[1]
    idx = topk_idx.to(device=dev, dtype=torch.int64).contiguous()
    w32 = topk_weights.to(device=dev, dtype=torch.float32).contiguous()
    per = num_experts // n
    path = _device_path(g, x)  # collective at the group's first call on x's device
    inprocess = isinstance(path, _client.C.A2Path) and not fp8 and _client.C.moe_takes(x, k, per)
    if not (inprocess and padded) and x.is_cuda and _capture.capturing():
        _capture.refuse(
            "moe.dispatch",
            g,
            "without padded=True it reads the counts on the host to size its output"
            if inprocess
            else "on this group (or with fp8, or this shape) its exchange reads the counts on the host",
        )
    if inprocess:
        fast = _backend.served[g, x.get_device()]
        fast.moe = True  # the kernels run on x's device: later padded calls take the fast path
        if max_tokens_per_rank is not None:
            cap = max_tokens_per_rank * n  # rows the exchange takes
        else:
            cap = _capacity_rows(_client.C.moe_row_bytes(h * x.element_size(), k))
        return _dispatch_inprocess(group, fast, x, idx, w32, num_experts, cap, padded)
    recv, tokens_per_expert, handle = _dispatch(
        group, g, path is not None, x, idx, w32, num_experts, n, fp8, max_tokens_per_rank
    )
    if not padded:
        return recv, tokens_per_expert, handle
    # the same shapes as where nothing syncs: the most rows, the grouped ones first
    handle.padded_rows = max_tokens_per_rank * n * k
    got = recv if fp8 else (recv,)
    padded_parts = []
    for part in got:
        full = part.new_empty((handle.padded_rows, *part.shape[1:]))
        full[: part.shape[0]] = part
        padded_parts.append(full)
    return (tuple(padded_parts) if fp8 else padded_parts[0]), tokens_per_expert, handle


def _dispatch(group, g, nv: bool, x, idx, w32, num_experts: int, n: int, fp8: bool, max_tokens_per_rank):
    """dispatch where the group's exchange is not the in-process kernel (NCCL, the sidecar's
    NVSHMEM kernel, the host engine), or the kernels do not take x: one host sync."""
    t, h = x.shape
    dev = x.device
    k = idx.shape[1]
    per = num_experts // n
    # the compiled client's op ([] where the kernels do not take x: torch ops route it)
    routed = torch.ops.gocomm.moe_route_pack(x, idx, w32, num_experts, n) if x.is_cuda and not fp8 else []
    if routed:
        # Two kernels route and pack on the GPU; ids out of range choose nothing there and
        # raise after the exchange (every rank takes part in it, so none is left waiting).
        payload, meta, send_order, t_idx, t_offs = routed
        parts = [x[:0], idx[:0].to(torch.int32), w32[:0]]  # the row layout: x, local ids, weights
        offs = _layout(parts)[0]
        send_splits = meta[:n]
    else:
        payload, send_splits, send_order, parts, offs = _route_torch(x, idx, w32, num_experts, n, fp8)
        meta = None
    out = None
    if max_tokens_per_rank is not None:
        out = payload.new_empty((max_tokens_per_rank * n, payload.shape[1]))
    elif nv:
        out = payload.new_empty((_capacity_rows(payload.shape[1]), payload.shape[1]))
    if meta is not None and not nv:
        m = meta.tolist()  # NCCL and the host engine read the splits on the host anyway
        payload, send_splits = payload[: m[n]], torch.tensor(m[:n], dtype=torch.int64)
    recv_p, recv_t = all_to_all_v(payload, send_splits, group=g, out=out)
    recv_t = recv_t.to(dev, torch.int64)
    # Routed on the GPU: grouped by expert there too, before the one read of the counts.
    grouped = torch.ops.gocomm.moe_group(recv_p, offs[1], offs[2], k, per, recv_t) if meta is not None else []
    first = [meta, recv_t] if meta is not None else [send_splits, recv_t]
    counts = torch.cat([*first, grouped[-1]] if grouped else first).tolist()
    if meta is not None:
        send, recv, bad = counts[:n], counts[n + 2 : 2 * n + 2], counts[n + 1]
        send_order = send_order[: counts[n]]
        if bad:
            lo, hi = torch.stack(torch.aminmax(idx)).tolist()
            raise ValueError(
                f"gocomm moe.dispatch: topk_idx must be in [-1, {num_experts}), got {lo}..{hi} "
                "(those entries were sent nowhere)"
            )
    else:
        send, recv = counts[:n], counts[n:]
    if sum(recv) > recv_p.shape[0]:  # the NVSHMEM path reports overflow in the counts
        raise OverflowError(
            f"gocomm moe.dispatch: this rank is sent {sum(recv)} tokens ({recv} by source rank), more than "
            f"max_tokens_per_rank x group size = {recv_p.shape[0]}; nothing was received"
        )
    rows = sum(recv)
    if grouped:
        # After the sync every torch op and view is host time nobody overlaps (tens of us each
        # on a loaded host): only the x part of the received rows is cut out, and the
        # kernels read the other buffers through their offsets.
        pairs = counts[-2]
        g_rows, g_w, tokens_per_expert, e_idx, e_offs, _ = grouped
        rows_sorted, weights = g_rows[:pairs], g_w[:pairs]
        sums = (e_idx[:pairs], e_offs[: rows + 1], t_idx, t_offs)  # t_idx: read within t_offs only
        got = [_unpack(recv_p, offs[0], parts[0], rows=False)]
    else:
        recv_p = recv_p[:rows]
        got = [_unpack(recv_p, off, p) for off, p in zip(offs, parts, strict=True)]
        rows_sorted, weights, tokens_per_expert = _group_torch(got[-2], got[-1], per)
        sums = None
    handle = Handle(
        group=group,
        tokens=t,
        dtype=x.dtype,
        send_order=send_order,
        send_splits=send,
        recv_splits=recv,
        rows=rows_sorted,
        weights=weights,
        sums=sums,
    )
    if fp8:
        return (got[0][rows_sorted], got[1][rows_sorted]), tokens_per_expert, handle
    return got[0][rows_sorted], tokens_per_expert, handle


def check(device: torch.device | int | None = None, num_experts: int = 0) -> None:
    """Wait for device's queued work (default: the current device), then raise what padded
    dispatches there found on the GPU and no combine has raised yet: OverflowError (a rank
    was sent more tokens than its bound) or ValueError (ids out of range). Host-only: no
    collective, so a rank may call it alone (once a step, say)."""
    if not torch.cuda.is_initialized():  # no padded dispatch on the GPU path in this process
        return
    dev = torch.device("cuda", device) if isinstance(device, int) else device
    idx = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
    if _client.C.moe_flags_made(idx):  # a padded dispatch ran there
        torch.cuda.synchronize(idx)
        raise_new(idx, num_experts)


def _group_torch(recv_local: torch.Tensor, recv_w: torch.Tensor, per: int):
    """dispatch's grouping by expert in torch ops (one more sync, a nonzero): (the received
    row of each grouped row, its weight, tokens per expert)."""
    recv_local = recv_local.long()
    r_rows, r_k = (recv_local >= 0).nonzero(as_tuple=True)
    experts = recv_local[r_rows, r_k]
    order = torch.argsort(experts * max(1, recv_local.shape[0]) + r_rows, stable=True)
    tokens_per_expert = torch.zeros(per, dtype=torch.int64, device=recv_local.device).index_add_(
        0, experts, torch.ones_like(experts)
    )  # bincount would sync for the largest id
    return r_rows[order], recv_w[r_rows, r_k][order], tokens_per_expert


def _route_torch(x, idx, w32, num_experts: int, n: int, fp8: bool):
    """dispatch's routing and packing in torch ops (CPU tensors, fp8, rows the kernels do not
    take): (payload, send_splits, send_order, parts, offsets). Syncs once (a nonzero)."""
    t, h = x.shape
    dev, per = x.device, num_experts // n
    # Only ops that need no host sync until the one nonzero: a token's destinations as a
    # [T, n] mask, filled by scatter (a boolean index would sync twice); entries out of
    # range choose nothing here and raise below.
    ok = (idx >= 0) & (idx < num_experts)
    dest = torch.where(ok, idx // per, n)  # [T, K] rank of each chosen expert; n = none
    hit = torch.zeros(t, n + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :n]
    send_splits = hit.sum(0)
    bounds = torch.stack(torch.aminmax(idx)) if idx.numel() else None
    pairs = hit.t().nonzero()  # (rank, token), by rank then token: the sync
    if bounds is not None:
        lo, hi = bounds.tolist()  # already computed: a copy, not a wait
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"gocomm moe.dispatch: topk_idx must be in [-1, {num_experts}), got {lo}..{hi}")
    send_order = pairs[:, 1]
    dest_rows = pairs[:, 0].unsqueeze(1)
    mine = dest[send_order] == dest_rows
    local = torch.where(mine, idx[send_order] - dest_rows * per, -1).to(torch.int32)
    wts = torch.where(mine, w32[send_order], 0.0)
    # One exchange moves each token with its routing (local expert ids and weights) in the
    # same row, so the receiver needs no second exchange and no counts beforehand.
    if fp8:
        blocks = x[send_order].float().view(-1, h // FP8_BLOCK, FP8_BLOCK)
        scale = blocks.abs().amax(dim=2).clamp(min=1e-12) / _FP8_MAX  # [S, H/128]
        q = (blocks / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(-1, h)
        parts = [q, scale, local, wts]
    else:
        parts = [x[send_order], local, wts]
    payload, offs = _pack(parts)
    return payload, send_splits, send_order, parts, offs


_ALIGN = 16  # bytes: every part of a packed row starts aligned for any dtype


def _layout(parts: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each part's byte offset in a packed row, and the row's size: it depends on the parts'
    row shapes and dtypes only, so every rank (whatever its rows) packs the same way."""
    offs, at = [], 0
    for p in parts:
        offs.append(at)
        at += -(-(math.prod(p.shape[1:]) * p.element_size()) // _ALIGN) * _ALIGN
    return offs, at


def _pack(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """[S, ...] tensors side by side as one [S, row] uint8 tensor (_layout); returns it and
    each part's byte offset in a row."""
    rows = parts[0].shape[0]
    offs, row = _layout(parts)
    out = torch.empty(rows, row, dtype=torch.uint8, device=parts[0].device)
    for off, p in zip(offs, parts, strict=True):
        flat = p.reshape(rows, math.prod(p.shape[1:]))
        out[:, off : off + flat.shape[1] * p.element_size()] = flat.view(torch.uint8)
    return out, offs


def _unpack(buf: torch.Tensor, off: int, like: torch.Tensor, rows: bool = True) -> torch.Tensor:
    """The part of buf's rows at byte offset off, shaped and typed like like's rows (rows=False:
    a 2-D like, whose rows need no reshape)."""
    width = math.prod(like.shape[1:]) * like.element_size()
    part = buf[:, off : off + width].view(like.dtype)
    return part.reshape(buf.shape[0], *like.shape[1:]) if rows or like.dim() != 2 else part


def _move(t: torch.Tensor, send: list[int], recv: list[int], g) -> torch.Tensor:
    """all_to_all_single of t's rows with counts both sides already know."""
    out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_to_all_single(out, t, recv, send, group=g)
    return out


def combine(y: torch.Tensor, handle: Handle) -> torch.Tensor:
    """Send the experts' outputs back and sum them, weighted, per original token.

    Args:
        y: [N, H] the experts' outputs, in the order dispatch returned the tokens.
        handle: dispatch's handle.

    Returns:
        [T, H] in the dtype dispatch's x had: for each token, the sum over its top-k choices
        of weight times that expert's output (float32 accumulation, one rounding per rank
        that held some of its experts, one at the end). On CUDA, with y in x's dtype (bf16,
        fp16 or fp32, rows a multiple of 16 bytes), both sums run in gocomm's kernel, in a
        fixed order (the same result every time); elsewhere in torch ops.
    """
    if isinstance(handle, _InProcess):
        return _combine_inprocess(y, handle)
    rows_y = handle.padded_rows or handle.rows.shape[0]
    if y.dim() != 2 or y.shape[0] != rows_y:
        raise ValueError(f"gocomm moe.combine: y must be [{rows_y}, hidden] (dispatch's rows), got {tuple(y.shape)}")
    if handle.padded_rows:
        y = y[: handle.rows.shape[0]]
    h = y.shape[1]
    dev = y.device
    g = handle.group if handle.group is not None else dist.group.WORLD
    rows = sum(handle.recv_splits)
    if y.is_cuda and y.dtype == handle.dtype and _client.C.moe_usable(y.device.index):
        # Two launches of one kernel (the compiled client's op; [] where it does not take the
        # rows), each reading its input once: every received token's expert rows weighted and
        # summed (float32, one rounding), sent back, then every token's partial sums added up
        # in rank order.
        e_idx, e_offs, t_idx, t_offs = _sums_of(handle, rows, dev)
        partial = torch.ops.gocomm.moe_wsum(y.contiguous(), e_idx, handle.weights[e_idx], e_offs, rows)
        if partial:
            back = _move(partial[0], handle.recv_splits, handle.send_splits, g)
            out = torch.ops.gocomm.moe_wsum(back, t_idx, None, t_offs, handle.tokens)
            if out:
                return out[0]
    partial = torch.zeros(rows, h, dtype=torch.float32, device=dev)
    partial.index_add_(0, handle.rows, y.float().mul_(handle.weights.unsqueeze(1)))
    back = _move(partial.to(handle.dtype), handle.recv_splits, handle.send_splits, g)
    out = torch.zeros(handle.tokens, h, dtype=torch.float32, device=dev)
    out.index_add_(0, handle.send_order, back.float())
    return out.to(handle.dtype)


def _sums_of(handle: Handle, rows: int, dev: torch.device):
    """The two sums of combine as (terms, offsets) pairs, made once per handle: the grouped
    rows of each received row (by expert), and the rows sent back for each token (by rank)."""
    if handle.sums is None:

        def csr(keys: torch.Tensor, n: int):
            idx = torch.argsort(keys, stable=True)
            offs = torch.searchsorted(keys[idx], torch.arange(n + 1, device=dev, dtype=keys.dtype))
            return idx, offs

        handle.sums = (*csr(handle.rows, rows), *csr(handle.send_order, handle.tokens))
    return handle.sums
