"""CPU benchmark: gocomm against gloo, in one run, on the same ranks and the same tensors.

    python -m gocomm.bench.cpu --world 2,3,4 --sizes 4K,...,64M [--json out.json]

For each world size it spawns that many ranks on this machine; each rank joins a gocomm group
and a gloo group and times all_reduce (float32, SUM) and all_to_all_single (equal splits) on
both, alternating them trial by trial. A trial starts after a barrier; its time is the
slowest rank's. The table gives the median over trials, algorithm bandwidth (bytes / time)
and bus bandwidth in the nccl-tests convention, and gocomm's time over gloo's.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import _perf


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def _fmt(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def _free_port() -> int:
    """A free TCP port for the benchmark's store, below Linux's ephemeral range (32768 up):
    a port bind(0) hands out is in that range, where any process's outgoing connection
    (the previous run's sidecars, gRPC) may take it as its local port before the store binds
    it again (bench.gpu failed once with EADDRINUSE right after bench.moe)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trials(nbytes: int) -> int:
    return 5 if nbytes >= 16 << 20 else 10 if nbytes >= 1 << 20 else 30


def _worker(rank: int, world: int, port: int, sizes: list[int], q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import gocomm  # noqa: F401  (registers the backend)

    dist.init_process_group("gocomm", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    ops = {
        "all_reduce": lambda t, o, g: dist.all_reduce(t, group=g),
        "all_to_all_single": lambda t, o, g: dist.all_to_all_single(o, t, group=g),
    }
    rows = []
    for op, fn in ops.items():
        for nbytes in sizes:
            n = nbytes // 4 // world * world
            t = torch.randn(n)
            o = torch.empty_like(t)
            times = {"gocomm": [], "gloo": []}
            for trial in range(_trials(nbytes) + 1):
                for name, g in (("gocomm", None), ("gloo", gloo)):
                    dist.barrier(group=gloo)
                    t0 = time.perf_counter()
                    fn(t, o, g)
                    if trial:  # the first trial warms up
                        times[name].append(time.perf_counter() - t0)
            rows.append((op, nbytes, times))
    everyone = [None] * world
    dist.all_gather_object(everyone, rows, group=gloo)
    if rank == 0:
        out = []
        for i, (op, nbytes, _) in enumerate(rows):
            res = {"op": op, "world": world, "bytes": nbytes}
            for name in ("gocomm", "gloo"):
                per_trial = zip(*(everyone[r][i][2][name] for r in range(world)), strict=True)
                res[name] = statistics.median(max(ts) for ts in per_trial)
            out.append(res)
        q.put(out)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def _busbw(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="2,3,4", help="comma-separated world sizes")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="comma-separated message sizes")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--perf", help="record the table in this file's section for this machine (docs/perf.md)")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.world.split(",")]
    sizes = [_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    results = []
    for world in worlds:
        q = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(world, _free_port(), sizes, q), nprocs=world, start_method="spawn")
        results.extend(q.get())
    with _perf.tee() as printed:
        print(f"gocomm vs gloo, CPU tensors (float32), {os.cpu_count()} cores, torch {torch.__version__}")
        print("time: median over trials of the slowest rank; busbw as in nccl-tests")
        hdr = f"{'op':18s} {'ranks':>5s} {'size':>6s} {'gocomm us':>11s} {'gloo us':>11s} {'gocomm/gloo':>11s} {'busbw GB/s':>11s}"
        print(hdr)
        print("-" * len(hdr))
        for r in results:
            g, b = r["gocomm"] * 1e6, r["gloo"] * 1e6
            bw = r["bytes"] / r["gocomm"] / 1e9 * _busbw(r["op"], r["world"])
            print(f"{r['op']:18s} {r['world']:5d} {_fmt(r['bytes']):>6s} {g:11.1f} {b:11.1f} {g / b:11.2f} {bw:11.2f}")
    _perf.save(args.perf, f"bench.cpu: {os.cpu_count()} cores", printed[0], args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
