"""The hand-off of an op to the sidecar: stage CPU inputs into the shared arena (or, for CUDA
tensors, order the op on the caller's stream by stream counters), write a descriptor into the
submission ring, and return a Work. ProcessGroupGocomm takes these methods from SidecarSubmit."""

from __future__ import annotations

import time

import torch

from . import _capture, _cuda, _wire
from ._dispatch import _GRACE, _Pending
from ._work import Work, _timeout_seconds


def _lane(kind: int) -> int:
    """The op's pair of stream counters: 0 for collectives, 1 for send and recv."""
    return 1 if kind in (_wire.SEND, _wire.RECV) else 0


def _stream_wait(idx: int, done: int, k: int) -> None:
    """Make the current stream of device idx wait until the op's done counter reaches k."""
    with _cuda.on_device(idx):
        _cuda.wait_value(_cuda.current_stream(idx), done, k)


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


def _stage(arena, p: _Pending, inputs, outputs, out_for: dict) -> list[tuple[int, int, int]]:
    """Stage a host op's buffers in the shared arena (as _submit's inputs and outputs say):
    copy each input's tensors in, and record in p the arena space (freed when the op
    finishes) and the views each output tensor is copied back from. Returns the buffers as
    (segment, offset, bytes)."""
    bufs = []
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
    return bufs


class SidecarSubmit:
    """ProcessGroupGocomm's submission plumbing (it holds the group's state: _sc, _disp,
    _handle, _slot, _k, _cuda_lock, _timeout, _closed)."""

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
        try:
            bufs = _stage(self._sc.arena, p, inputs, outputs, out_for)
        except BaseException:
            self._disp._release(p)
            raise
        dt = _wire.DTYPES[dtype] if dtype is not None else 0
        timeout_ms = _wire.timeout_ms(t_limit) if timeout is not None else 0
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
        timeout_ms = _wire.timeout_ms(t_limit) if timeout is not None else 0
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
            _capture.refuse(op, self, _capture.SIDECAR_NVSHMEM)
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
        timeout_ms = _wire.timeout_ms(t_limit) if timeout is not None else 0
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
