"""What a gocomm op returns: a Work that finishes when the sidecar's completion arrives (or,
for a CUDA op, that makes the caller's stream wait for it), and a _Batch standing for several."""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist


def _timeout_seconds(timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


_work_lock = threading.Lock()  # guards every Work's lazy Event/Future against _finish


class Work(dist._Work):
    """One op in flight. wait() blocks until the outputs are in the caller's tensors.

    The Event and the Future are made only when someone asks (a CUDA op is usually waited on
    through its stream, never through the host): making both costs more than the rest of a
    small op's submission."""

    def __init__(self, op: str, result: list[torch.Tensor], limit: float):
        super().__init__()
        self._op = op
        self._result = result
        self._finished = False
        self._event: threading.Event | None = None
        self._exc: BaseException | None = None
        self._fut: torch.futures.Future | None = None
        self._source = -1
        self._limit = limit  # seconds after which wait() gives up on the sidecar
        self._children: list[Work] = []
        self._cuda_wait = None  # CUDA ops: makes the current stream wait for the op

    def _finish(self, exc: BaseException | None) -> None:
        with _work_lock:
            if self._finished:
                return
            self._exc = exc
            self._finished = True
            ev, fut = self._event, self._fut
        if ev is not None:
            ev.set()
        if fut is not None:
            self._settle(fut)

    def _settle(self, fut: torch.futures.Future) -> None:
        if self._exc is None:
            fut.set_result(self._result)
        else:
            fut.set_exception(self._exc)

    def wait(self, timeout=None) -> bool:
        """Host tensors: block until the outputs are in place. CUDA tensors: make the current
        stream wait for the op (as torch's NCCL backend does) and return at once."""
        if self._cuda_wait is not None:
            if self._exc is not None:
                raise self._exc
            self._cuda_wait()
            return True
        limit = self._limit
        if timeout is not None and _timeout_seconds(timeout) > 0:
            limit = min(limit, _timeout_seconds(timeout))
        with _work_lock:
            if self._event is None:
                self._event = threading.Event()
                if self._finished:
                    self._event.set()
            ev = self._event
        if not ev.wait(limit):
            raise dist.DistBackendError(
                f"gocomm {self._op}: no completion from pgserver within {limit:.0f}s "
                "(the sidecar enforces op deadlines itself; it may be wedged)"
            )
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._exc is None

    def exception(self):
        return self._exc

    def get_future(self) -> torch.futures.Future:
        with _work_lock:
            fut = self._fut
            if fut is not None:
                return fut
            fut = self._fut = torch.futures.Future()
            settle = self._finished
        if settle:
            self._settle(fut)
        return fut

    def result(self) -> list[torch.Tensor]:
        return self._result

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        self.wait()


class _Batch(Work):
    """A Work standing for several ops (the coalesced variants)."""

    def __init__(self, op: str, works: list[Work], result: list[torch.Tensor]):
        super().__init__(op, result, max((w._limit for w in works), default=1.0))
        self._children = works
        if not works:
            self._finish(None)
        remaining = [len(works)]
        lock = threading.Lock()

        def one_done(fut, w=None):
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                exc = next((c._exc for c in works if c._exc is not None), None)
                self._finish(exc)

        for w in works:
            w.get_future().add_done_callback(one_done)

    def wait(self, timeout=None) -> bool:
        """Wait on each op (CUDA ops: the current stream waits, the host does not)."""
        for w in self._children:
            w.wait(timeout)
        return True
