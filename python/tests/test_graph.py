"""CUDA graph capture of gocomm's ops (marked gpu: they skip, saying why, without CUDA).

Every dense collective of CUDA tensors is called under torch.cuda.graph on a side stream.
What runs as a kernel in this process (all_reduce of bf16/fp16/fp32 sum and avg, and
all_to_all_single, on groups whose GPUs share NVLink) must be captured and, replayed with new
data each time, give what a float64 (or exact) reference computed on the host from every
rank's inputs gives. Everything that runs in the sidecar must raise at capture, naming the
op, and leave the group as it was: the sidecar saw no op (its counters), and the same op run
eagerly afterwards is right.

Worlds: one rank (its GPU alone is no NVLink group: everything raises); one rank with the
in-process kernels forced (GOCOMM_TRANSPORT=nvshmem); two and four ranks, each on its own
GPU where the machine has that many, else sharing GPUs (CUDA IPC within a device; run under
MPS so the ranks' kernels run at once). NCCL refuses ranks that share a GPU, so there the
sidecar ops are checked for their refusal only.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ranklib import Checker, gen, seeded_int

from gocomm._backend import state

pytestmark = pytest.mark.gpu

os.environ["GOCOMM_CUDA"] = "1"

RUN_LIMIT_S = float(os.environ.get("GOCOMM_GPU_TEST_LIMIT", "300"))
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
REPLAYS = 3


def _inputs(seed, key, n, shape, dtype):
    """Every rank's input for one replay (the same on every rank: each computes the reference)."""
    xs = [gen(seed, key, r, shape, torch.float32 if dtype in FP8 else dtype, small=True) for r in range(n)]
    return [x.to(dtype) for x in xs] if dtype in FP8 else xs


def _capture(dev, fn):
    """fn captured in a graph on a side stream; the graph."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    return graph


def _sum_close(ck, label, got, xs, avg):
    """got against the float64 sum (or mean) of xs: within one rounding of got's dtype of the
    inputs' sizes (the kernel sums in float32 and rounds once)."""
    ref = sum(x.double() for x in xs)
    scale = sum(x.double().abs() for x in xs)
    if avg:
        ref, scale = ref / len(xs), scale / len(xs)
    eps = torch.finfo(got.dtype).eps
    err = ((got.cpu().double() - ref).abs() - eps * (scale + 1e-30)).max().item() if got.numel() else 0.0
    if not err <= 0:
        ck.fail(label, f"off the float64 reference by more than one rounding (excess {err:.3g})")


