"""all_reduce in the training process for small and medium messages (kernels/inprocess/allreduce.cu).

Through the sidecar, a small all_reduce costs the shim's submit, the hand-off to pgserver and
an NCCL launch there, about twice torch's NCCL time at 8 KiB. Where the group's GPUs map each
other's memory over NVLink (the group's sparse transport is NVSHMEM: every pair NVLink, sm_90),
the shim instead launches one kernel on the caller's stream that pushes its data into the
peers' staging buffers through CUDA IPC (remote stores post; remote loads would wait a round
trip): one-shot (every rank sums every rank's copy) up to
GOCOMM_AR_ONESHOT bytes, two-shot (reduce-scatter then all-gather, both by remote stores)
above, in rounds of GOCOMM_AR_STAGE bytes (default 32 MiB) through staging of a fixed size,
up to GOCOMM_AR_MAX bytes (default: any size). Sum and avg of bf16, fp16 and fp32, message
sizes a multiple of 16 bytes; everything else goes through the sidecar as before.
GOCOMM_AR_MAX=0 turns the path off; the variables must be the same on every rank.

Setup is collective, at a group's first all_reduce of a CUDA tensor on a device: each rank
allocates a zeroed staging buffer (two halves of twice GOCOMM_AR_STAGE bytes, plus flags:
128 MiB by default), and the ranks swap IPC handles through the group itself
(gocomm/_peers.py). Any rank that cannot take part (the module missing, IPC refused, e.g.
under expandable_segments) turns the path off for the whole group, so all ranks always
agree.

Failure: a kernel wait gives up after the group's timeout and sets a word in pinned host
memory; the group's next all_reduce raises and aborts the group. The op itself, like any
CUDA op, returned before it ran.

The op's epoch lives on the GPU (kernels/inprocess/allreduce.cu), so a call can be captured in a CUDA
graph and replayed, once the group's first all_reduce on that device ran outside the
capture (it sets the path up, collectively); replays and eager calls of a group are ordered
by the caller, as with torch's NCCL."""

from __future__ import annotations

import ctypes
import logging
import zlib

import torch

from . import _config, _cuda, _kernels, _peers, _wire

log = logging.getLogger("gocomm")

MAX_RANKS, MAX_BLOCKS = 8, 128
_FLAG_BYTES = 2 * MAX_BLOCKS * MAX_RANKS * 8  # u64 [2 phases][blocks][ranks]
_CTL = _FLAG_BYTES  # kernels/inprocess/allreduce.cu's ctl words (the last epoch, the done count): 16 bytes
_HEAD = 64 << 10  # flags and ctl at the start of the staging allocation, halves after
assert _CTL + 16 <= _HEAD
_SLACK = 256  # two-shot's n slots of ceil(vectors / n) may pass the message by (n - 1) vectors


def _half_bytes(cap: int) -> int:
    """Bytes of one staging half for rounds of cap bytes: two-shot's n slots to reduce
    from and n to gather into (one-shot's n slots of at most cap / n fit the first)."""
    return 2 * (cap + _SLACK)


_THREADS = 512
_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
MODULE = _kernels.Module(
    "allreduce.cubin", tuple(f"gocomm_ar_{k}_{s}" for k in ("one", "two") for s in _SUFFIX.values())
)


def _blocks() -> int:
    """GOCOMM_AR_BLOCKS: the most blocks a kernel uses (1 to MAX_BLOCKS)."""
    return min(MAX_BLOCKS, _config.ar_blocks())


def configured_max() -> int:
    """GOCOMM_AR_MAX: the largest message (bytes) the path takes (default: no limit); 0
    turns it off."""
    return _config.ar_max()


def configured_stage() -> int:
    """GOCOMM_AR_STAGE: bytes of the message per two-shot round (a multiple of 16)."""
    return _config.ar_stage()


