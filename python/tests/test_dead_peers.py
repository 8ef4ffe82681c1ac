"""No survivor waits for a dead rank: a training process SIGKILLed, a sidecar SIGKILLed, a
sidecar SIGSTOPped (a silent peer, as a host whose traffic is dropped) and the Store's host
killed during group creation, each at a random point of an op of 4 KiB, 1 MiB and 64 MiB on
the host engine: every other rank raises within the dead-peer limit (5 s by default), naming
the dead rank (or the Store), and nothing is left behind. A hung rank (its training process
SIGSTOPped) shows in every other rank's flight record. Each trial is a world of its own
(python/tests/faults.py); `make soak` runs many more (soak_dead_peers.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import faults
import pytest
import torch

TRIALS = 2
SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20}


def _report(res: dict) -> str:
    lines = [f"{res['fault']} at {res['bytes']} bytes, victim rank {res['victim']}, logs in {res['logs']}"]
    for r, s in res["survivors"].items():
        lines.append(f"  rank {r}: {s.get('elapsed', float('nan')):.2f}s {s.get('message', 'never raised')[:400]}")
    lines.append(f"  left: {res['leaks']}; GPU free for a new process after {res.get('gpu_ready_s')}s")
    return "\n".join(lines)


def _check(res: dict, limit: float = faults.LIMIT_S) -> None:
    bad = faults.problems(res, limit)
    for r, s in res["survivors"].items():
        if s.get("fds_after") is not None and s["fds_after"] > s["fds_before"]:
            bad.append(f"rank {r}'s sidecar holds {s['fds_after']} fds after the group, {s['fds_before']} before")
    assert not bad, "\n".join(bad) + "\n" + _report(res)
    shutil.rmtree(res["logs"], ignore_errors=True)


@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
@pytest.mark.parametrize("fault", faults.FAULTS)
def test_every_survivor_raises_naming_the_dead_rank(fault, size, seed):
    """2 ranks, as the case that hung before: the survivor's by-reference sends waited for
    the dead rank's ack, and its sidecar said bye instead of abort."""
    if fault == "unreachable" and (why := faults.netns_usable()):
        pytest.skip(why)
    for i in range(TRIALS):
        _check(faults.trial(fault, SIZES[size], world=2, seed=seed + i))


@pytest.mark.parametrize("fault", faults.FAULTS)
def test_every_survivor_of_three_raises(fault, seed):
    """3 ranks, 1 MiB: both survivors raise, each naming the dead rank (told directly, or in
    the other survivor's abort)."""
    if fault == "unreachable" and (why := faults.netns_usable()):
        pytest.skip(why)
    _check(faults.trial(fault, 1 << 20, world=3, seed=seed))


def test_dead_peer_limit_is_a_knob(seed):
    """GOCOMM_PEER_DEAD_TIMEOUT_SEC=2: a silent peer is given up within 2 s."""
    res = faults.trial("stop_sidecar", 1 << 20, seed=seed, env={"GOCOMM_PEER_DEAD_TIMEOUT_SEC": "2"})
    _check(res, limit=2.0)
    assert all("for 1.6s" in s["message"] for s in res["survivors"].values()), _report(res)


def test_async_error_handling_tears_the_process_down(seed):
    """GOCOMM_ASYNC_ERROR_HANDLING=1 (TORCH_NCCL_ASYNC_ERROR_HANDLING's TearDown): ranks that
    wait on nothing end themselves with SIGABRT within the dead-peer limit once a peer died."""
    res = faults.trial("teardown", 4 << 10, seed=seed)
    for r, s in res["survivors"].items():
        assert s["returncode"] == -6 and s["exited"] is not None and s["exited"] < faults.LIMIT_S, (
            f"rank {r}: exit {s['returncode']} after {s['exited']}s\n{_report(res)}"
        )
    shutil.rmtree(res["logs"], ignore_errors=True)


