"""gocomm.moe where the group's exchange runs in this process (the compiled client's
all_to_all_v kernel, gocomm._C.A2Path: GPUs that share NVLink): dispatch is route, pack, exchange, group and gather launches over one
workspace; combine three launches (weighted sums per received token, exchange back, sums per
token) from what dispatch left on the GPU. A padded dispatch reads nothing on the host; the
errors it finds on the GPU are counted in host-mapped words (_Flags) and raised later."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _client, _kernels
from .sparse import _capacity_rows


def _inprocess_takes(x: torch.Tensor, k: int, per: int) -> bool:
    """Whether the kernels take dispatch of x (and combine of its dtype) on their own."""
    xbytes = x.shape[1] * x.element_size()
    return (
        x.dtype in _kernels._WSUM
        and k > 0
        and xbytes % 16 == 0
        and x.is_contiguous()
        and x.data_ptr() % 16 == 0
        and _kernels.usable(x.device)
        and _kernels.group_threads(per) > 0
    )


@dataclass
class _InProcess:
    """dispatch's handle where the exchange runs in this process: combine needs only
    addresses in ws (the routing dispatch made on the GPU) and sizes the host knows."""

    group: dist.ProcessGroup | None
    g: dist.ProcessGroup
    path: _client.C.A2Path
    tokens: int
    dtype: torch.dtype
    ws: torch.Tensor  # the workspace the addresses below point into
    at: dict  # name -> address in ws
    y_rows: int  # rows combine's y has (dispatch's output)
    recv_rows: int  # rows the exchange received into, at most (combine sends as many back)
    send_rows: int  # rows this rank sent, at most (combine receives as many)
    send_splits: list[int] | None = None  # known after a dispatch that synced
    recv_splits: list[int] | None = None
    experts: int = 0


def _carve(sizes: dict) -> tuple[dict, int]:
    """Byte offsets of named regions of one allocation (each 256-byte aligned), and its size."""
    offs, at = {}, 0
    for name, size in sizes.items():
        offs[name] = at
        at += -(-max(size, 1) // 256) * 256
    return offs, at


class _Flags:
    """Host memory the routing and grouping kernels count in on one device: padded
    dispatches that found an id out of range ([0]) or overflowed ([1]). The GPU only adds to
    them and the host only reads them (seen: what it reported), so none is lost."""

    def __init__(self, dev: int):
        host, self.at = _client.C.host_words(64, dev)
        self.words = (ctypes.c_uint32 * 2).from_address(host)
        self.seen = [0, 0]

    def raise_new(self, experts: int) -> None:
        """Raise for what the kernels counted since the last call (once each)."""
        got = [self.words[0], self.words[1]]
        if got == self.seen:
            return
        over = got[1] != self.seen[1]
        i = 1 if over else 0  # one error per call: the other stays for the next
        self.seen[i] = got[i]
        if over:
            raise OverflowError(
                "gocomm moe: a padded dispatch on this device was sent more tokens than max_tokens_per_rank x "
                "group size; it received none, and its combine sent nothing back (a rank dispatched more than "
                "the bound)"
            )
        raise ValueError(
            f"gocomm moe: a padded dispatch on this device had topk_idx outside [-1, {experts}) "
            "(those entries were sent nowhere)"
        )


_flags: dict[int, _Flags] = {}  # device -> its words


@functools.lru_cache(maxsize=256)
def _workspace(t: int, n: int, k: int, per: int, cap: int, payload: int, recv: int):
    """_dispatch_inprocess's two allocations for its shape, made once per shape: (the regions of
    the one that lives with the handle, its size, the regions of the one that lives through
    the call, its size)."""
    offs, size = _carve(
        {
            "counts": (2 * n + 4) * 8,  # meta [n + 2] (send splits, sent, bad), recv splits [n], gmeta [2]
            "send_order": t * n * 8,
            "send_rank": t * n * 4,
            "t_idx": t * n * 8,
            "t_offs": (t + 1) * 8,
            "mask": t,
            "bcount": _kernels.route_blocks(t)[0] * (n + 2) * 8,
            "bhist": _kernels.group_blocks(cap) * (per + 1) * 8,
            # a row's pairs: one per topk entry on this rank (k, duplicated ids included)
            "rows_sorted": cap * k * 8,
            "w_sorted": cap * k * 4,
            "tpe": per * 8,
            "e_idx": cap * k * 8,
            "w_e": cap * k * 4,
            "e_offs": (cap + 1) * 8,
            "csplits": n * 8,  # what combine sends back to each rank (zeros after an overflow)
            "back_splits": n * 8,
        }
    )
    # counts holds meta [n + 2], the recv splits [n], then gmeta [2] (pairs, rows)
    offs["recv_splits"], offs["gmeta"] = offs["counts"] + (n + 2) * 8, offs["counts"] + (2 * n + 2) * 8
    big_offs, big = _carve({"payload": payload, "recv": recv})
    return offs, size, big_offs, big


def _flags_of(dev: int) -> _Flags:
    """dev's flag words, made at the first dispatch on this path (outside any capture: it
    set the path up)."""
    f = _flags.get(dev)
    if f is None:
        f = _flags[dev] = _Flags(dev)
    return f


def _dispatch_inprocess(group, g, path, x, idx, w32, experts: int, n: int, bound, padded: bool):
    """dispatch where the exchange is the in-process kernel: five launches (route, pack,
    exchange, group, gather), addresses into one workspace, and no host sync when padded
    (else one, to size the output)."""
    t, h = x.shape
    k = idx.shape[1]
    per = experts // n
    dev = path.idx
    xbytes = h * x.element_size()
    id_off, w_off, row = _kernels.row_layout(xbytes, k)
    cap = bound * n if bound is not None else _capacity_rows(row)  # rows the exchange takes
    send_cap = t * min(n, k)
    offs, size, big_offs, big = _workspace(t, n, k, per, cap, send_cap * row, cap * row)
    ws = torch.empty(size, dtype=torch.uint8, device=x.device)
    base = ws.data_ptr()
    at = {name: base + off for name, off in offs.items()}
    meta, recv_splits, gmeta = at["counts"], at["recv_splits"], at["gmeta"]
    # the payload and the exchange's output live only through this call
    tmp = torch.empty(big, dtype=torch.uint8, device=x.device)
    payload, recv = tmp.data_ptr() + big_offs["payload"], tmp.data_ptr() + big_offs["recv"]
    flags = _flags_of(dev)
    flag_at = flags.at if padded else 0  # a synced dispatch raises at once
    _kernels.route_at(
        dev,
        *(idx.data_ptr(), t, k, experts, n, meta),
        *(at[a] for a in ("send_order", "send_rank", "t_idx", "t_offs", "mask", "bcount")),
        flag_at,
    )
    if send_cap:
        _kernels.pack_at(
            dev,
            *(payload, x.data_ptr(), idx.data_ptr(), w32.data_ptr(), meta, at["send_order"], at["send_rank"]),
            *(send_cap, n, k, experts, xbytes),
        )
    path.report()
    path.run_at(payload, send_cap, meta, False, recv, cap, recv_splits, row)
    _kernels.group_at(
        dev,
        *(recv, row, id_off, w_off, k, per, recv_splits, n, cap, at["bhist"]),
        tuple(at[a] for a in ("rows_sorted", "w_sorted", "tpe", "e_idx", "w_e", "e_offs")) + (gmeta, at["csplits"]),
        flag_at,
    )
    handle = _InProcess(group, g, path, t, x.dtype, ws, at, 0, cap, send_cap)
    tpe = ws[offs["tpe"] : offs["tpe"] + per * 8].view(torch.int64)
    if padded:
        rows = cap * k
    else:
        counts = ws[: (2 * n + 4) * 8].view(torch.int64).tolist()  # the one sync
        send, bad, recv_n = counts[:n], counts[n + 1], counts[n + 2 : 2 * n + 2]
        rows, got = counts[2 * n + 2], counts[2 * n + 3]
        if bad:
            lo, hi = torch.stack(torch.aminmax(idx)).tolist()
            raise ValueError(
                f"gocomm moe.dispatch: topk_idx must be in [-1, {experts}), got {lo}..{hi} "
                "(those entries were sent nowhere)"
            )
        if sum(recv_n) > cap:  # the exchange wrote nothing
            raise OverflowError(
                f"gocomm moe.dispatch: this rank is sent {sum(recv_n)} tokens ({recv_n} by source rank), more than "
                f"max_tokens_per_rank x group size = {cap}; nothing was received"
            )
        handle.recv_rows, handle.send_rows = got, counts[n]
        handle.send_splits, handle.recv_splits = send, recv_n
    out = torch.empty(rows, h, dtype=x.dtype, device=x.device)
    if rows:
        _kernels.gather_at(dev, out.data_ptr(), recv, at["rows_sorted"], gmeta, rows, row, xbytes)
    handle.y_rows, handle.experts = rows, experts
    del tmp  # freed in stream order: the kernels above are queued before any reuse
    return out, tpe, handle


def _combine_inprocess(y: torch.Tensor, hd: _InProcess) -> torch.Tensor:
    """combine after _dispatch_inprocess: three launches (the expert side's weighted sums, the
    exchange back, the token side's sums) from the routing dispatch left on the GPU; no sync."""
    if y.dim() != 2 or y.shape[0] != hd.y_rows:
        raise ValueError(f"gocomm moe.combine: y must be [{hd.y_rows}, hidden] (dispatch's rows), got {tuple(y.shape)}")
    if y.dtype != hd.dtype or y.device.index != hd.path.idx:
        raise ValueError(
            f"gocomm moe.combine: y must be {hd.dtype} on cuda:{hd.path.idx} like dispatch's x, got {y.dtype} on {y.device}"
        )
    h = y.shape[1]
    if (h * y.element_size()) % 16:
        raise ValueError(f"gocomm moe.combine: y's rows must be a multiple of 16 bytes like dispatch's x, got {h}")
    y = y.contiguous()
    at, dev, row = hd.at, hd.path.idx, h * y.element_size()
    tmp = torch.empty(hd.recv_rows * h + hd.send_rows * h, dtype=y.dtype, device=y.device)
    partial, back = tmp.data_ptr(), tmp.data_ptr() + hd.recv_rows * row
    if hd.recv_rows:  # gmeta[1]: the rows received
        _kernels.wsum_at(
            dev, y.dtype, partial, y.data_ptr(), at["e_idx"], at["w_e"], at["e_offs"], hd.recv_rows, at["gmeta"] + 8, h
        )
    hd.path.run_at(partial, hd.recv_rows, at["csplits"], False, back, hd.send_rows, at["back_splits"], row)
    out = torch.empty(hd.tokens, h, dtype=y.dtype, device=y.device)
    if hd.tokens:
        _kernels.wsum_at(dev, y.dtype, out.data_ptr(), back, at["t_idx"], 0, at["t_offs"], hd.tokens, 0, h)
    if hd.send_splits is None:  # padded: what the GPU found, after this pair's last exchange
        _flags_of(dev).raise_new(hd.experts)
    return out
