"""The ops' argument checks: clear TypeError/ValueError before anything is sent."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _config, _sidecar, _wire
from ._work import _timeout_seconds


def _check(op: str, name: str, t) -> torch.Tensor:
    # Every op's arguments pass here: the checks are ordered and written for host time (a
    # tensor's .device.type alone costs a microsecond; is_cuda a tenth of that).
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gocomm {op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"gocomm {op}: {name} is a {t.layout} tensor; only dense (strided) tensors are supported")
    if t.is_cuda:
        why = _cuda_refusal()
        if why:
            raise NotImplementedError(f"gocomm {op}: {name} is on {t.device}, {why}")
    elif not t.is_cpu:
        raise ValueError(f"gocomm {op}: {name} is on {t.device}; gocomm serves cpu and cuda tensors")
    if t.dtype not in _wire.DTYPES:
        raise TypeError(f"gocomm {op}: {name} has dtype {t.dtype}, which gocomm does not support")
    if not t.is_contiguous():
        raise ValueError(f"gocomm {op}: {name} must be contiguous (call .contiguous() on it)")
    return t


_refusal: tuple[object, str] = (None, "")  # (the sidecar it was asked of, _cuda_refusal's answer)


def _cuda_refusal() -> str:
    """Why CUDA tensors cannot be served ("" where they can), remembered per sidecar."""
    if not _config.cuda():  # GOCOMM_CUDA=0: CUDA tensors raise before anything is sent
        return "and gocomm's CUDA engine is turned off (GOCOMM_CUDA=0)"
    global _refusal
    sc = _sidecar.current()
    if sc is None:
        return ""
    if _refusal[0] is not sc:
        why = "" if sc.info.cuda_available else f"but this rank's pgserver cannot run CUDA ops: {sc.info.cuda_error}"
        _refusal = (sc, why)
    return _refusal[1]


def _single(op: str, name: str, tensors) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return _check(op, name, tensors)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(f"gocomm {op}: expected exactly one {name} per call, got {n}")
    return _check(op, name, tensors[0])


def _tensor_list(op: str, name: str, tensors) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"gocomm {op}: {name} must be a list of tensors, got {type(tensors).__name__}")
    return [_check(op, f"{name}[{i}]", t) for i, t in enumerate(tensors)]


def _same_dtype(op: str, name: str, ts: list[torch.Tensor]) -> None:
    for i, t in enumerate(ts):
        if t.dtype != ts[0].dtype:
            raise TypeError(f"gocomm {op}: {name}[{i}] has dtype {t.dtype}, {name}[0] has {ts[0].dtype}")


def _match_dtype(op: str, name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.dtype != like.dtype:
        raise TypeError(f"gocomm {op}: {name} has dtype {t.dtype}, the input has {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"gocomm {op}: {name} is on {t.device}, the input on {like.device}")


def _output_list(op: str, name: str, lists, like: torch.Tensor, size: int) -> list[torch.Tensor]:
    """The one list of size tensors shaped like `like` that list-style collectives take."""
    if not isinstance(lists, (list, tuple)) or len(lists) != 1:
        raise ValueError(f"gocomm {op}: expected one {name}")
    ts = _tensor_list(op, name, lists[0])
    if len(ts) != size:
        raise ValueError(f"gocomm {op}: {name} has {len(ts)} tensors, the group has {size} ranks")
    for i, t in enumerate(ts):
        _match_dtype(op, f"{name}[{i}]", t, like)
        if t.numel() != like.numel():
            raise ValueError(
                f"gocomm {op}: {name}[{i}] has {t.numel()} elements (shape {tuple(t.shape)}), "
                f"want {like.numel()} (shape {tuple(like.shape)})"
            )
    return ts


_REDOP_CODES = {torch_op: code for torch_op, code, _ in _wire.REDUCE_OPS}  # keyed by RedOpType
_redop_checked: dict[tuple, int] = {}  # (RedOpType, dtype, is_cuda) -> code, once supported


def _redop(op: str, opts, t: torch.Tensor) -> int:
    want = opts.reduceOp.op if opts is not None else dist.ReduceOp.SUM
    is_cuda = t.is_cuda
    key = (want, t.dtype, is_cuda)
    code = _redop_checked.get(key)
    if code is not None:
        return code
    code = _REDOP_CODES.get(want)
    if code is None:
        raise ValueError(f"gocomm {op}: reduce op {want} is not supported (PREMUL_SUM is NCCL-only)")
    why = (_wire.cuda_reduce_support if is_cuda else _wire.reduce_support)(t.dtype, code)
    if why:
        raise TypeError(f"gocomm {op}: {why}")
    _redop_checked[key] = code
    return code


def _root(op: str, opts, size: int) -> int:
    root = opts.rootRank
    if not 0 <= root < size:
        raise ValueError(f"gocomm {op}: root rank {root} is not in the group of {size}")
    return root


def _peer(op: str, name: str, peer, rank: int, size: int) -> None:
    """Check that peer (a send's dst, a recv's src) is another rank of the group."""
    if not isinstance(peer, int) or not 0 <= peer < size:
        raise ValueError(f"gocomm {op}: {name}={peer!r} is not a rank of this group of {size}")
    if peer == rank:
        raise ValueError(f"gocomm {op}: {name}={peer} is this rank")


def _splits(op: str, name: str, splits, rows: int, n: int) -> list[int]:
    if not splits:
        if rows % n:
            raise ValueError(f"gocomm {op}: {rows} rows do not split evenly over {n} ranks; pass {name}")
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n:
        raise ValueError(f"gocomm {op}: {name} has {len(splits)} entries, the group has {n} ranks")
    if any(s < 0 for s in splits):
        raise ValueError(f"gocomm {op}: {name} has a negative entry: {splits}")
    if sum(splits) != rows:
        raise ValueError(f"gocomm {op}: {name} add up to {sum(splits)} rows, the tensor has {rows}")
    return splits


def _opt_timeout(opts):
    if opts is None:
        return None
    t = getattr(opts, "timeout", None)
    if t is None or _timeout_seconds(t) <= 0:
        return None
    return t