def test_flight_record_shows_the_hung_rank(seed):
    """Rank 1's training process is SIGSTOPped between ops: the others time out (group
    timeout 3 s), and on each of them the flight record, from gocomm.flight_record() and from
    the JSON dump the break wrote, shows the op that hung (seq n, the only one not completed) and that rank 1
    last started and finished seq n-1 (its heartbeats said so), while the other survivor
    started seq n."""
    res = faults.trial("hang", 1 << 20, seed=seed)
    report = _report(res)
    assert len(res["traces"]) >= 2, f"no dump files: {res['traces']}\n{report}"
    dumps = {}
    for path in res["traces"]:
        with open(path) as f:
            d = json.load(f)
        dumps[d["rank"]] = d
    for r, s in res["survivors"].items():
        assert s["raised"] and "timed out" in s["message"], report
        assert s["elapsed"] < faults.HANG_TIMEOUT_S + 3, report
        for rec in (s["flight"], dumps[r]):
            (g,) = [g for g in rec["groups"] if g["name"] == "0"]
            # the op that hung: timed out here, or aborted by the other survivor's timeout
            hung = [o for o in g["ops"] if o["state"] != "completed"]
            assert len(hung) == 1 and hung[0]["state"] in ("timed out", "aborted"), json.dumps(g)[-3000:]
            assert hung[0]["op"] == "all_reduce", hung
            n = hung[0]["seq"]
            assert hung[0]["started"] and hung[0]["ended"] and hung[0]["bytes"] == [1 << 20], hung
            assert all(o["state"] == "completed" for o in g["ops"] if o["seq"] < n), json.dumps(g)[-3000:]
            peers = {p["rank"]: p for p in g["peers"]}
            assert peers[1]["last_started"] == n - 1 and peers[1]["last_finished"] == n - 1, peers
            other = 2 if r == 0 else 0
            assert peers[other]["last_started"] == n, peers
            assert 0 <= peers[1]["heard_s_ago"] < 5, peers
    shutil.rmtree(res["logs"], ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["auto", "sidecar_nccl"])
@pytest.mark.parametrize("fault", ["kill_rank", "kill_sidecar", "stop_sidecar"])
def test_gpu_survivors_raise_naming_the_dead_rank(fault, route, seed):
    """CUDA tensors, 2 ranks (sharing the GPUs there are: on one GPU, the in-process
    all_reduce kernel; on two, the route the group takes, and the sidecar's NCCL forced): a
    rank's death reaches the other's kernels or NCCL (the sidecar aborts the group, and the
    shim makes its kernels stop waiting), so torch.cuda.synchronize() returns and the next
    call raises within the limit."""
    if route == "sidecar_nccl" and torch.cuda.device_count() < 2:
        pytest.skip(f"the sidecar's NCCL takes one rank per GPU; this machine has {torch.cuda.device_count()}")
    for size in (4 << 10, 1 << 20, 64 << 20):
        try:
            # ranks sharing one GPU need the in-process kernel (NCCL takes one rank per GPU):
            # forced there as test_graph.py forces it
            env = {"GOCOMM_TRANSPORT": "nvshmem"} if torch.cuda.device_count() < 2 else None
            if route == "sidecar_nccl":
                env = {"GOCOMM_TRANSPORT": "nccl"}
            res = faults.trial(fault, size, world=2, seed=seed, device="cuda", env=env)
        except faults.Unfit as e:
            pytest.skip(str(e))
        if route == "sidecar_nccl":
            took = next(iter(res["routes"].values()))["all_reduce"][0]
            assert took == "sidecar NCCL", f"all_reduce took {took}: {res['routes']}"
        for r, s in res["survivors"].items():
            print(
                f"{fault} {size} B rank {r}: raised after {s.get('elapsed', float('nan')):.2f}s, {s.get('ops')} ops, "
                f"{s.get('wrong')} wrong (last op wrong: {s.get('last_wrong')}), GPU free for a new process "
                f"after {res['gpu_ready_s']}s; {s.get('message', '')[:200]}"
            )
        _check(res)


def check_flight_dump(rk):
    """Three all_reduces, then rank 0 asks for its record to be dumped (the control-plane
    RPC, gocomm.flight_record(dump=True)); returns its sidecar's pid and the dump's path."""
    import torch.distributed as dist

    import gocomm

    for _ in range(3):
        x = torch.full((1024,), float(rk.rank + 1))
        dist.all_reduce(x)
        assert float(x[0]) == 3.0
    rec = gocomm.flight_record(dump=rk.rank == 0)
    return {"pid": gocomm.info()["pid"], "path": rec.get("path")}


def test_flight_record_dumped_on_demand(worlds, tmp_path):
    """The record is written on demand: by the control plane's FlightRecord(dump) on rank 0,
    by SIGUSR1 to pgserver on rank 1; each file holds the group's three all_reduces, completed."""
    prefix = str(tmp_path / "trace_")
    world = worlds.fresh(2, label="-flight", env={"GOCOMM_DEBUG_INFO_TEMP_FILE": prefix})
    try:
        res = world.run(check_flight_dump)
        assert res[0]["path"] == prefix + "0", res
        os.kill(res[1]["pid"], signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not os.path.exists(prefix + "1") and time.monotonic() < deadline:
            time.sleep(0.05)
        for r in (0, 1):
            with open(prefix + str(r)) as f:
                d = json.load(f)
            assert d["rank"] == r and d["reason"], d
            (g,) = [g for g in d["groups"] if g["name"] == "0"]
            ops = [o for o in g["ops"] if o["op"] == "all_reduce"]
            assert len(ops) >= 3 and all(o["state"] == "completed" for o in ops[-3:]), json.dumps(g)[-2000:]
            assert g["last_finished"] >= 2, g
    finally:
        world.kill()
