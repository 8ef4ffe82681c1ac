"""The route table (the compiled client's, csrc/client/routes.h, through gocomm._C.Routes):
which engine runs each op of a group, decided once from what the ranks agreed on; gocomm.info()
shows it with the sidecar's capabilities; the benchmarks stay out of `import gocomm`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from gocomm._client import C

Routes = C.Routes
HOST, INPROCESS, SIDECAR_NCCL, SIDECAR_NVSHMEM = (
    Routes.HOST,
    Routes.INPROCESS,
    Routes.SIDECAR_NCCL,
    Routes.SIDECAR_NVSHMEM,
)
BIG = 1 << 62  # GOCOMM_AR_MAX's default: no limit


def facts(n: int, transport: str = "nvshmem", hosts: int = 1, ar_max: int = BIG) -> tuple[list[str], int]:
    """n ranks whose sidecars chose transport, spread round-robin over hosts: (choices, ar_max)."""
    return [f"{transport} host{r % hosts}" for r in range(n)], ar_max


@pytest.mark.parametrize(
    "desc, f, transport, ar, a2a, a2av, why",
    [
        ("NVLink node, 4 ranks", facts(4), "nvshmem", INPROCESS, INPROCESS, INPROCESS, ""),
        ("NVLink node, 8 ranks", facts(8), "nvshmem", INPROCESS, INPROCESS, INPROCESS, ""),
        ("NVLink node, 1 rank", facts(1), "nvshmem", SIDECAR_NCCL, INPROCESS, INPROCESS, "one rank"),
        ("PCIe node, 4 ranks", facts(4, "nccl"), "nccl", SIDECAR_NCCL, SIDECAR_NCCL, SIDECAR_NCCL, "NCCL"),
        ("NVLink nodes, 2 hosts", facts(4, hosts=2), "nccl", SIDECAR_NCCL, SIDECAR_NCCL, SIDECAR_NCCL, "spans 2 hosts"),
        ("PCIe nodes, 2 hosts", facts(4, "nccl", hosts=2), "nccl", SIDECAR_NCCL, SIDECAR_NCCL, SIDECAR_NCCL, "spans"),
        (
            "one rank on NCCL",
            (["nvshmem h", "nccl h"], BIG),
            "nccl",
            SIDECAR_NCCL,
            SIDECAR_NCCL,
            SIDECAR_NCCL,
            "['nccl', 'nvshmem']",
        ),
        ("GOCOMM_AR_MAX=0", facts(4, ar_max=0), "nvshmem", SIDECAR_NCCL, INPROCESS, INPROCESS, "GOCOMM_AR_MAX=0"),
        ("16 ranks on one node", facts(16), "nvshmem", SIDECAR_NCCL, SIDECAR_NCCL, SIDECAR_NVSHMEM, "16 ranks"),
    ],
)
def test_route_table(desc, f, transport, ar, a2a, a2av, why):
    r = Routes(*f, "g")
    assert r.transport == transport, desc
    assert r.splits_on_gpu == (transport == "nvshmem"), desc
    assert r.size == len(f[0]) and r.hosts == len({c.split(" ")[1] for c in f[0]}), desc
    table = r.table()
    assert list(table) == ["all_reduce", "all_to_all_single", "all_to_all_v", "moe", "other CUDA ops", "CPU tensors"]
    engines = {op: engine for op, (engine, _) in table.items()}
    assert (engines["all_reduce"], engines["all_to_all_single"], engines["all_to_all_v"]) == (ar, a2a, a2av), desc
    assert r.ar_inprocess == (ar == INPROCESS) and r.a2a_inprocess == (a2a == INPROCESS), desc
    assert engines["moe"] == a2av and engines["other CUDA ops"] == SIDECAR_NCCL, desc
    assert engines["CPU tensors"] == HOST, desc
    assert all(reason for _, reason in table.values()), table
    if why:
        assert any(why in reason for _, reason in table.values()), (desc, table)
    cap = r.capturable()
    assert ("all_reduce (sum, avg; bf16, fp16, fp32" in cap) == r.ar_inprocess, cap
    assert ("all_to_all_single in-process" in cap) == r.a2a_inprocess, cap
    # every group's sidecar collectives are captured as graph ops (decision 0020), not p2p
    assert "the collectives on sidecar NCCL (all_reduce, broadcast" in cap and "not send/recv" in cap, cap


def test_fall_back():
    """A kernel that failed sends its op class to the sidecar for good."""
    r = Routes(*facts(4), "g")
    r.fall_back("all_reduce", "timed out")
    assert not r.ar_inprocess and r.table()["all_reduce"] == (SIDECAR_NCCL, "timed out")
    assert r.a2a_inprocess
    r.fall_back("all_to_all_v", "timed out")
    t = r.table()
    assert not r.a2a_inprocess and t["all_to_all_v"] == (SIDECAR_NVSHMEM, "timed out")
    assert t["all_to_all_single"] == (SIDECAR_NCCL, "timed out")
    assert t["moe"] == (SIDECAR_NVSHMEM, "as all_to_all_v (one host sync): timed out"), t
    # the sidecar's NVSHMEM kernel serves the default group only: another group's falls to NCCL
    sub = Routes(*facts(4), "g", world=False)
    assert r.nvshmem and not sub.nvshmem, (r.world, sub.world)
    sub.fall_back("all_to_all_v", "timed out")
    assert sub.table()["all_to_all_v"] == (SIDECAR_NCCL, "timed out"), sub.table()
    big = Routes(*facts(16), "g", world=False).table()["all_to_all_v"]
    assert big[0] == SIDECAR_NCCL and "default group only" in big[1], big
    assert r.capturable().startswith("the collectives on sidecar NCCL"), r.capturable()


def test_one_rank_on_a_one_gpu_node():
    """A group of one rank needs no peer link: where its sidecar chose NCCL (a node of one GPU)
    its all_to_all_single, all_to_all_v and moe still take the in-process kernels, whose
    fallback is sidecar NCCL (no NVSHMEM engine there); GOCOMM_TRANSPORT=nccl keeps them on
    the sidecar."""
    r = Routes(["nccl h"], BIG, "g", "1 GPU(s) on this node: nothing to reach over NVLink")
    t = r.table()
    assert r.transport == "nccl" and r.splits_on_gpu and r.a2a_inprocess and not r.ar_inprocess, t
    assert [t[op][0] for op in ("all_reduce", "all_to_all_single", "all_to_all_v", "moe")] == [
        SIDECAR_NCCL,
        INPROCESS,
        INPROCESS,
        INPROCESS,
    ], t
    assert "one rank" in t["all_to_all_single"][1] and "one rank" in t["all_to_all_v"][1], t
    assert r.transport_reason.endswith(
        "one rank alone: its all-to-alls need no link to a peer (their routes say where they run)"
    ), r
    assert "all_to_all_single in-process" in r.capturable()
    r.fall_back("all_to_all_v", "declined")
    t = r.table()
    assert not r.a2a_inprocess and t["all_to_all_v"] == (SIDECAR_NCCL, "declined"), t
    assert t["moe"][0] == SIDECAR_NCCL, t
    forced = Routes(["nccl h"], BIG, "g", "forced by GOCOMM_TRANSPORT=nccl")
    assert not forced.splits_on_gpu and not forced.a2a_inprocess, forced.table()
    assert {e for e, _ in forced.table().values()} == {SIDECAR_NCCL, HOST}, forced.table()
    # two ranks on NCCL stay on the sidecar (a rank whose sidecar runs no CUDA ops: test_info_cpu)
    assert not Routes(["nccl h", "nccl h"], BIG, "g", "").a2a_inprocess


def test_agreement():
    """A group takes NVSHMEM only when every member's sidecar chose it, all on one host."""
    for choices, want in [
        (["nvshmem a", "nvshmem a"], "nvshmem"),
        (["nvshmem a"], "nvshmem"),
        (["nvshmem a", "nccl a"], "nccl"),
        (["nvshmem a", "nvshmem b"], "nccl"),  # two nodes
        (["nccl a", "nccl b"], "nccl"),
    ]:
        assert Routes(choices, BIG, "g").transport == want, choices


