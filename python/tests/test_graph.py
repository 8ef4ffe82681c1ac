"""CUDA graph capture of gocomm's ops (marked gpu: they skip, saying why, without CUDA).

Every dense collective of CUDA tensors is called under torch.cuda.graph on a side stream and,
replayed with new data each time, must give what a float64 (or exact) reference computed on
the host from every rank's inputs gives. What runs as a kernel in this process (all_reduce of
bf16/fp16/fp32 sum and avg, and all_to_all_single, on groups whose GPUs share NVLink) is
captured as that kernel; every other collective runs in the sidecar as a graph op
(docs/decisions/0020): registered at capture, run by the sidecar's graph lane at each replay,
counted by the sidecar once per replay, eager ops of the group between replays. What cannot
be captured (send/recv, gocomm.all_to_all_v without the in-process kernel) raises at capture,
naming the op, and leaves the group as it was.

Worlds: one rank (the sidecar's NCCL for everything, GOCOMM_TRANSPORT=nccl: on a machine of
several NVLink GPUs one rank would otherwise take the in-process all_to_all); one rank with the in-process kernels
forced (GOCOMM_TRANSPORT=nvshmem); two and four ranks, each on its own GPU where the machine
has that many, else sharing GPUs (CUDA IPC within a device; run under MPS so the ranks'
kernels run at once). NCCL refuses ranks that share a GPU, so there the sidecar's graph ops
are not run. At one rank also: graphs destroyed and re-captured past the process's trigger
count, and a sidecar failure (the group aborted, the sidecar killed) under replays, which
must leave no stream blocked.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from _harness import GPU_RUN_LIMIT_S as RUN_LIMIT_S
from ranklib import Checker, gen, seeded_int

import gocomm
from gocomm._backend import state

pytestmark = pytest.mark.gpu

os.environ["GOCOMM_CUDA"] = "1"

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
    """got against the float64 sum (or mean) of xs: the kernel sums in float32, so within one
    rounding of got's dtype of the inputs' sizes for bf16/fp16 (rounded once at the end), and
    one per addition for float32 (n - 1 of them). A result in the dtype's subnormal range
    rounds to its subnormal spacing, not relative to its size: one spacing more is allowed
    (an fp16 mean of two tiny inputs was 1.7e-8 past the relative bound alone)."""
    ref = sum(x.double() for x in xs)
    scale = sum(x.double().abs() for x in xs)
    if avg:
        ref, scale = ref / len(xs), scale / len(xs)
    fi = torch.finfo(got.dtype)
    eps = fi.eps * (max(1, len(xs) - 1) if got.dtype == torch.float32 else 1)
    spacing = fi.smallest_normal * fi.eps  # between subnormals
    err = ((got.cpu().double() - ref).abs() - eps * scale - spacing).max().item() if got.numel() else 0.0
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


def _graph_cases(n, me, dev, routes):
    """The sidecar's dense collectives as graph cases: (name, descriptors per call, make).
    make(seed) allocates the case's static tensors and returns (fill, call, check): fill(key)
    writes this rank's inputs of one run into them (on the current stream) and returns every
    rank's; call() runs the op on them (captured, or eagerly); check(ck, label, xs) compares
    the outputs with the reference computed from xs. Outputs live apart from inputs where the
    op allows, so that a replay whose op did not run shows stale data."""
    big = 1 << 22  # 16 MiB of float32: a replay that did not wait for the op reads a partial copy

    def per_rank(seed, key, shape, dtype, small=False):
        return [gen(seed, key, r, shape, dtype, small=small) for r in range(n)]

    def all_reduce(dtype, numel, op, small=False):
        def make(seed):
            t = torch.zeros(numel, dtype=dtype, device=dev)

            def fill(key):
                xs = per_rank(seed, key, (numel,), dtype, small)
                t.copy_(xs[me], non_blocking=True)
                return xs

            def check(ck, label, xs):
                if op == dist.ReduceOp.MAX:
                    ck.same(label, t.cpu(), torch.stack(xs).amax(0))
                elif dtype.is_floating_point:
                    _sum_close(ck, label, t, xs, False)
                else:
                    ck.same(label, t.cpu(), sum(xs))

            return fill, lambda: dist.all_reduce(t, op=op), check

        return make

    def coalesced(seed):
        ts = [torch.zeros(k, device=dev) for k in (5, 64, 3)]

        def fill(key):
            xs = [per_rank(seed, f"{key}/{j}", t.shape, torch.float32, True) for j, t in enumerate(ts)]
            for j, t in enumerate(ts):
                t.copy_(xs[j][me])
            return xs

        def check(ck, label, xs):
            for j, t in enumerate(ts):
                _sum_close(ck, f"{label} [{j}]", t, xs[j], False)

        return fill, lambda: dist.all_reduce_coalesced(ts), check

    def broadcast(seed):
        t = torch.zeros(6, 4, device=dev)

        def fill(key):
            xs = per_rank(seed, key, (6, 4), torch.float32)
            t.copy_(xs[me])
            return xs

        return fill, lambda: dist.broadcast(t, src=0), lambda ck, label, xs: ck.same(label, t.cpu(), xs[0])

    def reduce(seed):
        t = torch.zeros(40, dtype=torch.int32, device=dev)

        def fill(key):
            xs = per_rank(seed, key, (40,), torch.int32)
            t.copy_(xs[me])
            return xs

        return fill, lambda: dist.reduce(t, dst=0), lambda ck, label, xs: me != 0 or ck.same(label, t.cpu(), sum(xs))

    def all_gather(seed):
        x = torch.zeros(6, 4, device=dev)
        outs = [torch.zeros(6, 4, device=dev) for _ in range(n)]

        def fill(key):
            xs = per_rank(seed, key, (6, 4), torch.float32)
            x.copy_(xs[me])
            return xs

        def check(ck, label, xs):
            for r in range(n):
                ck.same(f"{label} [{r}]", outs[r].cpu(), xs[r])

        return fill, lambda: dist.all_gather(outs, x), check

    def all_gather_into_tensor(seed):
        x = torch.zeros(big, device=dev)
        out = torch.zeros(n * big, device=dev)

        def fill(key):
            xs = per_rank(seed, key, (big,), torch.float32)
            x.copy_(xs[me])
            return xs

        return (
            fill,
            lambda: dist.all_gather_into_tensor(out, x),
            lambda ck, label, xs: ck.same(label, out.cpu(), torch.cat(xs)),
        )

    def reduce_scatter(seed):
        ins = [torch.zeros(8, dtype=torch.int64, device=dev) for _ in range(n)]
        out = torch.zeros(8, dtype=torch.int64, device=dev)

        def fill(key):
            xs = per_rank(seed, key, (n, 8), torch.int64)
            for j in range(n):
                ins[j].copy_(xs[me][j])
            return xs

        return (
            fill,
            lambda: dist.reduce_scatter(out, ins),
            lambda ck, label, xs: ck.same(label, out.cpu(), sum(x[me] for x in xs)),
        )

    def reduce_scatter_tensor(seed):
        x = torch.zeros(n * 1000, device=dev)
        out = torch.zeros(1000, device=dev)

        def fill(key):
            xs = per_rank(seed, key, (n * 1000,), torch.float32, True)
            x.copy_(xs[me])
            return xs

        def check(ck, label, xs):
            _sum_close(ck, label, out, [v.narrow(0, me * 1000, 1000) for v in xs], False)

        return fill, lambda: dist.reduce_scatter_tensor(out, x), check

    def all_to_all(seed):
        ins = [torch.zeros(3, device=dev) for _ in range(n)]
        outs = [torch.zeros(3, device=dev) for _ in range(n)]

        def fill(key):
            xs = per_rank(seed, key, (n, 3), torch.float32)
            for j in range(n):
                ins[j].copy_(xs[me][j])
            return xs

        def check(ck, label, xs):
            for r in range(n):
                ck.same(f"{label} [{r}]", outs[r].cpu(), xs[r][me])

        return fill, lambda: dist.all_to_all(outs, ins), check

    def all_to_all_single(seed):
        # uneven splits, fixed at capture as in a torch NCCL graph
        splits = [[(s + d) % 3 + 1 for d in range(n)] for s in range(n)]
        send, recv = splits[me], [splits[s][me] for s in range(n)]
        x = torch.zeros(sum(send), 5, device=dev)
        out = torch.zeros(sum(recv), 5, device=dev)

        def fill(key):
            xs = [gen(seed, key, s, (sum(splits[s]), 5), torch.float32) for s in range(n)]
            x.copy_(xs[me])
            return xs

        def check(ck, label, xs):
            want = torch.cat([xs[s].narrow(0, sum(splits[s][:me]), splits[s][me]) for s in range(n)])
            ck.same(label, out.cpu(), want)

        return fill, lambda: dist.all_to_all_single(out, x, recv, send), check

    def gather(seed):
        x = torch.zeros(7, dtype=torch.float64, device=dev)
        outs = [torch.zeros(7, dtype=torch.float64, device=dev) for _ in range(n)]

        def fill(key):
            xs = per_rank(seed, key, (7,), torch.float64)
            x.copy_(xs[me])
            return xs

        def check(ck, label, xs):
            for r in range(n if me == 0 else 0):
                ck.same(f"{label} [{r}]", outs[r].cpu(), xs[r])

        return fill, lambda: dist.gather(x, outs if me == 0 else None, dst=0), check

    def scatter(seed):
        ins = [torch.zeros(9, dtype=torch.int32, device=dev) for _ in range(n)]
        out = torch.zeros(9, dtype=torch.int32, device=dev)

        def fill(key):
            xs = per_rank(seed, key, (n, 9), torch.int32)  # the root's rows are what counts
            for j in range(n):
                ins[j].copy_(xs[me][j])
            return xs

        return (
            fill,
            lambda: dist.scatter(out, ins if me == 0 else None, src=0),
            lambda ck, label, xs: ck.same(label, out.cpu(), xs[0][me]),
        )

    def coalescing_manager(seed):
        xs_t = [torch.zeros(3 + j, dtype=torch.int32, device=dev) for j in range(2)]
        outs = [torch.zeros(n * (3 + j), dtype=torch.int32, device=dev) for j in range(2)]

        def fill(key):
            xs = [per_rank(seed, f"{key}/{j}", (3 + j,), torch.int32) for j in range(2)]
            for j in range(2):
                xs_t[j].copy_(xs[j][me])
            return xs

        def call():
            with dist._coalescing_manager(async_ops=True) as cm:
                for j in range(2):
                    dist.all_gather_into_tensor(outs[j], xs_t[j])
            cm.wait()

        def check(ck, label, xs):
            for j in range(2):
                ck.same(f"{label} [{j}]", outs[j].cpu(), torch.cat(xs[j]))

        return fill, call, check

    return [
        ("all_reduce int32 sum", 1, all_reduce(torch.int32, 40, dist.ReduceOp.SUM)),
        ("all_reduce float32 max", 1, all_reduce(torch.float32, 24, dist.ReduceOp.MAX)),
        # descriptors 0 where the in-process kernel serves the op (it is captured there too)
        (
            "all_reduce bf16 sum 1M",
            0 if routes.ar_inprocess else 1,
            all_reduce(torch.bfloat16, 1 << 20, dist.ReduceOp.SUM, small=True),
        ),
        ("all_reduce_coalesced", 1, coalesced),
        ("broadcast", 1, broadcast),
        ("reduce", 1, reduce),
        ("all_gather", 1, all_gather),
        ("all_gather_into_tensor 16 MiB", 1, all_gather_into_tensor),
        ("reduce_scatter", 1, reduce_scatter),
        ("reduce_scatter_tensor", 1, reduce_scatter_tensor),
        ("all_to_all", 1, all_to_all),
        ("all_to_all_single uneven", 0 if routes.a2a_inprocess else 1, all_to_all_single),
        ("gather", 1, gather),
        ("scatter", 1, scatter),
        ("coalescing manager, 2 all_gather_into_tensor", 2, coalescing_manager),
    ]


def _sidecar_ops_run(pg):
    return sum(state(pg).stats()["ops"].values())


def _ops_reach(ck, label, pg, want, limit_s=5.0):
    """The sidecar's op count reaches want (its poller retires an op just after the GPU ran it)."""
    deadline = time.monotonic() + limit_s
    got = _sidecar_ops_run(pg)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.01)
        got = _sidecar_ops_run(pg)
    if got != want:
        ck.fail(label, f"the sidecar ran {got} ops, want {want}")


