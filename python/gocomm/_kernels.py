"""The MoE kernels (kernels/inprocess/moe.cu, built by make into gocomm/bin/moe.cubin): their
launch shapes and argument lists. The compiled client loads the module and launches them on
the caller's current stream (gocomm._C.kernel_launch, csrc/client/inprocess.cc). Where the
module is missing (a build without make's kernels step), or a tensor does not fit a kernel's
layout, the callers fall back to torch ops."""

from __future__ import annotations

import os
import warnings

import torch

from . import _client

_WSUM = {
    torch.bfloat16: "gocomm_moe_wsum_bf16",
    torch.float16: "gocomm_moe_wsum_f16",
    torch.float32: "gocomm_moe_wsum_f32",
}

_ARCH = (9, 0)  # the modules are built for sm_90 only (Makefile's CUDA_ARCH): a cubin runs on its own arch
LOAD_FAILED = "the module does not load"


class Module:
    """A cubin next to the package (make copies it from kernels/build), which the compiled
    client loads once per device, and its kernels' argument lists."""

    def __init__(self, file: str, sigs: dict[str, str]):
        self.file, self.sigs = file, sigs

    def why_not(self, dev: int) -> str:
        """Why the kernels do not run on device dev ("" where they do): the module was not
        built, is built for another architecture, or does not load there (this reason starts
        with LOAD_FAILED). Asked once per device."""
        return _client.C.module_why_not(self.file, dev)

    def launch(self, dev: int, name: str, grid: int, block: int, *vals: int, smem: int = 0) -> None:
        """Queue kernel name on dev's current stream with arguments vals, typed as the
        module's sigs say."""
        _client.C.kernel_launch(self.file, dev, name, grid, block, smem, self.sigs[name], vals)


# kernels/inprocess/moe.cu's kernels and their arguments, a letter each: P an address, q an int64, i an int32
_MOE_SIGS = {
    **dict.fromkeys(_WSUM.values(), "PPPPPqPq"),
    "gocomm_moe_route_count": "PqiqiiPP",
    "gocomm_moe_route_place": "qiPPPPPPPP",
    "gocomm_moe_route": "PqiqiiPPPPPPPP",
    "gocomm_moe_pack": "PPPPPPPiiqiqqqq",
    "gocomm_moe_group_count": "PqqiiPiqP",
    "gocomm_moe_group_place": "PqqqiiPiqPPPPPPPPPP",
    "gocomm_moe_group": "PqqqiiPiqPPPPPPPPPP",
    "gocomm_moe_gather": "PPPPqqq",
}
MOE = Module("moe.cubin", _MOE_SIGS)


def available() -> bool:
    """Whether the module was built (make's kernels step)."""
    return os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", MOE.file))


_usable: dict[int, bool] = {}


def usable(dev: torch.device) -> bool:
    """Whether the MoE kernels run on CUDA device dev: the module was built, for dev's
    architecture, and loads there (asked once per device; why_not says why not)."""
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    ok = _usable.get(i)
    if ok is None:
        why = MOE.why_not(i)
        if why.startswith(LOAD_FAILED):
            warnings.warn(f"gocomm: MoE kernels fall back to torch ops: {why}", RuntimeWarning, stacklevel=3)
        ok = _usable[i] = not why
    return ok


def why_not(dev: torch.device) -> str:
    """Why usable(dev) is False ("" where it is True)."""
    return MOE.why_not(dev.index if dev.index is not None else torch.cuda.current_device())


