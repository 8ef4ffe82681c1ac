"""The "gocomm" process group: a torch ProcessGroup whose ops run in this rank's sidecar.

Per op: check the arguments (clear TypeError/ValueError before anything is sent), stage CPU
inputs into the shared arena, write a descriptor into the submission ring, and return a Work.
A completion thread reads the completion ring, copies outputs back into the caller's tensors,
frees the arena space and finishes the Work and its Future.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import _a2av, _allreduce, _capture, _config, _cuda, _peers, _routes, _sidecar, _wire
from ._sidecar import SidecarError
from .v1 import pgserver_pb2 as pb

log = logging.getLogger("gocomm")

# Extra time past an op's own deadline before the shim stops waiting for the sidecar's answer
# (the sidecar enforces the deadline itself; this only guards against a wedged sidecar).
_GRACE = 30.0


def _timeout_seconds(timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


_work_lock = threading.Lock()  # guards every Work's lazy Event/Future against _finish
_leaked: list = []  # buffers of ops the sidecar never answered: never handed back to the allocator


def _lane(kind: int) -> int:
    """The op's pair of stream counters: 0 for collectives, 1 for send and recv."""
    return 1 if kind in (_wire.SEND, _wire.RECV) else 0


def _stream_wait(idx: int, done: int, k: int) -> None:
    """Make the current stream of device idx wait until the op's done counter reaches k."""
    with _cuda.on_device(idx):
        _cuda.wait_value(_cuda.current_stream(idx), done, k)


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


# this process's live groups, for gocomm.info()
_groups: weakref.WeakSet = weakref.WeakSet()
_dispatchers: dict[int, _Dispatcher] = {}
_dispatch_lock = threading.Lock()


def _dispatcher(sc: _sidecar.Sidecar) -> _Dispatcher:
    with _dispatch_lock:
        d = _dispatchers.get(id(sc))
        if d is None or d.sc is not sc:
            d = _Dispatcher(sc)
            _dispatchers[id(sc)] = d
        return d


