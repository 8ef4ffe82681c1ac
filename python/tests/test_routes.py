"""The route table (gocomm/_routes.py): which engine runs each op of a group, decided once from
what the ranks agreed on; gocomm.info() shows it with the sidecar's capabilities; the
benchmarks stay out of `import gocomm`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gocomm import _routes
from gocomm._routes import HOST, INPROCESS, SIDECAR_NCCL, SIDECAR_NVSHMEM, Facts, Routes

BIG = 1 << 62  # GOCOMM_AR_MAX's default: no limit


def facts(n: int, transport: str = "nvshmem", hosts: int = 1, ar_max: int = BIG) -> Facts:
    """n ranks whose sidecars chose transport, spread round-robin over hosts."""
    return Facts.agree([f"{transport} host{r % hosts}" for r in range(n)], ar_max)


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
            Facts.agree(["nvshmem h", "nccl h"], BIG),
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
    r = Routes(f, "g")
    assert r.transport == transport, desc
    assert r.splits_on_gpu == (transport == "nvshmem"), desc
    assert (r.all_reduce.engine, r.all_to_all_single.engine, r.all_to_all_v.engine) == (ar, a2a, a2av), desc
    assert r.ar_inprocess == (ar == INPROCESS) and r.a2a_inprocess == (a2a == INPROCESS), desc
    assert r.moe.engine == a2av and r.dense.engine == SIDECAR_NCCL and r.cpu.engine == HOST, desc
    table = r.table()
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
    r = Routes(facts(4), "g")
    r.fall_back("all_reduce", "timed out")
    assert not r.ar_inprocess and r.all_reduce == _routes.Route(SIDECAR_NCCL, "timed out")
    assert r.a2a_inprocess
    r.fall_back("all_to_all_v", "timed out")
    assert not r.a2a_inprocess and r.all_to_all_v.engine == SIDECAR_NVSHMEM
    assert r.moe.engine == SIDECAR_NVSHMEM and "timed out" in r.moe.reason
    assert r.capturable().startswith("the collectives on sidecar NCCL"), r.capturable()


def test_agreement():
    """A group takes NVSHMEM only when every member's sidecar chose it, all on one host."""
    for choices, want in [
        (["nvshmem a", "nvshmem a"], "nvshmem"),
        (["nvshmem a"], "nvshmem"),
        (["nvshmem a", "nccl a"], "nccl"),
        (["nvshmem a", "nvshmem b"], "nccl"),  # two nodes
        (["nccl a", "nccl b"], "nccl"),
    ]:
        assert Routes(Facts.agree(choices, BIG), "g").transport == want, choices


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