def wsum(out: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, w: torch.Tensor | None, offs: torch.Tensor) -> bool:
    """out[r] = sum over j in [offs[r], offs[r+1]) of w[j] * src[idx[j]], in float32, rounded
    once into out's dtype (a row without terms is zero). out [R, H] and src [N, H] share a
    dtype and device; idx int64 [nnz]; w float32 [nnz] or None (weight 1); offs int64 [R+1].
    Returns False, touching nothing, where the kernel cannot run it (then use torch ops)."""
    h = out.shape[1] if out.dim() == 2 else 0
    if (
        not out.is_cuda
        or not usable(out.device)
        or out.dtype not in _WSUM
        or src.dtype != out.dtype
        or src.device != out.device
        or out.dim() != 2
        or src.dim() != 2
        or src.shape[1] != h
        or (h * out.element_size()) % 16
        or not (out.is_contiguous() and src.is_contiguous())
        or (out.data_ptr() | src.data_ptr()) % 16
    ):
        return False
    rows = out.shape[0]
    if rows == 0:
        return True
    dev = out.device.index
    idx = idx.to(device=out.device, dtype=torch.int64).contiguous()
    offs = offs.to(device=out.device, dtype=torch.int64).contiguous()
    wp = 0
    if w is not None:
        w = w.to(device=out.device, dtype=torch.float32).contiguous()
        wp = w.data_ptr() if w.numel() else 0
    # idx, offs and w were made (or are used) on this stream: freeing them after the launch is
    # safe, the caching allocator reuses memory in stream order
    wsum_at(
        dev,
        out.dtype,
        out.data_ptr(),
        src.data_ptr() if src.numel() else 0,
        idx.data_ptr() if idx.numel() else 0,
        wp,
        offs.data_ptr(),
        rows,
        0,
        h,
    )
    return True


def wsum_at(
    dev: int, dtype: torch.dtype, out: int, src: int, idx: int, w: int, offs: int, rows: int, nrows: int, h: int
):
    """wsum's launch by addresses, unchecked: rows is the most rows, nrows (0: none) the
    address of an int64 count on the GPU that may cut them."""
    grid, block = min(rows, 65535), row_block(h * dtype.itemsize)
    MOE.launch(dev, _WSUM[dtype], grid, block, out, src, idx, w, offs, rows, nrows, h)


