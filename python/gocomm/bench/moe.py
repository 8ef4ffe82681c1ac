"""MoE all-to-all benchmark: gocomm's three APIs against torch's NCCL backend and torch's
NVSHMEM all_to_all_vdev, in one run, on the same GPUs and the same routing.

    python -m gocomm.bench.moe [--tokens 128,4096] [--hidden 7168] [--topk 8] [--experts 256]
                               [--transport nccl|nvshmem] [--torch-under-mps] [--json F] [--png F]

One rank per visible GPU. Routing as in ../shared/reference/nccl_baseline.py: each token picks
top-k distinct experts uniformly at random, experts spread evenly over the ranks, each token
sent once per destination rank. Rows are bf16 of the hidden size. Each variant is timed alone
between CUDA events (median of 20 after 5 warm-ups), as the reference scripts time:

Two process sets run one after the other in one invocation:

- gocomm's ranks (default group gocomm, plus an NCCL subgroup), as MPS clients when the
  environment has MPS: "nccl a2a (splits known)" and "nccl counts+a2a" on the NCCL subgroup,
  then gocomm's variants:
  - gocomm a2a (splits known): dist.all_to_all_single on the gocomm group (the shim's
    kernel where the GPUs share NVLink, the host's splits in its launch arguments).
  - gocomm all_to_all_v: gocomm.all_to_all_v with splits on the GPU.
  - gocomm all_to_all_v graph: the same call captured in a CUDA graph and replayed (where the
    shim's kernel serves it), as decode steps run; no host time per call.
  - gocomm all_to_all_v rbuf (graph): into a gocomm.receive_buffer, which the peers write
    into directly (no copy out of the kernel's receive buffer); eager, then captured.
  - gocomm dispatch / combine: gocomm.moe.dispatch and gocomm.moe.combine (top-k routing,
    dedupe, grouping by expert; combine weights and sums), with the host sync that sizes
    dispatch's output; "padded": without it (max_tokens_per_rank bounds the output), and
    both captured in one CUDA graph ("dispatch+combine padded graph", as decode steps run),
    in one launch each way where the group's low-latency buffer takes the call (up to 1024
    tokens a rank within GOCOMM_MOE_LL_MB; set it to 0 for the three-launch kernels);
    "low-latency": the same asked for (moe.dispatch(low_latency=True)), eager and captured.
- torch's ranks, as torch users run them (NCCL default group, no MPS unless
  --torch-under-mps), the baselines of docs/perf.md:
  - torch nccl a2a (splits known): all_to_all_single with host splits.
  - torch nccl counts+a2a: the usual pattern: all_to_all of the counts, .tolist(), all_to_all_single.
  - torch symm_mem all_to_all_vdev: torch's NVSHMEM kernel, device-side splits. (It runs in
    its own processes because torch's NVSHMEM bootstrap crashed in symm_mem.empty in a
    process whose default group is gocomm.)
  - torch symm_mem vdev_2d dispatch / combine: torch's MoE-shaped NVSHMEM ops (one row per
    token and expert, grouped by expert; then back), the closest torch has to dispatch and
    combine (see _symm_2d).

Columns: time of one op alone, bytes this rank sends to other ranks over that time (GB/s),
the ratios to torch's NCCL with the count exchange and to torch's all_to_all_vdev; then the
time per op in a loop of back-to-back ops, its GB/s and the same two ratios.

--host times instead the host side of each call (gocomm's ranks only): the wall time in the
calling thread (time.perf_counter_ns), after warm-up, of gocomm.all_to_all_v (and of the same
op called as torch.ops, as compiled graphs call it), moe.dispatch(padded=True),
moe.dispatch(low_latency=True) and moe.combine of their handles (the low-latency ops as
torch.ops too), against torch's NCCL all_to_all_single of the same rows (splits known) in the
same processes, with torch's add_ on 16 elements (the floor of an op of one launch) and three
torch.empty calls (the allocations' share): the median of 200 calls of the slowest rank, in
blocks of 10 calls of one variant (gpu._host_paired); once with the stream idle before each
call, once back to back with the GPU behind ("(busy)"), as a loop calls them.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import _perf
from .cpu import _free_port
from .gpu import _alone, _join, _loop


def routing(rank: int, world: int, tokens: int, topk: int, experts: int, seed: int = 0) -> torch.Tensor:
    """topk_idx [tokens, topk] of one rank (the reference scripts' generator)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])


def _timeit(fn, sync) -> list[float]:
    """[alone, loop]: median us of one op timed alone after every rank synced, and us per op
    in a loop of back-to-back ops (host time hidden behind the GPU's, as between layers)."""
    return [_alone(fn, sync), _loop(fn, sync)]


def _graphed(fn, dev, sync) -> list[float] | str:
    """_timeit of fn captured in a CUDA graph (one call per replay), as decode loops run; only
    where all_to_all_v takes the shim's kernel (the sidecar's cannot be captured)."""
    from .._backend import state

    if state(dist.group.WORLD)._a2av_path(dev.index) is None:
        return "not capturable: all_to_all_v goes through the sidecar here"
    fn()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    return _timeit(graph.replay, sync)


def _splits(rank, world, tokens, args) -> tuple[list[int], list[int], torch.Tensor]:
    """Rows this rank sends to and receives from each rank (every rank rebuilds every
    routing), and this rank's topk_idx."""
    send_of, idx = [], None
    for r in range(world):
        ri = routing(r, world, tokens, args.topk, args.experts)
        idx = ri if r == rank else idx
        hit = torch.zeros(tokens, world, dtype=torch.bool)
        hit[torch.arange(tokens).unsqueeze(1), ri // (args.experts // world)] = True
        send_of.append(hit.sum(0).tolist())
    return send_of[rank], [send_of[r][rank] for r in range(world)], idx


def _worker(rank, world, port, args, q):
    faulthandler.enable()  # a crash in a rank names its Python stack
    dev, nccl, sync = _join(rank, world, port)
    measure = _host_measure if args.host else _measure  # --host: the host time per call
    rows = [measure(rank, world, dev, nccl, sync, args, tokens) for tokens in args.tokens]
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _inputs(rank, world, dev, args, tokens) -> tuple:
    """This rank's routing and tensors at one token count, as gocomm's variants take them:
    (send, recv, x, inp, out, splits on the GPU, topk_idx on the GPU, topk_weights)."""
    h = args.hidden
    send, recv, idx = _splits(rank, world, tokens, args)
    x = torch.randn(tokens, h, device=dev).to(torch.bfloat16)
    inp = torch.randn(sum(send), h, device=dev).to(torch.bfloat16)
    out = torch.empty(sum(recv), h, dtype=torch.bfloat16, device=dev)
    splits_dev = torch.tensor(send, dtype=torch.int64, device=dev)
    return send, recv, x, inp, out, splits_dev, idx.to(dev), torch.rand(tokens, args.topk, device=dev)


def _measure(rank, world, dev, nccl, sync, args, tokens) -> dict:
    """Every variant at one token count (every rank calls it; rank 0's numbers are kept)."""
    import gocomm

    h = args.hidden
    send, recv, x, inp, out, splits_dev, didx, weights = _inputs(rank, world, dev, args, tokens)
    moved = (sum(send) - send[rank]) * h * 2
    res = {
        "tokens": tokens,
        "bytes": moved,
        "world": world,
        "transport": gocomm._backend.state(dist.group.WORLD)._routes.transport,
    }

    def nccl_known():
        dist.all_to_all_single(out, inp, recv, send, group=nccl)

    def nccl_counts():
        _counts_a2a(out, inp, send, dev, nccl)

    def run(name, f):
        if args.verbose:
            print(f"gocomm.bench.moe: rank {rank} {tokens} tokens: {name}", file=sys.stderr, flush=True)
        res[name] = f()

    run("nccl a2a (splits known)", lambda: _timeit(nccl_known, sync))
    run("nccl counts+a2a", lambda: _timeit(nccl_counts, sync))
    run("gocomm a2a (splits known)", lambda: _timeit(lambda: dist.all_to_all_single(out, inp, recv, send), sync))
    run("gocomm all_to_all_v", lambda: _timeit(lambda: gocomm.all_to_all_v(inp, splits_dev, out=out), sync))
    run("gocomm all_to_all_v graph", lambda: _graphed(lambda: gocomm.all_to_all_v(inp, splits_dev, out=out), dev, sync))
    rbuf = gocomm.receive_buffer(sum(recv), (h,), torch.bfloat16)
    run("gocomm all_to_all_v rbuf", lambda: _timeit(lambda: gocomm.all_to_all_v(inp, splits_dev, out=rbuf), sync))
    run(
        "gocomm all_to_all_v rbuf graph",
        lambda: _graphed(lambda: gocomm.all_to_all_v(inp, splits_dev, out=rbuf), dev, sync),
    )
    run("gocomm dispatch", lambda: _timeit(lambda: gocomm.moe.dispatch(x, didx, weights, args.experts), sync))
    recv_x, _, handle = gocomm.moe.dispatch(x, didx, weights, args.experts)
    run("gocomm combine", lambda: _timeit(lambda: gocomm.moe.combine(recv_x, handle), sync))

    def padded():
        return gocomm.moe.dispatch(x, didx, weights, args.experts, max_tokens_per_rank=tokens, padded=True)

    run("gocomm dispatch padded", lambda: _timeit(padded, sync))
    precv, _, phandle = padded()
    run("gocomm combine padded", lambda: _timeit(lambda: gocomm.moe.combine(precv, phandle), sync))

    def both():  # a decode step's two exchanges, with the experts' work left out
        recv_x, _, handle = padded()
        gocomm.moe.combine(recv_x, handle)

    run("gocomm dispatch+combine padded graph", lambda: _graphed(both, dev, sync))

    def low_latency():
        return gocomm.moe.dispatch(x, didx, weights, args.experts, max_tokens_per_rank=tokens, low_latency=True)

    if tokens > 1024:  # more than its kernels take: moe.dispatch would run the padded path
        res.update((v, "n/a (over 1024 tokens)") for v in VARIANTS if "low-latency" in v)
        return res
    run("gocomm dispatch low-latency", lambda: _timeit(low_latency, sync))
    lrecv, _, lhandle = low_latency()
    run("gocomm combine low-latency", lambda: _timeit(lambda: gocomm.moe.combine(lrecv, lhandle), sync))

    def both_ll():
        recv_x, _, handle = low_latency()
        gocomm.moe.combine(recv_x, handle)

    run("gocomm dispatch+combine low-latency graph", lambda: _graphed(both_ll, dev, sync))
    return res


def _host_measure(rank, world, dev, nccl, sync, args, tokens) -> dict:
    """--host: each variant's host time per call at one token count, the slowest rank's."""
    import gocomm

    from .gpu import _host_paired

    send, recv, x, inp, out, splits_dev, didx, weights = _inputs(rank, world, dev, args, tokens)

    def padded():
        return gocomm.moe.dispatch(x, didx, weights, args.experts, max_tokens_per_rank=tokens, padded=True)

    def low_latency():
        return gocomm.moe.dispatch(x, didx, weights, args.experts, max_tokens_per_rank=tokens, low_latency=True)

    precv, _, handle = padded()
    lrecv, _, lhandle = low_latency()
    a2av_op, name = torch.ops.gocomm.all_to_all_v_out.default, dist.group.WORLD.group_name
    small = torch.zeros(16, device=dev)
    ll_ops = (torch.ops.gocomm.moe_dispatch_ll.default, torch.ops.gocomm.moe_combine_ll.default)
    fns = {
        "torch nccl a2a (splits known)": lambda: dist.all_to_all_single(out, inp, recv, send, group=nccl),
        "gocomm all_to_all_v": lambda: gocomm.all_to_all_v(inp, splits_dev, out=out),
        # the same op called as torch.ops, as torch.compile's graphs call it: the wrapper's cost
        "gocomm all_to_all_v torch.ops": lambda: a2av_op(inp, splits_dev, out, name),
        "gocomm dispatch padded": padded,
        "gocomm combine padded": lambda: gocomm.moe.combine(precv, handle),
        "gocomm dispatch low-latency": low_latency,
        "gocomm combine low-latency": lambda: gocomm.moe.combine(lrecv, lhandle),
        # the low-latency ops called as torch.ops, without moe.py's wrappers (below)
        # the platform's floor for an op of one launch from Python
        "torch add_": lambda: small.add_(1),
        "torch.empty x3": lambda: (
            torch.empty(tokens, device=dev),
            torch.empty(8, device=dev),
            torch.empty(9, device=dev),
        ),
    }
    try:  # the low-latency ops exist where the group's exchange runs in this process
        ll_ops[0](x, didx, weights, args.experts, world, tokens, name)
        fns["gocomm dispatch low-latency torch.ops"] = lambda: ll_ops[0](
            x, didx, weights, args.experts, world, tokens, name
        )
        fns["gocomm combine low-latency torch.ops"] = lambda: ll_ops[1](
            lrecv, lhandle.state, tokens, tokens, args.topk, args.experts, name
        )
    except NotImplementedError as e:
        if rank == 0:
            print(f"gocomm.bench.moe: no low-latency torch.ops rows: {e}", flush=True)
    sync()
    host = _host_paired(fns)
    sync()
    host.update({f"{k} (busy)": v for k, v in _host_paired(fns, idle=False).items()})
    worst = torch.tensor(list(host.values()), dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=nccl)
    return {"tokens": tokens, "world": world, "host": dict(zip(host, worst.tolist(), strict=True))}


def _torch_worker(rank, world, port, args, q):
    """The torch baselines as torch users run them: NCCL as the default group (torch's
    NVSHMEM bootstrap crashed in symm_mem.empty in a process whose default group is gocomm,
    seen on H200), symm_mem's all_to_all_vdev on it, and NCCL all_to_all_single again."""
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    gsync = torch.zeros(1, device=dev)

    def sync():
        dist.all_reduce(gsync)

    rows = [_torch_measure(rank, world, dev, sync, args, tokens) for tokens in args.tokens]
    if rank == 0:
        q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _torch_measure(rank, world, dev, sync, args, tokens) -> dict:
    send, recv, idx = _splits(rank, world, tokens, args)
    h = args.hidden
    inp = torch.randn(sum(send), h, device=dev).to(torch.bfloat16)
    out = torch.empty(sum(recv), h, dtype=torch.bfloat16, device=dev)
    return {
        "tokens": tokens,
        "nccl a2a (splits known)": _timeit(lambda: dist.all_to_all_single(out, inp, recv, send), sync),
        "nccl counts+a2a": _timeit(lambda: _counts_a2a(out, inp, send, dev, None), sync),
        "symm_mem all_to_all_vdev": _symm(world, dev, send, h, tokens, sync),
        **_symm_2d(world, dev, idx, h, tokens, sync, args),
    }


SYMM_2D_SPLITS = 16  # torch 2.11's all_to_all_vdev_2d takes at most 16 experts per rank


def _symm_2d(world, dev, idx, h, tokens, sync, args) -> dict:
    """torch's MoE-shaped NVSHMEM ops on the same routing: all_to_all_vdev_2d (dispatch,
    rows grouped by expert) and all_to_all_vdev_2d_offset (combine, rows back in dispatch
    order). One row per (token, expert) pair, no per-rank dedupe, so they move more bytes than
    the other variants (the GB/s column is the deduplicated bytes over their time). torch 2.11
    takes at most 16 experts per rank: consecutive experts share a split (4 per split for 256
    experts on 4 ranks), which moves the same rows. Errors come back as text."""
    names = ("symm_mem vdev_2d dispatch", "symm_mem vdev_2d combine")
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        gname = dist.group.WORLD.group_name
        per = args.experts // world
        group = max(1, -(-per // SYMM_2D_SPLITS))  # experts per split
        if per % group:
            return dict.fromkeys(names, f"error: {per} experts per rank do not split into groups of {group}")
        ne = per // group
        idx = idx.to(dev)
        rows = idx.numel()

        def sym(shape, dtype=torch.bfloat16):
            return symm_mem.empty(shape, dtype=dtype, device=dev)

        # out is not bounds-checked by torch: room for every row of every rank, plus alignment
        inp, d_out, c_out = sym((rows, h)), sym((world * rows + ne, h)), sym((rows, h))
        in_splits, d_so, c_so = (
            sym(world * ne, torch.int64),
            sym((2, world * ne), torch.int64),
            sym((2, world * ne), torch.int64),
        )
        for t in (inp, d_out, c_out, in_splits, d_so, c_so):
            symm_mem.rendezvous(t, group=gname)
        flat = idx.flatten()
        order = flat.argsort(stable=True)  # by destination rank, then expert
        x = torch.randn(tokens, h, device=dev).to(torch.bfloat16)
        inp.copy_(x[order // args.topk])
        in_splits.copy_(torch.bincount(flat // group, minlength=world * ne))

        def dispatch():
            torch.ops.symm_mem.all_to_all_vdev_2d(inp, d_out, in_splits, d_so, gname, major_align=1)

        def combine():
            torch.ops.symm_mem.all_to_all_vdev_2d_offset(d_out, c_out, d_so, c_so, gname)

        dispatch()
        combine()
        torch.cuda.synchronize()
        if not torch.equal(c_out, inp):
            return dict.fromkeys(names, "error: combine did not bring dispatch's rows back")
        return {names[0]: _timeit(dispatch, sync), names[1]: _timeit(combine, sync)}
    except Exception as e:  # noqa: BLE001
        return dict.fromkeys(names, f"error: {e!r}"[:200])


def _counts_a2a(out, inp, send, dev, group):
    """The usual pattern: all_to_all the counts, .tolist() (a host sync), all_to_all_single."""
    sd = torch.tensor(send, dtype=torch.int64, device=dev)
    rc = torch.empty_like(sd)
    dist.all_to_all_single(rc, sd, group=group)
    r = rc.tolist()
    dist.all_to_all_single(out[: sum(r)], inp, r, send, group=group)


def _symm(world, dev, send, h, tokens, sync) -> float | str:
    """torch's NVSHMEM all_to_all_vdev on the same splits (its error text if it cannot run)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        gname = dist.group.WORLD.group_name
        cap = tokens * world * h
        inp = symm_mem.empty(cap, dtype=torch.bfloat16, device=dev).normal_()
        out = symm_mem.empty(cap, dtype=torch.bfloat16, device=dev)
        in_splits = symm_mem.empty(world, dtype=torch.int64, device=dev)
        oso = symm_mem.empty((2, world), dtype=torch.int64, device=dev)
        for t in (inp, out, in_splits, oso):
            symm_mem.rendezvous(t, group=gname)
        in_splits.copy_(torch.tensor(send, dtype=torch.int64) * h)
        return _timeit(lambda: torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, oso, gname), sync)
    except Exception as e:  # noqa: BLE001
        return f"error: {e!r}"[:200]


VARIANTS = (
    "torch nccl a2a (splits known)",
    "torch nccl counts+a2a",
    "torch symm_mem all_to_all_vdev",
    "torch symm_mem vdev_2d dispatch",
    "torch symm_mem vdev_2d combine",
    "nccl a2a (splits known)",
    "nccl counts+a2a",
    "gocomm a2a (splits known)",
    "gocomm all_to_all_v",
    "gocomm all_to_all_v graph",
    "gocomm all_to_all_v rbuf",
    "gocomm all_to_all_v rbuf graph",
    "gocomm dispatch",
    "gocomm combine",
    "gocomm dispatch padded",
    "gocomm combine padded",
    "gocomm dispatch+combine padded graph",
    "gocomm dispatch low-latency",
    "gocomm combine low-latency",
    "gocomm dispatch+combine low-latency graph",
)


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6.5 * len(rows), 5), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=True):
        names = [v for v in VARIANTS if isinstance(r.get(v), list)]
        y = list(range(len(names)))
        for k, shade in enumerate((0.45, 1.0)):
            ax.barh(
                [i + 0.4 * k - 0.2 for i in y],
                [r[v][k] for v in names],
                height=0.4,
                color=[
                    (0.16, 0.47, 0.33, shade) if v.startswith("gocomm") else (0.45, 0.45, 0.45, shade) for v in names
                ],
            )
        ax.set_yticks(y, names)
        ax.set_xlabel("us per op, median")
        ax.set_title(f"{r['tokens']} tokens per rank, {r['world']} GPUs\n{r['bytes'] / 1e6:.1f} MB sent by rank 0")
        ax.invert_yaxis()
    fig.suptitle("pale: one op alone; dark: ops back to back; green: gocomm", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(rows) -> None:
    for r in rows:
        base, vdev = r["torch nccl counts+a2a"], r["torch symm_mem all_to_all_vdev"]
        print(f"\n{r['tokens']} tokens per rank; {r['bytes'] / 1e6:.2f} MB sent to other ranks by rank 0")
        print(
            f"{'variant':32s} {'us alone':>9s} {'GB/s':>7s} {'/nccl+counts':>12s} {'/a2a_vdev':>10s}"
            f" {'us loop':>9s} {'GB/s':>7s} {'/nccl+counts':>12s} {'/a2a_vdev':>10s}"
        )
        for v in VARIANTS:
            t = r[v]
            if not isinstance(t, list):
                print(f"{v:32s} {t}")
                continue
            cols = f"{v:32s} {t[0]:9.1f} {r['bytes'] / t[0] / 1e3:7.1f}"
            for i in range(2):
                rb = f"{t[i] / base[i]:12.2f}" if isinstance(base, list) else f"{'-':>12s}"
                rv = f"{t[i] / vdev[i]:10.2f}" if isinstance(vdev, list) else f"{'-':>10s}"
                cols += f" {t[1]:9.1f} {r['bytes'] / t[1] / 1e3:7.1f}" if i == 1 else ""
                cols += f" {rb} {rv}"
            print(cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="128,4096")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument(
        "--transport",
        choices=("auto", "nvshmem", "nccl"),
        default=None,
        help="GOCOMM_TRANSPORT for the ranks' sidecars (default: the environment's)",
    )
    ap.add_argument(
        "--torch-under-mps",
        action="store_true",
        help="run the torch-only baselines as MPS clients too (default: without MPS, as torch users run them)",
    )
    ap.add_argument("--verbose", action="store_true", help="each rank says which variant it starts")
    ap.add_argument("--host", action="store_true", help="time the host side of each call (see above)")
    ap.add_argument("--json")
    ap.add_argument("--png")
    ap.add_argument("--perf", help="record the table in this file's section for this machine (docs/perf.md)")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    world = torch.cuda.device_count()
    if world < 1:
        print("gocomm.bench.moe: no GPU", file=sys.stderr)
        return 2
    q = mp.get_context("spawn").SimpleQueue()
    env = dict(os.environ)  # put back once both process sets are done
    if args.transport:
        os.environ["GOCOMM_TRANSPORT"] = args.transport  # the ranks and their sidecars inherit it
    mp.spawn(_worker, args=(world, _free_port(), args, q), nprocs=world)
    rows = q.get()
    if args.host:  # gocomm's ranks timed the host side, with NCCL's in the same processes
        print(f"MoE host time per call (us, slowest rank), {world}x {torch.cuda.get_device_name(0)}")
        for r in rows:
            print(f"{r['tokens']} tokens: " + ", ".join(f"{k} {v:.1f}" for k, v in r["host"].items()))
        return 0
    # The torch baselines in their own processes, right after, on the same GPUs and routing.
    no_mps = None
    if not args.torch_under_mps and "CUDA_MPS_PIPE_DIRECTORY" in os.environ:
        # as torch users run them: a pipe directory with no daemon makes CUDA skip MPS
        no_mps = os.environ["CUDA_MPS_PIPE_DIRECTORY"] = tempfile.mkdtemp(prefix="gocomm-no-mps-")
    # torch's 2-D ops need room for every row of every rank in symmetric memory
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(8 << 30))
    try:
        mp.spawn(_torch_worker, args=(world, _free_port(), args, q), nprocs=world)
    finally:
        os.environ.clear()
        os.environ.update(env)
        if no_mps:
            shutil.rmtree(no_mps, ignore_errors=True)
    for r, t in zip(rows, q.get(), strict=True):
        for k, v in t.items():
            if k != "tokens":
                r["torch " + k] = v
    with _perf.tee() as printed:
        print(
            f"MoE all-to-all, {world}x {torch.cuda.get_device_name(0)}, hidden {args.hidden} bf16, "
            f"gocomm transport {rows[0].get('transport', '?')}, "
            f"top-{args.topk} of {args.experts} experts, torch {torch.__version__}"
        )
        _table(rows)
    if args.perf:
        key = f"bench.moe: {world}x {torch.cuda.get_device_name(0)}, transport {rows[0].get('transport', '?')}"
        _perf.record(args.perf, key, printed[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.png:
        _plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
