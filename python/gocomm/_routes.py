"""Which engine runs each of a group's ops: one table per group, built once from what its
ranks agreed on, consulted by every op.

The facts come from each rank's sidecar (its capabilities at attach: the sparse transport it
chose from the node's NVLink domain, NVSHMEM and GOCOMM_TRANSPORT; its host) and from this
process's knobs (GOCOMM_AR_MAX). The table says, per op class, which engine runs it and why:

    all_reduce         in-process kernel (bf16/fp16/fp32 sum/avg, a multiple of 16 bytes, up
                       to GOCOMM_AR_MAX) where the ranks share one NVLink domain, else sidecar NCCL
    all_to_all_single  in-process kernel there, else sidecar NCCL
    all_to_all_v       in-process kernel there (else, where its setup declines, the sidecar's
                       NVSHMEM kernel on the default group), else sidecar NCCL with a host count
                       exchange
    moe                as all_to_all_v; the in-process kernels for padded dispatch without fp8
    other CUDA ops     sidecar NCCL
    CPU tensors        host engine

A group that spans hosts (host_id) runs every CUDA op on sidecar NCCL ("spans hosts"): the
in-process kernels and NVSHMEM serve one host's NVLink domain. Its subgroups that lie within
one host keep the one-host paths.

What depends on a call (dtype, size, a device's setup, a kernel that failed) is decided at the
call, by the rule the table states; a kernel that failed turns its route to the sidecar. The
per-op path reads the `ar_inprocess` and `a2a_inprocess` attributes, nothing more.
"""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger("gocomm")

# the most ranks the in-process kernels take (kernels/inprocess/{allreduce,a2av_ipc}.cu)
KERNEL_MAX_RANKS = 8

# engines, as the table names them
INPROCESS = "in-process kernel"
SIDECAR_NCCL = "sidecar NCCL"
SIDECAR_NVSHMEM = "sidecar NVSHMEM"
HOST = "host engine"


def host_id() -> str:
    """What tells this host from another: ranks are on one host when they share the kernel (its
    boot id) and the shared-memory file system (the device number of /dev/shm's mount), so
    that each can map the other's segments. A host name is not enough: containers and network
    namespaces often share one, and two hosts may be given the same."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        shm = f"{os.stat('/dev/shm').st_dev:x}"
    except OSError:
        shm = "no-shm"
    return f"{boot}/{shm}"


@dataclasses.dataclass(frozen=True)
class Route:
    """One op class's engine, and why."""

    engine: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a group's ranks agreed on, and this process's knobs that every rank must share.

    Attributes:
        size: ranks in the group.
        transports: the sparse transport each rank's sidecar chose ("nvshmem" or "nccl").
        hosts: the distinct hosts the ranks run on (host_id).
        ar_max: GOCOMM_AR_MAX, the largest all_reduce the in-process kernel takes (0: off).
    """

    size: int
    transports: tuple[str, ...]
    hosts: int
    ar_max: int

    @classmethod
    def agree(cls, choices: list[str], ar_max: int) -> Facts:
        """Facts from every member's "<transport> <host>", as published through the Store."""
        return cls(
            size=len(choices),
            transports=tuple(c.split(" ", 1)[0] for c in choices),
            hosts=len({c.split(" ", 1)[1] if " " in c else "" for c in choices}),
            ar_max=ar_max,
        )


