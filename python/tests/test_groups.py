"""gocomm groups as torch sees them: new_group / new_subgroups / destroy_process_group, the
group's identity (backend, ranks, name), several groups in flight at once."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
from ranklib import Checker, gen


def _settle_and_destroy(rk, *groups):
    """Members destroy their groups (None and NON_GROUP_MEMBER: not a member) only once every
    rank is past the groups' ops (a gloo barrier): destroying right after one's own op is
    test_destroy_right_after_a_collective."""
    dist.barrier(group=rk.world.gloo)
    for g in groups:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


def check_group_lifecycle(rk, seed):
    import gocomm

    ck = Checker("group lifecycle", seed, rk.rank)
    me, n = rk.rank, rk.size
    with ck.case("world group identity"):
        w = dist.group.WORLD
        b = w._get_backend(torch.device("cpu"))
        ck.expect("world's backend is gocomm's compiled one", isinstance(b, gocomm.Backend), type(b).__name__)
        ck.expect(
            "the same backend serves cuda tensors",
            w._get_backend(torch.device("cuda")) is b,
            type(w._get_backend(torch.device("cuda"))).__name__,
        )
        ck.expect("get_backend(world)", dist.get_backend() == "gocomm", dist.get_backend())
        ck.expect(
            "world group_name",
            isinstance(w.group_name, str) and w.group_name != "",
            repr(w.group_name),
        )
        # the sidecar's NVSHMEM all_to_all_v kernel serves the default group only
        ck.expect("the backend knows it is the world's", b.world is True, repr(b.world))

    for ranks in ([0, 2], [3, 1], [1, 2, 3], list(range(n))):
        label = f"new_group {ranks}"
        g = None
        with ck.case(label):
            g = dist.new_group(ranks, backend="gocomm")
            if me not in ranks:
                ck.expect(
                    label + " non-member gets NON_GROUP_MEMBER",
                    g == dist.GroupMember.NON_GROUP_MEMBER,
                    repr(g),
                )
            else:
                ck.expect(
                    label + " backend",
                    dist.get_backend(g) == "gocomm",
                    dist.get_backend(g),
                )
                ck.expect(
                    label + " size",
                    dist.get_world_size(g) == len(ranks),
                    str(dist.get_world_size(g)),
                )
                want_rank = sorted(ranks).index(me)
                ck.expect(
                    label + " rank",
                    dist.get_rank(g) == want_rank,
                    str(dist.get_rank(g)),
                )
                got_ranks = dist.get_process_group_ranks(g)
                ck.expect(label + " ranks", got_ranks == sorted(ranks), str(got_ranks))
                world = g._get_backend(torch.device("cpu")).world
                ck.expect(label + " is not the world's", world is False, repr(world))
                ck.expect(
                    label + " group_name",
                    isinstance(g.group_name, str) and g.group_name != "",
                    repr(g.group_name),
                )
                t = torch.full((3,), float(me))
                dist.all_reduce(t, group=g)
                ck.same(label + " all_reduce", t, torch.full((3,), float(sum(ranks))))
        with ck.case(label + ": destroy_process_group"):
            _settle_and_destroy(rk, g)
    with ck.case("create and destroy a subgroup 10 times"):
        for i in range(10):
            g = dist.new_group([0, n - 1], backend="gocomm")
            if me in (0, n - 1):
                t = torch.full((2,), float(i + me))
                dist.all_reduce(t, group=g)
                ck.same(f"round {i}", t, torch.full((2,), float(2 * i + n - 1)))
            _settle_and_destroy(rk, g)
    with ck.case("new_subgroups(group_size=2)"):
        mine, subs = dist.new_subgroups(group_size=2, backend="gocomm")
        t = torch.full((1,), float(me))
        dist.all_reduce(t, group=mine)
        base = me - me % 2
        ck.same("all_reduce in my subgroup", t, torch.full((1,), float(2 * base + 1)))
        _settle_and_destroy(rk, *subs)
    with ck.case("overlapping groups in flight at once"):
        ga = dist.new_group([0, 1, 2], backend="gocomm")
        gb = dist.new_group([1, 2, 3], backend="gocomm")
        xa = [gen(seed, "ga", r, (20000,), torch.float64) for r in range(n)]
        xb = [gen(seed, "gb", r, (20000,), torch.float64) for r in range(n)]
        ta, tb = xa[me].clone(), xb[me].clone()
        works = []
        # ranks 1 and 2 start gb's op before ga's: the groups must not wait on one another
        if me in (1, 2):
            order = [(gb, tb), (ga, ta)]
        else:
            order = [(ga, ta), (gb, tb)]
        for g, t in order:
            if g != dist.GroupMember.NON_GROUP_MEMBER:
                works.append(dist.all_reduce(t, group=g, async_op=True))
        for w in works:
            w.wait()
        if me in (0, 1, 2):
            ck.reduced("group a", ta, xa[:3], dist.ReduceOp.SUM, torch.float64)
        if me in (1, 2, 3):
            ck.reduced("group b", tb, xb[1:], dist.ReduceOp.SUM, torch.float64)
        _settle_and_destroy(rk, ga, gb)
    with ck.case("world still works"):
        t = torch.ones(4)
        dist.all_reduce(t)
        ck.same("world all_reduce", t, torch.full((4,), float(n)))
    return ck.done()


def test_group_lifecycle(worlds, seed):
    worlds.get(4).run(check_group_lifecycle, seed=seed)


def check_split_group(rk, seed):
    """split_group of the world into halves, and a split of a half: each member gets its group
    (ranks, description, one backend for cpu and cuda, the timeout given), non-members None,
    and the groups reduce right. The world's bound_device_id is what init_process_group(
    device_id=...) leaves (a device cannot be named without a GPU), with which DeviceMesh
    splits the default group instead of calling new_group. A world of its own: torch names a
    split group by its ranks and how many groups the rank has, so every member must have
    made the same number before (a world other tests left groups in may not)."""
    ck = Checker("split_group", seed, rk.rank)
    me, n = rk.rank, rk.size
    b = dist.group.WORLD._get_backend(torch.device("cpu"))
    with ck.case("split_group, and a split of the split"):
        dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
        try:
            ck.expect("the backend says it splits", b.supports_splitting is True, repr(b.supports_splitting))
            halves = [[r for r in range(n) if r % 2 == p] for p in (0, 1)]
            g = dist.split_group(split_ranks=halves, group_desc="halves", timeout=datetime.timedelta(seconds=30))
            mine = halves[me % 2]
            ck.expect("split ranks", dist.get_process_group_ranks(g) == mine, str(dist.get_process_group_ranks(g)))
            ck.expect("split desc", g.group_desc == "halves", g.group_desc)
            gb = g._get_backend(torch.device("cpu"))
            ck.expect("one backend for cpu and cuda", g._get_backend(torch.device("cuda")) is gb, "two")
            ck.expect("its timeout", gb.options is None and gb.state._timeout == 30, str(gb.state._timeout))
            x = [gen(seed, "split", r, (1000,), torch.float64) for r in range(n)]
            t = x[me].clone()
            dist.all_reduce(t, group=g)
            ck.reduced("all_reduce in my half", t, [x[r] for r in mine], dist.ReduceOp.SUM, torch.float64)
            sub = dist.split_group(parent_pg=g, split_ranks=[[0]])  # the half's rank 0 alone
            ck.expect("a split's non-member gets None", (sub is None) == (mine.index(me) != 0), repr(sub))
            if sub is not None:
                t = x[me].clone()
                dist.broadcast(t, group_src=0, group=sub)
                ck.same("broadcast in a group of one", t, x[me])
            _settle_and_destroy(rk, sub, g)
        finally:
            dist.group.WORLD.bound_device_id = None
    return ck.done()


def test_split_group(worlds, seed):
    with worlds.fresh(4, label="split") as w:
        w.run(check_split_group, seed=seed)


def check_destroy_right_after(rk, seed, rounds):
    """Each round: a new gocomm group, one all_reduce on it, and every rank destroys the group as
    soon as its own all_reduce returned (no barrier). A rank that is done may leave: the peers'
    all_reduce, whose data it already sent, must still succeed (it does on gloo)."""
    import datetime

    failures = []
    for i in range(rounds):
        timeout = datetime.timedelta(seconds=rk.timeout_s)
        g = dist.new_group(backend="gocomm", timeout=timeout)
        t = torch.ones(3)
        try:
            dist.all_reduce(t, group=g)
            if not torch.equal(t, torch.full((3,), float(rk.size))):
                failures.append(f"round {i}: wrong result {t.tolist()}")
        except Exception as e:  # noqa: BLE001
            failures.append(f"round {i}: {type(e).__name__}: {e}")
        dist.destroy_process_group(g)
        dist.barrier(group=rk.world.gloo)
    if failures:
        raise AssertionError(
            f"rank {rk.rank}: the all_reduce failed in {len(failures)} of {rounds} rounds "
            "because a peer destroyed the group right after its own all_reduce returned; "
            f"first: {failures[0]}"
        )
    return rounds


def test_destroy_right_after_a_collective(worlds, seed):
    worlds.get(3).run(check_destroy_right_after, seed=seed, rounds=40)


def check_debug_detail(rk, seed):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL, as torch's NCCL users set it to find desynchronized
    ranks: torch wraps each group's backend in its ProcessGroupWrapper, which asks the backend
    for its sequence numbers and checks every collective's shapes across ranks through gloo
    before running it. Collectives give the reference results, shapes that disagree raise on
    every rank naming the mismatch before gocomm runs anything (the group goes on),
    gocomm.all_to_all_v and moe.dispatch / combine still run (their host-count paths)."""
    import gocomm

    ck, n, me = Checker("TORCH_DISTRIBUTED_DEBUG=DETAIL", seed, rk.rank), rk.size, rk.rank
    w = dist.group.WORLD
    b = w._get_backend(torch.device("cpu"))
    with ck.case("the group is torch's wrapper around gocomm"):
        ck.expect("wrapped", type(b).__name__ == "_ProcessGroupWrapper", type(b).__name__)
        ck.expect("around gocomm", isinstance(b.wrapped_pg, gocomm.Backend), type(b.wrapped_pg).__name__)
    with ck.case("collectives, counted"):
        xs = [gen(seed, "dbg/ar", r, (33,), torch.float64) for r in range(n)]
        seq = b._get_sequence_number_for_group()
        t = xs[me].clone()
        dist.all_reduce(t)
        ck.same("all_reduce", t, torch.stack(xs).sum(0))
        out = torch.empty(n * 33, dtype=torch.float64)
        dist.all_gather_into_tensor(out, xs[me])
        ck.same("all_gather_into_tensor", out, torch.cat(xs))
        got = b._get_sequence_number_for_group()
        ck.expect("two collectives, two sequence numbers", got == seq + 2, f"{seq} -> {got}")
    with ck.case("shapes that disagree raise on every rank, before gocomm runs the op"):
        try:
            dist.all_reduce(torch.ones(4 + me))
            ck.fail("mismatched all_reduce", "no error")
        except RuntimeError as e:
            ck.expect("torch names the mismatch", "Detected mismatch between collectives" in str(e), str(e)[:300])
        t = torch.ones(3)
        dist.all_reduce(t)
        ck.same("the group goes on", t, torch.full((3,), float(n)))
    with ck.case("gocomm.all_to_all_v and moe"):
        x = torch.arange(2 * n, dtype=torch.float32).view(-1, 1) + 100 * me
        out, splits = gocomm.all_to_all_v(x, torch.full((n,), 2, dtype=torch.int64))
        want = torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 100 * s for s in range(n)])
        ck.same("all_to_all_v", out.view(-1), want)
        tok = gen(seed, "dbg/moe", me, (5, 16), torch.float32)
        idx = torch.tensor([[e % (2 * n), (e + 1) % (2 * n)] for e in range(5)])
        recv, _, h = gocomm.moe.dispatch(tok, idx, torch.full((5, 2), 0.5), 2 * n)
        ck.same("moe dispatch and combine give x back (weights sum to 1)", gocomm.moe.combine(recv, h), tok)
    return ck.done()


