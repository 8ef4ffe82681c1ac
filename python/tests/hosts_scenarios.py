"""What each rank of a simulated-hosts cluster (_netns.py) runs after init_process_group; each
scenario returns what goes into the rank's report. Data are integers in floating point, so
every reduction is exact and the reference is computed here, on each rank, for every rank."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

SMALL, LARGE = 257, 300_000  # elements: one direct exchange; 1.2 MB of float32 (pipelined, by reference on one host)


def data(r: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Rank r's input: small integers, different per rank and position."""
    return ((torch.arange(n, dtype=torch.int64) * (r + 3) + salt + 7 * r) % 101).to(dtype)


def suite(pg, ranks: list[int], me: int) -> list[str]:
    """Every collective, point to point and the barrier on pg (whose members are ranks, this
    process is group rank me), against references; the mismatches, described."""
    n = len(ranks)
    bad: list[str] = []

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape or not torch.equal(got, want):
            bad.append(f"{what}: got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}")

    for count in (SMALL, LARGE):
        for dtype in (torch.float32, torch.int64):
            xs = [data(r, count, dtype) for r in range(n)]
            t = xs[me].clone()
            dist.all_reduce(t, group=pg)
            check(f"all_reduce sum {dtype} x{count}", t, sum(xs))
            t = xs[me].clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
            check(f"all_reduce max {dtype} x{count}", t, torch.stack(xs).amax(0))
        xs = [data(r, count) for r in range(n)]
        root = n - 1
        t = xs[me].clone()
        dist.broadcast(t, group_src=root, group=pg)
        check(f"broadcast x{count}", t, xs[root])
        t = xs[me].clone()
        dist.reduce(t, group_dst=0, group=pg)
        if me == 0:
            check(f"reduce x{count}", t, sum(xs))
        outs = [torch.empty(count) for _ in range(n)]
        dist.all_gather(outs, xs[me], group=pg)
        for r in range(n):
            check(f"all_gather[{r}] x{count}", outs[r], xs[r])
        out = torch.empty(n * count)
        dist.all_gather_into_tensor(out, xs[me], group=pg)
        check(f"all_gather_into_tensor x{count}", out, torch.cat(xs))
        big = [data(r, n * count, salt=5) for r in range(n)]
        out = torch.empty(count)
        dist.reduce_scatter_tensor(out, big[me], group=pg)
        check(f"reduce_scatter_tensor x{count}", out, sum(big)[me * count : (me + 1) * count])
        # uneven splits: rank r sends (r + p) % 3 + 1 parts of count // 8 to rank p
        part = max(count // 8, 1)
        splits = [[((r + p) % 3 + 1) * part for p in range(n)] for r in range(n)]
        ins = [data(r, sum(splits[r]), salt=9) for r in range(n)]
        want = torch.cat([ins[r].split(splits[r])[me] for r in range(n)])
        out = torch.empty(sum(splits[r][me] for r in range(n)))
        dist.all_to_all_single(out, ins[me], [splits[r][me] for r in range(n)], splits[me], group=pg)
        check(f"all_to_all_single uneven x{count}", out, want)
        outs = [torch.empty(count) for _ in range(n)]
        dist.all_to_all(outs, [data(me, count, salt=p) for p in range(n)], group=pg)
        for r in range(n):
            check(f"all_to_all[{r}] x{count}", outs[r], data(r, count, salt=me))
        outs = [torch.empty(count) for _ in range(n)] if me == 0 else None
        dist.gather(xs[me], outs, group_dst=0, group=pg)
        if me == 0:
            for r in range(n):
                check(f"gather[{r}] x{count}", outs[r], xs[r])
        t = torch.empty(count)
        dist.scatter(t, [data(r, count, salt=3) for r in range(n)] if me == root else None, group_src=root, group=pg)
        check(f"scatter x{count}", t, data(me, count, salt=3))
        if n > 1:
            nxt, prv = (me + 1) % n, (me - 1) % n
            got = torch.empty(count)
            if me % 2 == 0:
                dist.send(xs[me], group_dst=nxt, group=pg)
                dist.recv(got, group_src=prv, group=pg)
            else:
                dist.recv(got, group_src=prv, group=pg)
                dist.send(xs[me], group_dst=nxt, group=pg)
            check(f"send/recv x{count}", got, xs[prv])
            got = torch.empty(count)
            ops = [
                dist.P2POp(dist.isend, xs[me], group=pg, group_peer=nxt),
                dist.P2POp(dist.irecv, got, group=pg, group_peer=prv),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            check(f"batch_isend_irecv x{count}", got, xs[prv])
    dist.barrier(group=pg)
    return bad


def _gocomm(pg):
    """The gocomm state of the group behind pg."""
    from gocomm import _backend

    return _backend.state(pg)


def core(
    workdir: str, rank: int, size: int, per_host: int, fault: bool = False, fault_timeout: float = 3.0, **_
) -> dict:
    """The CPU suite on the world and on subgroups within and across hosts; the route each
    group took; then, if fault, a group with a short timeout looping 4 MiB all_reduces until
    the test drops host 1's link, and when this rank raised."""
    import gocomm

    hosts = size // per_host
    if per_host > 1:  # within each host, then across (one rank of each host)
        subs = [list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
        subs += [[h * per_host + i for h in range(hosts)] for i in range(per_host)]
    else:  # a second group over both hosts, ranks in the other order
        subs = [list(reversed(range(size)))]
    groups = [(list(range(size)), dist.group.WORLD)]
    for ranks in subs:
        pg = dist.new_group(ranks, backend="gocomm")
        if rank in ranks:
            groups.append((ranks, pg))
    out: dict = {"errors": [], "groups": []}
    info = gocomm.info()
    out["peer_address"] = info["peer_address"]
    for ranks, pg in groups:
        t0 = time.monotonic()
        # the group's ranks in group-rank order, as torch ordered them
        me = dist.get_group_rank(pg, rank)
        ranks = [dist.get_global_rank(pg, i) for i in range(len(ranks))]
        errs = suite(pg, ranks, me)
        g = _gocomm(pg)
        routes = gocomm.info()["groups"][g.group_name]
        out["errors"] += [f"group {ranks}: {e}" for e in errs]
        out["groups"].append(
            {
                "ranks": ranks,
                "seconds": time.monotonic() - t0,
                "hosts": routes["hosts"],
                "transport": routes["transport"],
                "routes": routes["routes"],
                "stats": g.stats(),
            }
        )
    if fault:
        out["fault"] = _fault(workdir, rank, fault_timeout)
    return out


def _fault(workdir: str, rank: int, timeout: float) -> dict:
    fg = dist.new_group(backend="gocomm", timeout=datetime.timedelta(seconds=timeout))
    x = torch.ones(1 << 20)  # 4 MiB: a pipelined ring on the host engine
    dist.all_reduce(x, group=fg)
    open(os.path.join(workdir, f"armed{rank}"), "w").close()
    start, ops = time.time(), 0
    while True:
        t0 = time.time()
        try:
            dist.all_reduce(x, group=fg)
            ops += 1
        except Exception as e:  # noqa: BLE001
            return {"raised_at": time.time(), "op_started": t0, "ops": ops, "error": str(e)[:3000]}
        if time.time() - start > 120:
            return {"raised_at": None, "ops": ops, "error": "nothing raised in 120 s"}


def first_op(workdir: str, rank: int, size: int, per_host: int, **_) -> dict:
    """One all_reduce: with a peer nobody can reach, every rank raises; when, and what."""
    import gocomm

    t0 = time.time()
    try:
        t = torch.ones(1000)
        dist.all_reduce(t)
        return {"raised": False, "peer_address": gocomm.info()["peer_address"]}
    except Exception as e:  # noqa: BLE001
        return {
            "raised": True,
            "seconds": time.time() - t0,
            "op_error": str(e)[:3000],
            "peer_address": gocomm.info()["peer_address"],
        }


def cuda(workdir: str, rank: int, size: int, per_host: int, **_) -> dict:
    """CUDA tensors across hosts: dense collectives and gocomm.all_to_all_v on the world group
    (which spans hosts: sidecar NCCL over the veth, NCCL_HOSTID set per host by the test), and
    in a 2x2 cluster also on each host's subgroup (one-host routes), against references."""
    import gocomm

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    groups = [(list(range(size)), dist.group.WORLD)]
    if per_host > 1:
        for h in range(size // per_host):
            ranks = list(range(h * per_host, (h + 1) * per_host))
            pg = dist.new_group(ranks, backend="gocomm")
            if rank in ranks:
                groups.append((ranks, pg))
    out: dict = {"errors": [], "groups": []}
    for ranks, pg in groups:
        n, me = len(ranks), dist.get_group_rank(pg, rank)
        bad = []
        for dtype in (torch.float32, torch.bfloat16):
            xs = [(data(r, 1 << 18) % 32).to(dtype) for r in range(n)]  # sums exact in bf16
            t = xs[me].to(dev)
            dist.all_reduce(t, group=pg)
            if not torch.equal(t.cpu(), sum(x.float() for x in xs).to(dtype)):
                bad.append(f"all_reduce {dtype}")
        xs = [data(r, 4096) for r in range(n)]
        o = torch.empty(n * 4096, device=dev)
        dist.all_gather_into_tensor(o, xs[me].to(dev), group=pg)
        if not torch.equal(o.cpu(), torch.cat(xs)):
            bad.append("all_gather_into_tensor")
        part = 512
        splits = [[((r + p) % 3 + 1) * part for p in range(n)] for r in range(n)]
        ins = [data(r, sum(splits[r]), salt=9) for r in range(n)]
        want = torch.cat([ins[r].split(splits[r])[me] for r in range(n)])
        o = torch.empty(len(want), device=dev)
        dist.all_to_all_single(o, ins[me].to(dev), [splits[r][me] for r in range(n)], splits[me], group=pg)
        if not torch.equal(o.cpu(), want):
            bad.append("all_to_all_single")
        rows = ins[me].view(-1, part).to(dev)
        got, got_splits = gocomm.all_to_all_v(rows, torch.tensor([s // part for s in splits[me]], device=dev), group=pg)
        k = int(got_splits.sum())
        if not torch.equal(got[:k].reshape(-1).cpu(), want):
            bad.append("gocomm.all_to_all_v")
        torch.cuda.synchronize()
        g = _gocomm(pg)
        routes = gocomm.info()["groups"][g.group_name]
        out["errors"] += [f"group {ranks}: {e}" for e in bad]
        out["groups"].append({"ranks": ranks, "transport": routes["transport"], "routes": routes["routes"]})
    return out
