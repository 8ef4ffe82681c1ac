"""GPU benchmark: gocomm against torch's NCCL backend, in one run, on the same GPUs.

    python -m gocomm.bench.gpu [--sizes 8K,...,1G] [--ops all_reduce,...] [--json F] [--png F]

(--ops all_to_all_v times gocomm.all_to_all_v, splits on the GPU, against NCCL's
all_to_all_single with the same splits: the sidecar's NVSHMEM kernel where its transport is
NVSHMEM (auto on NVLink nodes; GOCOMM_TRANSPORT=nccl|nvshmem forces one).)

One rank per visible GPU. Each rank joins the gocomm default group and an NCCL group over
the same ranks and times, on bf16 tensors, each op two ways (nccl-tests' columns):
- alone: one op between CUDA events after a barrier and a device sync (median of 40 after 5
  warm-ups), the way ../shared/reference/nccl_baseline.py times, gocomm's and NCCL's
  iterations interleaved so that the machine's drift falls on both alike;
- loop: 20 ops back to back between two events, time per op.
--host times instead the host side of each call: the wall time of the call in the calling
thread (time.perf_counter_ns), after warm-up, with the GPU work left queued as the call returns
it (median of 200, in blocks of 10 calls of one backend, gocomm's and NCCL's blocks
interleaved): once with the stream idle before each call, once back to back, the GPU behind,
as a loop calls them.
Columns (default mode): time (us), algorithm bandwidth (bytes / time) and bus bandwidth (algbw times 2(n-1)/n
for all_reduce, (n-1)/n for the others), and gocomm's time over NCCL's. Set MPS up first
(gocomm.launch) to measure what the design expects.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import _perf
from .cpu import _fmt, _free_port, _size

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all_single")
# By --ops only: gocomm.all_to_all_v (splits on the GPU, one row of size/n bytes per rank)
# against NCCL all_to_all_single with the same splits known on the host.
EXTRA_OPS = ("all_to_all_v",)


def _busbw(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _alone(fn, sync, iters=20, warm=5) -> float:
    """One op between CUDA events after a barrier and a device sync: the median, in us."""
    return _alone_paired({"op": fn}, sync, iters, warm)["op"]


def _alone_paired(fns: dict, sync, iters=40, warm=5) -> dict:
    """_alone for several implementations of one op, their iterations interleaved (a, b, a,
    b, ...), so that a drift of the machine's state (clocks, other tenants, the ranks' skew)
    falls on all of them alike: medians of iters each, in us."""
    for fn in fns.values():
        for _ in range(warm):
            fn()
    torch.cuda.synchronize()
    ts = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            sync()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts[name].append(s.elapsed_time(e) * 1000)
    return {name: statistics.median(v) for name, v in ts.items()}


def _loop(fn, sync, iters=20) -> float:
    fn()
    sync()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000 / iters


def _op(op: str, n: int, world: int, dev, g):
    """The timed call for one op on n elements (the nccl-tests size: all_gather's output,
    reduce_scatter's input), on group g (None: the default group, gocomm)."""
    x = torch.randn(n, device=dev).to(torch.bfloat16)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=g)
    if op == "all_gather":
        part = torch.randn(n // world, device=dev).to(torch.bfloat16)
        return lambda: dist.all_gather_into_tensor(x, part, group=g)
    if op == "reduce_scatter":
        out = torch.empty(n // world, dtype=x.dtype, device=dev)
        return lambda: dist.reduce_scatter_tensor(out, x, group=g)
    out = torch.empty_like(x)
    if op == "all_to_all_v" and g is None:
        import gocomm

        rows, o = x.view(world, -1), out.view(world, -1)
        splits = torch.ones(world, dtype=torch.int64, device=dev)
        return lambda: gocomm.all_to_all_v(rows, splits, out=o)
    return lambda: dist.all_to_all_single(out, x, group=g)


def _join(rank: int, world: int, port: int):
    """A benchmark rank's setup: its GPU, the gocomm default group, an NCCL group over the
    same ranks, and a barrier through NCCL (so both backends start from the same point).
    Returns (device, nccl group, barrier)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    import gocomm  # noqa: F401  (registers the backend)

    dist.init_process_group("gocomm", rank=rank, world_size=world)
    nccl = dist.new_group(backend="nccl", device_id=dev)
    gsync = torch.zeros(1, device=dev)

    def sync():
        dist.all_reduce(gsync, group=nccl)

    return dev, nccl, sync


def _host_paired(fns: dict, iters=200, warm=20, idle=True) -> dict:
    """The host time of one call of each implementation (us, median of iters): the wall time in
    the calling thread, in blocks of 10 calls of one implementation, the implementations'
    blocks interleaved (interleaving single calls would charge each call for the one before
    it). idle: a sync before each call; else the block's calls back to back after a sync and
    one uncounted call, the GPU behind, as a loop calls them."""
    import time

    for fn in fns.values():
        for _ in range(warm):
            fn()
    ts = {name: [] for name in fns}
    for _ in range(iters // 10):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            if not idle:
                fn()
            for _ in range(10):
                if idle:
                    torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                fn()
                ts[name].append((time.perf_counter_ns() - t0) / 1000)
    torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in ts.items()}


def _host_worker(rank: int, world: int, port: int, sizes: list[int], ops: list[str], q) -> None:
    dev, nccl, sync = _join(rank, world, port)
    rows = []
    for op in ops:
        for nbytes in sizes:
            n = max(world, nbytes // 2 // world * world)
            fns = {name: _op(op, n, world, dev, g) for name, g in (("nccl", nccl), ("gocomm", None))}
            sync()
            host = _host_paired(fns)
            sync()
            host.update({f"{k} busy": v for k, v in _host_paired(fns, idle=False).items()})
            rows.append({"op": op, "bytes": n * 2, "world": world, "host": host})
            if rank == 0:
                print(f"{op} {_fmt(n * 2)}: host us {host}", flush=True)
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _print_host_table(rows, world) -> None:
    print(f"host time per call (us, median), {world}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    cols = f"{'nccl us':>9s} {'gocomm us':>9s} {'ratio':>6s}"
    print(f"{'':25s} | {'stream idle':^26s} | {'back to back':^26s}")
    hdr = f"{'op':18s} {'size':>6s} | {cols} | {cols}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        h, line = r["host"], f"{r['op']:18s} {_fmt(r['bytes']):>6s}"
        for sfx in ("", " busy"):
            nccl, ours = h["nccl" + sfx], h["gocomm" + sfx]
            line += f" | {nccl:9.1f} {ours:9.1f} {ours / nccl:6.2f}"
        print(line)


def _sidecar_ops() -> int:
    """Ops of the default group the sidecar has finished (its Stats rpc), to tell which engine
    ran gocomm's side of a measurement."""
    from .. import _backend

    return sum(_backend.state(dist.group.WORLD).stats().get("ops", {}).values())


def _worker(rank: int, world: int, port: int, sizes: list[int], ops: list[str], q) -> None:
    dev, nccl, sync = _join(rank, world, port)
    rows = []
    for op in ops:
        for nbytes in sizes:
            n = max(world, nbytes // 2 // world * world)  # elements of the nccl-tests "size"
            res = {"op": op, "bytes": n * 2, "world": world}
            fns = {name: _op(op, n, world, dev, g) for name, g in (("nccl", nccl), ("gocomm", None))}
            before = _sidecar_ops()
            alone = _alone_paired(fns, sync)
            for name, fn in fns.items():
                res[name] = {"alone": alone[name], "loop": _loop(fn, sync)}
            res["sidecar_ops"] = _sidecar_ops() - before
            if world == 1 and res["sidecar_ops"] == 0:
                # one GPU: every dense op must take the sidecar's NCCL (what this measures)
                raise RuntimeError(f"gocomm {op} at world size 1 did not go through the sidecar")
            rows.append(res)
            if rank == 0:
                print(f"{op} {_fmt(n * 2)}: nccl {res['nccl']} gocomm {res['gocomm']}", flush=True)
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows}, key=(OPS + EXTRA_OPS).index)
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        rs = [r for r in rows if r["op"] == op]
        xs = [r["bytes"] for r in rs]
        for name, style in (("nccl", "--"), ("gocomm", "-")):
            for mode, marker in (("alone", "o"), ("loop", "s")):
                bw = [r["bytes"] / (r[name][mode] * 1e-6) / 1e9 * _busbw(op, r["world"]) for r in rs]
                ax.plot(xs, bw, style, marker=marker, label=f"{name} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}, {rs[0]['world']} GPUs, bf16")
        ax.set_xlabel("bytes")
        ax.set_ylabel("bus bandwidth GB/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8K,64K,1M,16M,256M,1G")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--json")
    ap.add_argument("--png")
    ap.add_argument("--host", action="store_true", help="time the host side of each call (see above)")
    ap.add_argument("--perf", help="record the table in this file's section for this machine (docs/perf.md)")
    args = ap.parse_args(argv)
    world = torch.cuda.device_count()
    if world < 1:
        print("gocomm.bench.gpu: no GPU", file=sys.stderr)
        return 2
    sizes = [_size(s) for s in args.sizes.split(",")]
    ops = [o for o in args.ops.split(",") if o]
    if unknown := [o for o in ops if o not in OPS + EXTRA_OPS]:
        print(f"gocomm.bench.gpu: unknown ops {unknown}; known: {', '.join(OPS + EXTRA_OPS)}", file=sys.stderr)
        return 2
    if world == 1:
        # one rank: what this measures is the sidecar's path in isolation, but a group of one
        # takes the in-process kernels for all_to_all_single where NCCL is not asked for
        transport = os.environ.setdefault("GOCOMM_TRANSPORT", "nccl")
        print(
            f"gocomm.bench.gpu: one GPU: GOCOMM_TRANSPORT={transport} (nccl unless set: every op through the sidecar)"
        )
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_host_worker if args.host else _worker, args=(world, _free_port(), sizes, ops, q), nprocs=world)
    rows = q.get()
    if args.host:
        _print_host_table(rows, world)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    mps = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "(default pipe dir)"
    with _perf.tee() as printed:
        _print_table(rows, world, mps)
    if args.perf:
        _perf.record(args.perf, f"bench.gpu: {world}x {torch.cuda.get_device_name(0)}", printed[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.png:
        _plot(rows, args.png)
    return 0


def _print_table(rows, world, mps) -> None:
    print(
        f"gocomm vs torch NCCL, {world}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, MPS pipe {mps}"
    )
    hdr = (
        f"{'op':18s} {'size':>6s} | {'nccl us':>9s} {'gocomm us':>9s} {'ratio':>6s} {'busbw':>7s} | "
        f"{'nccl loop':>9s} {'gocomm loop':>11s} {'ratio':>6s} {'busbw':>7s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        nb, gb = r["nccl"], r["gocomm"]

        def bw(t, r=r):
            return r["bytes"] / (t * 1e-6) / 1e9 * _busbw(r["op"], r["world"])

        print(
            f"{r['op']:18s} {_fmt(r['bytes']):>6s} | {nb['alone']:9.1f} {gb['alone']:9.1f} "
            f"{gb['alone'] / nb['alone']:6.2f} {bw(gb['alone']):7.1f} | {nb['loop']:9.1f} {gb['loop']:11.1f} "
            f"{gb['loop'] / nb['loop']:6.2f} {bw(gb['loop']):7.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
