"""all_to_all_v in the training process (kernels/inprocess/a2av_ipc.cu).

Through the sidecar, all_to_all_v costs the shim's submit (a descriptor, a stream write, a
stream wait) and the hand-off to pgserver before its NVSHMEM kernel starts: about 70 us of
host time per call at decode sizes on 4 H200s (docs/decisions/0008-one-sided-all-to-all-v.md), where torch's
all_to_all_vdev takes 34 us in a loop. Where the group's GPUs map each other's memory over
NVLink (the group's sparse transport is NVSHMEM: every pair NVLink with peer atomics, sm_90),
the shim instead launches one kernel on the caller's stream. It pushes this rank's rows into
the peers' receive buffers (CUDA IPC mappings) with the same protocol as the sidecar's
kernel, and the op counter lives on the GPU: nothing on the host changes from one call to
the next, so a call can be captured in a CUDA graph. A pair of ranks whose rows fit a fast
slot (FAST_MAX, at decode sizes) moves before the ranks' counts are exchanged, into a slot
carved from the tail of the receiver's buffer that the receiver copies out.

Setup is collective, at a group's first all_to_all_v of a CUDA tensor on a device: each rank
allocates its receive buffer (GOCOMM_A2A_RECV_MB, the sidecar's, plus 64 KiB of
signals) and the ranks map each other's (gocomm/_peers.py). Any rank that cannot take part
turns the path off for the whole group (the default group then uses the sidecar's NVSHMEM
kernel, the others NCCL). GOCOMM_A2AV_INPROCESS=0 turns it off (the same on every rank).

Failure: a wait gives up after the group's timeout and sets a word in pinned host memory;
the group's next all_to_all_v raises and aborts the group."""

from __future__ import annotations

import ctypes
import logging
import math

import torch

from . import _config, _cuda, _kernels, _peers, _sidecar

log = logging.getLogger("gocomm")

MAX_RANKS, MAX_PARTS, MAX_OUTS = 8, 128, 16
_HEAD = 64 << 10  # kernels/inprocess/a2av_ipc.cu's A2_HEAD: signals before it, the receive buffer after
_TABLE = 9920  # kernels/inprocess/a2av_ipc.cu's A2_TABLE: u64 [MAX_OUTS][MAX_RANKS], the receive buffers
_INT31 = (1 << 31) - 1  # the largest value a meta word carries
_KERNEL = "gocomm_a2av_ipc"
MODULE = _kernels.Module("a2av_ipc.cubin", (_KERNEL,))


def recv_bytes() -> int:
    """The receive buffer of the sparse all-to-all per rank, this path's and the sidecar's
    NVSHMEM kernel's (GOCOMM_A2A_RECV_MB, default 512 MiB), as this process's sidecar read it."""
    sc = _sidecar.current()
    if sc is None:
        raise RuntimeError("gocomm: no sidecar yet: the all-to-all's receive buffer is the sidecar's setting")
    return sc.a2a.recv_bytes


def row_bytes(op: str, inp: torch.Tensor, out_rows: int = 0) -> int:
    """The bytes per row of inp. Raises where inp's rows (or out_rows, rows the caller must
    receive in full), or their size, pass what the kernel's 32-bit meta words carry."""
    row = inp.element_size() * math.prod(inp.shape[1:])
    if max(inp.shape[0], out_rows, row) > _INT31:
        raise ValueError(
            f"gocomm {op}: at most 2^31 - 1 rows of at most 2^31 - 1 bytes, got {tuple(inp.shape)}"
            + (f" and {out_rows} output rows" if out_rows else "")
        )
    return row


def enabled() -> bool:
    """GOCOMM_A2AV_INPROCESS (default 1): 0 leaves all_to_all_v to the sidecar."""
    return _config.a2av_inprocess()


