"""Jobs across hosts, on simulated hosts (_netns.py: each host its own network, UTS, PID and
mount namespaces with its own /proc and /dev/shm, joined by a veth pair; the host name is
left the same on both, so only what really tells hosts apart can): every init method finds
addresses the peers reach, every collective, subgroups and point to point are correct, each
group takes the route its hosts call for, a dropped link makes every rank raise, and a peer
advertised at an address nobody reaches fails every rank naming it and the knob.

Each cluster runs as its own processes (ranks, sidecars) for one scenario and reports through
files; its processes and namespaces are gone when the test ends, passed or not."""

from __future__ import annotations

import time

import pytest
from _netns import Cluster, addr, unavailable

from gocomm._client import C

HOST, SIDECAR_NCCL = C.Routes.HOST, C.Routes.SIDECAR_NCCL

WHY = unavailable()
pytestmark = pytest.mark.skipif(bool(WHY), reason=f"simulated hosts: {WHY}")

REPORT_S = 240.0  # the most a cluster may take to start, run its scenario and report
FAULT_TIMEOUT_S = 3.0  # the fault group's timeout
# A dropped link is silence, not a reset: until heartbeats find dead peers, the op's timeout
# does; a rank must raise within it plus this (an op in flight at the drop, a loaded machine).
FAULT_MARGIN_S = 4.0

TIMES: dict[str, float] = {}  # what each case measured, printed at the end (pytest -s)


def _fail(c: Cluster, what: str) -> None:
    pytest.fail(f"{what}\n{c.logs()}")


def _check_routes(c: Cluster, rep: dict) -> None:
    for g in rep["groups"]:
        hosts = {r // c.per_host for r in g["ranks"]}
        routes, (transport, why) = g["routes"], g["transport"]
        cpu_engine, cpu_why = routes["CPU tensors"]
        assert cpu_engine == HOST and g["hosts"] == len(hosts), g
        if len(hosts) > 1:
            assert f"spans {len(hosts)} hosts" in why and transport == "nccl", g
            assert f"spans {len(hosts)} hosts" in cpu_why, g
            for op in ("all_reduce", "all_to_all_single", "all_to_all_v", "moe", "other CUDA ops"):
                assert routes[op][0] == SIDECAR_NCCL, (op, g)
            # nothing by reference between hosts: the sidecars cannot prove they share one
            if len(g["ranks"]) == len(hosts):
                assert g["stats"]["bytes_by_reference"] == 0, g
        else:
            assert "spans" not in why and "spans" not in cpu_why, g
            if len(g["ranks"]) > 1:  # one host: large payloads go by reference
                assert g["stats"]["bytes_by_reference"] > 0, g


@pytest.mark.parametrize("per_host", [1, 2], ids=["2x1", "2x2"])
@pytest.mark.parametrize("init", ["env", "tcp", "file"])
def test_hosts_core(tmp_path, init, per_host):
    """The CPU suite's core on 2 hosts x per_host ranks over init, the routes each group took,
    then host 1's link dropped mid-op: every rank raises within the group's timeout + margin."""
    t0 = time.monotonic()
    c = Cluster(str(tmp_path), 2, per_host, init, "core", {"fault": True, "fault_timeout": FAULT_TIMEOUT_S})
    with c:
        armed = [f"armed{r}" for r in range(c.size)]
        if not c.wait_files(armed, REPORT_S):
            _fail(c, "the ranks did not reach the fault")
        time.sleep(0.3)  # some all_reduces in flight
        dropped = time.time()
        c.link_down(1)
        reps = c.reports(FAULT_TIMEOUT_S + 60)
    for r, rep in enumerate(reps):
        if rep is None or "error" in rep:
            _fail(c, f"rank {r}: {rep and rep['error']}")
        assert not rep["errors"], (r, rep["errors"])
        assert rep["peer_address"].startswith(addr(rep["host"]) + ":"), rep["peer_address"]
        _check_routes(c, rep)
    worst = 0.0
    for r, rep in enumerate(reps):
        f = rep["fault"]
        assert f["raised_at"] is not None and f["ops"] > 0, (r, f)
        after = f["raised_at"] - dropped
        worst = max(worst, after)
        assert after <= FAULT_TIMEOUT_S + FAULT_MARGIN_S, f"rank {r} raised {after:.1f} s after the drop: {f}"
        assert "timed out" in f["error"] or "lost" in f["error"] or "abort" in f["error"], f
    TIMES[f"{init} 2x{per_host}"] = time.monotonic() - t0
    print(
        f"\n{init}:// 2 hosts x {per_host}: pass in {time.monotonic() - t0:.1f} s "
        f"(init {max(rep['init_s'] for rep in reps):.1f} s); link dropped -> every rank raised within {worst:.2f} s "
        f"(group timeout {FAULT_TIMEOUT_S} s)"
    )


def test_unreachable_peer(tmp_path):
    """Rank 1 advertises the address of an interface host 0 has no route to: the first op
    fails on every rank at once, naming rank 1, that address and the knobs."""
    c = Cluster(
        str(tmp_path),
        2,
        1,
        "tcp",
        "first_op",
        extra={1: {"GOCOMM_SOCKET_IFNAME": "d0"}},
        dummy={1: "10.78.0.2"},
    )
    with c:
        reps = c.reports(REPORT_S)
    for r, rep in enumerate(reps):
        if rep is None or "error" in rep:
            _fail(c, f"rank {r}: {rep and rep['error']}")
    assert reps[1]["peer_address"].startswith("10.78.0.2:"), reps[1]
    for r, rep in enumerate(reps):
        assert rep["raised"], (r, rep)
        assert rep["seconds"] < 15, (r, rep)
    err = reps[0]["op_error"]
    for want in ("rank 1", reps[1]["peer_address"], "GOCOMM_ADVERTISE_ADDR", "GOCOMM_SOCKET_IFNAME"):
        assert want in err, (want, err)
    print(f"\nunreachable peer: rank 0 raised in {reps[0]['seconds']:.2f} s, rank 1 in {reps[1]['seconds']:.2f} s")
    print(f"rank 0: {err}\nrank 1: {reps[1]['op_error']}")


@pytest.mark.gpu
@pytest.mark.parametrize("per_host", [1, 2], ids=["2x1", "2x2"])
def test_hosts_cuda(tmp_path, per_host):
    """CUDA tensors on simulated hosts: the group spanning hosts runs on sidecar NCCL (NCCL
    told the namespaces are hosts by NCCL_HOSTID, so it takes its socket transport over the
    veth), each host's subgroup on the one-host routes; every result against a reference."""
    extra = {
        r: {"NCCL_HOSTID": f"gocomm-sim-host{r // per_host}", "NCCL_SOCKET_IFNAME": "gh", "NCCL_IB_DISABLE": "1"}
        for r in range(2 * per_host)
    }
    c = Cluster(str(tmp_path), 2, per_host, "env", "cuda", extra=extra)
    with c:
        reps = c.reports(REPORT_S)
    for r, rep in enumerate(reps):
        if rep is None or "error" in rep:
            _fail(c, f"rank {r}: {rep and rep['error']}")
        assert not rep["errors"], (r, rep["errors"])
        for g in rep["groups"]:
            spans = len({x // per_host for x in g["ranks"]}) > 1
            engines = {op: e for op, (e, _) in g["routes"].items() if op != "CPU tensors"}
            if spans:
                assert set(engines.values()) == {SIDECAR_NCCL} and "spans 2 hosts" in g["transport"][1], g
            else:
                assert "spans" not in g["transport"][1], g