def row_block(nbytes: int) -> int:
    """The block of the kernels that take a row of nbytes (a multiple of 16) per block: a
    thread per 16 bytes, in whole warps, at most 256."""
    return min(256, max(32, -(-(nbytes // 16) // 32) * 32))


def row_layout(xbytes: int, k: int) -> tuple[int, int, int]:
    """dispatch's packed row for tokens of xbytes and k choices: (the local ids' offset, the
    weights' offset, the row's bytes); every part 16-byte aligned, as moe._layout lays it."""
    w_off = xbytes + -(-k * 4 // 16) * 16
    return xbytes, w_off, w_off + -(-k * 4 // 16) * 16


def pack_at(
    dev: int,
    payload: int,
    x: int,
    idx: int,
    w: int,
    meta: int,
    send_order: int,
    send_rank: int,
    rows: int,
    n: int,
    k: int,
    experts: int,
    xbytes: int,
) -> None:
    """gocomm_moe_pack by addresses: payload holds at most rows packed rows (row_layout), of
    which the kernel fills meta[n]."""
    id_off, w_off, row = row_layout(xbytes, k)
    MOE.launch(
        dev,
        "gocomm_moe_pack",
        min(rows, 4096),
        row_block(xbytes),
        *(payload, x, idx, w, meta, send_order, send_rank),
        *(n, k, experts, experts // n, xbytes, id_off, w_off, row),
    )


def gather_at(dev: int, out: int, src: int, rows: int, count: int, cap: int, stride: int, nbytes: int) -> None:
    """gocomm_moe_gather by addresses: out[p] = the first nbytes of src's row rows[p] (rows
    stride apart), for p below the int64 count at address count and below cap."""
    MOE.launch(
        dev,
        "gocomm_moe_gather",
        min(cap, 2048),
        row_block(nbytes),
        out,
        src,
        rows,
        count,
        cap,
        stride,
        nbytes,
    )


def route_pack(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: int, n: int):
    """dispatch's routing and packing on the GPU (kernels/inprocess/moe.cu, two launches, no sync):
    (payload [T*n, row] uint8 whose first meta[n] rows are filled, meta int64 [n+2] = rows
    per rank, their sum, 1 if an id was out of range; send_order int64 [T*n], the token of
    each row; t_idx, t_offs: token t's rows are t_idx[t_offs[t]:t_offs[t+1]]). None where
    the kernels cannot take x (then use torch ops). idx int64 and w float32 [T, K] on x's
    device, contiguous."""
    t, h = x.shape if x.dim() == 2 else (0, 0)
    xbytes = h * x.element_size()
    if (
        not x.is_cuda
        or not usable(x.device)
        or t == 0
        or xbytes % 16
        or not x.is_contiguous()
        or x.data_ptr() % 16
        or idx.dim() != 2
        or idx.shape[1] == 0
        or n > ROUTE_MAX_RANKS
    ):
        return None
    k = idx.shape[1]
    dev = x.device
    row = row_layout(xbytes, k)[2]
    meta = torch.empty(n + 2, dtype=torch.int64, device=dev)
    send_order = torch.empty(t * n, dtype=torch.int64, device=dev)
    send_rank = torch.empty(t * n, dtype=torch.int32, device=dev)
    payload = torch.empty(t * n, row, dtype=torch.uint8, device=dev)
    t_idx = torch.empty(t * n, dtype=torch.int64, device=dev)
    t_offs = torch.empty(t + 1, dtype=torch.int64, device=dev)
    mask = torch.empty(t, dtype=torch.uint8, device=dev)
    bcount = torch.empty(route_blocks(t)[0] * (n + 2), dtype=torch.int64, device=dev)
    route_at(
        dev.index,
        *(idx.data_ptr(), t, k, experts, n),
        *(meta.data_ptr(), send_order.data_ptr(), send_rank.data_ptr(), t_idx.data_ptr(), t_offs.data_ptr()),
        *(mask.data_ptr(), bcount.data_ptr(), 0),
    )
    pack_at(
        dev.index,
        *(payload.data_ptr(), x.data_ptr(), idx.data_ptr(), w.data_ptr(), meta.data_ptr()),
        *(send_order.data_ptr(), send_rank.data_ptr(), t * n, n, k, experts, xbytes),
    )
    return payload, meta, send_order, t_idx, t_offs


ROUTE_MAX_RANKS = 8  # the routing kernels keep a token's ranks in a byte


def route_blocks(t: int) -> tuple[int, int]:
    """The routing kernels' grid and block for t tokens (a thread per token)."""
    threads = min(1024, max(32, -(-t // 32) * 32))
    return max(1, -(-t // threads)), threads


def route_at(
    dev: int,
    idx: int,
    t: int,
    k: int,
    experts: int,
    n: int,
    meta: int,
    send_order: int,
    send_rank: int,
    t_idx: int,
    t_offs: int,
    mask: int,
    bcount: int,
    flag: int,
) -> None:
    """gocomm_moe_route_count and _place by addresses (kernels/inprocess/moe.cu says what each holds;
    mask is t bytes, bcount route_blocks(t)[0] x (n + 2) int64; flag 0 or a host word).
    n is at most ROUTE_MAX_RANKS."""
    if n > ROUTE_MAX_RANKS:
        raise ValueError(f"gocomm: the routing kernels take at most {ROUTE_MAX_RANKS} ranks, got {n}")
    grid, block = route_blocks(t)
    if grid == 1:  # both passes in one launch
        MOE.launch(
            dev,
            "gocomm_moe_route",
            1,
            block,
            *(idx, t, k, experts, experts // n, n, mask, bcount, meta, send_order, send_rank, t_idx, t_offs, flag),
        )
        return
    MOE.launch(dev, "gocomm_moe_route_count", grid, block, idx, t, k, experts, experts // n, n, mask, bcount)
    MOE.launch(
        dev,
        "gocomm_moe_route_place",
        grid,
        block,
        *(t, n, mask, bcount, meta, send_order, send_rank, t_idx, t_offs, flag),
    )


# shared memory under the 48 KiB a kernel gets without opting in, less the static scan and words
_GROUP_SMEM = (48 << 10) - 512


def group_threads(per: int) -> int:
    """The grouping kernels' block for per local experts (their histogram is per x (threads
    + 1) int32 in shared memory, after per int64); 0 where per is too many."""
    t = min(1024, ((_GROUP_SMEM - per * 8) // (4 * max(per, 1)) - 1) // 32 * 32)
    return t if t >= 32 else 0


def group_blocks(cap: int) -> int:
    """The grouping kernels' grid for at most cap received rows: about 32 rows a block (one
    block of 64 threads for 256 rows took 21 us where 8 blocks took 11.7)."""
    return max(1, min(64, -(-cap // 32)))


def group_at(
    dev: int,
    recv: int,
    row: int,
    id_off: int,
    w_off: int,
    k: int,
    per: int,
    out_splits: int,
    n: int,
    cap: int,
    bhist: int,
    out: tuple[int, int, int, int, int, int, int, int],
    flag: int,
) -> None:
    """gocomm_moe_group_count and _place by addresses: out is (rows_sorted, w_sorted, tpe,
    e_idx, w_e (0: none), e_offs, gmeta, back (0: none)); bhist holds group_blocks(cap) x
    (per + 1) int64."""
    threads, blocks = group_threads(per), group_blocks(cap)
    smem = per * 8 + per * (threads + 1) * 4
    args = (recv, row, id_off, w_off, k, per, out_splits, n, cap, bhist, *out, flag)
    if blocks == 1:  # both passes in one launch
        MOE.launch(dev, "gocomm_moe_group", 1, threads, *args, smem=smem)
        return
    MOE.launch(
        dev,
        "gocomm_moe_group_count",
        blocks,
        threads,
        *(recv, row, id_off, k, per, out_splits, n, cap, bhist),
        smem=per * (threads + 1) * 4,
    )
    MOE.launch(
        dev,
        "gocomm_moe_group_place",
        blocks,
        threads,
        *args,
        smem=smem,
    )


def group(recv: torch.Tensor, id_off: int, w_off: int, k: int, per: int, out_splits: torch.Tensor):
    """dispatch's receive side on the GPU (two launches, no sync): recv [cap, row] uint8 as
    packed by route_pack, its first sum(out_splits) rows received. Returns (rows_sorted,
    w_sorted, tokens_per_expert, e_idx, e_offs, gmeta) with gmeta = [pairs, rows] on the
    device; None where the kernels cannot take it (then use torch ops)."""
    if not recv.is_cuda or not usable(recv.device) or not group_threads(per) or not recv.is_contiguous() or k == 0:
        return None
    dev = recv.device
    cap = recv.shape[0]
    out_splits = out_splits.to(device=dev, dtype=torch.int64).contiguous()
    rows_sorted = torch.empty(cap * k, dtype=torch.int64, device=dev)
    w_sorted = torch.empty(cap * k, dtype=torch.float32, device=dev)
    tpe = torch.empty(per, dtype=torch.int64, device=dev)
    e_idx = torch.empty(cap * k, dtype=torch.int64, device=dev)
    e_offs = torch.empty(cap + 1, dtype=torch.int64, device=dev)
    gmeta = torch.empty(2, dtype=torch.int64, device=dev)
    bhist = torch.empty(group_blocks(cap) * (per + 1), dtype=torch.int64, device=dev)
    outs = (rows_sorted, w_sorted, tpe, e_idx, None, e_offs, gmeta, None)
    group_at(
        dev.index,
        *(recv.data_ptr(), recv.shape[1], id_off, w_off, k, per, out_splits.data_ptr(), out_splits.numel(), cap),
        bhist.data_ptr(),
        tuple(0 if o is None else o.data_ptr() for o in outs),
        0,
    )
    return rows_sorted, w_sorted, tpe, e_idx, e_offs, gmeta
