"""The "gocomm" backend: torch calls the compiled client (gocomm._C.Backend, csrc/client/) for
every op; this module is its control plane. The creator torch calls for a new group sets the
group up with the sidecar (CreateGroup, the Store bootstrap, ConnectGroup, the route table)
and returns the C++ backend configured with what its ops need. A group's Python state
(_Group: its sidecar, routes) is what gocomm.info() and the MoE API use; state(pg) finds it.
The in-process engine and the route table are the compiled client's (csrc/client/inprocess.cc,
routes.h); they call back here only to log, at a path's setup and when a route falls back.
"""

from __future__ import annotations

import datetime
import logging
import os
import weakref

import torch
import torch.distributed as dist

from . import _client, _sidecar
from ._sidecar import SidecarError
from .v1 import pgserver_pb2 as pb

log = logging.getLogger("gocomm")

# this process's live groups, for gocomm.info()
_groups: weakref.WeakSet = weakref.WeakSet()


class Served:
    """A group whose in-process all_to_all_v serves a CUDA device: what gocomm.moe.dispatch
    would otherwise look up on every call (see served)."""

    __slots__ = ("group", "name", "size", "moe")

    def __init__(self, group: _Group, name: str, size: int):
        self.group = group  # the group's state, whose destroy drops the entry
        self.name = name  # the group's name, which torch.ops.gocomm take
        self.size = size
        self.moe = False  # gocomm.moe's kernels run on the device too (moe.dispatch found so)


# (ProcessGroup, device index) -> Served, made by the group's first moe.dispatch on that
# device (which sets the path up, collectively). Its fast path calls the registered op
# (csrc/client/moe.cc) with no other lookup or check; the op checks the arguments and raises
# NotImplementedError, before doing anything, where the path no longer serves the group
# (destroyed, broken, the sidecar gone), and the caller then drops the entry and takes its
# other paths. A destroyed group drops its entries (_Group._destroy).
served: dict = {}


# The longest timeout the sidecar takes (wire.MaxTimeout, 100 years): a longer one, such as
# timedelta.max, is sent as this instead of overflowing into a short or negative one.
_MAX_TIMEOUT_S = 100 * 365 * 24 * 3600


def _seconds(timeout) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _store_gone(group_name: str, rank: int, size: int, e: BaseException) -> dist.DistBackendError:
    """A group creation's error when its torch Store failed it: a key that never came (torch's
    wait timeout names it, so the rank), else the Store's host gone, in gocomm's words."""
    why = (
        "a rank did not create the group within the timeout (a TCPStore names its key, gocomm/host/<rank>)"
        if isinstance(e, dist.DistStoreError)
        else "the torch Store stopped answering; its host (rank 0 under env:// and tcp://) may have died"
    )
    return dist.DistBackendError(f"gocomm: creating group {group_name!r} (rank {rank} of {size}): {why} ({e})")


