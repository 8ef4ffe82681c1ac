"""A gocomm group's in-process kernel paths: all_reduce and all_to_all_single by the
kernels this process launches itself (gocomm/_allreduce.py, gocomm/_a2av.py), each set up at
the group's first such call on a device; and the NVSHMEM unique id of the sidecar's
all_to_all_v kernel, its fallback."""

from __future__ import annotations

import collections
import logging
import time

import torch
import torch.distributed as dist

from . import _a2av, _allreduce, _capture, _cuda, _peers
from .v1 import pgserver_pb2 as pb

log = logging.getLogger("gocomm")

# The in-process kernels' part of the flight record (gocomm.flight_record()["inprocess"]): the
# last kernel launches of this process, oldest first. A launch is asynchronous: its end is
# the stream's business, and a kernel that gave up waiting for a peer shows as the group's
# next call raising. Sized by GOCOMM_TRACE_BUFFER_SIZE (the sidecar's reading, at attach).
launches: collections.deque = collections.deque(maxlen=2000)


def _launched(pg, op: str, t: torch.Tensor, idx: int) -> None:
    global launches
    if launches.maxlen != pg._sc.trace_size:
        launches = collections.deque(launches, maxlen=pg._sc.trace_size)
    launches.append(
        {
            "group": pg._group_name,
            "op": op,
            "dtype": str(t.dtype).removeprefix("torch."),
            "bytes": t.numel() * t.element_size(),
            "device": idx,
            "launched": time.time(),
        }
    )


class InProcessKernels:
    """The group's in-process kernel paths (gocomm._backend._Group holds the state: _ar, _a2av,
    _routes, _cuda_lock, _store, _shmem_ready)."""

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
            if path is None:
                self._routes.fall_back(
                    "all_reduce", f"the in-process kernel's setup declined on cuda:{idx} (logged why)"
                )
        if path is None or not path.fits(t, redop):
            return None
        if path.failed():
            self._routes.fall_back("all_reduce", "an earlier all_reduce kernel timed out; the group is aborted")
            self._fail_kernel("all_reduce")
        with self._cuda_lock, _cuda.on_device(idx):
            ev, stream = path.run(t, redop)
        _launched(self, "all_reduce", t, idx)
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
            if path is None:
                why = f"the in-process kernel's setup declined on cuda:{idx} (logged why)"
                self._routes.fall_back("all_to_all_v", why)
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
        _launched(self, "all_to_all_single", input, path.idx)
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