def test_mixed_transports_warn():
    """Sidecars that chose differently leave the group on NCCL, with a warning through the log
    the table is given (the gocomm logger's); agreeing ones log nothing."""
    got = []
    Routes(["nvshmem h", "nvshmem h"], BIG, "g", "", lambda level, msg: got.append((level, msg)))
    Routes(["nccl h", "nccl h"], BIG, "g", "", lambda level, msg: got.append((level, msg)))
    assert got == []
    r = Routes(["nvshmem h", "nccl h"], BIG, "g", "", lambda level, msg: got.append((level, msg)))
    why = "the sidecars chose ['nccl', 'nvshmem']"
    assert got == [(logging.WARNING, f"gocomm group 'g': {why}; all_to_all_v takes NCCL")], got
    assert r.transport_reason == why


def test_host_id():
    """A host is its boot id and /dev/shm's device, as /proc and stat(2) say."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert C.host_id() == f"{boot}/{os.stat('/dev/shm').st_dev:x}"


def check_info(rk):
    import gocomm

    return gocomm.info()


def test_info_cpu(worlds):
    """On a machine without a GPU the sidecar says so, with reasons, and the default group
    routes CPU tensors to the host engine."""
    (i,) = worlds.get(1).run(check_info)
    caps = i["capabilities"]
    for name in ("host", "gpus", "nvlink_domain", "sm_arch", "mps", "nccl", "nvshmem"):
        value, reason = caps[name]
        assert value and reason, (name, caps)
    assert caps["gpus"][0] == "0" and caps["nvlink_domain"][0] == "no", caps
    assert caps["nccl"][0] == "no" and caps["mps"][0] == "unknown", caps
    (g,) = [g for g in i["groups"].values() if g["size"] == 1 and g["routes"]["CPU tensors"][0] == HOST]
    assert g["transport"][0] == "nccl" and g["routes"]["all_to_all_v"][0] == SIDECAR_NCCL, g
    assert g["hosts"] == 1 and "spans" not in g["routes"]["CPU tensors"][1], g
    # a job on one host listens for peers on loopback only
    assert i["peer_address"].startswith("127.0.0.1:"), i["peer_address"]


def test_bench_not_imported():
    """import gocomm loads none of the benchmarks."""
    code = "import sys, gocomm; assert 'gocomm.bench' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