class _Args(ctypes.Structure):
    # kernels/inprocess/a2av_ipc.cu's A2Args, field for field
    _fields_ = [
        ("base", ctypes.c_uint64 * MAX_RANKS),
        ("inp", ctypes.c_uint64),
        ("splits", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("out_splits", ctypes.c_uint64),
        ("err", ctypes.c_uint64),
        ("capacity", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("in_rows", ctypes.c_int64),
        ("out_id", ctypes.c_int64),
        ("out_off", ctypes.c_int64),
        ("stage_bytes", ctypes.c_int64),
        ("fast_bytes", ctypes.c_int64),
        ("host_splits", ctypes.c_int64 * MAX_RANKS),
        ("timeout_ns", ctypes.c_uint64),
        ("rank", ctypes.c_uint32),
        ("n", ctypes.c_uint32),
        ("parts", ctypes.c_uint32),
        ("splits32", ctypes.c_uint32),
    ]


class Path:
    """One group's client-side all_to_all_v on one device (see the module's docstring).

    Launch shape: parts blocks per destination, threads per block (GOCOMM_A2AV_THREADS, the
    sidecar's setting, default 256); see setup()."""

    def __init__(
        self,
        idx: int,
        rank: int,
        n: int,
        parts: int,
        threads: int,
        cap: int,
        err: tuple[int, int],
        maps: list[int],
        timeout_s: float,
    ):
        self.idx, self.cap = idx, cap
        a = self._args = _Args()
        for p, base in enumerate(maps):
            a.base[p] = base
        a.err = err[1]
        # the tail of recv holds two fast slots per sender (kernels/inprocess/a2av_ipc.cu, invariant 6)
        a.fast_bytes = fast_bytes(cap, n, parts)
        a.stage_bytes = cap - 2 * n * a.fast_bytes
        a.timeout_ns = int(timeout_s * 1e9)
        a.rank, a.n = rank, n
        a.parts = parts
        self._threads = threads
        self._grid = n * parts
        self._words = (ctypes.c_uint32 * 3).from_address(err[0])  # late, invalid ops, row-size ops
        self._seen = [0, 0]
        self._fn = MODULE.function(idx, _KERNEL)
        self._params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(a), ctypes.c_void_p))
        self._order = _peers.StreamOrder()
        self.outputs: list[tuple[int, int]] = []  # receive buffers: (address in this process, bytes)

    def add_output(self, maps: list[int], nbytes: int) -> int:
        """Record a receive buffer (every rank's copy, mapped into this process; maps[rank] is this rank's)
        in the table the kernel reads; its number. Call under the group's CUDA lock, and let
        no rank use it before every rank has (the caller's collective)."""
        if len(self.outputs) >= MAX_OUTS:
            raise RuntimeError(f"gocomm receive_buffer: at most {MAX_OUTS} per group and device")
        o = len(self.outputs)
        row = torch.tensor(maps + [0] * (MAX_RANKS - len(maps)), dtype=torch.int64)
        dst = _cuda.tensor_at(self._args.base[self._args.rank] + _TABLE + o * MAX_RANKS * 8, MAX_RANKS * 8, self.idx)
        dst.copy_(row.view(torch.uint8))
        torch.cuda.synchronize(self.idx)
        self.outputs.append((maps[self._args.rank], nbytes))
        return o

    def _output_of(self, p: int, nbytes: int) -> tuple[int, int]:
        """(the receive buffer the nbytes at address p lie in, their offset there), or (-1, 0)."""
        for o, (base, size) in enumerate(self.outputs):
            if base <= p and p + nbytes <= base + size:
                return o, p - base
        return -1, 0

    def failed(self) -> bool:
        """Whether a kernel of this path gave up waiting for a peer."""
        return self._words[0] != 0

    def give_up(self) -> None:
        """Make the path's kernels stop waiting for peers (the group broke): a running or
        queued one gives up at its next check, and the output is not valid."""
        self._words[0] = 1

    def report(self, group: str) -> None:
        """Log what the kernels found since the last call (they cannot raise)."""
        for i, what in enumerate(
            (
                "splits that were negative or more rows than the input (nothing sent)",
                "row sizes that differ between ranks (nothing received)",
            )
        ):
            got = self._words[1 + i]
            if got != self._seen[i]:
                log.warning("gocomm all_to_all_v on group %r: %d op(s) with %s", group, got - self._seen[i], what)
                self._seen[i] = got

    def run(
        self,
        inp: torch.Tensor,
        splits: torch.Tensor | list[int],
        out: torch.Tensor,
        out_splits: torch.Tensor | None,
        row: int,
    ) -> tuple[int | None, int]:
        """Queue the exchange of rows of row bytes (row_bytes) on the current stream; call
        under the group's CUDA lock. splits: int32 or int64 on the device (out_splits, if
        given, has the same dtype), or a list known on the host (valid: the caller checked
        it); out's rows are the capacity. Where out lies in a receive buffer the peers write
        into it; elsewhere the rows pass through recv (in rounds where they do not fit it at
        once). Returns the op's event (None while capturing a graph) and stream."""
        if isinstance(splits, torch.Tensor):
            sp, s32 = splits.data_ptr(), splits.dtype == torch.int32
        else:
            sp, s32 = 0, False
            self._args.host_splits[: len(splits)] = splits
        return self.run_at(
            inp.data_ptr(),
            inp.shape[0],
            sp,
            s32,
            out.data_ptr(),
            out.shape[0],
            0 if out_splits is None else out_splits.data_ptr(),
            row,
        )

    def run_at(
        self, inp: int, in_rows: int, splits: int, splits32: bool, out: int, out_rows: int, out_splits: int, row: int
    ) -> tuple[int | None, int]:
        """run by addresses: splits 0 takes the host splits run set in the arguments."""
        a, idx = self._args, self.idx
        stream = _cuda.current_stream(idx)
        # graph replays are ordered by the caller (kernels/inprocess/a2av_ipc.cu, invariant 1)
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            self._order.before(stream)
        a.splits, a.splits32 = splits, 1 if splits and splits32 else 0
        a.inp, a.out, a.out_splits = inp, out, out_splits
        # meta words carry 32-bit values (kernels/inprocess/a2av_ipc.cu): more rows than that never fit
        a.capacity, a.row_bytes, a.in_rows = min(out_rows, _INT31), row, in_rows
        a.out_id, a.out_off = self._output_of(out, out_rows * row)
        _cuda.launch(self._fn, self._grid, self._threads, stream, self._params)
        return (None if capturing else self._order.after(stream)), stream


