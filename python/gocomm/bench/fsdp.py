"""FSDP2 training step: gocomm against torch's NCCL backend in the same job.

    python -m gocomm.bench.fsdp [--layers 16 --dim 2048 --ff 8192 --steps 20] [--perf docs/perf.md]
    python -m gocomm.bench.fsdp --device cpu --world 2 --layers 2 --dim 64 --ff 128 --vocab 256

One rank per visible GPU (--device cpu: --world ranks, gloo as the baseline). Each rank
joins the gocomm default group and a baseline group (NCCL, or gloo on CPU) over the same
ranks and builds the same decoder-only transformer twice from one seed (the defaults make
about 1B parameters), each sharded with fully_shard over its own backend's mesh. Every step
feeds both models the same batch and takes an AdamW step, gocomm's model and the baseline's
alternately (so drift on the machine falls on both), bf16 parameters with float32 reductions
on GPU. Printed: the median step time of each (the slowest rank's), their ratio, and the
largest difference between the two losses over the steps (the backends reduce in the same
dtype; a difference past the tolerance fails the run: exit 1).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from . import _perf


class Block(nn.Module):
    def __init__(self, dim: int, ff: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.down = nn.Linear(dim, ff, bias=False), nn.Linear(ff, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, ff: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, ff, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _sharded(args, mesh, dev):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(1234)  # both models start from the same weights
    m = Model(args.vocab, args.dim, args.ff, args.layers, args.heads).to(dev)
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dev.type == "cuda" else None
    )
    kw = {"mesh": mesh} | ({"mp_policy": mp_policy} if mp_policy else {})
    for b in m.blocks:
        fully_shard(b, **kw)
    fully_shard(m, **kw)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4)


def _worker(rank, world, port, args, q):
    from torch.distributed.device_mesh import DeviceMesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    import gocomm  # noqa: F401  (registers the backend)

    dist.init_process_group("gocomm", rank=rank, world_size=world)
    base = dist.new_group(backend="nccl" if cuda else "gloo", **({"device_id": dev} if cuda else {}))
    meshes = {
        "gocomm": DeviceMesh.from_group(dist.group.WORLD, dev.type),
        "base": DeviceMesh.from_group(base, dev.type),
    }
    models = {name: _sharded(args, mesh, dev) for name, mesh in meshes.items()}
    # the sharded parameters are DTensors: numel() is the whole parameter's
    nparams = sum(p.numel() for p in models["gocomm"][0].parameters())
    times = {name: [] for name in models}
    losses = {name: [] for name in models}

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)
        dist.barrier(group=base)

    for step in range(args.steps + args.warmup):
        g = torch.Generator().manual_seed(step * world + rank)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(dev)
        for name, (m, opt) in models.items():
            sync()
            t0 = time.perf_counter()
            logits = m(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(dev)
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                # the slowest rank's time, and the loss averaged over the ranks (on dev: the
                # baseline is NCCL on GPUs, which takes CUDA tensors only)
                tt = torch.tensor([dt, loss.item()], dtype=torch.float64, device=dev)
                dist.all_reduce(tt[:1], op=dist.ReduceOp.MAX, group=base)
                dist.all_reduce(tt[1:], group=base)
                times[name].append(tt[0].item())
                losses[name].append(tt[1].item() / world)
    if rank == 0:
        q.put({"params": nparams, "times": times, "losses": losses})
    dist.barrier(group=base)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: one per GPU; 2 on CPU)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=1e-2, help="largest loss difference accepted")
    ap.add_argument("--json")
    ap.add_argument("--perf", help="record the table in this file's section for this machine (docs/perf.md)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        world = args.world or torch.cuda.device_count()
        if world < 1 or world > torch.cuda.device_count():
            print(f"gocomm.bench.fsdp: {world} ranks need as many GPUs", file=sys.stderr)
            return 2
        machine = f"{world}x {torch.cuda.get_device_name(0)}"
    else:
        world = args.world or 2
        machine = f"{world} CPU ranks"
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, _free_port(), args, q), nprocs=world)
    res = q.get()
    base = "NCCL" if args.device == "cuda" else "gloo"
    tg, tb = statistics.median(res["times"]["gocomm"]), statistics.median(res["times"]["base"])
    diff = max(abs(a - b) for a, b in zip(res["losses"]["gocomm"], res["losses"]["base"], strict=True))
    with _perf.tee() as printed:
        print(
            f"FSDP2 step, {machine}, {res['params'] / 1e6:.1f}M parameters ({args.layers} layers, dim {args.dim}), "
            f"batch {args.batch} x {args.seq}, torch {torch.__version__}"
        )
        print(
            f"{'backend':8s} {'step ms (median)':>17s} {'min':>8s} {'max':>8s} {'first loss':>11s} {'last loss':>10s}"
        )
        for name, label in (("gocomm", "gocomm"), ("base", base)):
            t, lo = res["times"][name], res["losses"][name]
            print(
                f"{label:8s} {statistics.median(t) * 1e3:17.1f} {min(t) * 1e3:8.1f} {max(t) * 1e3:8.1f} {lo[0]:11.4f} {lo[-1]:10.4f}"
            )
        print(f"gocomm / {base}: {tg / tb:.3f}; largest loss difference over {args.steps} steps: {diff:.3g}")
    _perf.save(args.perf, f"bench.fsdp: {machine}", printed[0], args.json, res)
    if diff > args.tolerance:
        print(f"gocomm.bench.fsdp: the losses differ by {diff:.3g}, more than {args.tolerance}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
