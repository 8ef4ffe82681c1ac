"""Link ceiling: every GPU pushing to every other GPU at once, the rate MoE prefill figures are
read against (bytes sent to other GPUs only).

    python -m gocomm.bench.links [--mib 64] [--reps 10] [--iters 20] [--perf docs/perf.md]

One process drives all visible GPUs (peer access on, as torch turns it on for a copy between
two GPUs). Each GPU sends --mib MiB to each other GPU, all pairs at once, each pair on its own
streams, two ways:
- copy engines: a copy between the two GPUs' tensors (torch issues a peer memcpy);
- SM stores: the same bytes written by a kernel (torch's cross-device copy that converts
  float32 to bf16 runs as a kernel on the source GPU, which reads locally and stores to the
  peer: the bf16 bytes written are what count).
An iteration issues --reps such rounds back to back between two syncs and counts its time
per round: one round of 64 MiB timed alone also counts the launches' and syncs' latency, a
large part of a ~180 us copy (on 2 H200s one round per sync read 204 GB/s out per GPU, 10
rounds 338, one direction alone by CUDA events 367).
Printed per way: GB/s out of each GPU (the slowest GPU's, over the median iteration) and the
machine's total. Outputs are checked once per way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from . import _perf


def _run(pairs, move, iters: int, reps: int) -> list[float]:
    """Seconds per round of every pair's move at once, one figure per iteration of reps
    rounds (after two warm-ups)."""
    devices = sorted({d for i, j in pairs for d in (i, j)})
    out = []
    for it in range(iters + 2):
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for _ in range(reps):
            for p in pairs:
                move(p)
        for d in devices:
            torch.cuda.synchronize(d)
        if it >= 2:
            out.append((time.perf_counter() - t0) / reps)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="MiB each GPU sends to each other GPU")
    ap.add_argument("--reps", type=int, default=10, help="rounds back to back per timed iteration")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--perf", help="record the table in this file's section for this machine (docs/perf.md)")
    args = ap.parse_args(argv)
    n = torch.cuda.device_count()
    if n < 2:
        print(f"gocomm.bench.links: needs two GPUs or more, this machine has {n}", file=sys.stderr)
        return 2
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    nbytes = args.mib << 20
    streams = {p: (torch.cuda.Stream(p[0]), torch.cuda.Stream(p[1])) for p in pairs}
    # copy engines: bf16 to bf16; SM stores: float32 read locally, bf16 stored to the peer
    src16 = {p: torch.randn(nbytes // 2, device=p[0]).to(torch.bfloat16) for p in pairs}
    src32 = {p: src16[p].float() for p in pairs}
    dst = {p: torch.empty(nbytes // 2, dtype=torch.bfloat16, device=p[1]) for p in pairs}

    def mover(srcs):
        def move(p):
            s_src, s_dst = streams[p]
            with torch.cuda.stream(s_src), torch.cuda.stream(s_dst):
                dst[p].copy_(srcs[p], non_blocking=True)

        return move

    rows = []
    for way, srcs in (("copy engines", src16), ("SM stores", src32)):
        for p in pairs:
            dst[p].zero_()
        ts = _run(pairs, mover(srcs), args.iters, max(args.reps, 1))
        for p in pairs:
            if not torch.equal(dst[p].cpu(), src16[p].cpu()):
                print(f"gocomm.bench.links: {way} {p[0]}->{p[1]}: the copy differs from its source", file=sys.stderr)
                return 1
        t = statistics.median(ts)
        per_gpu = nbytes * (n - 1) / t / 1e9
        rows.append((way, per_gpu, per_gpu * n, min(ts), max(ts)))
    with _perf.tee() as printed:
        print(
            f"link ceiling, {n}x {torch.cuda.get_device_name(0)}: each GPU sends {args.mib} MiB to each of the "
            f"{n - 1} others at once, {args.reps} rounds back to back, median of {args.iters}"
        )
        print(f"{'way':14s} {'GB/s out per GPU':>17s} {'total GB/s':>11s} {'round ms (min-max)':>24s}")
        for way, per, tot, lo, hi in rows:
            print(f"{way:14s} {per:17.1f} {tot:11.1f} {lo * 1e3:11.2f}-{hi * 1e3:<11.2f}")
        best = max(rows, key=lambda r: r[1])
        print(f"ceiling: {best[1]:.1f} GB/s out per GPU ({best[0]})")
    if args.perf:
        _perf.record(args.perf, f"bench.links: {n}x {torch.cuda.get_device_name(0)}", printed[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
