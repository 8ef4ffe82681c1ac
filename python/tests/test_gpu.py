"""CUDA tensors through the sidecar, against torch's own NCCL backend on the same inputs
(marked gpu: they skip, saying why, where torch.cuda.is_available() is False, and run on the
device machine with `make test-gpu`). Each rank uses GPU rank % device_count."""

from __future__ import annotations

import ctypes
import math
import os
import signal
import time

import pytest
import torch
import torch._functorch.config  # noqa: F401 - its patch() in the compiled cases
import torch.distributed as dist
from _harness import GPU_RUN_LIMIT_S as RUN_LIMIT_S
from ranklib import Checker, gen, seeded_int
from test_moe import check_all_to_all_v, check_moe


def _state(pg):
    from gocomm._backend import state

    return state(pg)


pytestmark = pytest.mark.gpu

# The CUDA engine is on unless GOCOMM_CUDA=0; these tests need it. Set at import, before any
# rank process is spawned, so every rank inherits it.
os.environ["GOCOMM_CUDA"] = "1"

# (dtype, reduce ops NCCL runs for it)
DTYPES = [
    (torch.float32, ["sum", "avg", "product", "min", "max"]),
    (torch.bfloat16, ["sum", "avg", "min", "max"]),
    (torch.float16, ["sum", "min", "max"]),
    (torch.float64, ["sum", "max"]),
    (torch.int32, ["sum", "product", "min", "max"]),
    (torch.int64, ["sum", "max"]),
    (torch.uint8, ["sum", "max"]),
    (torch.int8, ["sum", "min"]),
    (torch.bool, ["sum", "min", "max"]),
    (torch.float8_e4m3fn, ["sum", "max"]),
    (torch.float8_e5m2, ["sum"]),
]
OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}


def _setup(rk):
    """This rank's device and an NCCL group over the world (made once, collectively)."""
    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    nccl = getattr(rk, "nccl", None)
    if nccl is None:
        nccl = rk.nccl = dist.new_group(backend="nccl")
    return dev, nccl


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _input(seed, key, rank, n, dtype, dev, exact_sum=False):
    """exact_sum: fp8 values of -1, 0 or 1, so every partial sum over up to 8 ranks is exact
    and any order gives the same bits (with two or three mantissa bits, a bound on the
    rounding would be the whole value: it could not tell a missing rank)."""
    if dtype in FP8:
        x = gen(seed, key, rank, (n,), torch.float32, small=True)
        return (x.round().clamp(-1, 1) + 0.0 if exact_sum else x / 4).to(dtype).to(dev)  # + 0.0: no -0
    return gen(seed, key, rank, (n,), dtype, small=True).to(dev)


def _sum_scale(xs, part=None):
    """What a float sum of xs (every rank's input, on the CPU) may err relative to, per
    element (part (k, i): the i-th of k chunks, as reduce_scatter sums): the sum of the
    inputs' sizes; None for other dtypes (compared exactly). Under cancellation a partial
    sum outgrows the result, but never this, so each of a ring's roundings (and gocomm's
    one) is at most eps / 2 of it. Against the result's size, seed 76811082 on 4 GPUs gave
    0.01596 for bf16 over n * eps / 2 = 0.0156."""
    if not xs[0].dtype.is_floating_point:
        return None
    s = sum(x.double().abs() for x in xs)
    return s if part is None else s.chunk(part[0])[part[1]]


def _float_err(got, want, steps=1, scale=None):
    """(error, tolerance) of a float result against another. scale: per element, what the
    error may be relative to (default the result's size), plus 1."""
    g, w = got.double(), want.double()
    tol = 1e-2 if got.element_size() <= 2 else 1e-5
    if steps > 1 and got.element_size() <= 2:
        # NCCL's ring rounds after each of its steps; gocomm's own kernel sums in float32
        # and rounds once: the two may differ by one rounding per step
        tol = max(tol, steps * torch.finfo(got.dtype).eps / 2)
    err = ((g - w).abs() / ((w.abs() if scale is None else scale) + 1)).max().item() if g.numel() else 0.0
    return err, tol


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def _compare(ck, label, got, want, exact, steps=1, scale=None):
    """scale: per element, what the error may be relative to (default the result's size)."""
    got, want = got.cpu(), want.cpu()
    if exact or got.dtype in (torch.bool,) or not (got.dtype.is_floating_point or got.dtype.is_complex):
        if not torch.equal(_bits(got), _bits(want)):
            ck.fail(label, f"differs from nccl: {got[:6].tolist()} vs {want[:6].tolist()}")
        return
    err, tol = _float_err(got, want, steps, scale)
    if not err <= tol:
        ck.fail(label, f"max rel error {err} vs nccl (tol {tol})")


def check_collectives_vs_nccl(rk, seed):
    """Every op and dtype on CUDA tensors: gocomm's result against torch NCCL's. Each case
    calls NCCL first: a gocomm error on one rank must not leave the other rank inside an NCCL
    collective that will never complete."""
    dev, nccl = _setup(rk)
    ck = Checker("CUDA collectives vs nccl", seed, rk.rank)
    n, r = rk.size, rk.rank
    for dtype, ops in DTYPES:
        d = str(dtype).removeprefix("torch.")
        for count in (1, 1000, 1 << 18):
            for opname in ops:
                op = OPS[opname]
                key = f"ar{d}{count}{opname}"
                with ck.case(f"all_reduce {opname} {d} x{count}"):
                    x = _input(seed, key, r, count, dtype, dev, exact_sum=dtype in FP8)
                    a, b = x.clone(), x.clone()
                    dist.all_reduce(b, op=op, group=nccl)
                    dist.all_reduce(a, op=op)
                    scale = None
                    if opname in ("sum", "avg") and dtype not in FP8:
                        scale = _sum_scale([_input(seed, key, q, count, dtype, "cpu") for q in range(n)])
                        if opname == "avg" and scale is not None:
                            scale = scale / n
                    label = f"all_reduce {opname} {d} x{count}"
                    _compare(ck, label, a, b, exact=opname in ("min", "max") or dtype in FP8, steps=n, scale=scale)
        # float32 only: for bf16, torch 2.11's ProcessGroupNCCL hands NCCL a float32 factor
        # where NCCL reads a bf16 one (its first two bytes: 0 for 0.5 and 1.5), so NCCL's own
        # bf16 PREMUL_SUM is no reference; check_premul_cuda checks gocomm's against float64
        if dtype == torch.float32:
            with ck.case(f"all_reduce premul_sum {d}"):
                x = _input(seed, f"pm{d}", r, 1 << 16, dtype, dev)
                a, b = x.clone(), x.clone()
                dist.all_reduce(b, op=dist._make_nccl_premul_sum(0.5 + r), group=nccl)
                dist.all_reduce(a, op=dist._make_nccl_premul_sum(0.5 + r))
                _compare(ck, f"all_reduce premul_sum {d}", a, b, exact=False, steps=n)
        count = 4097
        x = _input(seed, f"mv{d}", r, count, dtype, dev)
        for root in range(n):
            with ck.case(f"broadcast {d} root {root}"):
                a, b = x.clone(), x.clone()
                dist.broadcast(b, root, group=nccl)
                dist.broadcast(a, root)
                _compare(ck, f"broadcast {d} root {root}", a, b, exact=True)
            with ck.case(f"reduce {d} root {root}"):
                a, b = x.clone(), x.clone()
                dist.reduce(b, root, op=dist.ReduceOp.MAX, group=nccl)
                dist.reduce(a, root, op=dist.ReduceOp.MAX)
                if r == root:
                    _compare(ck, f"reduce {d} root {root}", a, b, exact=True)
        with ck.case(f"all_gather_into_tensor {d}"):
            a = torch.empty(n * count, dtype=dtype, device=dev)
            b = torch.empty_like(a)
            dist.all_gather_into_tensor(b, x, group=nccl)
            dist.all_gather_into_tensor(a, x)
            _compare(ck, f"all_gather_into_tensor {d}", a, b, exact=True)
        with ck.case(f"all_gather list {d}"):
            a = [torch.empty(count, dtype=dtype, device=dev) for _ in range(n)]
            b = [torch.empty_like(t) for t in a]
            dist.all_gather(b, x, group=nccl)
            dist.all_gather(a, x)
            _compare(ck, f"all_gather list {d}", torch.cat(a), torch.cat(b), exact=True)
        if dtype in (torch.float32, torch.int64, torch.bfloat16):
            with ck.case(f"reduce_scatter_tensor {d}"):
                y = _input(seed, f"rs{d}", r, n * count, dtype, dev)
                a = torch.empty(count, dtype=dtype, device=dev)
                b = torch.empty_like(a)
                dist.reduce_scatter_tensor(b, y.clone(), group=nccl)
                dist.reduce_scatter_tensor(a, y.clone())
                scale = _sum_scale([_input(seed, f"rs{d}", q, n * count, dtype, "cpu") for q in range(n)], part=(n, r))
                _compare(ck, f"reduce_scatter_tensor {d}", a, b, exact=False, steps=n, scale=scale)
            with ck.case(f"reduce_scatter list {d}"):
                ins = list(y.clone().chunk(n))
                a = torch.empty(count, dtype=dtype, device=dev)
                b = torch.empty_like(a)
                dist.reduce_scatter(b, [t.clone() for t in ins], op=dist.ReduceOp.MAX, group=nccl)
                dist.reduce_scatter(a, ins, op=dist.ReduceOp.MAX)
                _compare(ck, f"reduce_scatter list {d}", a, b, exact=True)
    # all_to_all: uneven, empty, everything to one rank
    for label, splits_of in [
        ("uneven", lambda src: [(src * 7 + dst * 3) % 5 for dst in range(n)]),
        ("empty", lambda src: [0] * n),
        ("all to rank 0", lambda src: [9 if dst == 0 else 0 for dst in range(n)]),
    ]:
        with ck.case(f"all_to_all_single {label}"):
            send = splits_of(r)
            recv = [splits_of(src)[r] for src in range(n)]
            x = _input(seed, f"a2a{label}", r, sum(send) * 3, torch.bfloat16, dev).view(-1, 3)
            a = torch.empty(sum(recv), 3, dtype=x.dtype, device=dev)
            b = torch.empty_like(a)
            dist.all_to_all_single(b, x, recv, send, group=nccl)
            dist.all_to_all_single(a, x, recv, send)
            _compare(ck, f"all_to_all_single {label}", a, b, exact=True)
    with ck.case("all_to_all list"):
        ins = [_input(seed, f"a2al{j}", r, 5 + j, torch.float32, dev) for j in range(n)]
        a = [torch.empty(5 + r, device=dev) for _ in range(n)]
        b = [torch.empty_like(t) for t in a]
        dist.all_to_all(b, ins, group=nccl)
        dist.all_to_all(a, ins)
        _compare(ck, "all_to_all list", torch.cat(a), torch.cat(b), exact=True)
    for root in range(n):
        with ck.case(f"gather/scatter root {root}"):
            x = _input(seed, f"gs{root}", r, 33, torch.float32, dev)
            a = [torch.empty(33, device=dev) for _ in range(n)] if r == root else None
            b = [torch.empty(33, device=dev) for _ in range(n)] if r == root else None
            dist.gather(x, b, dst=root, group=nccl)
            dist.gather(x, a, dst=root)
            if r == root:
                _compare(ck, f"gather root {root}", torch.cat(a), torch.cat(b), exact=True)
            ins = [_input(seed, f"sc{j}", root, 33, torch.float32, dev) for j in range(n)] if r == root else None
            a, b = torch.empty(33, device=dev), torch.empty(33, device=dev)
            dist.scatter(b, ins, src=root, group=nccl)
            dist.scatter(a, ins, src=root)
            _compare(ck, f"scatter root {root}", a, b, exact=True)
    with ck.case("send/recv ring and batch_isend_irecv"):
        x = _input(seed, "p2p", r, 1000, torch.float32, dev)
        got = torch.empty_like(x)
        nxt, prv = (r + 1) % n, (r - 1) % n
        if n > 1:
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, got, prv)])
            for q in reqs:
                q.wait()
            want = _input(seed, "p2p", prv, 1000, torch.float32, dev)
            _compare(ck, "batch_isend_irecv", got, want, exact=True)
            if r % 2 == 0:
                dist.send(x * 2, nxt)
                dist.recv(got, prv)
            else:
                dist.recv(got, prv)
                dist.send(x * 2, nxt)
            _compare(ck, "send/recv", got, want * 2, exact=True)
    with ck.case("barrier"):
        dist.barrier()
    torch.cuda.synchronize()
    return ck.done()