def test_torch_distributed_debug_detail(worlds, seed):
    with worlds.fresh(3, label="-dbgdetail", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) as w:
        w.run(check_debug_detail, seed=seed)


_REINIT = """
import gc, socket, sys
import torch, torch.distributed as dist
import gocomm
from gocomm import _backend
port = int(sys.argv[1])
for i in range(3):
    dist.init_process_group("gocomm", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [1.0] * 4, t
    g = dist.new_group([0])
    dist.all_reduce(t, group=g)
    dist.destroy_process_group(g)
    del g
    dist.destroy_process_group()
gc.collect()
assert len(_backend._groups) == 0, f"{len(_backend._groups)} groups still alive"
s = socket.socket()
s.bind(("127.0.0.1", port))  # torch's TCPStore, held by a group that is gone, would hold it
print("ok")
"""


def _run_alone(script: str, cwd, **env) -> None:
    """script in a one-rank job of its own (a new session: its signals reach nobody else),
    given a free port, with env added; it prints ok at the end."""
    import os
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env}
    r = subprocess.run(
        [sys.executable, "-c", script, str(port)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_destroyed_groups_are_freed(tmp_path):
    """init, all_reduce and destroy three times on one rendezvous port: every gocomm group is
    freed once torch drops it (its backend's callbacks held the control plane's group, which
    held the backend weakly: neither went, nor the group's Store, whose server kept the port),
    and the port is free again afterwards, as with gloo."""
    _run_alone(_REINIT, tmp_path)


_CTRL_C = """
import os, signal, sys, time
import torch, torch.distributed as dist
import gocomm
dist.init_process_group("gocomm", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
t = torch.ones(4)
dist.all_reduce(t)
signal.signal(signal.SIGINT, signal.default_int_handler)  # a job started in the background ignores it
try:
    os.killpg(os.getpgrp(), signal.SIGINT)  # what a terminal's Ctrl-C does
    time.sleep(10)
    raise SystemExit("no KeyboardInterrupt")
except KeyboardInterrupt:
    time.sleep(3)  # a sidecar that took the signal too has aborted the group by now
dist.all_reduce(t)  # a rank that catches it (to save a checkpoint, say) goes on
assert t.tolist() == [1.0] * 4, t
dist.destroy_process_group()
print("ok")
"""


def test_ctrl_c_is_the_ranks(tmp_path):
    """SIGINT to the job's process group (Ctrl-C in a terminal) reaches the rank, which may
    catch it and run collectives, and not its sidecar (a session of its own), which stopped
    and aborted the groups."""
    _run_alone(_CTRL_C, tmp_path)


def test_relative_runtime_dir(tmp_path):
    """XDG_RUNTIME_DIR given relative (to the job's working directory): the sidecar's socket
    still makes a gRPC target (unix:rel/... is not one, and the start waited its full timeout
    to say pgserver did not answer)."""
    _run_alone(_REINIT, tmp_path, XDG_RUNTIME_DIR="rel", GOCOMM_START_TIMEOUT="20")


_OPTIONS = """
import logging, sys
import torch, torch.distributed as dist
import gocomm
said = []
logging.getLogger("gocomm").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: said.append(r.getMessage())})())
dist.init_process_group("gocomm", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
assert not any("pg_options" in m for m in said), said
g = dist.new_group([0], pg_options=dist.ProcessGroupGloo._Options(), group_desc="with_options")
assert any("pg_options (_Options) ignored" in m for m in said), said
t = torch.ones(4)
dist.all_reduce(t, group=g)
assert t.tolist() == [1.0] * 4, t
dist.destroy_process_group()
print("ok")
"""


def test_pg_options_are_said_ignored(tmp_path):
    """pg_options (torch's NCCL takes ProcessGroupNCCL.Options there) are ignored with a
    warning naming them: gocomm's settings are its GOCOMM_* variables; the group works."""
    _run_alone(_OPTIONS, tmp_path)
