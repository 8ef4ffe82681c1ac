"""The "gocomm" process group: a torch ProcessGroup whose ops run in this rank's sidecar, or,
on groups whose GPUs share NVLink, in kernels this process launches itself.

Per op: check the arguments (_args.py: clear TypeError/ValueError before anything is sent),
take the group's route (_routes.py): an in-process kernel (_inprocess.py) or the sidecar:
stage the inputs and write a descriptor into the submission ring (_submit.py), and return a
Work (_work.py). A completion thread reads the completion ring, copies outputs back into the
caller's tensors and finishes the Work and its Future (_dispatch.py).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import weakref

import torch
import torch.distributed as dist

from . import _a2av, _allreduce, _routes, _sidecar, _wire
from ._args import (
    _check,
    _match_dtype,
    _opt_timeout,
    _output_list,
    _peer,
    _redop,
    _root,
    _same_dtype,
    _single,
    _splits,
    _tensor_list,
)
from ._dispatch import _dispatcher
from ._inprocess import InProcessKernels
from ._sidecar import SidecarError
from ._submit import SidecarSubmit
from ._work import _Batch, _timeout_seconds
from .v1 import pgserver_pb2 as pb

log = logging.getLogger("gocomm")


# this process's live groups, for gocomm.info()
_groups: weakref.WeakSet = weakref.WeakSet()


class _BackendView:
    """What torch.distributed asks of a group's per-device backend (pg._get_backend(dev))."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, pg: ProcessGroupGocomm):
        self._pg = pg

    def __getattr__(self, name):
        return getattr(self._pg, name)


class ProcessGroupGocomm(SidecarSubmit, InProcessKernels, dist.ProcessGroup):
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
        try:
            if rank == 0:
                store.set("gocomm/secret", os.urandom(32).hex())
            secret = bytes.fromhex(store.get("gocomm/secret").decode())
            store.set(f"gocomm/boot/{rank}", resp.bootstrap)
            store.set(f"gocomm/sparse/{rank}", f"{self._sc.sparse_transport} {socket.gethostname()}")
            blobs = [store.get(f"gocomm/boot/{r}") for r in range(size)]
            sparse = [store.get(f"gocomm/sparse/{r}").decode() for r in range(size)]
        except (dist.DistError, RuntimeError) as e:
            # the Store's host (rank 0's process under env:// and tcp://) died or went away:
            # say so, instead of the socket's own words, and leave the group to no one
            self._sc.call("DestroyGroup", pb.DestroyGroupRequest(session=self._sc.session, group=self._handle))
            raise dist.DistBackendError(
                f"gocomm: creating group {group_name!r} (rank {rank} of {size}): the torch Store stopped answering "
                f"({type(e).__name__}: {e}); its host (rank 0 under env:// and tcp://) may have died"
            ) from e
        # which engine runs each op (gocomm/_routes.py), from every member's sidecar's choice
        # and host, and the knobs every rank shares
        facts = _routes.Facts.agree(sparse, _allreduce.configured_max())
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
        self._sc.on_group_broken(self._handle, self._sidecar_broke)
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
            # This rank's own block never leaves the process: copy it directly and stage only
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
            # as in all_to_all_single: the own block is copied directly, not staged
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
        _peer("send", "dst", dst, self._rank, self._size)
        return self._submit("send", _wire.SEND, t.dtype, count=t.numel(), root=dst, tag=tag, inputs=[[t]], result=[t])

    def recv(self, tensors, src, tag=0):
        t = _single("recv", "tensor", tensors)
        _peer("recv", "src", src, self._rank, self._size)
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

    def _sidecar_broke(self, detail: str) -> None:
        """The sidecar reports the group broken (a peer died or went silent, an op timed
        out): later ops go to the sidecar, which raises with the cause, and in-process kernels
        waiting for a peer give up now rather than at the group's timeout."""
        if self._broken is None:
            self._broken = dist.DistBackendError(f"gocomm: {detail}")
        for path in (*self._ar.values(), *self._a2av.values()):
            if path is not None:
                path.give_up()

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