def check_captured(rk, seed, shared):
    """The in-process ops captured and replayed with new data; returns the cases run."""
    n, me = rk.size, rk.rank
    dev = torch.device("cuda", me % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    pg = dist.group.WORLD
    ck = Checker(f"captured on {n} rank(s){' sharing GPUs' if shared else ''}", seed, me)
    if state(pg)._routes.ar_inprocess:
        # one-shot (16 KiB), two-shot (2 MiB) and two-shot in rounds (GOCOMM_AR_STAGE is 1 MiB here)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for numel in (8192 // torch.finfo(dtype).bits * 16, 1 << 20, (3 << 20) + 8):
                for op, avg in ((dist.ReduceOp.SUM, False), (dist.ReduceOp.AVG, True)):
                    label = f"all_reduce {dtype} {numel} {'avg' if avg else 'sum'}"
                    with ck.case(label):
                        t = torch.zeros(numel, dtype=dtype, device=dev)
                        dist.all_reduce(t, op=op)  # the path is set up before any capture
                        graph = _capture(dev, lambda t=t, op=op: dist.all_reduce(t, op=op))
                        for i in range(REPLAYS):
                            xs = _inputs(seed, f"{label}/{i}", n, (numel,), dtype)
                            t.copy_(xs[me])
                            graph.replay()
                            _sum_close(ck, f"{label} replay {i}", t, xs, avg)
                        # an eager op after the replays, and a replay after it, agree on the epoch
                        xs = _inputs(seed, f"{label}/eager", n, (numel,), dtype)
                        t.copy_(xs[me])
                        dist.all_reduce(t, op=op)
                        _sum_close(ck, f"{label} eager after replays", t, xs, avg)
                        t.copy_(xs[me])
                        graph.replay()
                        _sum_close(ck, f"{label} replay after eager", t, xs, avg)
    if state(pg)._routes.a2a_inprocess:
        for dtype, row in (
            (torch.bfloat16, (24,)),
            (torch.float32, (5,)),
            (torch.int64, ()),
            (torch.uint8, (3,)),
            (torch.bool, (16,)),
            (torch.float8_e4m3fn, (32,)),
        ):
            label = f"all_to_all_single {dtype} rows {row}"
            with ck.case(label):
                # uneven splits with empty ones, fixed in the graph (they ride in its launch)
                splits = [
                    [0 if (s + d) % 3 == 1 else seeded_int(seed, f"{label}/{s}/{d}", 1, 6) for d in range(n)]
                    for s in range(n)
                ]
                send, recv = splits[me], [splits[s][me] for s in range(n)]
                inp = torch.zeros((sum(send), *row), dtype=dtype, device=dev)
                out = torch.zeros((sum(recv), *row), dtype=dtype, device=dev)
                dist.all_to_all_single(out, inp, recv, send)
                graph = _capture(dev, lambda o=out, x=inp, r=recv, s=send: dist.all_to_all_single(o, x, r, s))
                for i in range(REPLAYS):
                    xs = [gen(seed, f"{label}/{i}", s, (sum(splits[s]), *row), dtype) for s in range(n)]
                    inp.copy_(xs[me].to(dev))
                    graph.replay()
                    want = torch.cat([xs[s].narrow(0, sum(splits[s][:me]), splits[s][me]) for s in range(n)])
                    ck.same(f"{label} replay {i}", out.cpu(), want)
    torch.cuda.synchronize(dev)
    return ck.done()


def _sidecar_ops(n, me, dev, seed, i):
    """(name, call, check) for every op that runs in the sidecar: call runs it on fresh
    tensors, check(ck) compares its outputs with the reference (eager runs only)."""
    x = [gen(seed, f"sc{i}", r, (6, 4), torch.float32) for r in range(n)]
    xi = [gen(seed, f"sci{i}", r, (40,), torch.int32) for r in range(n)]
    # this rank's inputs on the GPU now: a host-to-device copy is not allowed under capture
    dx, dxi = x[me].to(dev), xi[me].to(dev)
    t = {}

    def ar_int():
        t["ar"] = dxi.clone()
        dist.all_reduce(t["ar"])

    def ar_max():
        t["max"] = dx.clone()
        dist.all_reduce(t["max"], op=dist.ReduceOp.MAX)

    def agt():
        t["agt"] = torch.empty(n * 6, 4, device=dev)
        dist.all_gather_into_tensor(t["agt"], dx)

    def rst():  # 40 elements split over 1, 2 or 4 ranks
        t["rst"] = torch.empty(40 // n, dtype=torch.int32, device=dev)
        dist.reduce_scatter_tensor(t["rst"], dxi)

    def bc():
        t["bc"] = dx.clone()
        dist.broadcast(t["bc"], src=0)

    def ag():
        t["ag"] = [torch.empty(6, 4, device=dev) for _ in range(n)]
        dist.all_gather(t["ag"], dx)

    def a2a():
        t["a2a"] = [torch.empty(3, device=dev) for _ in range(n)]
        dist.all_to_all(t["a2a"], [dx[j % 6, :3].contiguous() for j in range(n)])

    def red():
        t["red"] = dxi.clone()
        dist.reduce(t["red"], dst=0)

    ops = [
        ("all_reduce", ar_int, lambda ck: ck.same("all_reduce int32", t["ar"].cpu(), sum(xi))),
        ("all_reduce", ar_max, lambda ck: ck.same("all_reduce max", t["max"].cpu(), torch.stack(x).amax(0))),
        ("all_gather_into_tensor", agt, lambda ck: ck.same("all_gather_into_tensor", t["agt"].cpu(), torch.cat(x))),
        (
            "reduce_scatter_tensor",
            rst,
            lambda ck: ck.same("reduce_scatter_tensor", t["rst"].cpu(), sum(xi).chunk(n)[me]),
        ),
        ("broadcast", bc, lambda ck: ck.same("broadcast", t["bc"].cpu(), x[0])),
        ("all_gather", ag, lambda ck: [ck.same(f"all_gather [{r}]", t["ag"][r].cpu(), x[r]) for r in range(n)]),
        (
            "all_to_all",
            a2a,
            lambda ck: [ck.same(f"all_to_all [{r}]", t["a2a"][r].cpu(), x[r][me % 6, :3]) for r in range(n)],
        ),
        ("reduce", red, lambda ck: me != 0 or ck.same("reduce", t["red"].cpu(), sum(xi))),
    ]
    if n % 2 == 0:  # pairs (0, 1), (2, 3): the even rank sends

        def p2p():
            if me % 2 == 0:
                dist.send(dx, me + 1)
            else:
                t["recv"] = torch.empty(6, 4, device=dev)
                dist.recv(t["recv"], me - 1)

        ops.append(
            (
                "send" if me % 2 == 0 else "recv",
                p2p,
                lambda ck: me % 2 == 0 or ck.same("recv", t["recv"].cpu(), x[me - 1]),
            )
        )
    if not state(dist.group.WORLD)._routes.a2a_inprocess:
        xs = [gen(seed, f"sca{i}", r, (2 * n, 3), torch.float32) for r in range(n)]
        dxs = xs[me].to(dev)

        def a2as():
            t["a2as"] = torch.empty(2 * n, 3, device=dev)
            dist.all_to_all_single(t["a2as"], dxs)

        ops.append(
            (
                "all_to_all_single",
                a2as,
                lambda ck: ck.same(
                    "all_to_all_single", t["a2as"].cpu(), torch.cat([v[2 * me : 2 * me + 2] for v in xs])
                ),
            )
        )
    if not state(dist.group.WORLD)._routes.ar_inprocess:
        xb = [gen(seed, f"scb{i}", r, (64,), torch.bfloat16, small=True) for r in range(n)]
        dxb = xb[me].to(dev)

        def ar_bf16():
            t["arb"] = dxb.clone()
            dist.all_reduce(t["arb"])

        ops.append(("all_reduce", ar_bf16, lambda ck: _sum_close(ck, "all_reduce bf16", t["arb"], xb, False)))
    return ops


def check_refused(rk, seed, shared):
    """Every sidecar op raises at capture, naming itself; the sidecar saw nothing of it; the
    same op eagerly afterwards is right (where the ranks have a GPU each)."""
    n, me = rk.size, rk.rank
    dev = torch.device("cuda", me % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    pg = dist.group.WORLD
    ck = Checker(f"refused under capture on {n} rank(s){' sharing GPUs' if shared else ''}", seed, me)
    before = state(pg).stats()["ops"]
    for i, (name, call, _) in enumerate(_sidecar_ops(n, me, dev, seed, 0)):
        with ck.case(f"{name} #{i} under capture"):
            try:
                _capture(dev, call)
                ck.fail(f"{name} #{i}", "captured without an error (a replay would not run it)")
            except RuntimeError as e:
                msg = str(e)
                ck.expect(f"{name} #{i} error", f"gocomm {name} cannot be captured" in msg, msg[:300])
            torch.cuda.synchronize(dev)
    ck.expect("the sidecar saw no op", state(pg).stats()["ops"] == before, f"{before} -> {state(pg).stats()['ops']}")
    if not shared:
        for i, (name, call, check) in enumerate(_sidecar_ops(n, me, dev, seed, 1)):
            with ck.case(f"{name} #{i} eagerly after"):
                call()
                torch.cuda.synchronize(dev)
                check(ck)
    return ck.done()


def _world(worlds, size, transport):
    if size > 1 and torch.cuda.device_count() < size and size > 2 * torch.cuda.device_count():
        pytest.skip(f"{size} ranks on {torch.cuda.device_count()} GPU(s): at most two ranks share a GPU here")
    shared = torch.cuda.device_count() < size
    env = {"GOCOMM_AR_STAGE": "1M"}
    if transport:
        env["GOCOMM_TRANSPORT"] = transport
    return worlds.fresh(size, label=f"graph{transport or ''}", env=env), shared


@pytest.mark.parametrize(
    "size,transport",
    [(1, ""), (1, "nvshmem"), (2, "nvshmem"), (4, "nvshmem")],
    ids=["w1", "w1-inprocess", "w2", "w4"],
)
def test_graph_capture(worlds, seed, size, transport):
    w, shared = _world(worlds, size, transport)
    try:
        refused = w.run(check_refused, seed=seed, shared=shared, timeout=RUN_LIMIT_S)
        captured = w.run(check_captured, seed=seed, shared=shared, timeout=RUN_LIMIT_S)
        if transport and shared:
            # the other in-process captures, which test_gpu runs on a GPU per rank, here on
            # ranks that share one: all_to_all_v (plain out, receive buffer, subgroups),
            # padded MoE dispatch + combine in one graph, and all_to_all_v as a compiled torch op
            from test_gpu import check_all_to_all_v_graph, check_all_to_all_v_op, check_moe_graph

            w.run(check_all_to_all_v_graph, seed=seed, timeout=RUN_LIMIT_S)
            w.run(check_moe_graph, seed=seed, timeout=RUN_LIMIT_S)
            w.run(check_all_to_all_v_op, seed=seed, timeout=RUN_LIMIT_S)
    finally:
        w.close()
    # every rank ran every case: the sidecar ops (8 to 11, with the eager rerun where each rank
    # has a GPU), and where the in-process kernels serve the group, all_to_all_single (6
    # dtypes) and from two ranks all_reduce (3 dtypes x 3 sizes x sum, avg)
    want = (6 if transport else 0) + (18 if transport and size > 1 else 0)
    assert captured == [want] * size, f"captured cases per rank {captured}, want {want} each"
    assert all(r >= 8 for r in refused), f"refused cases per rank {refused}"