class Routes:
    """A group's route table (see the module's docstring).

    Args:
        facts: what the group's ranks agreed on.
        group_name: the group's name, for the log.
        own_reason: why this rank's sidecar chose its transport, for the table's reasons.

    Attributes:
        transport: the group's sparse transport: "nvshmem" where every member's sidecar chose
            it and all are on one host (one rank on NCCL would leave the others waiting in a
            kernel for rows that never come; the NVSHMEM path is set up for one node), else
            "nccl".
        ar_inprocess: all_reduce of CUDA tensors tries the in-process kernel.
        a2a_inprocess: all_to_all_single, all_to_all_v and moe of CUDA tensors try it.
        splits_on_gpu: all_to_all_v keeps its splits on the GPU (the in-process kernel or
            the sidecar's NVSHMEM kernel), no host count exchange.
    """

    def __init__(self, facts: Facts, group_name: str = "", own_reason: str = ""):
        self.facts = facts
        kinds = set(facts.transports)
        if facts.hosts > 1:
            # NCCL picks the network between hosts (IB, RoCE, sockets, a net plugin); the
            # in-process kernels and NVSHMEM are set up for one host's NVLink domain
            self.transport = "nccl"
            why = f"the group spans {facts.hosts} hosts: NCCL between them (no in-process kernels, no NVSHMEM)"
        elif kinds == {"nvshmem"}:
            self.transport = "nvshmem"
            why = "every rank's sidecar chose NVSHMEM (one NVLink domain with peer atomics) on one host"
        else:
            self.transport = "nccl"
            if "nvshmem" in kinds:
                why = f"the sidecars chose {sorted(kinds)}"
                log.warning("gocomm group %r: %s; all_to_all_v takes NCCL", group_name, why)
            else:
                mine = (
                    f"this rank's: {own_reason}"
                    if own_reason
                    else "their GPUs do not share NVLink, or NVSHMEM cannot run"
                )
                why = f"the sidecars chose NCCL ({mine})"
        self.transport_reason = why
        self.splits_on_gpu = self.transport == "nvshmem"
        n = facts.size
        if not self.splits_on_gpu:
            ar_why = a2a_why = why
        else:
            ar_why = a2a_why = ""
            if n < 2:
                ar_why = "one rank: nothing to reduce across"
            elif n > KERNEL_MAX_RANKS:
                ar_why = f"{n} ranks, more than the kernel's {KERNEL_MAX_RANKS}"
            elif facts.ar_max <= 0:
                ar_why = "GOCOMM_AR_MAX=0"
            if n > KERNEL_MAX_RANKS:
                a2a_why = f"{n} ranks, more than the kernel's {KERNEL_MAX_RANKS}"
        self.ar_inprocess = not ar_why
        self.a2a_inprocess = not a2a_why
        self.all_reduce = (
            Route(
                INPROCESS,
                "the ranks share one NVLink domain; bf16/fp16/fp32 sum/avg of a multiple of 16 bytes up "
                "to GOCOMM_AR_MAX, the rest (and where the kernel's setup declines) sidecar NCCL",
            )
            if self.ar_inprocess
            else Route(SIDECAR_NCCL, ar_why)
        )
        self.all_to_all_single = (
            Route(INPROCESS, "the ranks share one NVLink domain (sidecar NCCL where the kernel's setup declines)")
            if self.a2a_inprocess
            else Route(SIDECAR_NCCL, a2a_why)
        )
        if self.a2a_inprocess:
            self.all_to_all_v = Route(
                INPROCESS,
                "the ranks share one NVLink domain; where the kernel's setup declines (GOCOMM_A2AV_INPROCESS=0 on a "
                "rank), the sidecar's NVSHMEM kernel on the default group, else sidecar NCCL with a host count "
                "exchange",
            )
        elif self.splits_on_gpu:
            self.all_to_all_v = Route(
                SIDECAR_NVSHMEM,
                f"{a2a_why}: the sidecar's NVSHMEM kernel on the default group, else sidecar NCCL "
                "with a host count exchange",
            )
        else:
            self.all_to_all_v = Route(SIDECAR_NCCL, f"{why}: the counts go through the host (one sync)")
        self.moe = Route(
            self.all_to_all_v.engine,
            "as all_to_all_v"
            + (
                ": the in-process kernels for padded dispatch without fp8 of the shapes they take, else one host sync"
                if self.a2a_inprocess
                else " (one host sync)"
            ),
        )
        self.dense = Route(SIDECAR_NCCL, "every other op of CUDA tensors")
        self.cpu = (
            Route(
                HOST,
                f"CPU tensors: the group spans {facts.hosts} hosts: the sidecars' host engine over TCP, payloads "
                "inline between hosts (by reference only between sidecars that proved they share one host)",
            )
            if facts.hosts > 1
            else Route(HOST, "CPU tensors: the sidecars' host engine over TCP and shared memory")
        )

    def fall_back(self, op: str, why: str) -> None:
        """Turn op's in-process route ("all_reduce" or "all_to_all_v") to the sidecar for good:
        its kernel's collective setup declined (every rank agrees), or one of its kernels
        failed (the group is aborted). all_to_all_v takes all_to_all_single and moe along."""
        if op == "all_reduce":
            self.ar_inprocess = False
            self.all_reduce = Route(SIDECAR_NCCL, why)
        else:
            self.a2a_inprocess = False
            self.all_to_all_single = Route(SIDECAR_NCCL, why)
            self.all_to_all_v = Route(SIDECAR_NVSHMEM if self.splits_on_gpu else SIDECAR_NCCL, why)
            self.moe = Route(self.all_to_all_v.engine, f"as all_to_all_v (one host sync): {why}")

    def table(self) -> dict[str, tuple[str, str]]:
        """The table as {op class: (engine, reason)}, for gocomm.info()."""
        return {
            "all_reduce": (self.all_reduce.engine, self.all_reduce.reason),
            "all_to_all_single": (self.all_to_all_single.engine, self.all_to_all_single.reason),
            "all_to_all_v": (self.all_to_all_v.engine, self.all_to_all_v.reason),
            "moe": (self.moe.engine, self.moe.reason),
            "other CUDA ops": (self.dense.engine, self.dense.reason),
            "CPU tensors": (self.cpu.engine, self.cpu.reason),
        }

    def capturable(self) -> str:
        """What a CUDA graph can hold of this group's ops, in words (for error messages)."""
        ops = []
        if self.ar_inprocess:
            ops.append("all_reduce (sum, avg; bf16, fp16, fp32; a multiple of 16 bytes) in-process")
        if self.a2a_inprocess:
            ops += [
                "all_to_all_single in-process",
                "gocomm.all_to_all_v",
                "gocomm.moe.dispatch(padded=True) and combine",
            ]
        # docs/decisions/0020: a collective on sidecar NCCL is registered at capture and run
        # by the sidecar's graph lane at each replay
        ops.append(
            "the collectives on sidecar NCCL (all_reduce, broadcast, reduce, all_gather(_into_tensor), "
            "reduce_scatter(_tensor), all_to_all(_single), gather, scatter and their coalesced forms); "
            "not send/recv"
            + ("" if self.a2a_inprocess else ", gocomm.all_to_all_v or moe.dispatch without the in-process kernels")
        )
        return ", ".join(ops)