class _Group:
    """The control plane's state of one gocomm group on this rank. The C++ backend holds it
    (and it holds the backend weakly), so it lives as long as the group."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        group_name: str = "",
        global_ranks: list[int] | None = None,
        world: bool = False,
    ):
        self._rank, self._size = rank, size
        seconds = _seconds(timeout)
        if seconds < 0:
            # torch's C++ side keeps timeouts in nanoseconds: one past ~292 years (timedelta.max)
            # reaches us wrapped negative. It meant "never": take the longest the sidecar does.
            log.warning("gocomm: group timeout %s came through negative (overflowed); taking the longest", timeout)
            seconds = _MAX_TIMEOUT_S
        self._timeout = max(seconds, 0.001)
        self._group_name = group_name
        self._global_ranks = list(global_ranks or range(size))
        global_rank = self._global_ranks[rank] if rank < len(self._global_ranks) else rank
        # Which host each rank is on (_C.host_id), before this process's sidecar starts:
        # a job all on one host listens on loopback only.
        host = _client.C.host_id()
        try:
            store.set(f"gocomm/host/{rank}", host)
            hosts = [store.get(f"gocomm/host/{r}").decode() for r in range(size)]
        except (dist.DistError, RuntimeError) as e:
            raise _store_gone(group_name, rank, size, e) from e
        self._sc = _sidecar.get(global_rank, lambda: _sidecar.rendezvous_host(store, set(hosts) == {host}))
        resp = self._sc.call(
            "CreateGroup",
            pb.CreateGroupRequest(
                session=self._sc.session,
                name=group_name,
                rank=rank,
                size=size,
                global_ranks=self._global_ranks,
                timeout_ms=int(min(self._timeout, _MAX_TIMEOUT_S) * 1000),
            ),
        )
        self._handle = resp.group
        self._slot = resp.counter_slot
        # Bootstrap through the group's Store: rank 0 hands out the secret peer links are
        # authenticated with; every rank publishes where its sidecar listens.
        try:
            if rank == 0:
                store.set("gocomm/secret", os.urandom(32).hex())
            secret = bytes.fromhex(store.get("gocomm/secret").decode())
            store.set(f"gocomm/boot/{rank}", resp.bootstrap)
            store.set(f"gocomm/sparse/{rank}", f"{self._sc.sparse_transport} {host}")
            blobs = [store.get(f"gocomm/boot/{r}") for r in range(size)]
            sparse = [store.get(f"gocomm/sparse/{r}").decode() for r in range(size)]
        except (dist.DistError, RuntimeError) as e:
            # the Store's host (rank 0's process under env:// and tcp://) died or went away:
            # say so, instead of the socket's own words, and leave the group to no one
            self._sc.call("DestroyGroup", pb.DestroyGroupRequest(session=self._sc.session, group=self._handle))
            raise _store_gone(group_name, rank, size, e) from e
        # which engine runs each op (csrc/client/routes.h), from every member's sidecar's
        # choice and host, the knobs every rank shares, and whether this is the world group
        self._routes = _client.C.Routes(
            sparse, self._sc.knobs.ar_max, group_name, self._sc.sparse_reason, log.log, world
        )
        conn = self._sc.call(
            "ConnectGroup",
            pb.ConnectGroupRequest(session=self._sc.session, group=self._handle, bootstrap=blobs, secret=secret),
        )
        self.transport = conn.transport
        # the slot's counters never go back: a group counts on from where its previous
        # group left them (docs/decisions/0004)
        base = list(resp.counter_base) if len(resp.counter_base) == 2 else [0, 0]
        backend = _client.C.Backend(
            self._sc.client,
            rank,
            size,
            self._handle,
            self._slot,
            base,
            self._timeout,
            group_name,
            self._sc.cuda_refusal,
            self._routes,
            self._sc.knobs,  # the in-process engine's settings, as the sidecar read them
            self._sc.a2a,
            log.log,
            self._destroy,
            self._abort,
            self,
            # the NVSHMEM unique id of that kernel travels through the group's Store, at its
            # first call (the compiled client's exchange_shmem_id), handed over by _shmem_id
            store=store,
            shmem_id=self._shmem_id,
            on_split=self._split,
        )
        self._ref = _client.C.BackendRef(backend)
        # the sidecar's word that the group broke (a peer died or went silent, an op timed
        # out), reported on the watch stream before any op of this rank may have failed
        self._sc.on_group_broken(self._handle, self._sidecar_broke)
        _client.C.set_launch_capacity(self._sc.trace_size)
        self.backend = backend  # dropped by create() once torch holds it: see backend
        _groups.add(self)
        log.info("gocomm group %r rank %d/%d on handle %d via %s", group_name, rank, size, self._handle, conn.transport)

    def _split(self, store, ranks: list[int], timeout_s: float, name: str):
        """torch's split_group of this group (the backend's split): a new group of ranks (this
        group's ranks, this one among them) through store, made as new_group makes one; its backend."""
        global_ranks = [self._global_ranks[r] for r in ranks]
        g = _Group(
            store, ranks.index(self._rank), len(ranks), datetime.timedelta(seconds=timeout_s), name, global_ranks
        )
        backend, g.backend = g.backend, None
        return backend

    # ----- what the MoE API and gocomm.info() ask of a group -----------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def _closed(self) -> bool:
        b = self._ref.get()
        return b is None or b.closed

    def abort(self) -> None:
        b = self._ref.get()
        if b is not None:
            b.abort()

    def _a2av_path(self, idx: int):
        """The in-process all_to_all_v path on device idx (a gocomm._C.A2Path; set up,
        collectively, at the group's first call there), or None where the group does not take
        it. Raises (and aborts the group) once one of its kernels gave up waiting for a peer."""
        b = self._ref.get()
        return None if b is None else b.a2av_path(idx)

    def _shmem_id(self, idx: int, uid: bytes) -> bytes:
        """The ShmemID rpc of the sidecar's NVSHMEM all_to_all_v kernel on device idx, which
        the compiled client calls on every rank once, carrying the id through the group's Store
        (Backend::nvshmem_ready): rank 0's sidecar makes the unique id (uid empty), every
        other rank's is handed rank 0's."""
        if self._slot < 0:  # no stream counters in the sidecar, which CUDA ops need
            raise RuntimeError(
                "gocomm all_to_all_v: this process has more CUDA groups than the sidecar has counters for"
            )
        self._sc.attach_device(torch.device("cuda", idx))
        return self._sc.call("ShmemID", pb.ShmemIDRequest(session=self._sc.session, group=self._handle, id=uid)).id

    # ----- lifetime -------------------------------------------------------------------------

    def _destroy(self) -> None:
        """The backend's shutdown(): leave the group (pending ops fail, peer links close)."""
        for key, e in list(served.items()):
            if e.group is self:
                served.pop(key, None)
        if self._sc.lost or self._sc._closed or _sidecar.current() is not self._sc:  # gone, or a forked child's
            return
        try:
            self._sc.call(
                "DestroyGroup", pb.DestroyGroupRequest(session=self._sc.session, group=self._handle), timeout=30
            )
        except SidecarError as e:
            log.warning("gocomm: destroying group %r: %s", self._group_name, e)

    def _sidecar_broke(self, detail: str) -> None:
        """The sidecar reports the group broken (a peer died or went silent, an op timed
        out): every later call on the group raises with the cause (the compiled backend
        refuses it: a CUDA op's wait() only queues a stream wait, so the sidecar's refusal
        of it would reach no caller), and in-process kernels waiting for a peer give up now
        rather than at the group's timeout."""
        b = self._ref.get()
        if b is not None:
            b.mark_broken(detail)
            b.sidecar_broke()

    def _abort(self, reason: str) -> None:
        """abort(), or a kernel's failure: fail the group's ops here and on its peers, with reason."""
        self._sc.call("Abort", pb.AbortRequest(session=self._sc.session, group=self._handle, reason=reason))

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
                    "bytes_by_reference": g.bytes_by_reference,
                }
        return {}

    def __repr__(self) -> str:
        return f"gocomm group(rank={self._rank}, size={self._size}, name={self._group_name!r})"


def state(pg) -> _Group | None:
    """The gocomm state of process group pg (a torch ProcessGroup or a gocomm backend), or None
    where pg is not a gocomm group."""
    if isinstance(pg, _Group):
        return pg
    b = pg
    if isinstance(pg, dist.ProcessGroup):
        try:
            b = pg._get_backend(torch.device("cpu"))
        except RuntimeError:
            return None
    return b.state if isinstance(b, _client.C.Backend) else None


def create(dist_opts, backend_opts=None):
    """The creator torch calls for backend="gocomm" (extended API): the group's C++ backend."""
    if backend_opts is not None:  # what torch's NCCL takes as ProcessGroupNCCL.Options
        log.warning("gocomm: pg_options (%s) ignored: gocomm is set by GOCOMM_* variables", type(backend_opts).__name__)
    g = _Group(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        group_name=str(dist_opts.group_id),
        global_ranks=list(dist_opts.global_ranks_in_group),
        world=not dist.is_initialized(),  # torch makes the default group before any other
    )
    backend, g.backend = g.backend, None  # torch holds it now; the state only refers to it
    return backend