def check_stream_semantics(rk, seed):
    """Ordering on the caller's current stream (also a side stream), async works, tensors freed
    and memory reused while ops run, empty_cache between ops."""
    dev, nccl = _setup(rk)
    ck = Checker("CUDA stream semantics", seed, rk.rank)
    n = rk.size
    with ck.case("op ordered after prior work on the current stream"):
        x = torch.zeros(1 << 20, device=dev)
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the fill
        x.fill_(rk.rank + 1)
        dist.all_reduce(x)
        want = float(n * (n + 1) // 2)
        ck.expect("sum after a slow kernel", torch.all(x == want).item(), f"got {x[:4].tolist()}, want {want}")
    with ck.case("inside torch.cuda.stream"):
        s = torch.cuda.Stream(dev)
        with torch.cuda.stream(s):
            y = torch.full((4096,), float(rk.rank), device=dev)
            w = dist.all_reduce(y, async_op=True)
            w.wait()  # makes s wait
            z = y * 2
        torch.cuda.current_stream(dev).wait_stream(s)
        want = float(2 * sum(range(n)))
        ck.expect("side stream result", torch.all(z == want).item(), f"got {z[:4].tolist()}, want {want}")
    with ck.case("async works: wait, is_completed, future"):
        works, ts = [], []
        for i in range(8):
            t = torch.full((10000,), float(i), device=dev)
            ts.append(t)
            works.append(dist.all_reduce(t, async_op=True))
        for w in works:
            w.wait()
        for i, t in enumerate(ts):
            ck.expect(f"async {i}", torch.all(t == i * n).item(), f"got {t[:2].tolist()}")
        works[-1].get_future().wait()
        torch.cuda.synchronize(dev)  # the kernel path's future orders streams, as NCCL's
        ck.expect("is_completed after future and a sync", works[-1].is_completed())
    with ck.case("tensor dropped before the op finished; memory reused"):
        for i in range(20):
            t = torch.full((1 << 18,), 1.0, device=dev)
            dist.all_reduce(t, async_op=True)
            del t  # the work keeps it alive until the GPU is done
            u = torch.full((1 << 18,), 5.0, device=dev)  # may land on reused memory
            dist.all_reduce(u)
            ck.expect(f"reuse {i}", torch.all(u == 5.0 * n).item(), f"got {u[:2].tolist()}")
    with ck.case("after empty_cache"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        v = torch.full((3000,), 2.0, device=dev)
        dist.all_reduce(v)
        ck.expect("empty_cache", torch.all(v == 2.0 * n).item(), f"got {v[:2].tolist()}")
    with ck.case("bad input still raises before sending"):
        try:
            dist.all_reduce(torch.ones(4, device=dev, dtype=torch.int16))
            ck.fail("int16 all_reduce", "no error")
        except (TypeError, ValueError, RuntimeError) as e:
            ck.expect("int16 message", "int16" in str(e), str(e))
        try:
            dist.all_reduce(torch.ones(4, 4, device=dev).t())
            ck.fail("non-contiguous", "no error")
        except ValueError as e:
            ck.expect("contiguous message", "contiguous" in str(e), str(e))
    torch.cuda.synchronize()
    return ck.done()


def check_ddp_cuda(rk, seed):
    """DDP on CUDA: losses on gocomm equal those on nccl (same seeds and data)."""
    dev, nccl = _setup(rk)
    losses = {}
    for name, group in (("gocomm", None), ("nccl", nccl)):
        torch.manual_seed(1234)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(dev)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index], process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(seed + rk.rank)
        out = []
        for _ in range(20):
            x = torch.randn(16, 32, generator=g).to(dev)
            y = torch.randn(16, 4, generator=g).to(dev)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            out.append(loss.item())
        losses[name] = out
    ck = Checker("DDP on CUDA", seed, rk.rank)
    for i, (a, b) in enumerate(zip(losses["gocomm"], losses["nccl"], strict=True)):
        ck.expect(f"step {i}", abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"gocomm {a} nccl {b}")
    return ck.done()


def check_killed_sidecar_cuda(rk, seed):
    """A sidecar killed during a large CUDA all_reduce that runs in the sidecars (MAX: the
    shim's kernel takes sum and avg only): every rank gets an error within the timeout, and
    no CUDA stream is left waiting forever."""
    import gocomm

    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    x = torch.ones(1 << 20, device=dev)
    dist.all_reduce(x)  # warm: links and communicators exist (the shim's kernel where NVLink)
    dist.all_reduce(torch.ones(1001, device=dev))  # and the sidecar's (4004 bytes: not the kernel's)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    big = torch.ones(64 << 20, device=dev)
    if rk.rank == 1:
        os.kill(gocomm.info()["pid"], signal.SIGKILL)
    works = [dist.all_reduce(big, op=dist.ReduceOp.MAX, async_op=True) for _ in range(3)]
    err = None
    try:
        for w in works:
            w.get_future().wait()  # a CUDA future: orders this stream, never holds the host
        # the failure reaches each rank's calls once its group broke or its sidecar was lost
        while time.monotonic() - t0 < rk.timeout_s + 10:
            dist.all_reduce(x)
            x.sum().item()  # returns once the op finished or its counters were released
    except Exception as e:  # noqa: BLE001
        err = e
    torch.cuda.synchronize()  # must not hang: counters were released
    el = time.monotonic() - t0
    if err is None:
        raise AssertionError("no error after a sidecar was killed")
    if el > rk.timeout_s + 10:
        raise AssertionError(f"error after {el:.1f}s (timeout {rk.timeout_s}s)")
    return f"{type(err).__name__} after {el:.1f}s: {str(err)[:200]}"


def check_allreduce_inprocess(rk, seed):
    """all_reduce by the in-process kernel (the compiled client's engine) where the GPUs share NVLink:
    one-shot and two-shot sizes and the boundary between them, sum and avg, bf16/fp16/fp32,
    a misaligned view, sizes it leaves to the sidecar, back-to-back ops on alternating streams
    with no user sync; results against a float64 sum of every rank's input (rebuilt from the
    seed), and the same bits on every rank."""
    from gocomm import _client
    from gocomm._backend import state

    dev, nccl = _setup(rk)
    ck = Checker("all_reduce in the shim", seed, rk.rank)
    n, r = rk.size, rk.rank
    g = state(dist.group.WORLD)
    x0 = torch.ones(8, device=dev)
    dist.all_reduce(x0)  # sets the path up (collective)
    want_inprocess = state(g)._routes.ar_inprocess
    path = g._ref.get().ar_path(dev.index)
    ck.expect("path set up where the GPUs share NVLink", (path is not None) == want_inprocess, str(path))
    ck.expect("setup result", torch.all(x0 == n).item(), str(x0.tolist()))
    one = path.oneshot if path else 256 << 10
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        d = str(dtype).removeprefix("torch.")
        e = torch.tensor([], dtype=dtype).element_size()
        counts = [16 // e, 1000, one // e, one // e + 16 // e, (1 << 20) + 8 * 16 // e, (3 << 20) // e + 3 * (16 // e)]
        counts += [(16 << 20) // e, 1001]
        for count in counts:
            for opname in ("sum", "avg"):
                label = f"{d} x{count} {opname}"
                with ck.case(label):
                    key = f"inprocess{d}{count}{opname}"
                    xs = [_input(seed, key, p, count, dtype, torch.device("cpu")) for p in range(n)]
                    a = xs[r].to(dev)
                    dist.all_reduce(a, op=OPS[opname])
                    ref = torch.stack([t.double() for t in xs]).sum(0)
                    if opname == "avg":
                        ref = ref / n
                    got = a.double().cpu()
                    # the kernel rounds once; sizes it leaves to NCCL round once per ring step,
                    # each rounding at most eps / 2 of the inputs' sizes (_sum_scale)
                    tol = max(1e-2, n * torch.finfo(dtype).eps / 2) if e <= 2 else 1e-5
                    scale = _sum_scale(xs) / (n if opname == "avg" else 1)
                    err = ((got - ref).abs() / (scale + 1)).max().item()
                    ck.expect(label, err <= tol, f"max rel error {err} vs float64 (tol {tol})")
                    bits = torch.empty(n * a.numel() * e, dtype=torch.uint8, device=dev)
                    dist.all_gather_into_tensor(bits, a.view(torch.uint8), group=nccl)
                    rows = bits.view(n, -1)
                    ck.expect(f"{label} same bits on every rank", bool((rows == rows[0]).all().item()))
        with ck.case(f"{d} misaligned view"):
            count = 4096
            xs = [_input(seed, f"mis{d}", p, count, dtype, torch.device("cpu")) for p in range(n)]
            buf = torch.zeros(count + 1, dtype=dtype, device=dev)
            v = buf[1:]
            v.copy_(xs[r])
            dist.all_reduce(v)
            ref = torch.stack([t.double() for t in xs]).sum(0)
            err = ((v.double().cpu() - ref).abs() / (ref.abs() + 1)).max().item()
            ck.expect(f"{d} misaligned", err <= (1e-2 if e <= 2 else 1e-5), f"max rel error {err}")
            ck.expect(f"{d} misaligned: element 0 untouched", buf[0].item() == 0)
    with ck.case("back to back on alternating streams, no sync between"):
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        ts = []
        for i in range(64):
            size = [64, 4096, 400_000][i % 3]
            s = side if i % 2 else torch.cuda.current_stream(dev)
            with torch.cuda.stream(s):
                t = torch.full((size,), float(i + r), device=dev)
                dist.all_reduce(t)
            ts.append((i, s, t))
        torch.cuda.synchronize(dev)
        for i, _s, t in ts:
            want = float(n * i + n * (n - 1) // 2)
            ck.expect(f"op {i}", bool(torch.all(t == want).item()), f"got {t[:2].tolist()}, want {want}")
    with ck.case("async works on the kernel path"):
        t = torch.full((1 << 16,), 1.0, device=dev, dtype=torch.bfloat16)
        w = dist.all_reduce(t, async_op=True)
        w.get_future().wait()
        torch.cuda.synchronize(dev)  # the future orders streams, as NCCL's: the host syncs here
        ck.expect("is_completed after future and a sync", w.is_completed())
        ck.expect("async result", bool(torch.all(t == n).item()))
    if path is not None:
        ck.expect("no kernel gave up", not path.failed())
    if want_inprocess:
        ck.expect("the module loads", _client.C.module_why_not("allreduce.cubin", dev.index) == "")
    torch.cuda.synchronize()
    return ck.done()


def check_subgroups_cuda(rk, seed):
    """new_group subgroups on CUDA tensors (issue 3): each member's ops on a gocomm subgroup
    against the same ops on an NCCL subgroup of the same ranks, several subgroups alive at
    once, then destroyed."""
    dev, _ = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("subgroups on CUDA", seed, me)
    sets = ([0, n - 1], [n - 1, 0] if n > 2 else [0, 1], list(range(1, n)), list(range(n)))
    pairs = [(dist.new_group(r, backend="gocomm"), dist.new_group(r, backend="nccl"), r) for r in sets]
    for i, (g, ref, ranks) in enumerate(pairs):
        if me not in ranks:
            continue
        m, key = len(ranks), f"sub{i}"
        with ck.case(f"subgroup {ranks}"):
            for dtype in (torch.bfloat16, torch.float32, torch.int64):
                a = _input(seed, key + str(dtype), me, 4099, dtype, dev)
                b = a.clone()
                dist.all_reduce(a, group=g)
                dist.all_reduce(b, group=ref)
                scale = _sum_scale([_input(seed, key + str(dtype), q, 4099, dtype, "cpu") for q in ranks])
                _compare(ck, f"{ranks} all_reduce {dtype}", a, b, exact=dtype == torch.int64, steps=m, scale=scale)
            x = _input(seed, key + "ag", me, 1000, torch.float32, dev)
            got, want = torch.empty(m * 1000, device=dev), torch.empty(m * 1000, device=dev)
            dist.all_gather_into_tensor(got, x, group=g)
            dist.all_gather_into_tensor(want, x, group=ref)
            _compare(ck, f"{ranks} all_gather", got, want, exact=True)
            root = max(ranks)
            y = _input(seed, key + "bc", me, 777, torch.bfloat16, dev)
            z = y.clone()
            dist.broadcast(y, root, group=g)
            dist.broadcast(z, root, group=ref)
            _compare(ck, f"{ranks} broadcast", y, z, exact=True)
            inp = _input(seed, key + "a2a", me, 64 * m, torch.float32, dev)
            got, want = torch.empty_like(inp), torch.empty_like(inp)
            dist.all_to_all_single(got, inp, group=g)
            dist.all_to_all_single(want, inp, group=ref)
            _compare(ck, f"{ranks} all_to_all_single", got, want, exact=True)
    torch.cuda.synchronize()
    dist.barrier(group=rk.world.gloo)
    for g, ref, ranks in pairs:
        if me in ranks:
            dist.destroy_process_group(g)
            dist.destroy_process_group(ref)
    with ck.case("the world after the subgroups"):
        t = torch.ones(8, device=dev)
        dist.all_reduce(t)
        ck.expect("world all_reduce", bool(torch.all(t == n)), str(t.tolist()))
    return ck.done()


def _need(n):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")


@pytest.mark.parametrize("size", [2, 4])
def test_subgroups_cuda(worlds, seed, size):
    _need(size)
    worlds.get(size).run(check_subgroups_cuda, seed=seed, timeout=RUN_LIMIT_S)


@pytest.mark.parametrize("size", [2, 4])
def test_collectives_vs_nccl(worlds, seed, size):
    _need(size)
    worlds.get(size).run(check_collectives_vs_nccl, seed=seed, timeout=RUN_LIMIT_S)


@pytest.mark.parametrize("size", [2, 4])
def test_allreduce_inprocess(worlds, seed, size):
    _need(size)
    worlds.get(size).run(check_allreduce_inprocess, seed=seed, timeout=RUN_LIMIT_S)


@pytest.mark.parametrize("size", [2, 4])
def test_allreduce_inprocess_rounds(worlds, seed, size):
    """The same checks with 1 MiB staging rounds: two-shot messages pass in up to 17
    rounds, the last one short, and ops of several rounds follow each other on two streams."""
    _need(size)
    with worlds.fresh(size, label="ar-rounds", env={"GOCOMM_AR_STAGE": "1M"}) as w:
        w.run(check_allreduce_inprocess, seed=seed, timeout=RUN_LIMIT_S)


def check_allreduce_rounds_shared(rk, seed):
    """The in-process two-shot all_reduce in many short staging rounds (GOCOMM_AR_STAGE 64 KiB),
    the last one short, with ranks that may share a GPU and a matmul on a side stream taking
    SMs from the kernel's blocks, so the blocks of one rank drift rounds apart (only block b of
    each rank waits for block b of the others): a short last round must not write into places
    a lagging block still reads two rounds back. Against float64 sums, 40 ops a dtype."""
    from gocomm import _client

    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ck, n, me = Checker("all_reduce rounds (shared GPU)", seed, rk.rank), rk.size, rk.rank
    dist.all_reduce(torch.ones(8, device=dev))  # sets the path up (collective)
    stage = 64 << 10
    side = torch.cuda.Stream(dev)
    a = torch.randn(2048, 2048, device=dev)
    for dtype in (torch.bfloat16, torch.float32):
        e = torch.tensor([], dtype=dtype).element_size()
        # 3 to 17 rounds, the last one 1/16 to 15/16 of a round (whole vectors)
        sizes = [(r * stage + (stage * f // 16) // 16 * 16) // e for r in (2, 4, 16) for f in (1, 8, 15)]
        for i in range(40):
            count = sizes[i % len(sizes)]
            with ck.case(f"{dtype} x{count} op {i}"):
                xs = [gen(seed, f"rounds{dtype}{i}", p, (count,), dtype) for p in range(n)]
                t = xs[me].to(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        a = (a @ a).tanh_()
                dist.all_reduce(t)
                ref = torch.stack([x.double() for x in xs]).sum(0)
                err = ((t.double().cpu() - ref).abs() / (ref.abs() + 1)).max().item()
                ck.expect(f"{dtype} x{count}", err <= (1e-2 if e <= 2 else 1e-5), f"max rel error {err}")
    torch.cuda.synchronize(dev)
    runs = [r for r in _client.C.inprocess_launches() if r["op"] == "all_reduce" and r["bytes"] > stage]
    ck.expect("the in-process kernel ran all 80", len(runs) == 80, f"{len(runs)} launches past one round")
    return ck.done()


@pytest.mark.parametrize("size", [2, 3])
def test_allreduce_rounds_shared(worlds, seed, size):
    """check_allreduce_rounds_shared on 2 and 3 ranks, the in-process engine forced
    (GOCOMM_TRANSPORT=nvshmem; where the machine has fewer GPUs, ranks share one)."""
    _need(1)
    env = {**_sharing(size), "GOCOMM_AR_STAGE": "64K"}
    with worlds.fresh(size, label="ar-rounds-shared", env=env) as w:
        w.run(check_allreduce_rounds_shared, seed=seed, timeout=RUN_LIMIT_S)


def test_stream_semantics(worlds, seed):
    _need(2)
    worlds.get(2).run(check_stream_semantics, seed=seed, timeout=RUN_LIMIT_S)


def test_ddp_cuda(worlds, seed):
    _need(2)
    worlds.get(2).run(check_ddp_cuda, seed=seed, timeout=RUN_LIMIT_S)


def test_killed_sidecar_cuda(worlds, seed):
    _need(2)
    with worlds.fresh(2, label="gpukill") as w:
        out = w.run(check_killed_sidecar_cuda, seed=seed, timeout=120)
        print(out)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_all_to_all_v_cuda(worlds, seed, size):
    _need(size)
    worlds.get(size).run(check_all_to_all_v, seed=seed, device="cuda", timeout=RUN_LIMIT_S)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_moe_cuda(worlds, seed, size):
    _need(size)
    worlds.get(size).run(check_moe, seed=seed, device="cuda", timeout=RUN_LIMIT_S)
    # 64 experts per rank, as 256 on 4 GPUs: the grouping kernel's other launch shape
    worlds.get(size).run(check_moe, seed=seed, device="cuda", per=64, timeout=RUN_LIMIT_S)


def check_all_to_all_v_nvshmem(rk, seed, inprocess):
    """gocomm.all_to_all_v with splits on the GPU (no host sync), by the shim's kernel
    (inprocess) or the sidecar's NVSHMEM kernel: the rows and counts equal what every rank
    rebuilds from the seed; an overflow writes nothing and shows in the counts."""
    from test_moe import ROUTINGS

    import gocomm

    dev, _ = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("all_to_all_v " + ("in this process" if inprocess else "on NVSHMEM"), seed, me)
    ck.expect("transport", _state(rk.world.pg)._routes.transport == "nvshmem", _state(rk.world.pg)._routes.transport)
    path = _state(rk.world.pg)._a2av_path(dev.index)
    ck.expect("path", (path is not None) == inprocess, f"in-process kernel {path}, wanted {inprocess}")
    for label, splits_of in ROUTINGS.items():
        send = splits_of(seed, me, n)
        recv = [splits_of(seed, src, n)[me] for src in range(n)]
        with ck.case(label):
            key = f"nv{label}"
            x = gen(seed, key, me, (sum(send), 64), torch.bfloat16).to(dev)
            out = torch.full((sum(recv) + 5, 64), -3.0, dtype=torch.bfloat16, device=dev)
            got, got_splits = gocomm.all_to_all_v(x, torch.tensor(send, device=dev), out=out)
            want = torch.cat(
                [
                    gen(seed, key, src, (sum(splits_of(seed, src, n)), 64), torch.bfloat16).narrow(
                        0, sum(splits_of(seed, src, n)[:me]), splits_of(seed, src, n)[me]
                    )
                    for src in range(n)
                ]
            )
            ck.same(label, got[: sum(recv)].cpu(), want)
            ck.same(label + " splits", got_splits.cpu(), torch.tensor(recv))
            ck.expect(label + " rows past the data untouched", bool(torch.all(out[sum(recv) :] == -3.0)))
    with ck.case("overflow"):
        send = ROUTINGS["all to rank 0"](seed, me, n)
        x = torch.ones(sum(send), 64, dtype=torch.bfloat16, device=dev)
        out = torch.full((7 * n - 1, 64), -1.0, dtype=torch.bfloat16, device=dev)
        _, got_splits = gocomm.all_to_all_v(x, torch.tensor(send, device=dev), out=out if me == 0 else None)
        if me == 0:
            ck.expect("overflow shows in the counts", int(got_splits.sum()) == 7 * n, str(got_splits.tolist()))
            ck.expect("nothing written", bool(torch.all(out == -1.0)))
    torch.cuda.synchronize()
    return ck.done()


@pytest.mark.parametrize("inprocess", [True, False], ids=["inprocess", "sidecar"])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_all_to_all_v_nvshmem(worlds, seed, size, inprocess):
    _need(size)
    env = {"GOCOMM_TRANSPORT": "nvshmem", "GOCOMM_A2AV_INPROCESS": "1" if inprocess else "0"}
    with worlds.fresh(size, label="nvshmem" + ("" if inprocess else "-sidecar"), env=env) as w:
        w.run(check_all_to_all_v_nvshmem, seed=seed, inprocess=inprocess, timeout=RUN_LIMIT_S)
        # dispatch/combine on that path (one exchange of tokens with their routing)
        w.run(check_moe, seed=seed, device="cuda", timeout=RUN_LIMIT_S)
        if inprocess:
            w.run(check_all_to_all_v_graph, seed=seed, timeout=RUN_LIMIT_S)
            w.run(check_all_to_all_v_op, seed=seed, timeout=RUN_LIMIT_S)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_moe_graph(worlds, seed, size):
    """dispatch/combine where the exchange runs in this process (one rank too), padded and
    captured in a CUDA graph, then the whole MoE check on the same world."""
    _need(size)
    with worlds.fresh(size, label="moegraph", env={"GOCOMM_TRANSPORT": "nvshmem"}) as w:
        w.run(check_moe_graph, seed=seed, timeout=RUN_LIMIT_S)
        w.run(check_moe, seed=seed, device="cuda", timeout=RUN_LIMIT_S)
        w.run(check_padded_ll, seed=seed, on=True, timeout=RUN_LIMIT_S)


def _sharing(size):
    """The environment of a world whose in-process kernels run even where its ranks share GPUs:
    every block of such a kernel waits for its peers', so all must be resident at once, and
    each rank sizes its grid for a GPU of its own (128 blocks; three ranks of all_to_all_v on
    one GPU did not fit and timed out)."""
    env = {"GOCOMM_TRANSPORT": "nvshmem"}
    if size > torch.cuda.device_count():
        env["GOCOMM_A2AV_BLOCKS"] = "32"
    return env


@pytest.mark.parametrize("size", [1, 2, 3])
def test_moe_low_latency(worlds, seed, size):
    """moe.dispatch(low_latency=True) and its combine (one launch each): captured in a CUDA
    graph against the eager path with its sync, then eager against the padded path and
    float64 (check_moe), with too small bounds and empty ranks. Where the machine has fewer
    GPUs than ranks, ranks share one (their kernels map each other's memory by CUDA IPC)."""
    # padded dispatch keeps its three-launch kernels here, so check_ll_buffer compares the two
    with worlds.fresh(size, label="moell", env={**_sharing(size), "GOCOMM_MOE_LL_MB": "0"}) as w:
        w.run(check_padded_ll, seed=seed, on=False, timeout=RUN_LIMIT_S)
        w.run(check_moe_graph, seed=seed, low_latency=True, timeout=RUN_LIMIT_S)
        w.run(check_moe, seed=seed, device="cuda", timeout=RUN_LIMIT_S)
        w.run(check_ll_buffer, seed=seed, timeout=RUN_LIMIT_S)


def check_padded_ll(rk, seed, on):
    """Padded dispatch picks the one-launch kernels by itself (docs/decisions/0039): on a new
    group, where GOCOMM_MOE_LL_MB allows (on), its first call sets up the low-latency buffer
    for its bound; a later call with a larger bound runs the three-launch kernels and a smaller
    one the buffer's, each equal to the synced dispatch and its combine, bit for bit. With the
    knob at 0 (not on) no buffer is set up."""
    import gocomm

    dev, _ = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("padded dispatch's own buffer", seed, me)
    g = dist.new_group(list(range(n)))
    be = g._get_backend(dev)
    per, k, h = 4, 3, 256
    experts = per * n
    for step, bound in enumerate((8, 16, 4, 8)):
        with ck.case(f"bound {bound}"):
            t = max(0, bound - me % 2)
            gg = torch.Generator().manual_seed(seed * 13 + step * 7 + me)
            x = gen(seed, f"pll{step}", me, (t, h), torch.bfloat16).to(dev)
            idx = torch.rand(t, experts, generator=gg).argsort(dim=1)[:, :k].to(dev)
            w = gen(seed, f"pllw{step}", me, (t, k), torch.float32).abs().to(dev)
            recv, tpe, hd = gocomm.moe.dispatch(x, idx, w, experts, group=g, max_tokens_per_rank=bound, padded=True)
            shape = be.ll_shape(dev.index)  # set up by the first call, for its bound, rows of h bf16
            has = shape is not None and shape[0] == 8 and shape[2] == 2 * h
            ck.expect(f"bound {bound}: buffer", has if on else shape is None, str(shape))
            wr, wt, wh = gocomm.moe.dispatch(x, idx, w, experts, group=g)
            ck.same(f"bound {bound}: tokens per expert", tpe.cpu(), wt.cpu())
            ck.same(f"bound {bound}: grouped tokens", recv[: wr.shape[0]].cpu(), wr.cpu())
            y = (recv.float() * 0.5 + 1).to(torch.bfloat16)
            ck.same(
                f"bound {bound}: combine",
                gocomm.moe.combine(y, hd).cpu(),
                gocomm.moe.combine(y[: wr.shape[0]], wh).cpu(),
            )
    torch.cuda.synchronize()
    dist.destroy_process_group(g)
    return ck.done()


def check_ll_buffer(rk, seed):
    """The low-latency buffer is sized by a group's first low-latency dispatch (0036): on a new
    group, later calls within its bound, hidden size and k give padded's result bit for bit;
    a larger bound or hidden size raises ValueError on every rank, naming what the buffer
    holds, before anything is launched, and the group goes on working."""
    import gocomm

    dev, _ = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("low-latency buffer", seed, me)
    g = dist.new_group(list(range(n)))
    per, k, first = 4, 2, 8
    experts = per * n

    def inputs(step, t, h):
        gg = torch.Generator().manual_seed(seed * 17 + step * 5 + me)
        x = gen(seed, f"llb{step}", me, (t, h), torch.bfloat16).to(dev)
        idx = torch.rand(t, experts, generator=gg).argsort(dim=1)[:, :k].to(dev)
        return x, idx, gen(seed, f"llbw{step}", me, (t, k), torch.float32).abs().to(dev)

    def agree(label, step, bound, t, h):
        x, idx, w = inputs(step, t, h)
        lr, lt, lh = gocomm.moe.dispatch(x, idx, w, experts, group=g, max_tokens_per_rank=bound, low_latency=True)
        ck.expect(f"{label}: low-latency kernels", lh.inproc is not None and lh.inproc[4] == -1, str(lh.inproc))
        pr, pt, ph = gocomm.moe.dispatch(x, idx, w, experts, group=g, max_tokens_per_rank=bound, padded=True)
        rows = int(pt.sum())
        ck.same(f"{label}: tokens per expert", lt.cpu(), pt.cpu())
        ck.same(f"{label}: grouped tokens", lr[:rows].cpu(), pr[:rows].cpu())
        y = lr * 2
        ck.same(f"{label}: combine", gocomm.moe.combine(y, lh).cpu(), gocomm.moe.combine(y, ph).cpu())

    with ck.case("first call sizes the buffer"):
        agree("first", 0, first, first, 256)
    for label, bound, h in (("a larger bound", 2 * first, 256), ("a larger hidden size", first, 512)):
        with ck.case(label):
            x, idx, w = inputs(1, 3, h)
            try:
                gocomm.moe.dispatch(x, idx, w, experts, group=g, max_tokens_per_rank=bound, low_latency=True)
                ck.fail(label, "no error")
            except ValueError as e:
                msg = str(e)
                ck.expect(label, f"max_tokens_per_rank {first}" in msg and "first call the largest" in msg, msg)
    with ck.case("a smaller call after the refusals"):
        agree("smaller", 2, first // 2, 3 + me % 2, 128)
    torch.cuda.synchronize()
    dist.destroy_process_group(g)
    return ck.done()


@pytest.mark.parametrize("size", [1, 2])
def test_autograd_cuda(worlds, seed, size):
    """all_to_all_v's and the MoE layer's backward, and the refusal of one where there is none
    (csrc/client/autograd.cc), on the in-process path, ranks sharing the GPUs where there are
    fewer."""
    from test_moe import check_all_to_all_v_backward, check_moe_backward, check_no_silent_backward

    with worlds.fresh(size, label="autograd", env=_sharing(size)) as w:
        w.run(check_all_to_all_v_backward, seed=seed, device="cuda", timeout=RUN_LIMIT_S)
        # first of the low-latency calls: the group's first one sizes its buffer for the rest
        w.run(check_no_silent_backward, seed=seed, device="cuda", timeout=RUN_LIMIT_S)
        for dtype in (torch.float32, torch.bfloat16):
            w.run(check_moe_backward, seed=seed, device="cuda", dtype=dtype, sync_free=True, timeout=RUN_LIMIT_S)


def check_moe_odd_inputs(rk, seed):
    """A padded MoE layer whose rows are too wide for the group's low-latency buffer
    (GOCOMM_MOE_LL_MB 1 here): its backward's dispatch of 16-byte rows must not set up a buffer
    its combine of the gradient (x's width) does not fit. Then x and y as misaligned views
    (rank 0's only, so its peers' are aligned): the ranks must still take one path. Against
    float64, with identity experts: out[t] = sum_j w[t, j] x[t]."""
    import gocomm

    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    n, me = rk.size, rk.rank
    ck = Checker("moe: wide backward, misaligned rows", seed, me)
    per, k, h, bound = 2, 2, 4096, 64
    experts, t = per * n, 40 + 3 * me
    x64 = gen(seed, "oddx", me, (t, h), torch.float64)
    idx = gen(seed, "oddi", me, (t, experts), torch.float64).argsort(1)[:, :k].to(dev)
    w64 = gen(seed, "oddw", me, (t, k), torch.float64).abs()
    g64 = gen(seed, "oddg", me, (t, h), torch.float64)
    want_out = w64.sum(1, keepdim=True) * x64

    def close(name, got, want, tol=2e-2):
        err = float((got.double().cpu() - want).abs().max())
        scale = max(float(want.abs().max()), 1.0)
        ck.expect(name, err <= tol * scale, f"max error {err:.3g} of {scale:.3g}")

    with ck.case("backward of a padded layer too wide for the low-latency buffer"):
        x = x64.to(dev, torch.bfloat16).requires_grad_()
        w = w64.to(dev, torch.float32).requires_grad_()
        recv, _tpe, hd = gocomm.moe.dispatch(x, idx, w, experts, max_tokens_per_rank=bound, padded=True)
        out = gocomm.moe.combine(recv, hd)
        close("forward", out, want_out)
        (out * g64.to(dev, torch.bfloat16)).sum().backward()
        close("x gradient", x.grad, w64.sum(1, keepdim=True) * g64)
        close("topk_weights gradient", w.grad, (x64 * g64).sum(1, keepdim=True).expand(t, k))
    for padded, x_off in ((True, 1), (True, 0), (False, 1), (False, 0)):
        with ck.case(f"misaligned {'x and ' if x_off else ''}y on rank 0, padded={padded}"):
            x = x64.to(dev, torch.bfloat16)
            if me == 0 and x_off:
                flat = torch.zeros(t * h + 8, dtype=torch.bfloat16, device=dev)
                x = flat[x_off : x_off + t * h].view(t, h)
                x.copy_(x64)
            kw = {"max_tokens_per_rank": bound, "padded": True} if padded else {}
            recv, _tpe, hd = gocomm.moe.dispatch(x, idx, w64.to(dev, torch.float32), experts, **kw)
            y = recv
            if me == 0:
                yflat = torch.zeros(recv.numel() + 8, dtype=recv.dtype, device=dev)
                y = yflat[1 : 1 + recv.numel()].view_as(recv)
                y.copy_(recv)
            close("combine of the misaligned rows", gocomm.moe.combine(y, hd), want_out)
    torch.cuda.synchronize(dev)
    return ck.done()


@pytest.mark.parametrize("size", [1, 2])
def test_moe_odd_inputs(worlds, seed, size):
    """check_moe_odd_inputs on the in-process path (one rank alone takes the low-latency
    kernels where its buffer fits; ranks that share a GPU never do)."""
    _need(1)
    with worlds.fresh(size, label="moe-odd", env={**_sharing(size), "GOCOMM_MOE_LL_MB": "1"}) as w:
        w.run(check_moe_odd_inputs, seed=seed, timeout=RUN_LIMIT_S)


def check_moe_graph(rk, seed, low_latency=False):
    """Padded dispatch and combine (no host sync; low_latency: in one launch each) captured in
    one CUDA graph with an expert step between them, replayed with new tokens and routings
    (uniform, all to rank 0's experts, with -1 entries): the counts, the grouped tokens and
    combine's sums equal, bit for bit, what dispatch and combine give eagerly (with their
    sync) on the same inputs."""
    import gocomm

    dev, _ = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("moe captured" + (" low-latency" if low_latency else ""), seed, me)
    per, k, h = 8, 4, 512
    experts = per * n
    tokens = [20 + 3 * r for r in range(n)]
    t, bound = tokens[me], max(tokens)
    x = torch.zeros(t, h, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(t, k, dtype=torch.int64, device=dev)
    w = torch.zeros(t, k, dtype=torch.float32, device=dev)

    def experts_of(step):
        g = torch.Generator().manual_seed(seed * 31 + step * 7 + me)
        pool = per if step % 3 == 1 else experts  # step 1, 4: only rank 0's experts
        ids = torch.rand(t, pool, generator=g).argsort(dim=1)[:, :k]
        if step % 3 == 2:
            ids = torch.where(torch.rand(t, k, generator=g) < 0.3, -1, ids)
        return ids

    def expert_step(recv):  # stands in for the experts: any op on the grouped rows
        return (recv.float() * 1.5 - 0.25).to(torch.bfloat16)

    kw = {"max_tokens_per_rank": bound, "padded": True, "low_latency": low_latency}
    gocomm.moe.dispatch(x, idx, w, experts, **kw)  # sets up: not while capturing
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        recv, tpe, handle = gocomm.moe.dispatch(x, idx, w, experts, **kw)
        out = gocomm.moe.combine(expert_step(recv), handle)
    torch.cuda.current_stream(dev).wait_stream(side)
    if low_latency:  # its own kernels, not the padded path it falls back to
        ck.expect("low-latency kernels", handle.inproc is not None and handle.inproc[4] == -1, str(handle.inproc))
    for step in range(5):
        with ck.case(f"replay {step}"):
            x.copy_(gen(seed, f"mg{step}", me, (t, h), torch.bfloat16))
            idx.copy_(experts_of(step))
            w.copy_(gen(seed, f"mw{step}", me, (t, k), torch.float32).abs())
            graph.replay()
            got = (recv.clone(), tpe.clone(), out.clone())
            want_recv, want_tpe, want_h = gocomm.moe.dispatch(x, idx, w, experts)
            want_out = gocomm.moe.combine(expert_step(want_recv), want_h)
            ck.same(f"replay {step} tokens per expert", got[1].cpu(), want_tpe.cpu())
            ck.same(f"replay {step} grouped tokens", got[0][: want_recv.shape[0]].cpu(), want_recv.cpu())
            ck.same(f"replay {step} combine", got[2].cpu(), want_out.cpu())
    torch.cuda.synchronize()
    return ck.done()


@pytest.mark.parametrize("size", [1, 2])
def test_moe_ops_compiled(worlds, seed, size):
    """gocomm.moe's in-process path as registered ops, traced by torch.compile."""
    _need(size)
    with worlds.fresh(size, label="moeops", env={"GOCOMM_TRANSPORT": "nvshmem"}) as w:
        w.run(check_moe_ops_compiled, seed=seed, timeout=RUN_LIMIT_S)


def check_moe_ops_compiled(rk, seed):
    """torch.ops.gocomm.moe_dispatch (padded) and moe_combine (csrc/client/moe.cc) under
    torch.compile(fullgraph=True), traced through their Meta kernels and run, with an expert
    step between them: the shapes the Meta kernels gave, and the grouped tokens, tokens per
    expert and combine's sums equal, bit for bit, what gocomm.moe.dispatch / combine give
    eagerly (with their sync) on the same inputs."""
    import gocomm

    dev, _ = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("moe ops compiled", seed, me)
    name = dist.group.WORLD.group_name
    per, k, h, t = 4, 3, 256, 17
    experts, cap = per * n, t * n
    g = torch.Generator().manual_seed(seed * 13 + me)
    x = gen(seed, "mo", me, (t, h), torch.bfloat16).to(dev)
    idx = torch.rand(t, experts, generator=g).argsort(dim=1)[:, :k].to(dev)
    w = gen(seed, "mow", me, (t, k), torch.float32).abs().to(dev)
    gocomm.moe.dispatch(x, idx, w, experts, max_tokens_per_rank=t, padded=True)  # sets the path up

    def expert_step(recv):
        return (recv.float() * 1.5 - 0.25).to(torch.bfloat16)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(x, idx, w):
        recv, tpe, ws, _ = torch.ops.gocomm.moe_dispatch(x, idx, w, experts, n, cap, True, name)
        out = torch.ops.gocomm.moe_combine(expert_step(recv), ws, t, cap, k, experts, cap, t * min(n, k), name)
        return recv, tpe, out

    # outputs sharing a storage are an error in a custom op from torch 2.12 (2.11 warns)
    with ck.case("compiled"), torch._functorch.config.patch(error_on_custom_op_aliasing=True):
        recv, tpe, out = step(x, idx, w)
        want_recv, want_tpe, want_h = gocomm.moe.dispatch(x, idx, w, experts)
        want_out = gocomm.moe.combine(expert_step(want_recv), want_h)
        ck.expect("padded rows", tuple(recv.shape) == (cap * k, h), str(tuple(recv.shape)))
        ck.same("tokens per expert", tpe.cpu(), want_tpe.cpu())
        ck.same("grouped tokens", recv[: want_recv.shape[0]].cpu(), want_recv.cpu())
        ck.same("combine", out.cpu(), want_out.cpu())
    with ck.case("fast path"):
        # a padded dispatch after the first takes gocomm.moe's fast path (_backend.served): the
        # op converts topk_idx / topk_weights (int32 and float64 on the CPU here, exact) and
        # checks the arguments, with the errors of moe.py's other paths, before anything runs
        fast = gocomm._backend.served.get((dist.group.WORLD, dev.index))
        ck.expect("served", fast is not None and fast.moe, str(fast))
        slow = gocomm.moe._device_path

        def no_slow(*a):  # the fast path never looks the route up
            raise AssertionError("moe.dispatch took its slow path")

        gocomm.moe._device_path = no_slow
        try:
            recv, tpe, hd = gocomm.moe.dispatch(
                x, idx.int().cpu(), w.double().cpu(), experts, max_tokens_per_rank=t, padded=True
            )
        finally:
            gocomm.moe._device_path = slow
        out = gocomm.moe.combine(expert_step(recv), hd)
        ck.same("converted: tokens per expert", tpe.cpu(), want_tpe.cpu())
        ck.same("converted: grouped tokens", recv[: want_recv.shape[0]].cpu(), want_recv.cpu())
        ck.same("converted: combine", out.cpu(), want_out.cpu())
        for label, args, err, words in (
            ("float ids", (x, idx.float(), w, experts), TypeError, "hold integers"),
            ("no experts", (x, idx, w, 0), ValueError, "spread evenly"),
            ("shapes", (x, idx[1:], w, experts), ValueError, "must both be"),
            ("1-D x", (x[0], idx, w, experts), ValueError, "[tokens, hidden]"),
        ):
            try:
                gocomm.moe.dispatch(*args, max_tokens_per_rank=t, padded=True)
                ck.fail(label, "no error")
            except err as e:
                ck.expect(label, words in str(e), str(e))
        try:
            gocomm.moe.dispatch(x, idx, w, experts, max_tokens_per_rank=t - 1, padded=True)
            ck.fail("bound", "no error")
        except ValueError as e:
            ck.expect("bound", f"max_tokens_per_rank {t - 1} < this rank's {t} tokens" in str(e), str(e))
    torch.cuda.synchronize()
    return ck.done()


def check_all_to_all_v_op(rk, seed):
    """gocomm.all_to_all_v's in-process path as registered ops (torch.ops.gocomm, the compiled
    client's csrc/client/ops.cc): all_to_all_v under torch.compile(fullgraph=True) traced
    through its Meta kernel (the padded output's shape) and run, and all_to_all_v_out eager,
    against the rows and counts every rank sent (rebuilt from the seed)."""
    import gocomm

    dev, _ = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("all_to_all_v as a torch op", seed, me)
    name = dist.group.WORLD.group_name
    h, most = 24, 9

    def send_of(src):
        return [seeded_int(seed, f"op-{src}-{d}", 0, most) for d in range(n)]

    send, recv = send_of(me), [send_of(src)[me] for src in range(n)]
    x = gen(seed, "op", me, (sum(send), h), torch.float32).to(dev)
    want = torch.cat(
        [
            gen(seed, "op", src, (sum(send_of(src)), h), torch.float32)[sum(send_of(src)[:me]) :][: recv[src]]
            for src in range(n)
        ]
    )
    gocomm.all_to_all_v(x, torch.tensor(send, device=dev))  # sets the path up (collective)
    rows = most * n

    @torch.compile(backend="aot_eager", fullgraph=True)
    def doubled(x, s):
        out, got = torch.ops.gocomm.all_to_all_v(x, s, rows, name)
        return out * 2, got + 1

    with ck.case("compiled"), torch._functorch.config.patch(error_on_custom_op_aliasing=True):
        out, got = doubled(x, torch.tensor(send, device=dev, dtype=torch.int32))
        ck.expect("padded rows", tuple(out.shape) == (rows, h), str(tuple(out.shape)))
        ck.same("rows", out[: sum(recv)].cpu(), want * 2)
        ck.same("splits", got.cpu(), torch.tensor(recv, dtype=torch.int32) + 1)
    with ck.case("out form"):
        out = torch.full((sum(recv) + 2, h), -9.0, device=dev)
        got_out, got = torch.ops.gocomm.all_to_all_v_out(x, torch.tensor(send), out, name)
        ck.expect("the whole out", got_out.data_ptr() == out.data_ptr() and got_out.shape == out.shape, "a view")
        ck.same("rows", out[: sum(recv)].cpu(), want)
        ck.same("splits", got.cpu(), torch.tensor(recv))
        ck.expect("splits on in_splits' device", got.device.type == "cpu", str(got.device))
        ck.expect("rows past the data untouched", bool(torch.all(out[sum(recv) :] == -9.0)))
    with ck.case("argument errors"):
        # the op checks the arguments (the wrapper checks nothing), with the errors of the
        # other paths, before anything is sent
        z = torch.zeros(n + 5, h, device=dev)
        s64 = torch.zeros(n, dtype=torch.int64, device=dev)
        for label, args, kw, words in (
            ("wrong length", (z, torch.zeros(n + 1, dtype=torch.int64, device=dev)), {}, ["in_splits", str(n)]),
            ("float splits", (z, torch.zeros(n, device=dev)), {}, ["int32/int64"]),
            ("0-d input", (z[0, 0], s64), {}, ["at least one dimension"]),
            ("strided input", (z.t(), s64), {}, ["input must be contiguous"]),
            (
                "out's dtype",
                (z, s64),
                {"out": torch.zeros(4, h, dtype=torch.float64, device=dev)},
                ["does not match"],
            ),
            ("strided out", (z, s64), {"out": torch.zeros(h, 4, device=dev).t()}, ["out must be contiguous"]),
        ):
            try:
                gocomm.all_to_all_v(*args, **kw)
                ck.fail(label, "no error")
            except ValueError as e:
                ck.expect(label, all(w in str(e) for w in words), str(e))
        out, got = gocomm.all_to_all_v(x, torch.tensor(send, device=dev), out=torch.empty(rows, h, device=dev))
        ck.same("rows after", out[: sum(recv)].cpu(), want)
        ck.same("splits after", got.cpu(), torch.tensor(recv))
    torch.cuda.synchronize()
    return ck.done()


def check_all_to_all_v_graph(rk, seed):
    """The in-process all_to_all_v kernel (csrc/client/inprocess.cc) captured in a CUDA graph and replayed
    with new rows and splits, between eager calls, with no host sync in between, into a plain
    out and into a view of a receive buffer (the peers write into it); then on subgroups (of
    one rank at 2 GPUs), which only this path serves without a host sync."""
    from test_moe import ROUTINGS

    import gocomm

    dev, _ = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("all_to_all_v captured", seed, me)
    h, most = 96, 12  # rows of 192 bytes; at most 12 rows to each rank
    x = torch.zeros(most * n, h, dtype=torch.bfloat16, device=dev)
    splits = torch.zeros(n, dtype=torch.int64, device=dev)
    plain = torch.full((most * n, h), -5.0, dtype=torch.bfloat16, device=dev)
    # a receive buffer (the peers write into it, no copy out), used through a view 3 rows in
    rbuf = gocomm.receive_buffer(most * n + 3, (h,), torch.bfloat16)
    ck.expect("receive buffer", _state(rk.world.pg)._a2av_path(dev.index).outputs != [], "not registered")
    rbuf[:3].fill_(-7.0)

    def send_of(step, src):
        return [seeded_int(seed, f"g{step}-{src}-{d}", 0, most) for d in range(n)]

    for kind, out in (("out", plain), ("receive buffer", rbuf[3:])):
        gocomm.all_to_all_v(x, splits, out=out)  # sets the path up: not while capturing
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            _, graph_splits = gocomm.all_to_all_v(x, splits, out=out)
        torch.cuda.current_stream(dev).wait_stream(side)
        steps, kept = ["replay", "eager", "replay", "replay", "eager", "replay"], []
        for i, how in enumerate(steps):
            send = send_of(i, me)
            x[: sum(send)].copy_(gen(seed, f"g{i}", me, (sum(send), h), torch.bfloat16))
            splits.copy_(torch.tensor(send))
            if how == "replay":
                graph.replay()
                got_splits = graph_splits
            else:
                _, got_splits = gocomm.all_to_all_v(x, splits, out=out)
            kept.append((out.clone(), got_splits.clone()))
        torch.cuda.synchronize(dev)
        for i, (how, (got, got_splits)) in enumerate(zip(steps, kept, strict=True)):
            recv = [send_of(i, src)[me] for src in range(n)]
            want = torch.cat(
                [
                    gen(seed, f"g{i}", src, (sum(send_of(i, src)), h), torch.bfloat16).narrow(
                        0, sum(send_of(i, src)[:me]), send_of(i, src)[me]
                    )
                    for src in range(n)
                ]
            )
            with ck.case(f"{kind} step {i} ({how})"):
                ck.same(f"{kind} step {i} rows", got[: sum(recv)].cpu(), want)
                ck.same(f"{kind} step {i} splits", got_splits.cpu(), torch.tensor(recv))
    ck.expect("receive buffer before the view untouched", bool(torch.all(rbuf[:3] == -7.0)))
    with ck.case("receive buffer overflow"):
        # rank 0 takes 7 rows from every rank into room for 7n - 1: nothing written, counts say so
        send = [7 if d == 0 else 0 for d in range(n)]
        xs = torch.ones(7, h, dtype=torch.bfloat16, device=dev)
        rbuf.fill_(-1.0)
        room = rbuf[: 7 * n - 1] if me == 0 else rbuf
        _, got_splits = gocomm.all_to_all_v(xs, torch.tensor(send, device=dev), out=room)
        if me == 0:
            ck.expect("overflow shows in the counts", int(got_splits.sum()) == 7 * n, str(got_splits.tolist()))
            ck.expect("nothing written", bool(torch.all(rbuf == -1.0)))
    with ck.case("row sizes that differ"):
        # rank 0's rows are half as wide: no rank writes anything into any receive buffer
        w = h // 2 if me == 0 else h
        xs = torch.ones(n, w, dtype=torch.bfloat16, device=dev)
        rbuf.fill_(-2.0)
        room = rbuf.view(-1).view(-1, w)
        _, got_splits = gocomm.all_to_all_v(xs, torch.ones(n, dtype=torch.int64, device=dev), out=room)
        torch.cuda.synchronize(dev)
        dist.barrier(group=rk.world.gloo)  # every rank's kernel is done
        ck.expect("nothing written", bool(torch.all(rbuf == -2.0)))
        ck.expect("the counts", got_splits.tolist() == [1] * n, str(got_splits.tolist()))
    # subgroups: the lower and the upper half of the ranks
    halves = [list(range(n // 2)), list(range(n // 2, n))]
    subs = [dist.new_group(r, backend="gocomm") for r in halves]
    ranks = halves[0] if me in halves[0] else halves[1]
    sub, m, i = subs[0 if me in halves[0] else 1], len(ranks), ranks.index(me)
    ck.expect("subgroup path", _state(sub)._a2av_path(dev.index) is not None, "the shim's kernel is not set up")
    for label, splits_of in ROUTINGS.items():
        send = splits_of(seed, i, m)
        recv = [splits_of(seed, src, m)[i] for src in range(m)]
        with ck.case(f"subgroup {ranks} {label}"):
            key = f"sub{label}{ranks}"
            xs = gen(seed, key, i, (sum(send), 5), torch.float32).to(dev)
            out = torch.empty(sum(recv), 5, device=dev)
            got, got_splits = gocomm.all_to_all_v(xs, torch.tensor(send, dtype=torch.int32), out=out, group=sub)
            want = torch.cat(
                [
                    gen(seed, key, src, (sum(splits_of(seed, src, m)), 5), torch.float32).narrow(
                        0, sum(splits_of(seed, src, m)[:i]), splits_of(seed, src, m)[i]
                    )
                    for src in range(m)
                ]
            )
            ck.same(label, got[: sum(recv)].cpu(), want)
            ck.same(label + " splits", got_splits, torch.tensor(recv, dtype=torch.int32))
    torch.cuda.synchronize(dev)
    dist.barrier(group=rk.world.gloo)
    for g in subs:
        dist.destroy_process_group(g)
    return ck.done()


def check_all_to_all_single_inprocess(rk, seed):
    """dist.all_to_all_single of CUDA tensors where the group's GPUs share NVLink: the shim's
    one-sided kernel (host splits in its launch arguments), bitwise against torch's NCCL on
    the same inputs: every dtype, uneven, empty, skewed and random splits, rows of several
    dimensions, outputs larger than the receive buffer (this world's is 1 MiB, so they
    pass through it in rounds; 1 MiB of 7168 bf16 rows is 73 rows), a receive buffer as
    output, async_op on another stream, and a CUDA graph replayed with new rows."""
    from test_moe import ROUTINGS

    import gocomm

    dev, nccl = _setup(rk)
    n, me = rk.size, rk.rank
    ck = Checker("all_to_all_single by the shim's kernel", seed, me)
    path = _state(rk.world.pg)._a2av_path(dev.index)
    ck.expect("the kernel path is set up", path is not None and path.cap == 1 << 20, "a 1 MiB receive buffer")
    routings = dict(ROUTINGS)
    routings["random, many rows"] = lambda seed, src, n: [seeded_int(seed, f"big{src}-{d}", 0, 300) for d in range(n)]
    routings["one big pair"] = lambda seed, src, n: [700 if (src, d) == (0, n - 1) else 3 for d in range(n)]
    # one row of 7168 bf16 fits the kernel's fast slot at every size up to 8 ranks (16 KiB and
    # more with this 1 MiB buffer): pairs sent before the counts beside a pair in rounds
    routings["one big pair, one-row others"] = lambda seed, src, n: [
        700 if (src, d) == (0, n - 1) else 1 for d in range(n)
    ]

    def both(label, x, send, recv, row_shape, out=None):
        a = torch.empty(sum(recv), *row_shape, dtype=x.dtype, device=dev) if out is None else out
        b = torch.empty(sum(recv), *row_shape, dtype=x.dtype, device=dev)
        dist.all_to_all_single(b, x, recv, send, group=nccl)
        dist.all_to_all_single(a, x, recv, send)
        _compare(ck, label, a, b, exact=True)

    for label, splits_of in routings.items():
        send = splits_of(seed, me, n)
        recv = [splits_of(seed, src, n)[me] for src in range(n)]
        for dtype in [d for d, _ in DTYPES]:
            d = str(dtype).removeprefix("torch.")
            big = label in ("random, many rows", "one big pair", "one big pair, one-row others")
            row_shape = (7168,) if big and dtype == torch.bfloat16 else (3, 5) if not big else (40,)
            with ck.case(f"{label} {d}"):
                x = _input(seed, f"s{label}{d}", me, sum(send) * math.prod(row_shape), dtype, dev)
                both(f"{label} {d}", x.view(-1, *row_shape), send, recv, row_shape)
    with ck.case("into a receive buffer"):
        send = routings["random, many rows"](seed, me, n)
        recv = [routings["random, many rows"](seed, src, n)[me] for src in range(n)]
        rb = gocomm.receive_buffer(1200, (7168,), torch.bfloat16)
        x = _input(seed, "rbuf", me, sum(send) * 7168, torch.bfloat16, dev).view(-1, 7168)
        both("into a receive buffer", x, send, recv, (7168,), out=rb[: sum(recv)])
    with ck.case("all_to_all_v (splits on the GPU) into an out larger than the receive buffer"):
        send = routings["random, many rows"](seed, me, n)
        recv = [routings["random, many rows"](seed, src, n)[me] for src in range(n)]
        x = _input(seed, "a2av", me, sum(send) * 7168, torch.bfloat16, dev).view(-1, 7168)
        out = torch.empty(n * 300, 7168, dtype=torch.bfloat16, device=dev)  # 17 MB
        got, got_splits = gocomm.all_to_all_v(x, torch.tensor(send, device=dev), out=out)
        want = torch.empty(sum(recv), 7168, dtype=torch.bfloat16, device=dev)
        dist.all_to_all_single(want, x, recv, send, group=nccl)
        ck.expect("all_to_all_v out_splits", got_splits.tolist() == recv, f"{got_splits.tolist()} vs {recv}")
        _compare(ck, "all_to_all_v rows", got[: sum(recv)], want, exact=True)
    with ck.case("async_op, waited on another stream"):
        send = routings["uneven"](seed, me, n)
        recv = [routings["uneven"](seed, src, n)[me] for src in range(n)]
        x = _input(seed, "async", me, sum(send) * 64, torch.float32, dev).view(-1, 64)
        want = torch.empty(sum(recv), 64, device=dev)
        dist.all_to_all_single(want, x, recv, send, group=nccl)
        got = torch.full((sum(recv), 64), -1.0, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            w = dist.all_to_all_single(got, x, recv, send, async_op=True)
        w.wait()  # the current stream waits for the op
        _compare(ck, "async_op", got.clone(), want, exact=True)
    with ck.case("captured in a CUDA graph, replayed with new rows"):
        send = routings["random, many rows"](seed, me, n)
        recv = [routings["random, many rows"](seed, src, n)[me] for src in range(n)]
        x = torch.empty(sum(send), 7168, dtype=torch.bfloat16, device=dev)
        got = torch.empty(sum(recv), 7168, dtype=torch.bfloat16, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(g):
            dist.all_to_all_single(got, x, recv, send)
        torch.cuda.current_stream(dev).wait_stream(side)
        for step in range(3):
            x.copy_(_input(seed, f"graph{step}", me, x.numel(), torch.bfloat16, dev).view_as(x))
            g.replay()
            want = torch.empty_like(got)
            dist.all_to_all_single(want, x, recv, send, group=nccl)
            _compare(ck, f"graph replay {step}", got, want, exact=True)
    torch.cuda.synchronize()
    return ck.done()


@pytest.mark.parametrize("size", [2, 4])
def test_all_to_all_single_inprocess(worlds, seed, size):
    _need(size)
    env = {"GOCOMM_TRANSPORT": "nvshmem", "GOCOMM_A2A_RECV_MB": "1"}
    with worlds.fresh(size, label="a2a-single", env=env) as w:
        w.run(check_all_to_all_single_inprocess, seed=seed, timeout=RUN_LIMIT_S)


def check_kernel_timeout(rk, seed):
    """A peer that never joins an all_reduce: the in-process kernel gives up at the group's
    timeout (3 s) and torch.cuda.synchronize() returns; the group's next all_reduce aborts the
    group and raises DistBackendError naming the timeout, and the route table says why
    all_reduce left the kernel."""
    import datetime

    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ck = Checker("in-process kernel timeout", seed, rk.rank)
    sub = dist.new_group(backend="gocomm", timeout=datetime.timedelta(seconds=3))
    g = _state(sub)
    x = torch.ones(4096, device=dev)
    dist.all_reduce(x, group=sub)  # sets the path up (collective)
    torch.cuda.synchronize()
    ck.expect("in-process", g._ref.get().ar_path(dev.index) is not None, str(g._routes.table()["all_reduce"]))
    if rk.rank == 0:
        t0 = time.monotonic()
        dist.all_reduce(x, group=sub)  # the peer never joins
        torch.cuda.synchronize()  # returns once the kernel gave up
        waited = time.monotonic() - t0
        ck.expect("the kernel gave up at the timeout", 2.5 <= waited <= 60, f"{waited:.1f}s")
        err = None
        try:
            dist.all_reduce(x, group=sub)
        except dist.DistBackendError as e:
            err = str(e)
        want = "an earlier all_reduce timed out after 3s waiting for a peer"
        ck.expect("the next call raises, naming the timeout", err is not None and want in err, str(err))
        engine, why = g._routes.table()["all_reduce"]
        ck.expect("the route fell back", engine == "sidecar NCCL" and "timed out" in why, f"{engine}: {why}")
        ck.expect("the group is closed", g._closed)
    dist.all_reduce(torch.ones(1))  # CPU, on the world: both ranks past the trial
    return ck.done()


def test_inprocess_kernel_timeout(worlds, seed):
    """2 ranks with the in-process all_reduce forced (GOCOMM_TRANSPORT=nvshmem: on one GPU the
    ranks share it through CUDA IPC)."""
    with worlds.fresh(2, label="kernel-timeout", env={"GOCOMM_TRANSPORT": "nvshmem"}) as w:
        w.run(check_kernel_timeout, seed=seed, timeout=RUN_LIMIT_S)


def check_a2a_single_mismatch(rk, seed):
    """all_to_all_single by the in-process kernel where rank 1 sends rank 0 other rows than
    rank 0's output_split_sizes expect (fewer: they would land misplaced; more: they would
    not fit): rank 0's next call on the group raises DistBackendError naming the source and
    both counts, and aborts the group, so rank 1's next calls raise too with that reason,
    both well within the group's timeout (30 s). The call before, with matching splits, is
    exact; the world group is untouched."""
    import datetime

    from gocomm import _client

    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ck, me = Checker("all_to_all_single splits mismatch", seed, rk.rank), rk.rank
    for case, sent in (("fewer", 2), ("more", 4)):
        sub = dist.new_group(backend="gocomm", timeout=datetime.timedelta(seconds=30))

        def call(to_rank0, case=case, sub=sub):
            ins, outs = ([2, 1], [2, 3]) if me == 0 else ([to_rank0, 1], [1, 1])
            x = gen(seed, f"mm{case}{to_rank0}", me, (sum(ins), 16), torch.float32).to(dev)
            out = torch.full((sum(outs), 16), -1.0, device=dev)
            dist.all_to_all_single(out, x, outs, ins, group=sub)
            return out

        with ck.case(case):
            out = call(3)  # matching splits: sets the path up
            xs = [gen(seed, f"mm{case}3", p, (3 + p, 16), torch.float32) for p in range(2)]
            want = torch.cat([xs[0][:2], xs[1][:3]]) if me == 0 else torch.cat([xs[0][2:3], xs[1][3:4]])
            ck.same("matching splits", out.cpu(), want)
            call(sent)  # rank 1 sends `sent` rows where rank 0 expects 3
            torch.cuda.synchronize()
            t0, err = time.monotonic(), None
            for _ in range(20):
                try:
                    call(3)
                    torch.cuda.synchronize()
                except dist.DistBackendError as e:
                    err = str(e)
                    break
                time.sleep(0.2)
            waited = time.monotonic() - t0
            ck.expect("a later call raised in time", err is not None and waited < 15, f"{waited:.1f}s: {err}")
            want = f"rank 1 sent {sent} rows where output_split_sizes expected 3"
            ck.expect("the error names the mismatch", err is not None and want in err, str(err))
        dist.destroy_process_group(sub)
    runs = [r for r in _client.C.inprocess_launches() if r["op"] == "all_to_all_single"]
    ck.expect("the in-process kernel ran the calls", len(runs) >= 4, f"{len(runs)} launches")
    dist.all_reduce(torch.ones(1))  # CPU, on the world: both ranks past the trial
    return ck.done()


def test_a2a_single_mismatch(worlds, seed):
    """2 ranks with the in-process kernels forced (on one GPU they share it)."""
    with worlds.fresh(2, label="a2a-mismatch", env=_sharing(2)) as w:
        w.run(check_a2a_single_mismatch, seed=seed, timeout=RUN_LIMIT_S)


def check_device_mesh_split(rk, seed):
    """init_device_mesh where the default group was given its device (init_process_group's
    device_id sets bound_device_id, as here) splits that group (split_group) instead of calling
    new_group: a 2 x 2 mesh of four ranks, each dimension's group all_reduces CUDA tensors
    (the in-process kernel, the ranks sharing a GPU) and CPU ones against float64 sums."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ck, me = Checker("device mesh by split_group", seed, rk.rank), rk.rank
    dist.group.WORLD.bound_device_id = dev
    try:
        mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
        for name, want in (("dp", [me % 2, me % 2 + 2]), ("tp", [me - me % 2, me - me % 2 + 1])):
            with ck.case(name):
                g = mesh.get_group(name)
                ck.expect("its ranks", dist.get_process_group_ranks(g) == want, str(dist.get_process_group_ranks(g)))
                ck.expect("a split group", g.group_desc.startswith("mesh_"), g.group_desc)
                for where in ("cuda", "cpu"):
                    x = [gen(seed, name + where, r, (4096,), torch.float32) for r in range(rk.size)]
                    t = x[me].to(dev) if where == "cuda" else x[me].clone()
                    dist.all_reduce(t, group=g)
                    ck.reduced(
                        f"all_reduce of {where} tensors",
                        t.cpu(),
                        [x[r] for r in want],
                        dist.ReduceOp.SUM,
                        torch.float32,
                    )
        dist.barrier(group=rk.world.gloo)
    finally:
        dist.group.WORLD.bound_device_id = None
    return ck.done()


def test_device_mesh_split(worlds, seed):
    """4 ranks with the in-process kernels forced (on one GPU they share it)."""
    with worlds.fresh(4, label="mesh-split", env=_sharing(4)) as w:
        w.run(check_device_mesh_split, seed=seed, timeout=RUN_LIMIT_S)


def check_forked_child_keeps_counters(rk, seed):
    """A child forked from a rank whose sidecar serves its GPU closes its copy of the sidecar's
    client (as freeing it, or its exit hook, would): the stream counter pages it shares with
    the parent and the sidecar stay as they were (closing used to release every stream by
    storing done = ready + 2^30 into them, so the parent's streams would run past ops still in
    flight), and the parent's CUDA ops go on."""
    import gocomm._sidecar as sc

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ck = Checker("forked child keeps the counters", seed, rk.rank)
    x = torch.ones(1 << 16, device=dev)
    out = torch.empty(1 << 16, device=dev)
    dist.all_gather_into_tensor(out, x)  # the sidecar's NCCL: the counters are mapped
    torch.cuda.synchronize()
    # the pages' file is unlinked once mapped: read them where they are mapped
    pages = [int(line.split("-")[0], 16) for line in open("/proc/self/maps") if "gocomm-counters" in line]
    ck.expect("the counter pages are mapped", len(pages) > 0, "no gocomm-counters mapping")
    if pages:
        before = ctypes.string_at(pages[0], 4096)
        mine = sc.current()
        pid = os.fork()
        if pid == 0:
            mine.client.close()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        ck.expect("the child exited", status == 0, f"status {status}")
        after = ctypes.string_at(pages[0], 4096)
        ck.expect("the counters are untouched", before == after, "the child stored into them")
    x.add_(1)
    dist.all_gather_into_tensor(out, x)
    ck.expect("the parent's next op", bool((out == 2).all()), str(out[:4]))
    return ck.done()


def test_forked_child_keeps_counters(worlds, seed):
    with worlds.fresh(1, label="fork") as w:
        w.run(check_forked_child_keeps_counters, seed=seed, timeout=RUN_LIMIT_S)


def _future_case(rk, seed, what, key):
    """The future checks' start: this rank's device (made current), a Checker, every rank's
    float32 input of 2^14 elements from the seed, and their sum in float64."""
    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    xs = [gen(seed, key, r, 1 << 14, torch.float32) for r in range(rk.size)]
    return dev, Checker(what, seed, rk.rank), xs, torch.stack([x.double() for x in xs]).sum(0)


def _expect_future_sums(ck, got, twice, want):
    """A future's value is the sum, and its then() doubling saw it (the caller's stream synced)."""
    err = (got.double().cpu() - want).abs().max().item()
    ck.expect("future value is the sum", err < 1e-3, f"max error {err}")
    err2 = (twice.double().cpu() - 2 * want).abs().max().item()
    ck.expect("then() sees the sum", err2 < 2e-3, f"max error {err2}")


def check_kernel_future(rk, seed):
    """The in-process all_reduce's Work: get_future() returns at once while the kernel waits
    behind a long kernel on the stream (ProcessGroupNCCL's CUDA future: DDP takes it right
    after each bucket's all_reduce), is_completed() is False then, and the future's value and
    a then() callback see the sum once the caller's stream is ordered after it; an op on a
    stream torch does not own, destroyed after the op, leaves the next op on another stream
    unharmed."""
    dev, ck, xs, want = _future_case(rk, seed, "in-process future", "future")
    x = xs[rk.rank].to(dev)
    warm = torch.ones(4096, device=dev)
    dist.all_reduce(warm)  # sets the path up (collective)
    torch.cuda.synchronize()
    ck.expect("in-process", _state(dist.group.WORLD)._ref.get().ar_path(dev.index) is not None, "no kernel path")
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of the op on this stream
    w = dist.all_reduce(x, async_op=True)
    t0 = time.monotonic()
    fut = w.get_future()
    took = time.monotonic() - t0
    ck.expect("get_future returns without waiting for the GPU", took < 0.1, f"{took * 1000:.1f} ms")
    ck.expect("not completed while the stream is busy", not w.is_completed())
    doubled = fut.then(lambda f: f.value()[0] * 2)
    got = fut.wait()[0]  # orders this stream after the kernel; the host does not wait
    twice = doubled.wait()
    torch.cuda.synchronize(dev)
    ck.expect("completed after a sync", w.is_completed())
    _expect_future_sums(ck, got, twice, want)
    with ck.case("an external stream destroyed after its op"):
        # the next op on another stream must not record on it (it may be gone by then)
        rt = ctypes.CDLL("libcudart.so.13")  # loaded by torch already
        h = ctypes.c_void_p()
        ck.expect("stream made", rt.cudaStreamCreateWithFlags(ctypes.byref(h), 1) == 0)
        ext = torch.cuda.ExternalStream(h.value, device=dev)
        y = xs[rk.rank].to(dev)
        ext.wait_stream(torch.cuda.current_stream(dev))
        y2 = xs[rk.rank].to(dev)
        with torch.cuda.stream(ext):
            dist.all_reduce(y)
            w2 = dist.all_reduce(y2, async_op=True)
        torch.cuda.synchronize(dev)
        ck.expect("stream destroyed", rt.cudaStreamDestroy(h) == 0)
        got2 = w2.get_future().wait()[0]  # its Work's future, made after the stream went
        torch.cuda.synchronize(dev)
        e2 = (got2.double().cpu() - want).abs().max().item()
        ck.expect("the future of an op on the gone stream", e2 < 1e-3, f"max error {e2}")
        z = xs[rk.rank].to(dev)
        dist.all_reduce(z)  # on the current stream again: ordered after the gone stream's op
        torch.cuda.synchronize(dev)
        for name, t in (("on the external stream", y), ("after it was destroyed", z)):
            e = (t.double().cpu() - want).abs().max().item()
            ck.expect(name, e < 1e-3, f"max error {e}")
    return ck.done()


def test_inprocess_future(worlds, seed):
    """2 ranks with the in-process all_reduce forced (on one GPU they share it through CUDA IPC)."""
    with worlds.fresh(2, label="kernel-future", env={"GOCOMM_TRANSPORT": "nvshmem"}) as w:
        w.run(check_kernel_future, seed=seed, timeout=RUN_LIMIT_S)


def check_sidecar_future(rk, seed):
    """A sidecar op's Work (GOCOMM_TRANSPORT=nccl: the sidecar's NCCL runs every op): with the
    op queued behind ~0.5 s of GPU work on the caller's stream, get_future(), its then() and
    its wait() all return at once, as ProcessGroupNCCL's CUDA future does (DDP's hooks take it
    after each bucket; a future completed by the sidecar's answer would hold the host until the
    GPU got there), is_completed() is False meanwhile, and the value and then()'s result are
    the sum once the caller's stream is ordered after them; the same for the coalesced form's
    Work, whose future waits for every op of the batch."""
    dev, ck, xs, want = _future_case(rk, seed, "sidecar future", "sfuture")
    n = rk.size
    warm = torch.ones(4096, device=dev)
    # the process's first CUDA future, and its first then(), make torch's stream pools and
    # callback state, which wait for the device: once per process, as with ProcessGroupNCCL's
    dist.all_reduce(warm, async_op=True).get_future().then(lambda f: f.value()[0] * 2).wait()
    torch.cuda.synchronize()
    b = _state(dist.group.WORLD)._ref.get()
    ck.expect("on the sidecar", b.ar_path(dev.index) is None, "the in-process all_reduce serves the group")
    x = xs[rk.rank].to(dev)
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of the op on this stream
    t0 = time.monotonic()
    w = dist.all_reduce(x, async_op=True)
    fut = w.get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    got = fut.wait()[0]  # orders this stream after the op; the host does not wait
    twice = doubled.wait()
    took = time.monotonic() - t0
    ck.expect("the call, get_future, then() and wait() hold nothing", took < 0.1, f"{took * 1000:.1f} ms")
    ck.expect("not completed while the stream is busy", not w.is_completed())
    torch.cuda.synchronize(dev)
    _expect_future_sums(ck, got, twice, want)
    with ck.case("coalesced all_gather_into_tensor"):
        parts = [[gen(seed, f"sfuture/ag{i}", r, 1000 * (i + 1), torch.float32) for r in range(n)] for i in range(3)]
        ins = [p[rk.rank].to(dev) for p in parts]
        outs = [torch.zeros(n * t.numel(), device=dev) for t in ins]
        torch.cuda._sleep(1_000_000_000)
        t0 = time.monotonic()
        cw = dist.group.WORLD.allgather_into_tensor_coalesced(outs, ins)
        vals = cw.get_future().wait()
        took = time.monotonic() - t0
        ck.expect("the call and its future hold nothing", took < 0.1, f"{took * 1000:.1f} ms")
        ptrs = [v.data_ptr() for v in vals]
        ck.expect("the batch's outputs", ptrs == [o.data_ptr() for o in outs], f"{len(vals)} values")
        torch.cuda.synchronize(dev)
        for i, o in enumerate(outs):
            ck.same(f"output {i}", o.cpu(), torch.cat(parts[i]))
    with ck.case("a list-output op answered before it is recorded"):
        # A coalesced all_reduce (its tensors packed into one buffer and unpacked after): its
        # descriptor goes out and its record waits 0.5 s, so the sidecar's answer comes first.
        # That settle waits for the unpack on the GPU: the completion thread, not the caller,
        # finishes the Work.
        client = _state(dist.group.WORLD)._sc.client
        parts = [[gen(seed, f"sfuture/early{i}", r, 500 * (i + 1), torch.float32) for r in range(n)] for i in range(2)]
        ts = [p[rk.rank].to(dev) for p in parts]
        torch.cuda.synchronize(dev)
        dist.barrier()
        early = client.early()
        client.delay_next_track(0.5)
        t0 = time.monotonic()
        fut = dist.all_reduce_coalesced(ts, async_op=True)  # torch hands back the Work's future
        took = time.monotonic() - t0
        ck.expect("its answer came first", client.early() == early + 1, f"{client.early() - early} early, {took:.2f} s")
        fut.wait()
        torch.cuda.synchronize(dev)
        for i, t in enumerate(ts):
            want = torch.stack([x.double() for x in parts[i]]).sum(0)
            err = (t.double().cpu() - want).abs().max().item()
            ck.expect(f"answered early: tensor {i} summed", err < 1e-4, f"max error {err}")
        end = time.monotonic() + 5
        while not (fut.done() and client.pending() == 0) and time.monotonic() < end:
            time.sleep(0.01)
        ck.expect("the Work finished", fut.done())
        ck.expect("nothing left pending", client.pending() == 0, client.pending())
    return ck.done()


@pytest.mark.parametrize("size", [1, 2])
def test_sidecar_future(worlds, seed, size):
    """Every op on the sidecar's NCCL (GOCOMM_TRANSPORT=nccl); 2 ranks need 2 GPUs (NCCL takes one
    rank per GPU)."""
    _need(size)
    with worlds.fresh(size, label="sidecar-future", env={"GOCOMM_TRANSPORT": "nccl"}) as w:
        w.run(check_sidecar_future, seed=seed, timeout=RUN_LIMIT_S)


def check_channels_last_cuda(rk, seed):
    """all_reduce, broadcast and reduce of CUDA tensors in channels_last / channels_last_3d, as
    torch's NCCL backend takes them, on whichever engine serves the world (the in-process
    kernel or the sidecar's NCCL): against float64 sums of every rank's input; the output keeps
    its memory format. A transposed 2-D tensor (not contiguous in any format) is still refused.
    Ranks that share a GPU run all_reduce only: the other ops go to NCCL, which takes one rank
    per GPU."""
    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ck, n, me = Checker("channels_last on CUDA", seed, rk.rank), rk.size, rk.rank
    shared = torch.cuda.device_count() < n
    cl, cl3 = torch.channels_last, torch.channels_last_3d
    xs = [gen(seed, "cl", r, (4, 16, 8, 8), torch.float32) for r in range(n)]
    want = torch.stack([x.double() for x in xs]).sum(0)
    with ck.case("all_reduce"):
        t = xs[me].to(dev).to(memory_format=cl)
        dist.all_reduce(t)
        ck.expect("keeps channels_last", t.is_contiguous(memory_format=cl), str(t.stride()))
        err = (t.double().cpu() - want).abs().max().item()
        ck.expect("all_reduce sums", err < 1e-4, f"max error {err}")
        if os.environ.get("GOCOMM_TRANSPORT") == "nvshmem":  # its launch record has this call last
            from gocomm import _client

            last = [r for r in _client.C.inprocess_launches() if r["op"] == "all_reduce"][-1:]
            ck.expect("the in-process kernel ran it", [r["bytes"] for r in last] == [t.nbytes], str(last))
    with ck.case("a transposed matrix is refused"):
        try:
            dist.all_reduce(torch.ones(8, 4, device=dev).t())
            ck.fail("transposed all_reduce", "no error")
        except ValueError as e:
            ck.expect("names contiguity", "contiguous" in str(e), str(e))
    if shared:
        torch.cuda.synchronize()
        return ck.done()
    with ck.case("broadcast (channels_last_3d)"):
        x = gen(seed, "cl3", n - 1, (2, 8, 4, 4, 4), torch.bfloat16)
        b = (x if me == n - 1 else torch.zeros_like(x)).to(dev).to(memory_format=cl3)
        dist.broadcast(b, n - 1)
        ck.expect("broadcast", torch.equal(b.cpu(), x), "differs from the root's")
    with ck.case("reduce"):
        r = xs[me].to(dev).to(memory_format=cl)
        dist.reduce(r, 0)
        if me == 0:
            err = (r.double().cpu() - want).abs().max().item()
            ck.expect("reduce sums on the root", err < 1e-4, f"max error {err}")
    torch.cuda.synchronize()
    return ck.done()


@pytest.mark.parametrize("engine", ["inprocess", "sidecar"])
def test_channels_last_cuda(worlds, seed, engine):
    """The in-process engine forced on 2 ranks (GOCOMM_TRANSPORT=nvshmem; on one GPU they share
    it), and the sidecar's NCCL on 1 rank (GOCOMM_TRANSPORT=nccl, as on a PCIe-only box)."""
    _need(1)
    size, env = (2, {"GOCOMM_TRANSPORT": "nvshmem"}) if engine == "inprocess" else (1, {"GOCOMM_TRANSPORT": "nccl"})
    with worlds.fresh(size, label=f"cl-{engine}", env=env) as w:
        w.run(check_channels_last_cuda, seed=seed, timeout=RUN_LIMIT_S)


def check_premul_cuda(rk, seed):
    """ReduceOp.PREMUL_SUM on CUDA tensors (FSDP2's reduce-scatter with a gradient divide
    factor), a different factor on each rank, on whichever engine serves the world: all_reduce
    (bf16 through the in-process kernel where it runs), reduce_scatter_tensor (its input left as
    it was) and the factor as a one-element tensor on the GPU, against each rank's input scaled
    in its dtype and summed in float64. Ranks that share a GPU run all_reduce only."""
    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    ck, n, me = Checker("PREMUL_SUM on CUDA", seed, rk.rank), rk.size, rk.rank
    fs = [0.5 + r for r in range(n)]
    for dtype in (torch.bfloat16, torch.float32):
        xs = [gen(seed, f"pm{dtype}", r, (4096 * n,), dtype) for r in range(n)]
        want = torch.stack([(x * f).double() for x, f in zip(xs, fs, strict=True)]).sum(0)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        for kind, f in (("float", fs[me]), ("tensor", torch.tensor([fs[me]], device=dev))):
            with ck.case(f"all_reduce {dtype} {kind} factor"):
                t = xs[me].to(dev)
                dist.all_reduce(t, op=dist._make_nccl_premul_sum(f))
                err = ((t.double().cpu() - want).abs() / want.abs().clamp(min=1)).max().item()
                ck.expect(f"all_reduce {dtype} {kind}", err < tol, f"max rel error {err}")
        if torch.cuda.device_count() < n:
            continue
        with ck.case(f"reduce_scatter_tensor {dtype}"):
            inp, out = xs[me].to(dev), torch.empty(4096, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(fs[me]))
            part = want[4096 * me : 4096 * (me + 1)]
            err = ((out.double().cpu() - part).abs() / part.abs().clamp(min=1)).max().item()
            ck.expect(f"reduce_scatter_tensor {dtype}", err < tol, f"max rel error {err}")
            ck.expect("its input is untouched", torch.equal(inp.cpu(), xs[me]))
    torch.cuda.synchronize()
    return ck.done()


@pytest.mark.parametrize("engine", ["inprocess", "sidecar"])
def test_premul_cuda(worlds, seed, engine):
    """As test_channels_last_cuda: the in-process engine forced on 2 ranks, the sidecar's NCCL on 1."""
    _need(1)
    size, env = (2, {"GOCOMM_TRANSPORT": "nvshmem"}) if engine == "inprocess" else (1, {"GOCOMM_TRANSPORT": "nccl"})
    with worlds.fresh(size, label=f"pm-{engine}", env=env) as w:
        w.run(check_premul_cuda, seed=seed, timeout=RUN_LIMIT_S)


def check_transport(rk, want):
    """The sidecar's sparse transport, as the shim reads it."""
    got = _state(rk.world.pg)._routes.transport
    if got != want:
        raise AssertionError(f"rank {rk.rank}: sparse transport {got}, want {want}")
    return got


@pytest.mark.parametrize("size", [2, 4, 8])
def test_moe_cuda_nccl_forced(worlds, seed, size):
    """The sparse suite on the NCCL path, forced, with NCCL_P2P_DISABLE=1 standing in for a
    PCIe-only box (issue 4): all_to_all_v and dispatch/combine on CUDA tensors."""
    _need(size)
    forced = {"GOCOMM_TRANSPORT": "nccl", "NCCL_P2P_DISABLE": "1"}
    with worlds.fresh(size, label="ncclforced", env=forced) as w:
        w.run(check_transport, want="nccl", timeout=RUN_LIMIT_S)
        w.run(check_all_to_all_v, seed=seed, device="cuda", timeout=RUN_LIMIT_S)
        w.run(check_moe, seed=seed, device="cuda", timeout=RUN_LIMIT_S)


def _moe_kernels_device() -> torch.device:
    """cuda:0, where the MoE kernels (gocomm/bin/moe.cubin) must run: skips on a GPU of
    another architecture (the module is built for sm_90 only)."""
    from gocomm import _client

    dev = torch.device("cuda", 0)
    built = os.path.join(os.path.dirname(os.path.abspath(_client.__file__)), "bin", "moe.cubin")
    assert os.path.exists(built), "make builds gocomm/bin/moe.cubin"
    why = _client.C.module_why_not("moe.cubin", 0)
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip(why)
    assert _client.C.moe_usable(0), why  # built for this GPU: it must load
    return dev


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_moe_wsum_kernel(seed, dtype):
    """combine's kernel (kernels/inprocess/moe.cu) through torch.ops.gocomm.moe_wsum against a
    float64 sum of the same terms: random segments, empty ones among them, weighted and not;
    rows it cannot take fall back."""
    dev = _moe_kernels_device()
    g = torch.Generator().manual_seed(seed)
    n_src, rows, h = 300, 97, 7168 if dtype != torch.float32 else 1028
    src = (torch.randn(n_src, h, generator=g) * 3).to(dtype)
    counts = torch.randint(0, 5, (rows,), generator=g)
    counts[::7] = 0  # empty segments: zero rows
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    idx = torch.randint(0, n_src, (int(offs[-1]),), generator=g)
    w = torch.rand(int(offs[-1]), generator=g)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    for weights in (w, None):
        want = torch.zeros(rows, h, dtype=torch.float64)
        terms = src.double()[idx] * (weights.double().unsqueeze(1) if weights is not None else 1.0)
        want.index_add_(0, torch.repeat_interleave(torch.arange(rows), counts), terms)
        args = (src.to(dev), idx.to(dev), weights.to(dev) if weights is not None else None, offs.to(dev), rows)
        # NaNs in a block of the output's size, freed just before the op allocates its output
        # (its first allocation: the inputs need no conversion), which the caching allocator
        # most likely hands it: rows the kernel did not write would not read zero
        torch.full((rows, h), float("nan"), dtype=dtype, device=dev)
        (out,) = torch.ops.gocomm.moe_wsum(*args)
        assert (out.shape, out.dtype, out.device) == ((rows, h), dtype, dev)
        got = out.cpu().double()
        err = ((got - want).abs() / (want.abs() + 1)).max().item()
        assert err <= tol, f"{dtype} weighted={weights is not None}: max relative error {err}"
        assert torch.all(got[counts == 0] == 0), "rows without terms are zero"
        (again,) = torch.ops.gocomm.moe_wsum(*args)
        assert torch.equal(out, again), "the same sum every time"
    odd = torch.zeros(n_src, 7, dtype=dtype, device=dev)  # 7 elements: not a multiple of 16 bytes
    assert torch.ops.gocomm.moe_wsum(odd, idx.to(dev), None, offs.to(dev), rows) == [], "torch ops take it"
    f64 = torch.zeros(n_src, 2, dtype=torch.float64, device=dev)  # 16 bytes, but no kernel for float64
    assert torch.ops.gocomm.moe_wsum(f64, idx.to(dev), None, offs.to(dev), rows) == []
    (empty,) = torch.ops.gocomm.moe_wsum(src.to(dev), idx[:0].to(dev), None, offs[:1].to(dev), 0)
    assert empty.shape == (0, h)


@pytest.mark.parametrize(
    "tokens,n,k,per",
    [
        (0, 4, 8, 64),
        (1, 2, 8, 128),
        (128, 4, 8, 64),
        (1024, 8, 8, 32),
        (1025, 4, 4, 16),
        (3000, 8, 8, 32),
        (2500, 2, 4, 128),
        (777, 3, 2, 5),
        (600, 2, 8, 3),
    ],
)
def test_moe_route_group_kernels(seed, tokens, n, k, per):
    """dispatch's routing, packing and grouping kernels on one GPU against a reference built
    in Python from the same ids: every slot, split and offset, more tokens and rows than one
    block takes, -1 entries, ids repeated within a token (more pairs per row than experts
    per rank), an id out of range, and an overflow that groups nothing: torch.ops.gocomm's
    moe_route_pack and moe_group, which moe.dispatch's NCCL and NVSHMEM paths run; and the
    in-process dispatch's fused launches (route and pack in one, group and gather in one, with
    grouping blocks that wait on each other from 33 rows up) give the same, bit for bit."""
    from gocomm import _client

    dev = _moe_kernels_device()
    g = torch.Generator().manual_seed(seed)
    experts, h = per * n, 64
    idx = torch.randint(0, experts, (tokens, k), generator=g)  # repeats within a token too
    idx = torch.where(torch.rand(tokens, k, generator=g) < 0.2, -1, idx)
    x = torch.randn(max(tokens, 1), h, generator=g).to(torch.bfloat16)[:tokens]
    w = torch.rand(tokens, k, generator=g)
    # the reference: rows by rank, tokens ascending within a rank
    ranks_of = [sorted({int(e) // per for e in idx[t] if e >= 0}) for t in range(tokens)]
    slots = [(r, t) for r in range(n) for t in range(tokens) if r in ranks_of[t]]
    sync = torch.full((4,), -1, dtype=torch.int32, device=dev)  # the fused launches' words, zeroed by the first
    fused = _client.C.moe_route_pack_fused(x.to(dev), idx.to(dev), w.to(dev), experts, n, sync)
    assert sync.tolist() == [0, 0, 0, 0], "route_pack zeroes group_gather's words"
    nothing = _client.C.moe_route_pack_fused(x.to(dev), torch.full_like(idx, -1).to(dev), w.to(dev), experts, n, sync)
    assert nothing[1].tolist() == [0] * (n + 2) and nothing[4].tolist() == [0] * (tokens + 1), "nothing to send"
    if tokens == 0:
        assert torch.ops.gocomm.moe_route_pack(x.to(dev), idx.to(dev), w.to(dev), experts, n) == []  # torch ops
        assert fused[1].tolist() == [0] * (n + 2) and fused[4].tolist() == [0]
    else:
        routed = torch.ops.gocomm.moe_route_pack(x.to(dev), idx.to(dev), w.to(dev), experts, n)
        payload, meta, send_order, t_idx, t_offs = routed
        meta, send_order, t_idx, t_offs = meta.cpu(), send_order.cpu(), t_idx.cpu(), t_offs.cpu()
        assert meta.tolist() == [sum(1 for r, _ in slots if r == q) for q in range(n)] + [len(slots), 0]
        assert send_order[: len(slots)].tolist() == [t for _, t in slots]
        where = {s: i for i, s in enumerate(slots)}
        want_offs = [0]
        for t in range(tokens):
            want_offs.append(want_offs[-1] + len(ranks_of[t]))
        assert t_offs.tolist() == want_offs
        assert t_idx[: len(slots)].tolist() == [where[(r, t)] for t in range(tokens) for r in ranks_of[t]]
        rows = payload[: len(slots)].cpu()
        assert torch.equal(rows[:, : h * 2].view(torch.bfloat16), x[[t for _, t in slots]])
        id_off = h * 2
        ids = rows[:, id_off : id_off + k * 4].view(torch.int32)
        want_ids = torch.tensor(
            [[int(e) - r * per if e >= 0 and int(e) // per == r else -1 for e in idx[t]] for r, t in slots],
            dtype=torch.int32,
        ).view(-1, k)
        assert torch.equal(ids, want_ids)
        sent = len(slots)
        wo = h * 2 + -(-k * 4 // 16) * 16  # the weights' offset in a row; the bytes between the parts are not written
        for name, a, b in zip(("payload", "meta", "send_order", "t_idx", "t_offs"), routed, fused, strict=True):
            a, b = (a[:sent], b[:sent]) if name in ("payload", "send_order", "t_idx") else (a, b)
            if name == "payload":
                a, b = (torch.cat([v[:, : h * 2 + k * 4], v[:, wo : wo + k * 4]], dim=1) for v in (a, b))
            assert torch.equal(a.cpu(), b.cpu()), f"fused route_pack's {name} differs from route + pack"
        ranks9 = torch.ops.gocomm.moe_route_pack(x.to(dev), idx.to(dev), w.to(dev), 9 * per, 9)
        assert ranks9 == [], "a token's ranks are a byte: more than 8 go to torch ops"
        bad = idx.clone()
        bad[tokens // 2, 0] = experts + 3
        bad_meta = torch.ops.gocomm.moe_route_pack(x.to(dev), bad.to(dev), w.to(dev), experts, n)[1]
        assert bad_meta[n + 1].item() == 1
        assert _client.C.moe_route_pack_fused(x.to(dev), bad.to(dev), w.to(dev), experts, n, sync)[1][n + 1].item() == 1
    # grouping: rows as one rank receives them (local ids in [0, per) or -1), weights
    rows_n = 3 * tokens + 5
    cap = rows_n + 7
    xbytes = 16 * 37  # what the gather copies: 37 vectors, more than one pass of a block
    id_off, w_off = xbytes, xbytes + -(-k * 4 // 16) * 16
    row = w_off + -(-k * 4 // 16) * 16
    local = torch.randint(-1, per, (rows_n, k), generator=g, dtype=torch.int32)  # -1: none; repeats too
    wts = torch.rand(rows_n, k, generator=g)
    recv = torch.zeros(cap, row, dtype=torch.uint8)
    recv[:, :xbytes] = torch.randint(0, 256, (cap, xbytes), generator=g, dtype=torch.uint8)
    recv[:rows_n, id_off : id_off + k * 4] = local.contiguous().view(torch.uint8)
    recv[:rows_n, w_off : w_off + k * 4] = wts.contiguous().view(torch.uint8)
    splits = torch.tensor([rows_n // n] * (n - 1) + [rows_n - rows_n // n * (n - 1)])
    got = torch.ops.gocomm.moe_group(recv.to(dev), id_off, w_off, k, per, splits.to(dev))
    rows_sorted, w_sorted, tpe, e_idx, e_offs, gmeta = (v.cpu() for v in got)
    pairs = [(e, r, j) for e in range(per) for r in range(rows_n) for j in range(k) if local[r, j] == e]
    assert gmeta.tolist() == [len(pairs), rows_n]
    assert tpe.tolist() == [sum(1 for e, _, _ in pairs if e == q) for q in range(per)]
    assert rows_sorted[: len(pairs)].tolist() == [r for _, r, _ in pairs]
    assert torch.equal(w_sorted[: len(pairs)], torch.tensor([float(wts[r, j]) for _, r, j in pairs]))
    place = {(r, j): p for p, (_, r, j) in enumerate(pairs)}
    in_row = [[place[(r, j)] for j in range(k) if local[r, j] >= 0] for r in range(rows_n)]
    assert e_offs[: rows_n + 1].tolist() == [sum(len(v) for v in in_row[:r]) for r in range(rows_n + 1)]
    assert e_idx[: len(pairs)].tolist() == [p for v in in_row for p in v]
    over = torch.ops.gocomm.moe_group(recv.to(dev), id_off, w_off, k, per, splits.to(dev) + cap)
    assert over[-1].cpu().tolist() == [0, 0] and int(over[2].sum()) == 0, "an overflow groups nothing"
    # the fused group and gather, its words as route_pack left them; G grouping blocks
    blocks = max(1, min(64, -(-cap // 32)))
    for label, sp, want in (("", splits, got), (" overflowed", splits + cap, over), (" empty", splits * 0, None)):
        _client.C.moe_route_pack_fused(x.to(dev), idx.to(dev), w.to(dev), experts, n, sync)
        fused = [
            v.cpu()
            for v in _client.C.moe_group_gather_fused(recv.to(dev), id_off, w_off, k, per, sp.to(dev), xbytes, sync)
        ]
        f_rows, f_w, f_tpe, f_eidx, f_eoffs, f_gmeta, f_we, f_back, f_out = fused
        m, r = f_gmeta.tolist()
        if want is None:
            assert (m, r) == (0, 0) and int(f_tpe.sum()) == 0, "nothing received groups nothing"
        else:
            want = [v.cpu() for v in want]
            assert f_gmeta.tolist() == want[5].tolist() and torch.equal(f_tpe, want[2]), "fused" + label
            for a, b in ((f_rows, want[0]), (f_w, want[1]), (f_eidx, want[3])):
                assert torch.equal(a[:m], b[:m]), "fused group" + label + " differs from group"
            assert torch.equal(f_eoffs[: r + 1], want[4][: r + 1]), "fused group's offsets" + label
        assert torch.equal(f_we[:m], f_w[f_eidx[:m]]), "combine's weights in row order" + label
        assert f_back.tolist() == (sp.tolist() if r else [0] * n), "what combine sends back" + label
        assert torch.equal(f_out[:m], recv[f_rows[:m], :xbytes]), "the gathered rows" + label
        assert sync.tolist()[1:3] == [blocks if blocks > 1 else 0, blocks], f"grouping blocks' counts {sync.tolist()}"


def _segments_settled(sc, timeout=10.0):
    """The sidecar's counts of this client's CUDA segments once the drops the client queued
    are in the ring and the sidecar read them (its count of registered ones equals the
    client's) and nothing dropped is still mapped; the last counts seen after timeout."""
    if not sc.client.flush_cuda_drops(timeout):
        raise AssertionError(f"the client's queued drops were not written within {timeout}s")
    deadline = time.monotonic() + timeout
    while True:
        s = sc.cuda_segments()
        if s["registered"] == sc.client.cuda_segments() and s["mapped"] == s["registered"]:
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def _free_memory_back(dev, want, timeout=10.0):
    """The device's free bytes once they reach want (or after timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        free = torch.cuda.mem_get_info(dev)[0]
        if free >= want or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


def _fence(dev, timeout=30.0):
    """An all_reduce whose Work completed on the host: the completion thread has released every
    op's tensors by then (completions arrive in order, each op's tensors are let go before its
    Work finishes), so what the caller dropped is back in torch's allocator. Not its future,
    which, as ProcessGroupNCCL's, completes at once and only orders streams."""
    t = torch.ones(16, device=dev)
    w = dist.all_reduce(t, async_op=True)
    end = time.monotonic() + timeout
    while not w.is_completed():
        assert time.monotonic() < end, f"the fence's all_reduce did not complete within {timeout}s"
        time.sleep(0.0005)


def check_freed_memory_leaves_sidecar(rk, seed):
    """CUDA memory torch gives back (empty_cache) is unmapped by the sidecar at once, so it
    returns to the device: one 256 MiB tensor, then 200 cycles of tensors of random sizes
    (1-40 MiB, each a segment of its own or a shared 20 MiB one) through all_reduce with
    empty_cache every third cycle. The sidecar's count of mapped segments never grows past
    what the allocator holds, and ends where it started."""
    from gocomm import _sidecar

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ck = Checker("freed CUDA memory leaves the sidecar", seed, rk.rank)
    sc = _sidecar.current()
    _fence(dev)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ck.expect("torch's allocator reports what it frees", sc.client.cuda_hooked)
    s0 = _segments_settled(sc)
    free0 = torch.cuda.mem_get_info(dev)[0]
    slack = 48 << 20
    with ck.case("one 256 MiB tensor"):
        big = torch.full((64 << 20,), 1.5, device=dev)
        dist.all_reduce(big)
        ck.expect("all_reduce result", bool(torch.all(big == 1.5 * rk.size).item()))
        s1 = _segments_settled(sc)
        ck.expect("registered while alive", s1["registered"] == s0["registered"] + 1, f"{s0} -> {s1}")
        ck.expect("its bytes mapped", s1["bytes_mapped"] >= s0["bytes_mapped"] + (256 << 20), f"{s0} -> {s1}")
        del big
        _fence(dev)
        torch.cuda.empty_cache()
        t0 = time.monotonic()
        s2 = _segments_settled(sc)
        free2 = _free_memory_back(dev, free0 - slack)
        ck.expect(
            "unmapped by the sidecar after empty_cache",
            s2["registered"] == s0["registered"] and s2["mapped"] == s0["mapped"] and s2["unmapped"] > s1["unmapped"],
            f"{s0} -> {s1} -> {s2}",
        )
        ck.expect(
            "the device's memory came back",
            free2 >= free0 - slack,
            f"free {free0 >> 20} MiB before, {free2 >> 20} MiB {time.monotonic() - t0:.2f}s after empty_cache",
        )
    with ck.case("200 alloc/free cycles"):
        rng = torch.Generator().manual_seed(seed)
        peak = 0
        for i in range(200):
            nbytes = int(torch.randint(1 << 20, 40 << 20, (1,), generator=rng)) & ~15
            t = torch.full((nbytes // 4,), float(i), device=dev)
            w = dist.all_reduce(t, async_op=i % 2 == 0)
            if w is not None:
                w.wait()
            if not bool(torch.all(t == float(i) * rk.size).item()):
                ck.fail(f"cycle {i}", f"all_reduce of {nbytes} bytes gave {t[:2].tolist()}")
                break
            del t, w
            if i % 3 == 2:
                torch.cuda.empty_cache()
            if i % 20 == 19:
                peak = max(peak, _segments_settled(sc)["mapped"])
        _fence(dev)
        torch.cuda.empty_cache()
        s3 = _segments_settled(sc)
        free3 = _free_memory_back(dev, free0 - slack)
        ck.expect("mapped segments bounded while cycling", peak <= s0["mapped"] + 8, f"peak {peak}, start {s0}")
        ck.expect(
            "back where it started",
            s3["registered"] == s0["registered"] and s3["mapped"] == s0["mapped"],
            f"{s0} -> {s3}",
        )
        ck.expect(
            "the device's memory came back",
            free3 >= free0 - slack,
            f"free {free0 >> 20} MiB before, {free3 >> 20} MiB after",
        )
    return ck.done()


def test_freed_memory_leaves_the_sidecar(worlds, seed):
    """Issue 21 item 5: cached IPC mappings are dropped when torch frees the memory."""
    worlds.get(1).run(check_freed_memory_leaves_sidecar, seed=seed, timeout=RUN_LIMIT_S)


def check_work_keeps_tensors_alive(rk, seed):
    """Async ops whose caller drops every reference to its input and output at once: the
    Work keeps them until the GPU is done. Right after the call, tensors of the same size
    are allocated and filled on the same stream: had the input's block gone back to the
    allocator, they would take it and overwrite it while the sidecar's NCCL reads it."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ck = Checker("works keep their tensors", seed, rk.rank)
    n, size = 8 << 20, rk.size  # 32 MiB of float32

    def launch(op, x):
        if op == "all_reduce":
            return dist.all_reduce(x, async_op=True)
        if op == "broadcast":
            return dist.broadcast(x, 0, async_op=True)
        if op == "all_gather_into_tensor":
            return dist.all_gather_into_tensor(torch.empty(n * size, device=dev), x, async_op=True)
        if op == "all_gather":
            return dist.all_gather([torch.empty(n, device=dev) for _ in range(size)], x, async_op=True)
        if op == "reduce_scatter_tensor":
            return dist.reduce_scatter_tensor(torch.empty(n // size, device=dev), x, async_op=True)
        if op == "all_to_all_single":
            return dist.all_to_all_single(torch.empty(n, device=dev), x, async_op=True)
        raise ValueError(op)

    ops = ["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor"]
    if not _state(dist.group.WORLD)._routes.a2a_inprocess:  # the kernel runs on the caller's stream
        ops.append("all_to_all_single")
    for op in ops:
        with ck.case(op):
            for i in range(6):
                v = float(i + 1)
                w = launch(op, torch.full((n,), v, device=dev))  # no reference kept here
                junk = [torch.full((n,), -3.0, device=dev) for _ in range(3)]
                w.wait()
                want = v * size if op in ("all_reduce", "reduce_scatter_tensor") else v
                got = w.get_future().wait()  # the op's outputs, which the Work holds
                ok = len(got) > 0 and all(bool(torch.all(t == want).item()) for t in got)
                if not ok:
                    ck.fail(f"{op} #{i}", f"result {[t.flatten()[:2].tolist() for t in got]}, want {want}")
                    break
                del junk, w, got
    torch.cuda.synchronize()
    return ck.done()


def test_work_keeps_tensors_alive(worlds, seed):
    """Issue 21 item 5: work objects keep their tensors alive until the GPU finished."""
    worlds.get(1).run(check_work_keeps_tensors_alive, seed=seed, timeout=RUN_LIMIT_S)


def _dense_ops_exact(ck, rk, dev, seed, tag, sizes):
    """all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast of float32
    tensors of each size (elements), each against the float64 sum or the exact copy of every
    rank's input (gen makes them on any rank)."""
    for n in sizes:
        key = f"{tag}-{n}"
        xs = [gen(seed, key, r, (n,), torch.float32, small=True) for r in range(rk.size)]
        ref = torch.stack([x.double() for x in xs]).sum(0)
        with ck.case(f"{tag}: all_reduce of {n * 4} bytes"):
            x = xs[rk.rank].to(dev)
            dist.all_reduce(x)
            err = (x.double().cpu() - ref).abs().max().item()
            ck.expect("close to the float64 sum", err <= 1e-5 * rk.size, f"max error {err}")
        with ck.case(f"{tag}: all_gather_into_tensor of {n * 4} bytes"):
            out = torch.empty(n * rk.size, device=dev)
            dist.all_gather_into_tensor(out, xs[rk.rank].to(dev))
            ck.expect("every rank's input, exactly", torch.equal(out.cpu(), torch.cat(xs)))
        with ck.case(f"{tag}: reduce_scatter_tensor of {n * 4} bytes"):
            ys = [gen(seed, f"{tag}-rs-{n}", r, (n * rk.size,), torch.float32, small=True) for r in range(rk.size)]
            want = torch.stack([y.double() for y in ys]).sum(0)[rk.rank * n : (rk.rank + 1) * n]
            out = torch.empty(n, device=dev)
            dist.reduce_scatter_tensor(out, ys[rk.rank].to(dev))
            err = (out.double().cpu() - want).abs().max().item()
            ck.expect("close to the float64 sum", err <= 1e-5 * rk.size, f"max error {err}")
        with ck.case(f"{tag}: broadcast of {n * 4} bytes"):
            x = xs[rk.rank].to(dev)
            dist.broadcast(x, 0)
            ck.expect("rank 0's input, exactly", torch.equal(x.cpu(), xs[0]))


def check_expandable_segments(rk, seed):
    """Under expandable_segments:True (decision 0029) CUDA tensors reach the sidecar as the
    chunks they span, by fd: dense ops on tensors of one small-pool chunk, inside one 20 MiB
    chunk and across several are right; ops in flight while torch unmaps other chunks stay
    right; empty_cache (SEGMENT_UNMAP) drops the sidecar's mappings and gives the memory back
    to the device; tensors allocated after are registered anew and right."""
    from gocomm import _sidecar

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ck = Checker("expandable segments", seed, rk.rank)
    sc = _sidecar.current()
    sizes = [1000, 3 << 18, 13 << 20]  # 4 KB, 3 MiB, 52 MiB (three or more 20 MiB chunks)
    _fence(dev)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ck.expect("torch's allocator reports what it unmaps", sc.client.cuda_hooked)
    probe = torch.empty(13 << 20, device=dev)
    expandable = any(seg.get("is_expandable") for seg in torch.cuda.memory_snapshot())
    ck.expect("the tensors live in expandable segments", expandable, "no segment has is_expandable")
    del probe
    torch.cuda.empty_cache()
    s0 = _segments_settled(sc)
    free0 = torch.cuda.mem_get_info(dev)[0]
    slack = 48 << 20
    _dense_ops_exact(ck, rk, dev, seed, "first", sizes)
    s1 = _segments_settled(sc)
    ck.expect("registered while alive", s1["registered"] > s0["registered"], f"{s0} -> {s1}")
    ck.expect("their chunks mapped", s1["bytes_mapped"] >= s0["bytes_mapped"] + (52 << 20), f"{s0} -> {s1}")
    with ck.case("ops in flight while torch unmaps other chunks"):
        keep = [torch.full((n,), 1.0 + i, device=dev) for i, n in enumerate(sizes)]
        gone = [torch.full((n,), -1.0, device=dev) for n in sizes]
        for t in gone:
            dist.all_reduce(t)
        _fence(dev)  # the sidecar is done with `gone`: freed, its chunks can go
        works = [dist.all_reduce(t, async_op=True) for t in keep]
        del gone
        torch.cuda.empty_cache()  # unmaps the chunks only `gone` used
        for w in works:
            w.wait()
        for i, t in enumerate(keep):
            ck.expect(f"all_reduce #{i}", bool(torch.all(t == (1.0 + i) * rk.size).item()), str(t[:2].tolist()))
        # t and w: the loops' last tensor and Work (which holds its tensors), that would keep
        # their chunks in use
        del keep, works, t, w
    _fence(dev)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    t0 = time.monotonic()
    s2 = _segments_settled(sc)
    free2 = _free_memory_back(dev, free0 - slack)
    ck.expect("some chunks unmapped by the sidecar after empty_cache", s2["unmapped"] > s1["unmapped"], f"{s1} -> {s2}")
    # what torch itself still holds, to tell a chunk torch kept from one the drop missed
    held = [
        (hex(seg["address"]), seg["total_size"] >> 20, seg["allocated_size"] >> 20, seg["is_expandable"])
        for seg in torch.cuda.memory_snapshot()
    ]
    ck.expect(
        "every chunk unmapped by the sidecar after empty_cache",
        s2["registered"] == s0["registered"] and s2["mapped"] == s0["mapped"],
        f"{s0} -> {s1} -> {s2}; torch's segments (address, MiB, MiB allocated, expandable): {held}; "
        f"client registrations {sc.client.cuda_segments()}",
    )
    ck.expect(
        "the device's memory came back",
        free2 >= free0 - slack,
        f"free {free0 >> 20} MiB before, {free2 >> 20} MiB {time.monotonic() - t0:.2f}s after empty_cache; "
        f"torch reserves {torch.cuda.memory_reserved(dev) >> 20} MiB",
    )
    _dense_ops_exact(ck, rk, dev, seed, "again", sizes)
    torch.cuda.synchronize()
    return ck.done()


def test_expandable_segments(worlds, seed):
    """Issue 21 item 5: tensors in torch's expandable segments through the sidecar's NCCL: the
    ops right before, during and after torch unmaps chunks, and the sidecar unmapping every
    chunk torch unmapped, so the device's memory comes back."""
    with worlds.fresh(1, label="expandable", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) as w:
        w.run(check_expandable_segments, seed=seed, timeout=RUN_LIMIT_S)


def check_expandable_segments_without_fd_refused(rk, seed):
    """Chunks torch made with no exportable handle (TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0) are
    refused before anything is sent, naming the cause and the fix, and the group goes on with
    a tensor allocated with expandable segments off (decision 0029)."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ck = Checker("expandable segments without fds refused", seed, rk.rank)
    with ck.case("refused with the reason"):
        t = torch.ones(1 << 20, device=dev)
        try:
            dist.all_reduce(t)
            ck.fail("refusal", "all_reduce of a chunk with no fd handle did not raise (torch ignored the variable?)")
        except RuntimeError as e:
            msg = str(e)
            for words in (
                "cuMemMap",
                "cannot be exported to a file descriptor",
                "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0",
                "expandable_segments:False",
            ):
                ck.expect(f"message names {words!r}", words in msg, msg)
    with ck.case("the group goes on with cudaMalloc memory"):
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        u = torch.full((1 << 20,), 2.0, device=dev)
        dist.all_reduce(u)
        ck.expect("all_reduce result", bool(torch.all(u == 2.0 * rk.size).item()))
    torch.cuda.synchronize()
    return ck.done()


def test_expandable_segments_without_fd_refused(worlds, seed):
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC": "0"}
    with worlds.fresh(1, label="expandable-nofd", env=env) as w:
        w.run(check_expandable_segments_without_fd_refused, seed=seed, timeout=RUN_LIMIT_S)


def check_one_rank_past_the_receive_buffer(rk, seed):
    """A group of one rank takes the in-process all-to-all kernels on any node, and its default
    outputs hold everything it sends itself, however far past the receive buffer
    (GOCOMM_A2A_RECV_MB=1 here: 512 rows of 2 KiB): all_to_all_v without out (rows past the
    buffer pass through it in rounds) and moe.dispatch without max_tokens_per_rank."""
    from test_moe import _routing

    import gocomm

    dev, _ = _setup(rk)
    ck = Checker("one rank past the receive buffer", seed, rk.rank)
    path = gocomm.sparse._device_path(dist.group.WORLD, torch.empty(0, device=dev))
    ck.expect("the in-process path", isinstance(path, gocomm._client.C.A2Path), repr(path))
    rows, h = 1500, 1024
    x = gen(seed, "alone", 0, (rows, h), torch.bfloat16).to(dev)
    for send in (rows, 1200, 0):
        with ck.case(f"all_to_all_v of {send} of {rows} rows"):
            out, got = gocomm.all_to_all_v(x, torch.tensor([send], device=dev))
            ck.expect("output rows", tuple(out.shape) == (rows, h), str(tuple(out.shape)))
            ck.same("rows", out[:send].cpu(), x[:send].cpu())
            ck.same("splits", got.cpu(), torch.tensor([send]))
    experts, k = 4, 2
    idx = _routing(seed, 0, rows, experts, k, 1, "uniform")
    w = gen(seed, "alone-w", 0, (rows, k), torch.float32).abs()
    with ck.case(f"moe.dispatch of {rows} tokens x {k} without a bound, and combine"):
        recv, tpe, handle = gocomm.moe.dispatch(x, idx.to(dev), w.to(dev), experts)
        chose = [(idx == e).any(1) for e in range(experts)]
        order = torch.cat([torch.nonzero(c).flatten() for c in chose])
        ck.same("grouped tokens", recv.cpu(), x.cpu()[order])
        ck.same("tokens per expert", tpe.cpu(), torch.tensor([int(c.sum()) for c in chose]))
        got = gocomm.moe.combine(recv, handle).cpu().double()
        ref = x.cpu().double() * w.double().sum(1, keepdim=True)  # every expert returns its input
        bad = (got - ref).abs() > 4 * 2.0**-8 * ref.abs() + 1e-6
        ck.expect("combine vs float64", not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} off")
    torch.cuda.synchronize()
    return ck.done()


def test_one_rank_past_the_receive_buffer(worlds, seed):
    with worlds.fresh(1, label="alone", env={"GOCOMM_A2A_RECV_MB": "1"}) as w:
        w.run(check_one_rank_past_the_receive_buffer, seed=seed, timeout=RUN_LIMIT_S)
