"""CUDA graph replay latency: a sidecar op captured in a graph (a graph op,
docs/decisions/0020) against torch NCCL's captured kernel; one rank, one op per graph.

    python -m gocomm.bench.graph [--sizes 8K,1M] [--iters 200] [--json F]

One process on one GPU joins the gocomm default group (world size 1: all_reduce goes to the
sidecar's NCCL) and an NCCL group, captures one all_gather_into_tensor of bf16 in a graph on
each (out of place: at one rank NCCL's in-place all_reduce is no kernel at all, an empty
graph), and times, their iterations interleaved (a, b, a, b, ...):
- replay: one replay between CUDA events after a device sync (median);
- after idle: the same after 5 ms of host idle (the sidecar's watcher has backed off);
- loop: 20 replays back to back between two events, per replay (median of 10 rounds);
- eager, eager after idle: the op called eagerly, one between events (the hand-off without
  the graph), and after 5 ms of idle.
Set MPS up first (gocomm.launch, or nvidia-cuda-mps-control -d) to measure what the design
expects.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from .cpu import _fmt, _free_port, _size


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _one(fn, idle_s: float = 0.0) -> float:
    """fn between two events after a device sync (and idle_s of host sleep): in us."""
    torch.cuda.synchronize()
    if idle_s:
        time.sleep(idle_s)
    s, e = _events()
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000


def _loop(fn, n: int = 20) -> float:
    torch.cuda.synchronize()
    s, e = _events()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000 / n


def _capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(g):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return g


def run(sizes: list[int], iters: int) -> list[dict]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    import gocomm  # noqa: F401  (registers the backend)

    dist.init_process_group("gocomm", rank=0, world_size=1)
    nccl = dist.new_group(backend="nccl", device_id=dev)
    rows = []
    try:
        for nbytes in sizes:
            x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
            a, b = torch.empty_like(x), torch.empty_like(x)
            ops = {
                "gocomm": lambda a=a, x=x: dist.all_gather_into_tensor(a, x),
                "nccl": lambda b=b, x=x: dist.all_gather_into_tensor(b, x, group=nccl),
            }
            for fn in ops.values():
                fn()  # communicators and buffer registration before the capture
            graphs = {name: _capture(fn) for name, fn in ops.items()}
            res: dict[str, dict[str, list[float]]] = {
                m: {b: [] for b in ops} for m in ("replay", "after idle", "loop", "eager", "eager after idle")
            }
            for name in ops:
                for _ in range(5):
                    graphs[name].replay()
                    ops[name]()
            for i in range(iters):
                for name in ops:
                    res["replay"][name].append(_one(graphs[name].replay))
                    res["eager"][name].append(_one(ops[name]))
                    if i % 10 == 0:
                        res["after idle"][name].append(_one(graphs[name].replay, idle_s=0.005))
                        res["eager after idle"][name].append(_one(ops[name], idle_s=0.005))
                        res["loop"][name].append(_loop(graphs[name].replay))
            row = {"bytes": nbytes}
            for m, by in res.items():
                row[m] = {b: round(statistics.median(v), 2) for b, v in by.items()}
            rows.append(row)
            del graphs
    finally:
        dist.destroy_process_group()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8K,1M", help="message sizes in bytes (K, M, G suffixes)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default="", help="also write the rows here")
    a = ap.parse_args()
    rows = run([_size(s) for s in a.sizes.split(",")], a.iters)
    print(f"{'size':>6s} {'measure':>16s} | {'nccl us':>9s} {'gocomm us':>9s} {'ratio':>6s}")
    for r in rows:
        for m in ("replay", "after idle", "loop", "eager", "eager after idle"):
            g, n = r[m]["gocomm"], r[m]["nccl"]
            print(f"{_fmt(r['bytes']):>6s} {m:>16s} | {n:9.1f} {g:9.1f} {g / n:6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
