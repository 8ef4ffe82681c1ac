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
in the same row: one all-to-all per dispatch, one per combine. On CUDA, gocomm's own kernels
(kernels/inprocess/moe.cu, launched on the caller's stream) route and pack the tokens, group
what arrives by expert, and do combine's weighted sums; elsewhere, and for fp8, ATen ops do.

Every path is the compiled client's; this module picks one per call and keeps the handle.
Where the group's exchange is the in-process kernel (GPUs that share NVLink), dispatch and
combine are one registered op each, torch.ops.gocomm.moe_dispatch / moe_combine
(csrc/client/moe.cc): three launches each (route and pack, the exchange, group and gather;
weighted sums, the exchange back, sums per token), or with padded=True one each where the
group's low-latency buffer takes the call (docs/decisions/0039). dispatch reads the counts on
the host once, to size its output; with padded=True it never does (its output has the most
rows max_tokens_per_rank allows), so dispatch and combine can be captured in one CUDA graph.
Elsewhere (NCCL, the sidecar's NVSHMEM kernel, the host engine; CPU tensors, fp8, rows the
kernels do not take) they are torch.ops.gocomm.moe_dispatch_any / moe_combine_any
(csrc/client/moe_any.cc): the kernels' launches (csrc/client/moe_kernels.cc) or ATen ops
around gocomm.all_to_all_v's exchange (csrc/client/a2av.cc), the counts crossing the host.

Both are differentiable (x, topk_weights, and y through combine; the compiled client's
Autograd kernels, docs/decisions/0038-moe-autograd.md); fp8 dispatch raises at a backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _backend, _capture, _client
from .sparse import _capacity_rows, _device_path

__all__ = ["Handle", "check", "combine", "dispatch"]

FP8_BLOCK = 128  # channels per scale in fp8 dispatch

# the compiled client's ops, called as overloads (the packet's call resolves the overload):
# the in-process path's (csrc/client/moe.cc) and the other paths' (csrc/client/moe_any.cc)
_DISPATCH = torch.ops.gocomm.moe_dispatch.default
_COMBINE = torch.ops.gocomm.moe_combine.default
_CHECK = torch.ops.gocomm.moe_check.default
_DISPATCH_LL = torch.ops.gocomm.moe_dispatch_ll.default
_COMBINE_LL = torch.ops.gocomm.moe_combine_ll.default
_DISPATCH_ANY = torch.ops.gocomm.moe_dispatch_any.default
_COMBINE_ANY = torch.ops.gocomm.moe_combine_any.default
_RAISE_NEW = _client.C.moe_raise_new


class Handle:
    """What combine needs to send the experts' outputs back (opaque to callers): the routing
    dispatch left on the device, in the form the compiled client's combine op takes."""

    __slots__ = ("name", "tokens", "dtype", "rows", "state", "inproc", "routing")

    def __init__(self, name, tokens, dtype, rows, state, inproc=None, routing=None):
        self.name, self.tokens, self.dtype = name, tokens, dtype  # the group's name, x's rows and dtype
        self.rows = rows  # y's rows where they are fixed (in-process, padded), else 0
        self.state = state  # moe_dispatch's workspace, or moe_dispatch_any's handle tensors
        # in-process: [device, cap, k, experts, recv_rows, send_rows, padded] (moe_combine's sizes)
        self.inproc, self.routing = inproc, routing  # routing: (topk_idx, topk_weights, num_experts)


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
    low_latency: bool = False,
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
            what this rank can receive (each token comes at most once per rank). Where the
            counts stay on the GPU (see gocomm.all_to_all_v) it sizes the receive buffer;
            without it that is the whole receive capacity (GOCOMM_A2A_RECV_MB), or on a group
            of one rank its T tokens. A rank that is sent more raises OverflowError.
        padded: no host sync (needs max_tokens_per_rank): recv has its most rows,
            max_tokens_per_rank x group size x k, expert e's tokens at rows
            sum(tokens_per_expert[:e]) onwards and rows past their total undefined, so
            shapes do not depend on the routing and the call can be captured in a CUDA graph
            (once a first call ran outside the capture: it sets the group's exchange up).
            combine then takes y of that many rows. Where the group's all-to-all runs in
            this process (NVLink, or one rank; see gocomm.all_to_all_v), nothing waits for
            the GPU. An id out of range (sent nowhere), or more tokens sent to a rank than
            its bound (that rank receives none, and combine's sums of the tokens sent to it
            are undefined), is found on the GPU and raises ValueError / OverflowError at the
            end of a later combine of a padded dispatch on that rank's device (after that
            combine's exchange, so no peer is left waiting), or in gocomm.moe.check(), which
            waits for the GPU first. Elsewhere the result is the same, after one sync, and
            such errors raise in dispatch.
        low_latency: padded, in one launch each way where the exchange runs in this process
            (docs/decisions/0036), which padded=True does by itself where the group's buffer
            takes the call (0039, GOCOMM_MOE_LL_MB). The group's first call of either sizes the
            buffer for its max_tokens_per_rank (the same on every rank), hidden size and k:
            later low_latency calls stay within, larger padded ones take three launches.

    Returns:
        (recv, tokens_per_expert, handle): recv holds the received tokens grouped by local
        expert (expert 0's first), one row per (token, local expert) pair, or a pair
        (fp8 values [N, H], scales [N, H / FP8_BLOCK]) with fp8; tokens_per_expert is an
        int64 tensor of E/n counts on x's device; handle is for combine.
    """
    g = group if group is not None else dist.group.WORLD
    routing = (topk_idx, topk_weights, num_experts)  # what combine's backward needs
    if (padded or low_latency) and max_tokens_per_rank is not None and not fp8:
        if low_latency:
            n, k, b = g.size(), topk_idx.shape[1], max_tokens_per_rank
            try:
                out, tpe, ws = _DISPATCH_LL(x, topk_idx, topk_weights, num_experts, n, b, g.group_name)
                sizes = (x.get_device(), b, k, num_experts, -1, -1, True)  # recv_rows -1: low-latency (cap: b)
                return out, tpe, Handle(g.group_name, x.shape[0], x.dtype, b * n * k, ws, sizes, routing)
            except NotImplementedError:  # not in this process, or shapes its kernels do not take
                padded = True
        # the fast path: the group's in-process kernels serve x's device (found at an earlier
        # dispatch); the op checks the arguments and converts topk_idx / topk_weights
        fast = _backend.served.get((g, x.get_device()))
        if fast is not None and fast.moe:
            try:
                return _dispatch_inprocess(fast, x, routing, max_tokens_per_rank, True)
            except NotImplementedError:  # the kernels do not take x (dtype, alignment), or the path is gone
                _backend.served.pop((g, x.get_device()), None)
    padded = padded or low_latency
    n = dist.get_world_size(g)
    _CHECK(x, topk_idx, topk_weights, num_experts, n, fp8, max_tokens_per_rank, padded)
    k = topk_idx.shape[1]
    path = _device_path(g, x)  # collective at the group's first call on x's device
    if isinstance(path, _client.C.A2Path) and not fp8 and _client.C.moe_takes(x, k, num_experts // n):
        if not padded and _capture.capturing():
            why = "without padded=True it reads the counts on the host to size its output"
            _capture.refuse("moe.dispatch", g, why)
        fast = _backend.served[g, x.get_device()]
        fast.moe = True  # the kernels run on x's device: later padded calls take the fast path
        return _dispatch_inprocess(fast, x, routing, max_tokens_per_rank, padded)
    # the other paths: one op around gocomm.all_to_all_v's exchange, one host sync (or two)
    got = _DISPATCH_ANY(x, topk_idx, topk_weights, num_experts, fp8, max_tokens_per_rank, padded, g.group_name)
    hd = Handle(g.group_name, x.shape[0], x.dtype, max_tokens_per_rank * n * k if padded else 0, got[3:], None, routing)
    return ((got[0], got[1]) if fp8 else got[0]), got[2], hd


def _dispatch_inprocess(fast: _backend.Served, x, routing: tuple, bound, padded: bool):
    """dispatch where the exchange is the in-process kernel: one op, which checks the arguments,
    converts topk_idx / topk_weights (routing, with num_experts) as the kernels read them, and
    syncs once unless padded. bound: max_tokens_per_rank or None (the receive buffer).
    NotImplementedError where the kernels do not take x or serve the group (nothing done)."""
    n, t, k = fast.size, x.shape[0], routing[0].shape[1]
    cap = bound * n if bound is not None else t if n == 1 else _capacity_rows(x, k)  # alone: its own tokens
    out, tpe, ws, counts = _DISPATCH(x, *routing, n, cap, padded, fast.name)
    rows, recv_rows, send_rows = cap * k, cap, t * min(n, k)
    if not padded:  # the rows the exchanges move: what the counts say
        c = counts.tolist()
        rows, recv_rows, send_rows = c[2 * n + 2], c[2 * n + 3], c[n]
    sizes = (x.get_device(), cap, k, routing[2], recv_rows, send_rows, padded)
    return out, tpe, Handle(fast.name, t, x.dtype, rows, ws, sizes, routing)


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
        fixed order (the same result every time); elsewhere in ATen ops (index_add_).
    """
    if handle.inproc is None:
        return _COMBINE_ANY(y, handle.state, handle.tokens, handle.dtype, handle.rows, handle.name, *handle.routing)
    device, cap, k, experts, recv_rows, send_rows, padded = handle.inproc
    if y.dim() != 2 or y.shape[0] != handle.rows or y.dtype != handle.dtype or y.get_device() != device:
        raise ValueError(
            f"gocomm moe.combine: y must be [{handle.rows}, hidden] (dispatch's rows), {handle.dtype} on "
            f"cuda:{device} like dispatch's x, got {tuple(y.shape)} {y.dtype} on {y.device}"
        )
    # the op checks the rest (rows of a multiple of 16 bytes)
    r = handle.routing
    if recv_rows < 0:
        out = _COMBINE_LL(y, handle.state, handle.tokens, cap, k, experts, handle.name, r[0], r[1])
    else:
        out = _COMBINE(y, handle.state, handle.tokens, cap, k, experts, recv_rows, send_rows, handle.name, r[0], r[1])
    if padded:  # what the GPU found, after this pair's last exchange
        _RAISE_NEW(device, experts)
    return out


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
        _client.C.moe_raise_new(idx, num_experts)