def check_sidecar_captured(rk, seed):
    """Every dense sidecar collective captured (a graph op, docs/decisions/0020) and replayed
    with new data; an eager op of the same kind between replays; each replay and eager op
    counted once by the sidecar (so at one rank, where the result equals the input for the
    in-place ops, a replay whose op did not run is still seen)."""
    n, me = rk.size, rk.rank
    dev = torch.device("cuda", me % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    pg = dist.group.WORLD
    ck = Checker(f"sidecar ops captured on {n} rank(s)", seed, me)
    for name, ndesc, make in _graph_cases(n, me, dev, state(pg)._routes):
        with ck.case(name):
            fill, call, check = make(seed)
            before = _sidecar_ops_run(pg)  # the previous case's ops all counted (_ops_reach)
            xs = fill(f"{name}/first")
            call()  # eagerly once: buffers registered, communicators made, as a warm-up would
            check(ck, f"{name} eager before capture", xs)
            before += ndesc
            _ops_reach(ck, f"{name} eager op run", pg, before)
            graph = _capture(dev, call)
            ck.expect(
                f"{name}: capture ran nothing", _sidecar_ops_run(pg) == before, "the sidecar ran an op at capture"
            )
            for i in range(REPLAYS):
                xs = fill(f"{name}/{i}")
                graph.replay()
                check(ck, f"{name} replay {i}", xs)
                if i == 1:  # an eager op of the same kind, on the same buffers, between replays
                    xs = fill(f"{name}/eager")
                    call()
                    check(ck, f"{name} eager between replays", xs)
            _ops_reach(ck, f"{name} ops run", pg, before + ndesc * (REPLAYS + 1))
            del graph
    with ck.case("barrier under capture"):
        # a host op: it runs when called, as the README says, and a replay does not run it
        before = _sidecar_ops_run(pg)
        graph = _capture(dev, dist.barrier)
        _ops_reach(ck, "barrier at capture", pg, before + 1)
        graph.replay()
        torch.cuda.synchronize(dev)
        time.sleep(0.05)
        ck.expect("barrier not replayed", _sidecar_ops_run(pg) == before + 1, f"{_sidecar_ops_run(pg) - before} ran")
    torch.cuda.synchronize(dev)
    return ck.done()


def check_recapture(rk, seed):
    """Graphs destroyed and captured again: the drop reaches the sidecar and the next capture
    reuses the trigger; more graphs than a process has triggers (1024) run, 32 at a time
    (each batch destroyed before the next), so a trigger that was not given back shows."""
    n, me = rk.size, rk.rank
    dev = torch.device("cuda", me % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    pg = dist.group.WORLD
    client = state(pg)._sc.client
    ck = Checker(f"graphs re-captured on {n} rank(s)", seed, me)
    t = torch.zeros(64, device=dev)
    out = torch.zeros(n * 64, device=dev)
    dist.all_gather_into_tensor(out, t)
    base = client.live_triggers()
    with ck.case("re-capture"):
        per = 32
        for k in range(1024 // per + 2):
            graphs = [_capture(dev, lambda: dist.all_gather_into_tensor(out, t)) for _ in range(per)]
            xs = [gen(seed, f"rc{k}", r, (64,), torch.float32) for r in range(n)]
            t.copy_(xs[me])
            graphs[k % per].replay()
            ck.same(f"replay after {k * per} captures", out.cpu(), torch.cat(xs))
            live = client.live_triggers()
            ck.expect("live triggers", live == base + per, f"{live} live, want {base + per}")
            del graphs
            torch.cuda.synchronize(dev)
            deadline = time.monotonic() + 5
            while client.live_triggers() != base and time.monotonic() < deadline:
                time.sleep(0.002)
            if client.live_triggers() != base:
                ck.fail("drop", f"{client.live_triggers() - base} triggers still live 5 s after their graphs went")
                break
    return ck.done()


def check_failure_releases(rk, seed, how):
    """A sidecar failure during replays leaves no stream blocked: the replays in flight and
    every later one return within a bounded time (their outputs are not defined), and the next
    eager call raises. how: "abort" (the group breaks in the sidecar, which lets each replay
    through) or "kill" (the sidecar dies; the client lets them through)."""
    n, me = rk.size, rk.rank
    dev = torch.device("cuda", me % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    pg = dist.group.WORLD if how == "kill" else dist.new_group(list(range(n)))
    ck = Checker(f"replays after a sidecar failure ({how}) on {n} rank(s)", seed, me)
    t = torch.zeros(1 << 20, device=dev)
    out = torch.zeros(n << 20, device=dev)
    dist.all_gather_into_tensor(out, t, group=pg)
    graph = _capture(dev, lambda: dist.all_gather_into_tensor(out, t, group=pg))
    xs = [gen(seed, "fr", r, (1 << 20,), torch.float32) for r in range(n)]
    t.copy_(xs[me])
    graph.replay()
    ck.same("replay before the failure", out.cpu(), torch.cat(xs))
    with ck.case(f"replays across the failure ({how})"):
        for _ in range(20):  # replays in flight when it happens
            graph.replay()
        if how == "kill":
            os.kill(gocomm.info()["pid"], signal.SIGKILL)
        else:
            state(pg).abort()
        start = time.monotonic()
        torch.cuda.synchronize(dev)
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize(dev)
        took = time.monotonic() - start
        ck.expect("bounded", took < 20, f"the replays took {took:.1f} s after the failure")
    with ck.case("the next call raises"):
        try:
            dist.all_gather_into_tensor(out, t, group=pg)
            torch.cuda.synchronize(dev)
            ck.fail("eager call after the failure", "returned without an error")
        except (RuntimeError, ValueError) as e:
            ck.expect("names gocomm", "gocomm" in str(e), str(e)[:300])
    return ck.done()


def check_refused(rk, seed, shared):
    """What cannot be captured raises at capture, naming the op, and leaves the group as it
    was (the sidecar saw no op; the same op eagerly afterwards is right where the ranks have
    a GPU each): send/recv (the sidecar's per-peer communicators), and gocomm.all_to_all_v and
    gocomm.moe.dispatch without the in-process kernel (their counts are read on the host; the
    compiled client refuses both, csrc/client/a2av.cc and moe_any.cc)."""
    n, me = rk.size, rk.rank
    dev = torch.device("cuda", me % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    pg = dist.group.WORLD
    ck = Checker(f"refused under capture on {n} rank(s){' sharing GPUs' if shared else ''}", seed, me)
    x = [gen(seed, "p2p", r, (6, 4), torch.float32) for r in range(n)]
    dx = x[me].to(dev)
    got = {}
    ops = []
    if n % 2 == 0:  # pairs (0, 1), (2, 3): the even rank sends

        def p2p():
            if me % 2 == 0:
                dist.send(dx, me + 1)
            else:
                got["recv"] = torch.empty(6, 4, device=dev)
                dist.recv(got["recv"], me - 1)

        ops.append(
            (
                "send" if me % 2 == 0 else "recv",
                p2p,
                lambda: me % 2 == 0 or ck.same("recv", got["recv"].cpu(), x[me - 1]),
            )
        )
    if not state(pg)._routes.a2a_inprocess:
        rows = torch.ones(n, dtype=torch.int64, device=dev)
        inp = torch.zeros(n, 3, device=dev)
        ops.append(("all_to_all_v", lambda: gocomm.all_to_all_v(inp, rows), lambda: True))
        tokens = torch.ones(n, 128, dtype=torch.bfloat16, device=dev)
        experts = torch.arange(n, device=dev).unsqueeze(1)  # token r to expert r, on rank r
        weights = torch.ones(n, 1, device=dev)
        ops.append(("moe.dispatch", lambda: gocomm.moe.dispatch(tokens, experts, weights, n), lambda: True))
    before = state(pg).stats()["ops"]
    for name, call, _ in ops:
        with ck.case(f"{name} under capture"):
            try:
                _capture(dev, call)
                ck.fail(name, "captured without an error (a replay would not run it)")
            except RuntimeError as e:
                msg = str(e)
                ck.expect(f"{name} error", f"gocomm {name} cannot be captured" in msg, msg[:300])
            torch.cuda.synchronize(dev)
    ck.expect("the sidecar saw no op", state(pg).stats()["ops"] == before, f"{before} -> {state(pg).stats()['ops']}")
    if not shared:
        for name, call, check in ops:
            with ck.case(f"{name} eagerly after"):
                call()
                torch.cuda.synchronize(dev)
                check()
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
    [(1, "nccl"), (1, "nvshmem"), (2, "nvshmem"), (4, "nvshmem")],
    ids=["w1", "w1-inprocess", "w2", "w4"],
)
def test_graph_capture(worlds, seed, size, transport):
    w, shared = _world(worlds, size, transport)
    sidecar = None
    try:
        refused = w.run(check_refused, seed=seed, shared=shared, timeout=RUN_LIMIT_S)
        captured = w.run(check_captured, seed=seed, shared=shared, timeout=RUN_LIMIT_S)
        if not shared:  # NCCL refuses ranks that share a GPU: the sidecar's ops need one each
            sidecar = w.run(check_sidecar_captured, seed=seed, timeout=RUN_LIMIT_S)
        if transport == "nvshmem" and shared:
            # the other in-process captures, which test_gpu runs on a GPU per rank, here on
            # ranks that share one: all_to_all_v (plain out, receive buffer, subgroups),
            # padded MoE dispatch + combine in one graph, and all_to_all_v as a compiled torch op
            from test_gpu import check_all_to_all_v_graph, check_all_to_all_v_op, check_moe_graph

            w.run(check_all_to_all_v_graph, seed=seed, timeout=RUN_LIMIT_S)
            w.run(check_moe_graph, seed=seed, timeout=RUN_LIMIT_S)
            w.run(check_all_to_all_v_op, seed=seed, timeout=RUN_LIMIT_S)
    finally:
        w.close()
    # every rank ran every case: where the in-process kernels serve the group, all_to_all_single
    # (6 dtypes) and from two ranks all_reduce (3 dtypes x 3 sizes x sum, avg); the sidecar's
    # 15 collectives and barrier where each rank has a GPU; the refusals (send/recv on even worlds,
    # all_to_all_v and moe.dispatch without the in-process kernel), each run eagerly after where
    # ranks have a GPU
    inprocess = transport == "nvshmem"
    want = (6 if inprocess else 0) + (18 if inprocess and size > 1 else 0)
    assert captured == [want] * size, f"captured cases per rank {captured}, want {want} each"
    want_refused = ((size % 2 == 0) + 2 * (not inprocess)) * (1 if shared else 2)
    assert refused == [want_refused] * size, f"refused cases per rank {refused}, want {want_refused} each"
    if not shared:
        assert sidecar == [16] * size, f"sidecar graph cases per rank {sidecar}"


def test_graph_sidecar_lifetime(worlds, seed):
    """One rank, the sidecar's NCCL: graphs destroyed and re-captured past the trigger count,
    then the failures: the group aborted under replays (a new group), then the sidecar killed
    under replays (the world's; last, the world is gone after it)."""
    w, _ = _world(worlds, 1, "nccl")
    try:
        assert w.run(check_recapture, seed=seed, timeout=RUN_LIMIT_S) == [1]
        assert w.run(check_failure_releases, seed=seed, how="abort", timeout=RUN_LIMIT_S) == [2]
        assert w.run(check_failure_releases, seed=seed, how="kill", timeout=RUN_LIMIT_S) == [2]
    finally:
        w.close()