class _BackendView:
    """What torch.distributed asks of a group's per-device backend (pg._get_backend(dev))."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, pg: ProcessGroupGocomm):
        self._pg = pg

    def __getattr__(self, name):
        return getattr(self._pg, name)


class ProcessGroupGocomm(dist.ProcessGroup):
    """A process group served by pgserver. Created by torch through the "gocomm" backend;
    every collective, point-to-point op and barrier of torch.distributed works on it."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        group_name: str = "",
        global_ranks: list[int] | None = None,
    ):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._timeout = max(_timeout_seconds(timeout), 0.001)
        self._group_name = group_name
        self._global_ranks = list(global_ranks or range(size))
        global_rank = self._global_ranks[rank] if rank < len(self._global_ranks) else rank
        self._sc = _sidecar.get(global_rank)
        self._disp = _dispatcher(self._sc)
        resp = self._sc.call(
            "CreateGroup",
            pb.CreateGroupRequest(
                session=self._sc.session,
                name=group_name,
                rank=rank,
                size=size,
                global_ranks=self._global_ranks,
                timeout_ms=int(self._timeout * 1000),
            ),
        )
        self._handle = resp.group
        self._slot = resp.counter_slot
        # the last stream value per lane (collectives, point to point): the slot's counters
        # never go back, so a group counts on from where the slot's previous group left them
        self._k = list(resp.counter_base) if len(resp.counter_base) == 2 else [0, 0]
        self._cuda_lock = threading.Lock()
        # Bootstrap through the group's Store: rank 0 hands out the secret peer links are
        # authenticated with; every rank publishes where its sidecar listens.
        if rank == 0:
            store.set("gocomm/secret", os.urandom(32).hex())
        secret = bytes.fromhex(store.get("gocomm/secret").decode())
        store.set(f"gocomm/boot/{rank}", resp.bootstrap)
        store.set(f"gocomm/sparse/{rank}", f"{self._sc.sparse_transport} {socket.gethostname()}")
        blobs = [store.get(f"gocomm/boot/{r}") for r in range(size)]
        # which engine runs each op (gocomm/_routes.py), from every member's sidecar's choice
        # and host, and the knobs every rank shares
        facts = _routes.Facts.agree(
            [store.get(f"gocomm/sparse/{r}").decode() for r in range(size)], _allreduce.configured_max()
        )
        self._routes = _routes.Routes(facts, group_name, self._sc.sparse_reason)
        conn = self._sc.call(
            "ConnectGroup",
            pb.ConnectGroupRequest(session=self._sc.session, group=self._handle, bootstrap=blobs, secret=secret),
        )
        self.transport = conn.transport
        self._closed = False
        # the in-process kernels of all_reduce (gocomm/_allreduce.py) and all_to_all_v
        # (gocomm/_a2av.py) per device index, where the route table sends those ops: set up at
        # the first such op on the device (collectively; GOCOMM_A2AV_INPROCESS=0 on a rank turns the
        # latter off there, for all ranks)
        self._ar: dict[int, _allreduce.Path | None] = {}
        self._a2av: dict[int, _a2av.Path | None] = {}
        self._broken: BaseException | None = None  # the first failure of an op of this group
        # the group's Store, for the NVSHMEM unique id of the sidecar's all_to_all_v kernel
        # (_shmem_id), handed over at the group's first such op
        self._store = store
        self._shmem_ready = False
        _groups.add(self)
        log.info("gocomm group %r rank %d/%d on handle %d via %s", group_name, rank, size, self._handle, conn.transport)

    # ----- identity -------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return "gocomm"

    def name(self) -> str:
        return "gocomm"

    # torch keeps a group's name on the C++ backends registered with it; this group registers
    # none, so the base class's group_name raises "ProcessGroup name not set" (and with it
    # dist.destroy_process_group(subgroup)). Keep the name here instead.
    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def __repr__(self) -> str:
        return f"ProcessGroupGocomm(rank={self._rank}, size={self._size}, name={self._group_name!r})"

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device=None) -> _BackendView:
        return _BackendView(self)

    @property
    def options(self):
        return None

    # ----- plumbing -------------------------------------------------------------------------

    def _submit(
        self,
        op: str,
        kind: int,
        dtype: torch.dtype | None,
        *,
        count: int = 0,
        redop: int = 0,
        root: int = 0,
        tag: int = 0,
        inputs: list[list[torch.Tensor] | None] = (),
        outputs: list[tuple[int, list[torch.Tensor]]] = (),
        splits: list[int] | None = None,
        result: list[torch.Tensor] | None = None,
        timeout=None,
    ) -> Work:
        """Stage buffers and submit one op.

        inputs: one entry per descriptor buffer: the tensors packed into it (copied in), or
        None for a buffer that only receives (its size comes from outputs).
        outputs: (buffer index, tensors) whose bytes are copied back from that buffer, in
        order, when the op succeeds.
        """
        if self._closed:
            raise ValueError(f"gocomm {op}: the process group was destroyed")
        direct = _direct_buffers(inputs, outputs)
        if direct is not None and all(t.is_cuda for t in direct):
            return self._cuda_direct(
                op,
                kind,
                direct,
                dtype=dtype,
                count=count,
                redop=redop,
                root=root,
                tag=tag,
                splits=splits,
                result=result,
                timeout=timeout,
            )
        t_limit = self._timeout
        if timeout is not None and _timeout_seconds(timeout) > 0:
            t_limit = _timeout_seconds(timeout)
        work = Work(op, result if result is not None else [], t_limit + _GRACE)
        p = _Pending(work, op, time.monotonic() + t_limit + _GRACE, group=self)
        out_for = {i: ts for i, ts in outputs}
        first = next((ts[0] for ts in list(inputs) + list(out_for.values()) if ts), None)
        if first is not None and first.device.type == "cuda":
            return self._submit_cuda(
                op, kind, dtype, count, redop, root, tag, inputs, out_for, splits, t_limit, timeout, p
            )
        bufs = []
        arena = self._sc.arena
        try:
            for i, ins in enumerate(inputs):
                tensors = ins if ins is not None else out_for[i]
                nbytes = sum(t.nbytes for t in tensors)
                seg, off, view = arena.alloc(nbytes)
                p.allocs.append((seg, off, nbytes))
                bufs.append((seg, off, nbytes))
                if ins is not None:
                    pos = 0
                    for t in tensors:
                        view[pos : pos + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
                        pos += t.nbytes
            for i, ts in outputs:
                seg, off, nbytes = bufs[i]
                view = arena._segs[seg].bytes[off : off + nbytes]
                pos = 0
                for t in ts:
                    p.copy_out.append((t, view[pos : pos + t.nbytes].view(t.dtype).view(t.shape)))
                    pos += t.nbytes
        except BaseException:
            self._disp._release(p)
            raise
        dt = _wire.DTYPES[dtype] if dtype is not None else 0
        timeout_ms = int(t_limit * 1000) if timeout is not None else 0
        return self._disp.submit(
            lambda seq: _wire.encode_desc(
                seq, self._handle, kind, dt, redop, root, tag, count, timeout_ms, bufs, splits
            ),
            p,
        )

    def _cuda_direct(
        self,
        op: str,
        kind: int,
        bufs: list[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        count: int = 0,
        redop: int = 0,
        root: int = 0,
        tag: int = 0,
        splits: list[int] | None = None,
        result: list[torch.Tensor] | None = None,
        timeout=None,
    ) -> Work:
        """_submit_cuda for ops whose buffers are the caller's tensors as they are (no packing):
        the same steps without the general case's bookkeeping, which is most of a small op's
        host time. dtype defaults to the first buffer's, result to the last buffer. Called by
        _submit, which has checked that the group is open."""
        if _capture.capturing():
            _capture.refuse(op, self, _capture.SIDECAR)
        self._need_slot(op)
        t0 = bufs[0]
        idx = t0.get_device()
        for t in bufs:
            if t.get_device() != idx:
                raise ValueError(f"gocomm {op}: tensors on {t.device} and {t0.device}; one op runs on one device")
        t_limit = _timeout_seconds(timeout) if timeout is not None and _timeout_seconds(timeout) > 0 else self._timeout
        sc = self._sc
        refs = [sc.cuda_segment(t) for t in bufs]
        work = Work(op, result if result is not None else [bufs[-1]], t_limit + _GRACE)
        p = _Pending(work, op, time.monotonic() + t_limit + _GRACE, group=self)
        p.keep = bufs
        dt = _wire.DTYPES[dtype if dtype is not None else t0.dtype]
        timeout_ms = int(t_limit * 1000) if timeout is not None else 0
        handle = self._handle
        done, k = self._enqueue_cuda(
            kind,
            t0.device,
            p,
            lambda seq, k: _wire.encode_desc(
                seq, handle, kind, dt, redop, root, tag, count, timeout_ms, refs, splits, _wire.DEVICE_CUDA, k
            ),
        )
        work._cuda_wait = lambda: _stream_wait(idx, done, k)
        return work

    def _cuda_now(self, op: str, kind: int, refs: list[tuple[int, int, int]], keep: list, idx: int, count: int) -> None:
        """_cuda_direct for an op whose caller waits at once and never sees a Work (the
        sparse all-to-all): refs are the buffers already named (cuda_ref), keep what must
        stay alive until the op finished, idx their device. The caller's current stream
        waits for the op before this returns; the op's failure, if any, is logged (the
        sidecar breaks the group then, so the group's next op raises). A Work, its closure
        and the views of a small op cost tens of microseconds of host time each."""
        if self._closed:
            raise ValueError(f"gocomm {op}: the process group was destroyed")
        if _capture.capturing():
            _capture.refuse(op, self, "it runs in the sidecar's NVSHMEM kernel, which is handed each call on the host")
        self._need_slot(op)
        p = _Pending(None, op, time.monotonic() + self._timeout + _GRACE, group=self)
        p.keep = keep
        handle, dt = self._handle, _wire.DTYPES[keep[0].dtype]
        done, k = self._enqueue_cuda(
            kind,
            keep[0].device,
            p,
            lambda seq, k: _wire.encode_desc(
                seq, handle, kind, dt, 0, 0, 0, count, 0, refs, None, _wire.DEVICE_CUDA, k
            ),
        )
        _stream_wait(idx, done, k)

    def _need_slot(self, op: str) -> None:
        """Raise unless this group has stream counters in the sidecar (CUDA ops need them)."""
        if self._slot < 0:
            raise RuntimeError(
                f"gocomm {op}: this process has more groups using CUDA tensors than the sidecar has counters for"
            )

    def _enqueue_cuda(self, kind: int, device: torch.device, p: _Pending, desc) -> tuple[int, int]:
        """Hand the sidecar an op whose buffers need no packing, ordered on device's current
        stream: under the lock, the lane's next value k, its stream write (ready = k) and the
        descriptor desc(seq, k) stay in step. Returns (the address of the op's done counter, k)."""
        lane = _lane(kind)
        ready = self._sc.attach_device(device) + 16 * self._slot + 8 * lane
        idx = device.index
        with self._cuda_lock, _cuda.on_device(idx):
            k = self._next_value(lane)
            _cuda.write_value(_cuda.current_stream(idx), ready, k)
            self._disp.submit(lambda seq: desc(seq, k), p)
        return ready + 4, k

    def _next_value(self, lane: int) -> int:
        """The stream value of the lane's next op (u32, wrapping); call under _cuda_lock."""
        self._k[lane] = (self._k[lane] + 1) & 0xFFFFFFFF
        return self._k[lane]

    def _submit_cuda(self, op, kind, dtype, count, redop, root, tag, inputs, out_for, splits, t_limit, timeout, p):
        """The CUDA form of _submit: no staging; ordered on the caller's current stream.

        On the current stream S: pack list inputs into a flat buffer; write ready = k to the
        group's counter; (the sidecar waits for it, runs NCCL on the tensors' memory, writes
        done = k). Ops with list outputs also make S wait for done and unpack, and record an
        event for wait(); the others leave S alone until wait() makes the current stream
        wait for done >= k. Every tensor stays referenced until the GPU finished the op, so
        the caching allocator cannot hand its memory out while the sidecar uses it.
        """
        if _capture.capturing():
            _capture.refuse(op, self, _capture.SIDECAR)
        sc = self._sc
        self._need_slot(op)
        tensors = [t for ts in list(inputs) + list(out_for.values()) if ts for t in ts]
        dev = tensors[0].device
        for t in tensors:
            if t.device != dev:
                raise ValueError(f"gocomm {op}: tensors on {t.device} and {dev}; one op runs on one device")
        counters = sc.attach_device(dev) + 16 * self._slot
        raw = _cuda.current_stream(dev.index)
        lane = _lane(kind)
        bufs, keep, unpack = [], list(tensors), []
        for i, ins in enumerate(inputs):
            ts = ins if ins is not None else out_for[i]
            outs = out_for.get(i)
            if len(ts) == 1 and (outs is None or (len(outs) == 1 and outs[0] is ts[0])):
                buf = ts[0]
            else:
                buf = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=dev)
                if ins is not None:
                    torch.cat([t.reshape(-1) for t in ins], out=buf)
                if outs is not None:
                    unpack.append((buf, outs))
                keep.append(buf)
            bufs.append(sc.cuda_segment(buf))
        dt = _wire.DTYPES[dtype] if dtype is not None else 0
        timeout_ms = int(t_limit * 1000) if timeout is not None else 0
        p.keep = keep
        with self._cuda_lock, _cuda.on_device(dev.index):
            k = self._next_value(lane)
            ready, done = counters + 8 * lane, counters + 8 * lane + 4
            _cuda.write_value(raw, ready, k)
            if unpack:
                # Queued before the descriptor goes out, so the unpack event is recorded
                # before the sidecar can report the op done (the completion waits for it).
                _cuda.wait_value(raw, done, k)
                for buf, outs in unpack:
                    pos = 0
                    for t in outs:
                        t.copy_(buf[pos : pos + t.numel()].view(t.shape))
                        pos += t.numel()
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                p.unpacked = ev
            work = self._disp.submit(
                lambda seq: _wire.encode_desc(
                    seq, self._handle, kind, dt, redop, root, tag, count, timeout_ms, bufs, splits, _wire.DEVICE_CUDA, k
                ),
                p,
            )
        if unpack:
            work._cuda_wait = lambda: torch.cuda.current_stream(dev).wait_event(ev)
        else:
            idx = dev.index
            work._cuda_wait = lambda: _stream_wait(idx, done, k)
        return work

    def _sparse_transport(self) -> str:
        """This group's sparse all-to-all transport ("nvshmem" or "nccl"): NVSHMEM where every
        member's sidecar chose it when its client attached, and all are on one host."""
        return self._routes.transport

    # ----- collectives ------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        t = _single("all_reduce", "tensor", tensors)
        redop = _redop("all_reduce", opts, t)
        if self._routes.ar_inprocess and t.is_cuda:
            w = self._allreduce_inprocess(t, redop)
            if w is not None:
                return w
        return self._submit(
            "all_reduce",
            _wire.ALL_REDUCE,
            t.dtype,
            count=t.numel(),
            redop=redop,
            inputs=[[t]],
            outputs=[(0, [t])],
            result=[t],
            timeout=_opt_timeout(opts),
        )

    def _allreduce_inprocess(self, t: torch.Tensor, redop: int):
        """all_reduce of t by a kernel in this process (gocomm/_allreduce.py), or None where
        that path does not take it. The choice depends only on what every rank of the
        group shares (size, dtype, op, device setup), so the ranks agree."""
        if self._closed or self._broken is not None or self._sc.lost:
            return None  # the sidecar path raises (destroyed group, the group's error, sidecar lost)
        idx = t.get_device()
        path = self._ar.get(idx, False)
        if path is False:
            if _capture.capturing():
                _capture.refuse_setup("all_reduce", self, idx)
            path = self._ar[idx] = _allreduce.setup(self, t.device)
        if path is None or not path.fits(t, redop):
            return None
        if path.failed():
            self._routes.fall_back("all_reduce", "an earlier all_reduce kernel timed out; the group is aborted")
            self._fail_kernel("all_reduce")
        with self._cuda_lock, _cuda.on_device(idx):
            ev, stream = path.run(t, redop)
        return _peers.KernelWork([t], ev, stream, idx)

    def _a2av_path(self, idx: int):
        """The shim's all_to_all_v kernel on device idx (gocomm/_a2av.py; set up, collectively,
        at the group's first call there), or None where the group does not take it. Raises
        (and aborts the group) once one of its kernels gave up waiting for a peer."""
        if not self._routes.a2a_inprocess or self._closed or self._broken is not None or self._sc.lost:
            return None  # the other paths raise (destroyed group, the group's error, sidecar lost)
        path = self._a2av.get(idx, False)
        if path is False:
            if _capture.capturing():
                _capture.refuse_setup("all_to_all_v / all_to_all_single", self, idx)
            path = self._a2av[idx] = _a2av.setup(self, idx, self._sc.a2a)
        if path is not None and path.failed():
            self._routes.fall_back("all_to_all_v", "an earlier all_to_all_v kernel timed out; the group is aborted")
            self._fail_kernel("all_to_all_v")
        return path

    def _all_to_all_single_inprocess(self, output: torch.Tensor, input: torch.Tensor, ins: list[int]):
        """all_to_all_single of CUDA tensors by the shim's all_to_all_v kernel, one-sided
        over NVLink (gocomm/_a2av.py; the host's splits ride in the launch's arguments: no
        copy, no host sync, capturable once the group's first call on the device ran), or
        None where the group does not take it. The choice depends only on what every rank of
        the group shares (its transport and the path's collective setup), so the ranks agree;
        any output size works (rows that do not fit the receive buffer at once pass through
        it in rounds). Splits that disagree between ranks (a peer sends other than
        output_split_sizes says) are not checked, as with NCCL: where more arrives than the
        output holds the kernel writes nothing into it; where less arrives, the rows land
        where the senders' splits put them."""
        if output.device != input.device:
            raise ValueError(f"gocomm all_to_all_single: output is on {output.device}, input on {input.device}")
        path = self._a2av_path(input.get_device())
        if path is None:
            return None
        row = _a2av.row_bytes("all_to_all_single", input, output.shape[0])
        path.report(self._group_name)
        with self._cuda_lock, _cuda.on_device(path.idx):
            ev, stream = path.run(input, ins, output, None, row)
        return _peers.KernelWork([output], ev, stream, path.idx)

    def _shmem_id(self, device: torch.device) -> None:
        """Carry the group's NVSHMEM unique id from rank 0's sidecar (the bootstrap's root,
        which makes it) to every other rank's through the group's torch Store. Collective:
        each rank calls it before the group's first all_to_all_v in the sidecar's NVSHMEM
        kernel, which makes the PE with the id. A rank 0 that cannot make one says so through
        the Store, so the other ranks raise at once instead of at the Store's timeout."""
        if self._shmem_ready:
            return
        self._need_slot("all_to_all_v")
        self._sc.attach_device(device)
        key = "gocomm/nvshmem_uid"
        req = pb.ShmemIDRequest(session=self._sc.session, group=self._handle)
        if self._rank == 0:
            try:
                uid = self._sc.call("ShmemID", req).id
            except BaseException:
                self._store.set(key, b"")
                raise
            self._store.set(key, uid)
        else:
            uid = self._store.get(key)
            if not uid:
                raise RuntimeError(
                    f"gocomm all_to_all_v on group {self._group_name!r}: rank 0 could not make the NVSHMEM "
                    "unique id (its error says why)"
                )
            req.id = uid
            self._sc.call("ShmemID", req)
        self._shmem_ready = True

    def _fail_kernel(self, op: str) -> None:
        """Abort the group and raise: a kernel of op in this process timed out waiting for a peer."""
        why = (
            f"gocomm {op} on group {self._group_name!r}: an earlier {op} timed out "
            f"after {self._timeout:.0f}s waiting for a peer; its result was not valid and the group is aborted"
        )
        try:
            self.abort()
        except Exception as e:  # noqa: BLE001
            log.warning("gocomm: aborting group %r: %s", self._group_name, e)
        raise dist.DistBackendError(why)

    def allreduce_coalesced(self, tensors, opts=None):
        ts = _tensor_list("all_reduce_coalesced", "tensors", tensors)
        if not ts:
            return _Batch("all_reduce_coalesced", [], [])
        _same_dtype("all_reduce_coalesced", "tensors", ts)
        redop = _redop("all_reduce_coalesced", opts, ts[0])
        return self._submit(
            "all_reduce_coalesced",
            _wire.ALL_REDUCE,
            ts[0].dtype,
            count=sum(t.numel() for t in ts),
            redop=redop,
            inputs=[ts],
            outputs=[(0, ts)],
            result=ts,
            timeout=_opt_timeout(opts),
        )

    def broadcast(self, tensors, opts=None):
        t = _single("broadcast", "tensor", tensors)
        root = _root("broadcast", opts, self._size)
        me = root == self._rank
        return self._submit(
            "broadcast",
            _wire.BROADCAST,
            t.dtype,
            count=t.numel(),
            root=root,
            inputs=[[t] if me else None],
            outputs=[] if me else [(0, [t])],
            result=[t],
            timeout=_opt_timeout(opts),
        )

    def reduce(self, tensors, opts=None):
        t = _single("reduce", "tensor", tensors)
        redop = _redop("reduce", opts, t)
        root = _root("reduce", opts, self._size)
        return self._submit(
            "reduce",
            _wire.REDUCE,
            t.dtype,
            count=t.numel(),
            redop=redop,
            root=root,
            inputs=[[t]],
            outputs=[(0, [t])] if root == self._rank else [],
            result=[t],
            timeout=_opt_timeout(opts),
        )

    def allgather(self, output_tensors, input_tensors, opts=None):
        t = _single("all_gather", "tensor", input_tensors)
        outs = _output_list("all_gather", "tensor_list", output_tensors, t, self._size)
        return self._submit(
            "all_gather",
            _wire.ALL_GATHER,
            t.dtype,
            count=t.numel(),
            inputs=[[t], None],
            outputs=[(1, outs)],
            result=outs,
            timeout=_opt_timeout(opts),
        )

    def _allgather_base(self, output, input, opts=None):
        _check("all_gather_into_tensor", "input_tensor", input)
        _check("all_gather_into_tensor", "output_tensor", output)
        _match_dtype("all_gather_into_tensor", "output_tensor", output, input)
        if output.numel() != self._size * input.numel():
            raise ValueError(
                f"gocomm all_gather_into_tensor: output_tensor has {output.numel()} elements, "
                f"want world_size * input numel = {self._size} * {input.numel()}"
            )
        return self._submit(
            "all_gather_into_tensor",
            _wire.ALL_GATHER,
            input.dtype,
            count=input.numel(),
            inputs=[[input], None],
            outputs=[(1, [output])],
            result=[output],
            timeout=_opt_timeout(opts),
        )

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _Batch("all_gather_into_tensor_coalesced", works, list(outputs))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """dist.all_gather_coalesced: output_lists[r][j] receives rank r's input_list[j]. One
        all_gather of every input packed end to end: rank r's block of the result is its
        inputs in order, which is output_lists[r] flattened in order. CPU tensors only, as
        torch's NCCL backend has no all_gather_coalesced either."""
        op = "all_gather_coalesced"
        ins = _tensor_list(op, "input_tensor_list", input_list)
        if any(t.is_cuda for t in ins):
            raise NotImplementedError(
                f"gocomm {op}: CUDA tensors are not supported (torch's NCCL backend has no all_gather_coalesced "
                "either); use all_gather_into_tensor, or all_gather per tensor"
            )
        _same_dtype(op, "input_tensor_list", ins)
        if not isinstance(output_lists, (list, tuple)) or len(output_lists) != self._size:
            n = len(output_lists) if isinstance(output_lists, (list, tuple)) else type(output_lists).__name__
            raise ValueError(f"gocomm {op}: output_tensor_lists has {n} lists, want one per rank ({self._size})")
        outs = []
        for r, lst in enumerate(output_lists):
            ts = _tensor_list(op, f"output_tensor_lists[{r}]", lst)
            if len(ts) != len(ins):
                raise ValueError(
                    f"gocomm {op}: output_tensor_lists[{r}] has {len(ts)} tensors, input_tensor_list {len(ins)}"
                )
            for j, (o, i) in enumerate(zip(ts, ins, strict=True)):
                _match_dtype(op, f"output_tensor_lists[{r}][{j}]", o, i)
                if o.numel() != i.numel():
                    raise ValueError(
                        f"gocomm {op}: output_tensor_lists[{r}][{j}] has {o.numel()} elements, "
                        f"input_tensor_list[{j}] has {i.numel()}"
                    )
            outs.extend(ts)
        if not ins:
            return _Batch(op, [], [])
        return self._submit(
            op,
            _wire.ALL_GATHER,
            ins[0].dtype,
            count=sum(t.numel() for t in ins),
            inputs=[ins, None],
            outputs=[(1, outs)],
            result=outs,
            timeout=_opt_timeout(opts),
        )

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out = _single("reduce_scatter", "output", output_tensors)
        if not isinstance(input_tensors, (list, tuple)) or len(input_tensors) != 1:
            raise ValueError("gocomm reduce_scatter: expected one input list")
        ins = _output_list("reduce_scatter", "input_list", input_tensors, out, self._size)
        redop = _redop("reduce_scatter", opts, out)
        return self._submit(
            "reduce_scatter",
            _wire.REDUCE_SCATTER,
            out.dtype,
            count=out.numel(),
            redop=redop,
            inputs=[ins, None],
            outputs=[(1, [out])],
            result=[out],
            timeout=_opt_timeout(opts),
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        _check("reduce_scatter_tensor", "input", input)
        _check("reduce_scatter_tensor", "output", output)
        _match_dtype("reduce_scatter_tensor", "output", output, input)
        if input.numel() != self._size * output.numel():
            raise ValueError(
                f"gocomm reduce_scatter_tensor: input has {input.numel()} elements, "
                f"want world_size * output numel = {self._size} * {output.numel()}"
            )
        redop = _redop("reduce_scatter_tensor", opts, output)
        return self._submit(
            "reduce_scatter_tensor",
            _wire.REDUCE_SCATTER,
            output.dtype,
            count=output.numel(),
            redop=redop,
            inputs=[[input], None],
            outputs=[(1, [output])],
            result=[output],
            timeout=_opt_timeout(opts),
        )

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _Batch("reduce_scatter_tensor_coalesced", works, list(outputs))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        op = "all_to_all_single"
        _check(op, "input", input)
        _check(op, "output", output)
        _match_dtype(op, "output", output, input)
        n = self._size
        if input.dim() == 0 or output.dim() == 0:
            raise ValueError(f"gocomm {op}: input and output need at least one dimension to split")
        if input.shape[1:] != output.shape[1:]:
            raise ValueError(
                f"gocomm {op}: output rows have shape {tuple(output.shape[1:])}, input rows "
                f"{tuple(input.shape[1:])}; they must match"
            )
        row = input[0].numel() if input.shape[0] else max(1, int(torch.Size(input.shape[1:]).numel()))
        ins = _splits(op, "input_split_sizes", input_split_sizes, input.shape[0], n)
        outs = _splits(op, "output_split_sizes", output_split_sizes, output.shape[0], n)
        if ins[self._rank] != outs[self._rank]:
            raise ValueError(
                f"gocomm {op}: rank {self._rank} sends itself {ins[self._rank]} rows "
                f"(input_split_sizes) but expects {outs[self._rank]} (output_split_sizes)"
            )
        if input.is_cuda:
            w = self._all_to_all_single_inprocess(output, input, ins)
            if w is not None:
                return w
        me = self._rank
        if input.device.type == "cpu" and n > 1 and ins[me]:
            # This rank's own block never leaves the process: copy it here and stage only
            # the blocks for the peers (one copy instead of three through shared memory).
            def blocks(t, splits):
                offs = [sum(splits[:j]) for j in range(n)]
                return [t.narrow(0, offs[j], splits[j]) for j in range(n) if j != me]

            out_off, in_off = sum(outs[:me]), sum(ins[:me])
            output.narrow(0, out_off, outs[me]).copy_(input.narrow(0, in_off, ins[me]))
            no_self = [0 if j == me else 1 for j in range(n)]
            return self._submit(
                op,
                _wire.ALL_TO_ALL,
                input.dtype,
                inputs=[blocks(input, ins), None],
                outputs=[(1, blocks(output, outs))],
                splits=[s * row * k for s, k in zip(ins, no_self, strict=True)]
                + [s * row * k for s, k in zip(outs, no_self, strict=True)],
                result=[output],
                timeout=_opt_timeout(opts),
            )
        return self._submit(
            op,
            _wire.ALL_TO_ALL,
            input.dtype,
            inputs=[[input], None],
            outputs=[(1, [output])],
            splits=[s * row for s in ins] + [s * row for s in outs],
            result=[output],
            timeout=_opt_timeout(opts),
        )

    def alltoall(self, output_tensors, input_tensors, opts=None):
        op = "all_to_all"
        ins = _tensor_list(op, "input_tensor_list", input_tensors)
        outs = _tensor_list(op, "output_tensor_list", output_tensors)
        n = self._size
        if len(ins) != n or len(outs) != n:
            raise ValueError(f"gocomm {op}: {len(ins)} inputs and {len(outs)} outputs, want {n} each")
        _same_dtype(op, "input_tensor_list", ins)
        for o in outs:
            _match_dtype(op, "output_tensor_list", o, ins[0])
        if ins[self._rank].numel() != outs[self._rank].numel():
            raise ValueError(
                f"gocomm {op}: input {self._rank} has {ins[self._rank].numel()} elements but "
                f"output {self._rank} has {outs[self._rank].numel()}"
            )
        me = self._rank
        if ins[0].device.type == "cpu" and n > 1:
            # as in all_to_all_single: the own block is copied here, not staged
            outs[me].copy_(ins[me].view(outs[me].shape))
            return self._submit(
                op,
                _wire.ALL_TO_ALL,
                ins[0].dtype,
                inputs=[[t for j, t in enumerate(ins) if j != me], None],
                outputs=[(1, [t for j, t in enumerate(outs) if j != me])],
                splits=[0 if j == me else t.numel() for j, t in enumerate(ins)]
                + [0 if j == me else t.numel() for j, t in enumerate(outs)],
                result=outs,
                timeout=_opt_timeout(opts),
            )
        return self._submit(
            op,
            _wire.ALL_TO_ALL,
            ins[0].dtype,
            inputs=[ins, None],
            outputs=[(1, outs)],
            splits=[t.numel() for t in ins] + [t.numel() for t in outs],
            result=outs,
            timeout=_opt_timeout(opts),
        )

    def gather(self, output_tensors, input_tensors, opts=None):
        t = _single("gather", "tensor", input_tensors)
        root = _root("gather", opts, self._size)
        if root == self._rank:
            outs = _output_list("gather", "gather_list", output_tensors, t, self._size)
            inputs, outputs = [[t], None], [(1, outs)]
        else:
            if output_tensors and any(len(o) for o in output_tensors):
                raise ValueError("gocomm gather: gather_list must be given on the destination rank only")
            outs, inputs, outputs = [], [[t]], []
        return self._submit(
            "gather",
            _wire.GATHER,
            t.dtype,
            count=t.numel(),
            root=root,
            inputs=inputs,
            outputs=outputs,
            result=outs,
            timeout=_opt_timeout(opts),
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        t = _single("scatter", "tensor", output_tensors)
        root = _root("scatter", opts, self._size)
        if root == self._rank:
            ins = _output_list("scatter", "scatter_list", input_tensors, t, self._size)
            inputs = [None, ins]
        else:
            if input_tensors and any(len(i) for i in input_tensors):
                raise ValueError("gocomm scatter: scatter_list must be given on the source rank only")
            inputs = [None]
        return self._submit(
            "scatter",
            _wire.SCATTER,
            t.dtype,
            count=t.numel(),
            root=root,
            inputs=inputs,
            outputs=[(0, [t])],
            result=[t],
            timeout=_opt_timeout(opts),
        )

    def barrier(self, opts=None):
        return self._submit("barrier", _wire.BARRIER, None, timeout=_opt_timeout(opts))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._submit("monitored_barrier", _wire.BARRIER, None, timeout=timeout).wait()

    # ----- point to point -----------------------------------------------------------------

    def send(self, tensors, dst, tag=0):
        t = _single("send", "tensor", tensors)
        self._peer("send", "dst", dst)
        return self._submit("send", _wire.SEND, t.dtype, count=t.numel(), root=dst, tag=tag, inputs=[[t]], result=[t])

    def recv(self, tensors, src, tag=0):
        t = _single("recv", "tensor", tensors)
        self._peer("recv", "src", src)
        return self._submit(
            "recv",
            _wire.RECV,
            t.dtype,
            count=t.numel(),
            root=src,
            tag=tag,
            inputs=[None],
            outputs=[(0, [t])],
            result=[t],
        )

    def recv_anysource(self, tensors, tag=0):
        t = _single("recv", "tensor", tensors)
        if t.device.type == "cuda":
            raise ValueError("gocomm recv: a CUDA tensor needs a source rank (NCCL has no receive from any rank)")
        return self._submit(
            "recv",
            _wire.RECV,
            t.dtype,
            count=t.numel(),
            root=-1,
            tag=tag,
            inputs=[None],
            outputs=[(0, [t])],
            result=[t],
        )

    def _peer(self, op: str, name: str, peer) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self._size:
            raise ValueError(f"gocomm {op}: {name}={peer!r} is not a rank of this group of {self._size}")
        if peer == self._rank:
            raise ValueError(f"gocomm {op}: {name}={peer} is this rank")

    # ----- lifetime -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the group: pending ops fail, peer links close."""
        if self._closed:
            return
        self._closed = True
        if self._sc.lost:
            return
        try:
            self._sc.call(
                "DestroyGroup", pb.DestroyGroupRequest(session=self._sc.session, group=self._handle), timeout=30
            )
        except SidecarError as e:
            log.warning("gocomm: destroying group %r: %s", self._group_name, e)

    def abort(self) -> None:
        """Fail everything pending on the group, on this rank and its peers."""
        if self._closed or self._sc.lost:
            return
        self._sc.call("Abort", pb.AbortRequest(session=self._sc.session, group=self._handle, reason="abort()"))
        self.shutdown()

    def stats(self) -> dict:
        """This group's counters from the sidecar."""
        resp = self._sc.call("Stats", pb.StatsRequest(session=self._sc.session))
        for g in resp.groups:
            if g.group == self._handle:
                return {
                    "ops": dict(g.ops),
                    "errors": g.errors,
                    "bytes_sent": g.bytes_sent,
                    "bytes_received": g.bytes_received,
                }
        return {}


def _direct_buffers(inputs, outputs) -> list[torch.Tensor] | None:
    """The op's buffers when each is one caller tensor used as it is (an output, if any, being
    that same tensor); None when some buffer packs several tensors."""
    out_for = dict(outputs)
    bufs = []
    for i, ins in enumerate(inputs):
        outs = out_for.get(i)
        if ins is None:
            if outs is None or len(outs) != 1:
                return None
            bufs.append(outs[0])
        elif len(ins) != 1 or (outs is not None and (len(outs) != 1 or outs[0] is not ins[0])):
            return None
        else:
            bufs.append(ins[0])
    return bufs or None


# ----- argument checks (before anything is sent) -------------------------------------------------


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


def create(dist_opts, backend_opts=None) -> ProcessGroupGocomm:
    """The creator torch calls for backend="gocomm" (extended API)."""
    return ProcessGroupGocomm(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        group_name=str(dist_opts.group_id),
        global_ranks=list(dist_opts.global_ranks_in_group),
    )
