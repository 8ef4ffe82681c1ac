"""The completion side of the per-op path: a per-process _Dispatcher submits descriptors into
the ring and a completion thread reads the completion ring, copies outputs back into the
caller's tensors, frees the arena space and finishes the Work and its Future."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import _sidecar, _wire
from ._work import Work

log = logging.getLogger("gocomm")

# Extra time past an op's own deadline before the shim stops waiting for the sidecar's answer
# (the sidecar enforces the deadline itself; this only guards against a wedged sidecar).
_GRACE = 30.0
_leaked: list = []  # buffers of ops the sidecar never answered: never handed back to the allocator


@dataclass
class _Pending:
    work: Work | None  # None for ops no caller waits on through a Work (_cuda_now): failures are logged
    op: str
    deadline: float
    allocs: list[tuple[int, int, int]] = field(default_factory=list)
    copy_out: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)  # alive until the op finished
    # CUDA ops that unpack their outputs on the caller's stream: recorded after the unpack;
    # the Work's future completes only once it has (the outputs are in place by then)
    unpacked: object = None
    group: object = None  # the ProcessGroupGocomm it ran on: a failure marks it broken


class _Dispatcher:
    """Per-process: submits descriptors and finishes Works from the completion ring."""

    def __init__(self, sc: _sidecar.Sidecar):
        self.sc = sc
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._stop = False
        sc.on_lost(self._fail_all)
        self._thread = threading.Thread(target=self._loop, name="gocomm-completions", daemon=True)
        self._thread.start()

    def submit(self, desc_fn, p: _Pending) -> Work:
        seq = next(self._seq)
        with self._lock:
            if self.sc.lost:
                self._release(p)
                raise dist.DistBackendError(f"gocomm {p.op}: {self.sc.lost}")
            self._pending[seq] = p
        payload = desc_fn(seq)
        while not self.sc.ring.submit(_wire.REC_OP, payload):
            if self.sc.lost:
                break  # _fail_all finishes the work
            time.sleep(20e-6)
        return p.work

    def _loop(self) -> None:
        ring = self.sc.ring
        last_check = time.monotonic()
        while not self._stop:
            recs = ring.poll()
            for typ, payload in recs:
                if typ == _wire.REC_DONE:
                    self._complete(*_wire.decode_done(payload))
            if not recs:
                now = time.monotonic()
                if now - last_check > 1.0:
                    last_check = now
                    self._expire(now)
                ring.wait(0.05)

    def _complete(self, seq: int, status: int, source: int, msg: str) -> None:
        with self._lock:
            p = self._pending.pop(seq, None)
        if p is None:
            log.error("gocomm: pgserver reported %s for unknown op %d: %s", _wire.STATUS_NAMES.get(status), seq, msg)
            return
        exc = None
        try:
            if status == _wire.STATUS_OK:
                for dst, src in p.copy_out:
                    dst.copy_(src)
                if p.unpacked is not None:
                    p.unpacked.synchronize()  # the copies behind the sidecar's op are short
                if p.work is not None:
                    p.work._source = source
            else:
                exc = _error(p.op, status, msg)
        except BaseException as e:  # never let a copy error kill the completion thread
            exc = e
        self._release(p)
        _finish(p, exc)

    def _release(self, p: _Pending) -> None:
        for seg, off, n in p.allocs:
            self.sc.arena.release(seg, off, n)
        p.allocs = []
        p.copy_out = []
        p.keep = []

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [(s, p) for s, p in self._pending.items() if now > p.deadline]
            for s, _ in late:
                del self._pending[s]
        for _, p in late:
            # The sidecar may still write into these buffers: leak them rather than reuse
            # (host staging stays allocated; CUDA tensors stay referenced for good).
            _leaked.append(p.keep)
            _finish(
                p,
                dist.DistBackendError(f"gocomm {p.op}: pgserver did not answer within its deadline plus {_GRACE:.0f}s"),
            )

    def _fail_all(self, why: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for p in pending:
            _finish(p, dist.DistBackendError(f"gocomm {p.op}: {why}"))


def _finish(p: _Pending, exc: BaseException | None) -> None:
    """Finish p's Work; without one, log a failure (nobody else would see it). A failure
    marks the group broken (the sidecar breaks it too): ops that do not pass through the
    sidecar (the shim's all_reduce kernel) raise then instead of waiting for peers."""
    if exc is not None and p.group is not None and p.group._broken is None:
        p.group._broken = exc
    if p.work is not None:
        p.work._finish(exc)
    elif exc is not None:
        log.error("%s", exc)


def _error(op: str, status: int, msg: str) -> BaseException:
    kind = _wire.STATUS_NAMES.get(status, f"status {status}")
    text = f"gocomm {op} failed ({kind}): {msg}"
    return dist.DistBackendError(text)


_dispatchers: dict[int, _Dispatcher] = {}
_dispatch_lock = threading.Lock()


def _dispatcher(sc: _sidecar.Sidecar) -> _Dispatcher:
    with _dispatch_lock:
        d = _dispatchers.get(id(sc))
        if d is None or d.sc is not sc:
            d = _Dispatcher(sc)
            _dispatchers[id(sc)] = d
        return d