FAST_MAX = 2 << 20  # bytes: a pair that fits goes before the meta rows are in


def fast_bytes(cap: int, n: int, parts: int) -> int:
    """A fast slot's size (every rank's is the same: cap, n and parts are): at most FAST_MAX
    and an eighth of recv's share per sender, a multiple of 16 x parts; 0 on one rank."""
    if n < 2:
        return 0
    unit = 16 * parts
    return min(FAST_MAX, cap // (8 * n)) // unit * unit


def setup(pg, idx: int, a2a: _config.A2A) -> Path | None:
    """Collective over pg (every rank calls it at the same all_to_all_v): the path on device
    idx, or None where any rank cannot take part (GOCOMM_A2AV_INPROCESS=0 on any rank, too).

    a2a is the sidecar's settings (Sidecar.a2a): the receive buffer's size, and the launch
    shape, which is the same on every rank (share() refuses otherwise): parts blocks per
    destination, a2a.blocks in all (GOCOMM_A2AV_BLOCKS, default 128, as the sidecar's kernel;
    at least one per destination), capped at what the GPU holds at once, since the blocks
    wait for each other."""
    why, n, parts, threads, recv_bytes = "", pg.size(), 0, a2a.threads, a2a.recv_bytes
    try:
        if not enabled():
            why = "GOCOMM_A2AV_INPROCESS=0"
        elif n > MAX_RANKS:
            why = f"more than {MAX_RANKS} ranks"
        else:
            why = MODULE.why_not(idx)
        if not why:
            with _cuda.on_device(idx):
                room = _cuda.max_resident(MODULE.function(idx, _KERNEL), threads, idx)
            parts = min(MAX_PARTS, max(1, min(a2a.blocks, room) // n))
    except Exception as e:  # noqa: BLE001 - any failure turns the path off for the group
        why = f"{type(e).__name__}: {e}"
    sh = _peers.share(pg, idx, "all_to_all_v", why, recv_bytes, _HEAD + recv_bytes, (parts << 16) | threads)
    if sh is None:
        return None
    with _cuda.on_device(idx):
        path = Path(idx, pg.rank(), n, parts, threads, sh.cap, sh.err, sh.maps, pg._timeout)
    log.info(
        "gocomm group %r: all_to_all_v in this process (IPC peers, device %d, %d MiB receive buffer)",
        pg.group_name,
        idx,
        sh.cap >> 20,
    )
    return path