class _Args(ctypes.Structure):
    # kernels/inprocess/allreduce.cu's ArArgs, field for field
    _fields_ = [
        ("stage", ctypes.c_uint64 * MAX_RANKS),
        ("flags", ctypes.c_uint64 * MAX_RANKS),
        ("inp", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("err", ctypes.c_uint64),
        ("nvec", ctypes.c_uint64),
        ("round", ctypes.c_uint64),
        ("half", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("ctl", ctypes.c_uint64),
        ("scale", ctypes.c_float),
        ("rank", ctypes.c_uint32),
        ("n", ctypes.c_uint32),
        ("aligned", ctypes.c_uint32),
    ]


class Path:
    """One group's client-side all_reduce on one device (see the module's docstring)."""

    def __init__(
        self, idx: int, rank: int, n: int, cap: int, limit: int, err: tuple[int, int], maps: list[int], timeout_s: float
    ):
        self.idx, self.cap, self.limit = idx, cap, limit
        # one-shot puts every rank's whole message in a half: n slots of it
        self.oneshot = min(_config.ar_oneshot(), cap // n)
        self.blocks = _blocks()
        self._errword = ctypes.c_uint32.from_address(err[0])
        a = self._args = _Args()
        for p, base in enumerate(maps):
            a.flags[p] = base
            a.stage[p] = base + _HEAD
        a.err = err[1]
        a.half = _half_bytes(cap)
        a.round = cap // 16
        a.ctl = maps[rank] + _CTL  # zeroed by share(): no op ran yet
        a.timeout_ns = int(timeout_s * 1e9)
        a.rank, a.n = rank, n
        self._params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(a), ctypes.c_void_p))
        self._fn = {
            (k, dt): MODULE.function(idx, f"gocomm_ar_{k}_{sfx}") for k in ("one", "two") for dt, sfx in _SUFFIX.items()
        }
        self._order = _peers.StreamOrder()
        self._n = n

    def fits(self, t: torch.Tensor, redop: int) -> bool:
        nb = t.numel() * t.element_size()
        return (
            t.dtype in _SUFFIX
            and redop in (_wire.SUM, _wire.AVG)
            and 0 < nb <= self.limit
            and nb % 16 == 0
            and t.get_device() == self.idx
        )

    def failed(self) -> bool:
        """Whether a kernel of this path gave up waiting for a peer."""
        return self._errword.value != 0

    def give_up(self) -> None:
        """Make the path's kernels stop waiting for peers (the group broke): a running or
        queued one gives up at its next check, and the output is not valid."""
        self._errword.value = 1

    def run(self, t: torch.Tensor, redop: int) -> tuple[int | None, int]:
        """Queue the all_reduce of t (in place) on the current stream; call under the group's
        CUDA lock. Returns (the event recorded after it, None while capturing a graph; the
        stream)."""
        a, idx = self._args, self.idx
        stream = _cuda.current_stream(idx)
        # the halves and flags assume one op after another; graph replays are ordered by the
        # caller (kernels/inprocess/allreduce.cu)
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._order.before(stream)
        nb = t.numel() * t.element_size()
        ptr = t.data_ptr()
        a.inp = a.out = ptr
        a.nvec = nb // 16
        a.aligned = 1 if ptr % 16 == 0 else 0
        a.scale = 1.0 / self._n if redop == _wire.AVG else 1.0
        kind = "one" if nb <= self.oneshot else "two"
        per_block = _THREADS * (1 if kind == "one" else self._n)
        grid = max(1, min(self.blocks, -(-a.nvec // per_block)))
        _cuda.launch(self._fn[(kind, t.dtype)], grid, _THREADS, stream, self._params)
        return (None if capturing else self._order.after(stream)), stream


def setup(pg, dev: torch.device) -> Path | None:
    """Collective over pg (every rank calls it at the same all_reduce): the path on dev, or
    None where any rank cannot take part."""
    idx = dev.index
    cap, limit = configured_stage(), configured_max()
    try:
        why = MODULE.why_not(idx)
    except Exception as e:  # noqa: BLE001 - any failure turns the path off for the group
        why = f"{type(e).__name__}: {e}"
    shape = zlib.crc32(f"{_blocks()} {_config.ar_oneshot()} {limit}".encode())
    sh = _peers.share(pg, idx, "all_reduce", why, cap, _HEAD + 2 * _half_bytes(cap), shape)
    if sh is None:
        return None
    with _cuda.on_device(idx):
        path = Path(idx, pg.rank(), pg.size(), sh.cap, limit, sh.err, sh.maps, pg._timeout)
    log.info(
        "gocomm group %r: all_reduce up to %d bytes in this process, in rounds of %d (IPC peers, device %d)",
        pg.group_name,
        limit,
        sh.cap,
        idx,
    )
    return path
