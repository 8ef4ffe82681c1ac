"""Buffers the ranks of a group map into each other's processes (CUDA IPC), for the shim's
kernels that write into their peers' memory over NVLink (gocomm/_allreduce.py, gocomm/_a2av.py),
the order those kernels keep on the caller's streams (StreamOrder), and the Work of an op
they queued (KernelWork).

share() is collective: every rank of the group calls it at the same op, also a rank that
cannot take part (it says why), so that all ranks agree on the outcome. The handles travel
through the group itself (an all_gather of CPU tensors, the host engine)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _cuda

log = logging.getLogger("gocomm")

_PEER = "a peer cannot take part"


@dataclass
class Shared:
    """What share() gives a rank: every rank's buffer mapped into this process (maps[rank] is its own),
    the smallest capacity any rank offered, and a zeroed 64-byte word block in pinned host
    memory its kernels report into (host address, device address)."""

    maps: list[int]
    cap: int
    err: tuple[int, int]


def share(pg, idx: int, what: str, why: str, cap: int, nbytes: int, settings: int = 0) -> Shared | None:
    """Collective over pg: each rank allocates nbytes of zeroed device memory on device idx
    (outside torch's allocator, so that its IPC handle names it alone; kept for the life of
    the process, as a peer may map it after this group is gone), offers cap, and maps every
    peer's. why, if not empty, says why this rank cannot take part; settings, what must be
    the same on every rank (a kernel's launch shape: ranks that differ would wait for each
    other forever). None (logged, naming what for) where any rank cannot take part or the
    settings differ."""
    rank, n = pg.rank(), pg.size()
    rec = torch.zeros(88, dtype=torch.uint8)  # IPC handle, cap (int64), settings (int64), ok
    buf = err = None
    if not why:
        try:
            with _cuda.on_device(idx):
                _cuda.ensure_context(idx)
                buf = _cuda.mem_alloc(nbytes)
                err = _cuda.host_word()
                handle = _cuda.ipc_handle(buf)
            rec[:64] = torch.frombuffer(bytearray(handle), dtype=torch.uint8)
            rec[64:80] = torch.tensor([cap, settings], dtype=torch.int64).view(torch.uint8)
            rec[80] = 1
        except Exception as e:  # noqa: BLE001 - any failure turns the path off for the group
            why = f"{type(e).__name__}: {e}"
    recs = _gather(pg, rec)
    ok = [bool(recs[p][80]) for p in range(n)]
    if why or not all(ok) or len({int(recs[p][72:80].view(torch.int64)) for p in range(n)}) > 1:
        agree(pg, False)
        _say(pg, rank, what, why or (_PEER if not all(ok) else "the ranks' settings differ (the same on every rank)"))
        return None
    maps, ok = [], True
    try:
        with _cuda.on_device(idx):
            for p in range(n):
                maps.append(buf if p == rank else _cuda.open_ipc(bytes(recs[p][:64].tolist())))
    except Exception as e:  # noqa: BLE001
        why, ok = f"mapping a peer's buffer: {type(e).__name__}: {e}", False
    if not agree(pg, ok):
        _say(pg, rank, what, why or "a peer could not map the buffers")
        return None
    cap = min(int(recs[p][64:72].view(torch.int64)) for p in range(n))
    torch.cuda.synchronize(idx)  # the zeroed buffer is in place before any peer's kernel
    agree(pg, True)
    return Shared(maps, cap, err)


class StreamOrder:
    """Keeps one group's kernels on a device one after another when the caller changes
    streams: the kernels' epochs and shared buffers assume it. An op queued on a stream
    other than the previous op's waits for the previous op's event. Events come from a ring,
    so an event a caller keeps (a Work's) answers for its op or a later one, never an earlier
    one. Call under the group's CUDA lock, in the device's context."""

    def __init__(self, events: int = 64):
        self._events = [_cuda.event_create() for _ in range(events)]
        self._ops = 0
        self._stream = None  # the stream of the last op recorded

    def before(self, stream: int) -> None:
        """Order an op about to be queued on stream after the previous one."""
        if stream != self._stream:
            if self._stream is not None:
                _cuda.stream_wait_event(stream, self._events[(self._ops - 1) % len(self._events)])
            self._stream = stream

    def after(self, stream: int) -> int:
        """Record the op just queued on stream; its event."""
        ev = self._events[self._ops % len(self._events)]
        _cuda.event_record(ev, stream)
        self._ops += 1
        return ev


class KernelWork(dist._Work):
    """A kernel the shim queued (all_reduce, all_to_all_single): on stream before its event
    ev. wait() makes the current stream wait (as torch's NCCL work does); is_completed() asks
    the event, which a later op of the group may have recorded again (then it answers for
    that op: later, never early). ev is None for an op queued while capturing a graph."""

    def __init__(self, result: list[torch.Tensor], ev: int | None, stream: int, idx: int):
        super().__init__()
        self._result, self._ev, self._stream, self._idx = result, ev, stream, idx
        self._done = False

    def wait(self, timeout=None) -> bool:
        if self._ev is None:  # queued while capturing a graph: on the capturing stream
            return True
        cur = _cuda.current_stream(self._idx)
        if cur != self._stream:
            with _cuda.on_device(self._idx):
                _cuda.stream_wait_event(cur, self._ev)
        return True

    def is_completed(self) -> bool:
        if not self._done and self._ev is not None:
            with _cuda.on_device(self._idx):
                self._done = _cuda.event_done(self._ev)
        return self._done

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self) -> torch.futures.Future:
        with _cuda.on_device(self._idx):
            if self._ev is not None:
                _cuda.event_sync(self._ev)
        self._done = True
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        self.wait()


def _gather(pg, rec: torch.Tensor) -> list[torch.Tensor]:
    out = torch.empty(pg.size() * rec.numel(), dtype=torch.uint8)
    pg._allgather_base(out, rec).wait()
    return list(out.view(pg.size(), rec.numel()))


def agree(pg, ok: bool) -> bool:
    """Whether every rank says ok (a collective through the group)."""
    recs = _gather(pg, torch.tensor([1 if ok else 0], dtype=torch.uint8))
    return all(int(r[0]) for r in recs)


def _say(pg, rank: int, what: str, why: str) -> None:
    if rank == 0 or why != _PEER:
        log.info("gocomm group %r: %s goes through the sidecar: %s", pg.group_name, what, why)
