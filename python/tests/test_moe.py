"""gocomm.all_to_all_v and gocomm.moe.dispatch/combine against references every rank builds
from the shared seed (and gloo's all_to_all_single): uneven, empty and one-rank routings,
skewed expert choices, no tokens on a rank, fp8 dispatch, overflow of the caller's buffer.
The check functions take a device so that test_gpu.py runs them on CUDA tensors too."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from ranklib import Checker, gen, seeded_int

import gocomm
from gocomm._backend import state as _state

ROUTINGS = {
    "uneven": lambda seed, src, n: [seeded_int(seed, f"sp{src}-{d}", 0, 5) for d in range(n)],
    "empty": lambda seed, src, n: [0] * n,
    "all to rank 0": lambda seed, src, n: [7 if d == 0 else 0 for d in range(n)],
    "skewed to the last rank": lambda seed, src, n: [1 if d < n - 1 else 11 for d in range(n)],
}


def _dev(rk, device):
    """The rank's device of that type (ranks share GPUs where there are fewer)."""
    return torch.device(device, rk.rank % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")


def _elsewhere(rk, device):
    """On CUDA, make a device other than the rank's current (as torch's NCCL backend allows,
    ops run on their tensors' device); this once broke the shim's stream operations."""
    if device == "cuda" and torch.cuda.device_count() > 1:
        torch.cuda.set_device((rk.rank + 1) % torch.cuda.device_count())


def check_all_to_all_v(rk, seed, device="cpu"):
    dev = _dev(rk, device)
    _elsewhere(rk, device)
    n, me = rk.size, rk.rank
    # On the NVSHMEM path (CUDA, where the sidecars chose it) the output is the whole buffer
    # (the rows are its first sum(out_splits)) and an overflow shows in the counts: nothing
    # on that path waits for the GPU, so nothing can raise.
    nv = device == "cuda" and _state(rk.world.pg)._routes.transport == "nvshmem"
    ck = Checker(f"all_to_all_v on {device}" + (" (NVSHMEM)" if nv else ""), seed, me)
    for label, splits_of in ROUTINGS.items():
        send = splits_of(seed, me, n)
        recv = [splits_of(seed, src, n)[me] for src in range(n)]

        def short(r, splits_of=splits_of):
            """Whether rank r receives more rows than its default NVSHMEM output holds."""
            return sum(splits_of(seed, s, n)[r] for s in range(n)) > n * sum(splits_of(seed, r, n))

        for dtype in (torch.bfloat16, torch.float32, torch.int64, torch.uint8):
            key = f"a2av{label}{dtype}"
            case = f"{label} {str(dtype).removeprefix('torch.')}"
            with ck.case(case):
                x = gen(seed, key, me, (sum(send), 3), dtype).to(dev)
                splits_dtype = torch.int32 if dtype == torch.uint8 else torch.int64
                splits = torch.tensor(send, dtype=splits_dtype, device=dev)
                got, got_splits = gocomm.all_to_all_v(x, splits)
                if nv and any(short(r) for r in range(n)):
                    # the default output (input's rows times the group size) cannot hold what
                    # some rank receives under uneven routing: reported in its counts; then
                    # every rank (it is a collective) repeats the exchange into an out that fits
                    if short(me):
                        over = int(got_splits.sum()) == sum(recv) and got.shape[0] == n * sum(send)
                        ck.expect(case + " overflow of the default output reported", over, str(got_splits.tolist()))
                    got, got_splits = gocomm.all_to_all_v(
                        x, splits, out=torch.empty(sum(recv), 3, dtype=dtype, device=dev)
                    )
                want = torch.cat(
                    [
                        gen(seed, key, src, (sum(splits_of(seed, src, n)), 3), dtype).narrow(
                            0, sum(splits_of(seed, src, n)[:me]), splits_of(seed, src, n)[me]
                        )
                        for src in range(n)
                    ]
                )
                ck.same(case, (got[: sum(recv)] if nv else got).cpu(), want)
                ck.same(case + " splits", got_splits.cpu(), torch.tensor(recv, dtype=splits_dtype))
                ck.expect(case + " splits device", got_splits.device == dev, str(got_splits.device))
                if device == "cpu":
                    ref = torch.empty(sum(recv), 3, dtype=dtype)
                    dist.all_to_all_single(ref, x, recv, send, group=rk.world.gloo)
                    ck.same(case + " vs gloo", got, ref)
        with ck.case(f"{label} into a larger out"):
            x = gen(seed, f"out{label}", me, (sum(send), 2), torch.float32).to(dev)
            out = torch.full((sum(recv) + 3, 2), -7.0, device=dev)
            got, _ = gocomm.all_to_all_v(x, torch.tensor(send, device=dev), out=out)
            rows = out.shape[0] if nv else sum(recv)
            view = got.shape[0] == rows and (got.numel() == 0 or got.data_ptr() == out.data_ptr())
            ck.expect(f"{label}: a view of out", view, f"{tuple(got.shape)}")
            ck.expect(f"{label}: out past the rows untouched", bool(torch.all(out[sum(recv) :] == -7.0)))
    # overflow: rank 0 receives 7 rows from everyone into room for fewer; the others go on
    send = ROUTINGS["all to rank 0"](seed, me, n)
    x = torch.ones(sum(send), 2, device=dev)
    room = 7 * n - 1
    out = torch.full((room, 2), -1.0, device=dev)
    with ck.case("overflow"):
        try:
            _, got_splits = gocomm.all_to_all_v(x, torch.tensor(send, device=dev), out=out if me == 0 else None)
            if nv and me == 0:
                ck.expect("overflow shows in the counts", int(got_splits.sum()) == 7 * n, str(got_splits.tolist()))
            else:
                ck.expect("overflow raised on rank 0", me != 0, "no OverflowError")
        except OverflowError as e:
            ck.expect("overflow only on rank 0", me == 0, str(e))
            ck.expect("overflow message", "receives" in str(e) and str(room) in str(e), str(e))
        ck.expect("nothing written past or into out", bool(torch.all(out == -1.0)))
    with ck.case("group usable after an overflow"):
        t = torch.ones(4, device=dev)
        dist.all_reduce(t)
        ck.expect("health", bool(torch.all(t == n)), str(t.tolist()))
    for label, splits, words in (
        ("wrong length", torch.zeros(n + 1, dtype=torch.int64), ["in_splits", str(n)]),
        ("float splits", torch.zeros(n), ["int32/int64"]),
        ("sum exceeds rows", torch.full((n,), 2, dtype=torch.int64), ["add up to at most"]),
    ):
        if nv and label == "sum exceeds rows":
            continue  # checked on the GPU there (this rank would send nothing), not raised
        with ck.case(f"bad input: {label}"):
            try:
                gocomm.all_to_all_v(torch.zeros(2 * n - 1, 2, device=dev), splits.to(dev))
                ck.fail(label, "no error")
            except ValueError as e:
                ck.expect(label, all(w in str(e) for w in words), str(e))
    with ck.case("input rows past sum(in_splits) are not sent"):
        splits_of = ROUTINGS["uneven"]
        send, recv = splits_of(seed, me, n), [splits_of(seed, src, n)[me] for src in range(n)]
        xs = [gen(seed, "a2avpast", src, (sum(splits_of(seed, src, n)), 3), torch.float32) for src in range(n)]
        x = torch.cat([xs[me], torch.full((3, 3), -5.0)]).to(dev)
        out = torch.empty(5 * n + 1, 3, device=dev)  # room for the most that can arrive (5 a rank)
        got, got_splits = gocomm.all_to_all_v(x, torch.tensor(send, device=dev), out=out)
        mine = [xs[src].narrow(0, sum(splits_of(seed, src, n)[:me]), recv[src]) for src in range(n)]
        ck.same("the received rows", got[: sum(recv)].cpu(), torch.cat(mine))
        ck.same("out_splits", got_splits.cpu(), torch.tensor(recv))
    if device == "cuda":
        torch.cuda.synchronize()
    if nv:
        return ck.done()  # no count exchange on the NVSHMEM path
    with ck.case("a failed count exchange raises"):
        from gocomm import _client

        _client.C._skip_count_exchange(True)  # every rank: a failed exchange writes nothing
        try:
            gocomm.all_to_all_v(torch.ones(n, 2, device=dev), torch.ones(n, dtype=torch.int64, device=dev))
            ck.fail("a failed count exchange raises", "no error")
        except dist.DistBackendError as e:
            ck.expect("names the count exchange", "count exchange" in str(e), str(e))
        finally:
            _client.C._skip_count_exchange(False)
    return ck.done()


def _routing(seed, src, tokens, experts, k, n, label):
    """topk_idx [tokens, k] of rank src (distinct experts per token; -1 sprinkled in; or a
    token's last slot repeating its first)."""
    g = torch.Generator().manual_seed(seed * 7919 + src * 31 + len(label))
    if label == "all to rank 0":
        pool = experts // n  # only rank 0's experts
        idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(tokens)]) if tokens else None
    else:
        idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) if tokens else None
    if idx is None:
        return torch.empty(0, k, dtype=torch.int64)
    if label == "with -1":
        drop = torch.rand(tokens, k, generator=g) < 0.3
        idx = torch.where(drop, -1, idx)
    if label == "duplicate ids":
        idx[:, -1] = idx[:, 0]
    return idx


def check_moe(rk, seed, device="cpu", per=4):
    dev = _dev(rk, device)
    _elsewhere(rk, device)
    n, me = rk.size, rk.rank
    ck = Checker(f"moe dispatch/combine on {device}", seed, me)
    # where the exchange runs in the shim's kernel, a padded dispatch's errors are found on
    # the GPU and raised by a combine; elsewhere dispatch raises them (the same on every rank)
    inprocess = device == "cuda" and isinstance(
        gocomm.sparse._device_path(dist.group.WORLD, torch.empty(0, device=dev)), gocomm._client.C.A2Path
    )
    hidden = 256
    experts = per * n
    k = min(4, experts)
    for label in ("uniform", "all to rank 0", "with -1", "no tokens on rank 0"):
        tokens_of = [0 if (label == "no tokens on rank 0" and src == 0) else 5 + 3 * src for src in range(n)]
        xs = [gen(seed, f"moe{label}", src, (tokens_of[src], hidden), torch.bfloat16) for src in range(n)]
        idxs = [_routing(seed, src, tokens_of[src], experts, k, n, label) for src in range(n)]
        ws = [gen(seed, f"w{label}", src, (tokens_of[src], k), torch.float32).abs() for src in range(n)]

        def _to_me(row):
            return bool(((row >= me * per) & (row < (me + 1) * per)).any())

        with ck.case(f"{label} dispatch"):
            recv, per_expert, handle = gocomm.moe.dispatch(xs[me].to(dev), idxs[me].to(dev), ws[me].to(dev), experts)
            # expected: for each local expert, every (source rank, token) that chose it, in order
            want_rows, counts = [], []
            for e in range(per):
                ge = me * per + e
                c = 0
                for src in range(n):
                    for t in range(tokens_of[src]):
                        if bool((idxs[src][t] == ge).any()):
                            want_rows.append(xs[src][t])
                            c += 1
                counts.append(c)
            want = torch.stack(want_rows) if want_rows else torch.empty(0, hidden, dtype=torch.bfloat16)
            ck.same(f"{label} grouped tokens", recv.cpu(), want)
            ck.same(f"{label} tokens per expert", per_expert.cpu(), torch.tensor(counts, dtype=torch.int64))
            # a bound every rank respects gives the same result; one too small for what a
            # rank is sent raises there, and only there
            args = (xs[me].to(dev), idxs[me].to(dev), ws[me].to(dev), experts)
            bounded, _, _ = gocomm.moe.dispatch(*args, max_tokens_per_rank=max(tokens_of))
            ck.same(f"{label} grouped tokens, bounded", bounded.cpu(), want)
            sent_to_me = len({(src, t) for src in range(n) for t in range(tokens_of[src]) if _to_me(idxs[src][t])})
            try:
                gocomm.moe.dispatch(*args, max_tokens_per_rank=tokens_of[me])
                ck.expect(f"{label} too small a bound", sent_to_me <= tokens_of[me] * n, "no OverflowError")
            except OverflowError:
                ck.expect(f"{label} too small a bound", sent_to_me > tokens_of[me] * n, "OverflowError")
        with ck.case(f"{label} combine"):
            eid = torch.repeat_interleave(torch.arange(per, device=dev), per_expert) + me * per
            y = (recv.float() * (eid + 1).unsqueeze(1)).to(torch.bfloat16)  # expert e scales by e + 1
            got = gocomm.moe.combine(y, handle)
            x64, idx, w = xs[me].double(), idxs[me], ws[me].double()
            ref = torch.zeros(tokens_of[me], hidden, dtype=torch.float64)
            mag = torch.zeros_like(ref)
            for t in range(tokens_of[me]):
                for j in range(k):
                    e = int(idx[t, j])
                    if e >= 0:
                        yv = (xs[me][t].float() * (e + 1)).to(torch.bfloat16).double()
                        ref[t] += w[t, j] * yv
                        mag[t] += (w[t, j] * yv).abs()
            del x64
            tol = 4 * 2.0**-8 * mag + 1e-6  # a bf16 rounding per rank holding experts, one at the end
            ck.expect(f"{label} combine dtype", got.dtype == torch.bfloat16, str(got.dtype))
            d = (got.cpu().double() - ref).abs()
            bad = d > tol
            ck.expect(
                f"{label} combine vs float64",
                not bool(bad.any()),
                f"{int(bad.sum())} of {d.numel()} off, max {float(d.max()) if d.numel() else 0:.3g}",
            )
        with ck.case(f"{label} padded"):
            # no host sync where the exchange runs in this process: the most rows, grouped
            # ones first, counts on the GPU; combine of y padded alike gives the same sums
            bound = max(tokens_of)
            most = bound * n * k
            precv, ptpe, ph = gocomm.moe.dispatch(*args, max_tokens_per_rank=bound, padded=True)
            ck.expect(f"{label} padded shape", tuple(precv.shape) == (most, hidden), str(tuple(precv.shape)))
            ck.same(f"{label} padded tokens per expert", ptpe.cpu(), torch.tensor(counts, dtype=torch.int64))
            ck.same(f"{label} padded grouped tokens", precv[: sum(counts)].cpu(), want)
            yp = torch.full((most, hidden), float("nan"), dtype=torch.bfloat16, device=dev)
            yp[: sum(counts)] = y  # rows past the total are never read
            ck.same(f"{label} padded combine", gocomm.moe.combine(yp, ph).cpu(), got.cpu())
            try:
                gocomm.moe.combine(torch.zeros(most + 1, hidden, dtype=torch.bfloat16, device=dev), ph)
                ck.fail(f"{label} padded combine of the wrong rows", "no error")
            except ValueError as e:
                ck.expect(f"{label} padded combine of the wrong rows", str(most) in str(e), str(e))
            # low-latency: the same result (in one launch each way where the exchange runs in
            # this process; elsewhere it is this padded path)
            lrecv, ltpe, lh = gocomm.moe.dispatch(*args, max_tokens_per_rank=bound, low_latency=True)
            ck.expect(f"{label} low-latency shape", tuple(lrecv.shape) == (most, hidden), str(tuple(lrecv.shape)))
            ck.same(f"{label} low-latency tokens per expert", ltpe.cpu(), ptpe.cpu())
            ck.same(f"{label} low-latency grouped tokens", lrecv[: sum(counts)].cpu(), want)
            ck.same(f"{label} low-latency combine", gocomm.moe.combine(yp, lh).cpu(), got.cpu())
            if inprocess:  # its own kernels ran, not the padded path it falls back to
                ck.expect(f"{label} low-latency kernels", lh.inproc[4] == -1, str(lh.inproc))
        for ll in (False, True):
            with ck.case(f"{label} padded{' low-latency' if ll else ''}, too small a bound"):
                # found on the GPU where nothing syncs: raised at the end of a combine (the
                # next once the GPU ran the dispatch), never on a rank that was not sent too much
                raised = 0
                for bound in (tokens_of[me], max(tokens_of)):
                    try:
                        r, _, hd = gocomm.moe.dispatch(*args, max_tokens_per_rank=bound, padded=True, low_latency=ll)
                        if inprocess:
                            gocomm.moe.combine(r, hd)
                    except OverflowError:
                        raised += 1
                    if device == "cuda":
                        torch.cuda.synchronize()
                if inprocess:
                    try:
                        gocomm.moe.check(dev)  # by here at the latest
                    except OverflowError:
                        raised += 1
                ck.expect(
                    f"{label} padded{' low-latency' if ll else ''} overflow raised",
                    raised == (sent_to_me > tokens_of[me] * n),
                    f"{raised}",
                )
    with ck.case("fp8 dispatch"):
        x = gen(seed, "fp8", me, (6, hidden), torch.bfloat16)
        idx = _routing(seed, me, 6, experts, k, n, "uniform")
        w = torch.ones(6, k)
        (vals, scales), per_expert, _ = gocomm.moe.dispatch(x.to(dev), idx.to(dev), w.to(dev), experts, fp8=True)
        plain, _, _ = gocomm.moe.dispatch(x.to(dev), idx.to(dev), w.to(dev), experts)
        ck.expect("fp8 values dtype", vals.dtype == torch.float8_e4m3fn, str(vals.dtype))
        ck.expect("fp8 scales shape", tuple(scales.shape) == (plain.shape[0], hidden // 128), str(tuple(scales.shape)))
        deq = vals.float().cpu() * scales.cpu().repeat_interleave(128, dim=1)
        ref = plain.float().cpu()
        err = (deq - ref).abs()
        tol = 0.07 * ref.abs() + scales.cpu().repeat_interleave(128, dim=1) * 2.0**-6
        ck.expect(
            "fp8 dequantized within e4m3 rounding", bool(torch.all(err <= tol)), f"max err {float(err.max()):.3g}"
        )
    with ck.case("check with nothing found"):
        gocomm.moe.check(dev if device == "cuda" else None)  # raises nothing: every error was raised above
    with ck.case("bad input"):
        for call, exc in (
            (
                lambda: gocomm.moe.dispatch(
                    torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), n + 1 if n > 1 else 0
                ),
                ValueError,
            ),
            (lambda: gocomm.moe.dispatch(torch.zeros(3, 8), torch.zeros(3, 2), torch.ones(3, 2), experts), TypeError),
            (
                lambda: gocomm.moe.dispatch(
                    torch.zeros(3, 8), torch.full((3, 2), experts, dtype=torch.long), torch.ones(3, 2), experts
                ),
                ValueError,
            ),
            (
                lambda: gocomm.moe.dispatch(
                    torch.zeros(3, 100), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), experts, fp8=True
                ),
                ValueError,
            ),
        ):
            try:
                call()
                ck.fail("bad input", "no error")
            except exc:
                pass
    if device == "cuda":
        # routed on the GPU: an id out of range is found there and raised after the exchange,
        # which every rank finished (rank 0 alone passes one here)
        with ck.case("id out of range on the GPU"):
            ids = torch.zeros(3, k, dtype=torch.long, device=dev)
            if me == 0:
                ids[1, 0] = experts + 5
            try:
                gocomm.moe.dispatch(
                    torch.ones(3, hidden, dtype=torch.bfloat16, device=dev), ids, torch.ones(3, k, device=dev), experts
                )
                ck.expect("raised on rank 0", me != 0, "no ValueError")
            except ValueError as e:
                ck.expect("only rank 0 raises", me == 0 and str(experts + 5) in str(e), str(e))
        with ck.case("id out of range, padded"):
            raised = 0
            for bad in (True, False):
                ids = torch.zeros(3, k, dtype=torch.long, device=dev)
                if me == 0 and bad:
                    ids[1, 0] = experts + 5
                try:
                    r, _, hd = gocomm.moe.dispatch(
                        torch.ones(3, hidden, dtype=torch.bfloat16, device=dev),
                        ids,
                        torch.ones(3, k, device=dev),
                        experts,
                        max_tokens_per_rank=3,
                        padded=True,
                    )
                    if inprocess:
                        gocomm.moe.combine(r, hd)
                except ValueError as e:
                    raised += 1
                    ck.expect("names topk_idx", "topk_idx" in str(e), str(e))
                torch.cuda.synchronize()
            if inprocess:
                try:
                    gocomm.moe.check(dev, experts)
                except ValueError as e:
                    raised += 1
                    ck.expect("names topk_idx", "topk_idx" in str(e), str(e))
            ck.expect("raised once on rank 0 only", raised == (me == 0), f"{raised}")
        with ck.case("padded needs a bound"):
            try:
                gocomm.moe.dispatch(
                    torch.ones(3, hidden, dtype=torch.bfloat16, device=dev),
                    torch.zeros(3, k, dtype=torch.long, device=dev),
                    torch.ones(3, k, device=dev),
                    experts,
                    padded=True,
                )
                ck.fail("padded needs a bound", "no error")
            except ValueError as e:
                ck.expect("padded needs a bound", "max_tokens_per_rank" in str(e), str(e))
        with ck.case("group usable after it"):  # every rank gets here, whatever the case above did
            t = torch.ones(4, device=dev)
            dist.all_reduce(t)
            ck.expect("group usable after it", bool(torch.all(t == n)), str(t.tolist()))
        torch.cuda.synchronize()
    return ck.done()


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_all_to_all_v(worlds, seed, size):
    worlds.get(size).run(check_all_to_all_v, seed=seed)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_moe_dispatch_combine(worlds, seed, size):
    worlds.get(size).run(check_moe, seed=seed)


def _fitting(sends: list[list[int]]) -> list[list[int]]:
    """sends (sends[src][dst] rows), with rows a rank sends itself added until every rank
    receives at most its input's rows times the group size: the default output's room on the
    GPU paths (the differentiable call takes no out)."""
    n = len(sends)
    while True:
        over = [d for d in range(n) if sum(s[d] for s in sends) > n * sum(sends[d])]
        if not over:
            return sends
        for d in over:
            sends[d][d] += 1


def check_all_to_all_v_backward(rk, seed, device="cpu"):
    """all_to_all_v's backward sends each output row's gradient back to the rank that sent the
    row, into the place it had in that rank's input: against the same routing built from the
    shared seed on every rank, exactly (the gradient is only moved). Also its second backward
    (create_graph), and a gradient that reaches only part of the output."""
    n, me, dev = rk.size, rk.rank, _dev(rk, device)
    ck = Checker("all_to_all_v backward", seed, me)
    for label, splits_of in ROUTINGS.items():
        with ck.case(label):
            sends = _fitting([splits_of(seed, src, n) for src in range(n)])
            xs = [gen(seed, f"a2ab{label}", src, (sum(sends[src]), 3), torch.float32) for src in range(n)]
            # the output rank d sees, and the gradient its loss gives each of its rows
            outs = [sum((sends[src][d] for src in range(n)), 0) for d in range(n)]
            gs = [gen(seed, f"a2abg{label}", d, (outs[d], 3), torch.float32) for d in range(n)]
            # expected: row i of xs[me] went to rank d at its place among me's rows for d,
            # after the rows of the ranks before me
            want = torch.empty_like(xs[me])
            at = 0
            for d in range(n):
                off = sum(sends[src][d] for src in range(me))
                want[at : at + sends[me][d]] = gs[d][off : off + sends[me][d]]
                at += sends[me][d]
            x = xs[me].clone().to(dev).requires_grad_()
            out, out_splits = gocomm.all_to_all_v(x, torch.tensor(sends[me], device=dev))
            ck.same(
                "the received rows",
                out[: outs[me]].detach().cpu(),
                torch.cat([xs[src][sum(sends[src][:me]) : sum(sends[src][: me + 1])] for src in range(n)])
                if outs[me]
                else torch.empty(0, 3),
            )
            (out[: outs[me]] * gs[me].to(dev)).sum().backward()
            ck.same("the gradient", x.grad.cpu(), want)
    with ck.case("second backward"):
        sends = _fitting([ROUTINGS["uneven"](seed, src, n) for src in range(n)])
        x = gen(seed, "a2ab2", me, (sum(sends[me]), 4), torch.float32).to(dev).requires_grad_()
        out, _ = gocomm.all_to_all_v(x, torch.tensor(sends[me], device=dev))
        (gx,) = torch.autograd.grad((out * out).sum(), x, create_graph=True)
        ck.same("d(sum out^2)/dx = 2x", gx.detach().cpu(), 2 * x.detach().cpu())
        (ggx,) = torch.autograd.grad(gx.sum(), x)
        ck.same("its derivative", ggx.cpu(), torch.full_like(x, 2.0).cpu())
    return ck.done()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_all_to_all_v_backward(worlds, seed, size):
    worlds.get(size).run(check_all_to_all_v_backward, seed=seed)


def check_moe_backward(rk, seed, device="cpu", dtype=torch.float32, sync_free=False):
    """A MoE layer (dispatch, a matmul per local expert, combine) trains: the gradients of x,
    topk_weights and the experts' matrices equal a float64 autograd of the same layer over
    every rank's tokens (built on every rank from the seed), with uneven, -1 and all-to-one
    routings and a rank without tokens, padded and not, and low-latency (padded's path where
    the kernels do not run). Gradients of tokens no rank's expert took are zero. sync_free (the
    in-process path): a padded layer's backward never waits for the GPU (torch's sync debug
    mode raises at any sync)."""
    n, me, dev = rk.size, rk.rank, _dev(rk, device)
    ck = Checker(f"moe backward on {device} {str(dtype).removeprefix('torch.')}", seed, me)
    per, k, hidden = 3, 2, 8
    experts = per * n
    mats = gen(seed, "mbW", 0, (experts, hidden, hidden), torch.float64) / hidden**0.5
    tol = 2e-4 if dtype == torch.float32 else 6e-2
    for label in ("uniform", "with -1", "all to rank 0", "no tokens on rank 0", "duplicate ids"):
        tokens_of = [0 if (label == "no tokens on rank 0" and src == 0) else 4 + 2 * src for src in range(n)]
        xs = [gen(seed, f"mbx{label}", src, (tokens_of[src], hidden), torch.float64) for src in range(n)]
        idxs = [_routing(seed, src, tokens_of[src], experts, k, n, label) for src in range(n)]
        ws = [gen(seed, f"mbw{label}", src, (tokens_of[src], k), torch.float64).abs() for src in range(n)]
        gs = [gen(seed, f"mbg{label}", src, (tokens_of[src], hidden), torch.float64) for src in range(n)]
        # the reference: every rank's tokens, float64
        rx = [x.clone().requires_grad_() for x in xs]
        rw = [w.clone().requires_grad_() for w in ws]
        rm = mats.clone().requires_grad_()
        loss = 0
        for src in range(n):
            for t in range(tokens_of[src]):
                for j in range(k):
                    e = int(idxs[src][t, j])
                    if e >= 0:
                        loss = loss + rw[src][t, j] * (rx[src][t] @ rm[e] * gs[src][t]).sum()
        if torch.is_tensor(loss):
            loss.backward()
        want = {
            "x": rx[me].grad if rx[me].grad is not None else torch.zeros_like(xs[me]),
            "topk_weights": rw[me].grad if rw[me].grad is not None else torch.zeros_like(ws[me]),
            "experts' matrices": rm.grad[me * per : (me + 1) * per]
            if rm.grad is not None
            else torch.zeros(per, hidden, hidden, dtype=torch.float64),
        }
        bound = max(tokens_of)
        for kind, kw in (
            ("", {}),
            (" padded", {"max_tokens_per_rank": bound, "padded": True}),
            (" low-latency", {"max_tokens_per_rank": bound, "low_latency": True}),
        ):
            with ck.case(label + kind):
                x = xs[me].to(dev, dtype).requires_grad_()
                w = ws[me].to(dev, torch.float32).requires_grad_()
                m = mats[me * per : (me + 1) * per].to(dev, dtype).requires_grad_()
                recv, tpe, handle = gocomm.moe.dispatch(x, idxs[me].to(dev), w, experts, **kw)
                counts, rows, at = tpe.tolist(), [], 0
                for e in range(per):
                    rows.append(recv[at : at + counts[e]] @ m[e])
                    at += counts[e]
                rows.append(torch.zeros(recv.shape[0] - at, hidden, dtype=dtype, device=dev))  # padding
                out = gocomm.moe.combine(torch.cat(rows), handle)
                loss = (out * gs[me].to(dev, dtype)).sum()
                strict = sync_free and kind != ""
                if strict:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    loss.backward()
                finally:
                    if strict:
                        torch.cuda.set_sync_debug_mode("default")
                for name, got in (("x", x.grad), ("topk_weights", w.grad), ("experts' matrices", m.grad)):
                    got = torch.zeros_like(want[name]) if got is None else got.double().cpu()
                    err = float((got - want[name]).abs().max()) if got.numel() else 0.0
                    scale = float(want[name].abs().max()) if got.numel() else 0.0
                    ck.expect(f"{name} gradient", err <= tol * max(scale, 1.0), f"max error {err:.3g} of {scale:.3g}")
    return ck.done()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_moe_backward(worlds, seed, size, dtype):
    worlds.get(size).run(check_moe_backward, seed=seed, dtype=dtype)


def check_no_silent_backward(rk, seed, device="cpu"):
    """Where dispatch or combine has no gradient to give (fp8 dispatch; a combine not told the
    routing, as torch.ops callers may call it), a backward that reaches it raises, naming the
    op, instead of letting the gradient stop there (torch's default for an op without an
    Autograd kernel is a warning); such a combine has no edge to topk_weights at all. Calls that
    need no gradient are untouched. all_to_all_v with out= refuses at the call."""
    n, me, dev = rk.size, rk.rank, _dev(rk, device)
    ck = Checker("no silent backward", seed, me)
    experts = 2 * n
    x = gen(seed, "nsb x", me, (5, 128), torch.float32).to(dev).requires_grad_()
    idx = _routing(seed, me, 5, experts, 2, n, "uniform").to(dev)
    w = gen(seed, "nsb w", me, (5, 2), torch.float32).abs().to(dev).requires_grad_()
    with ck.case("fp8 dispatch"):
        (vals, _), _, _ = gocomm.moe.dispatch(x, idx, w, experts, fp8=True)
        try:
            vals.float().sum().backward()
            ck.fail("fp8", f"backward returned; the gradient is {x.grad}")
        except RuntimeError as e:
            ck.expect("names the op", "gocomm::moe_dispatch" in str(e) and "not implemented" in str(e), str(e))
    for (label, leaf), kw in itertools.product((("x", x), ("topk_weights", w)), ({}, {"low_latency": True})):
        # low-latency (padded elsewhere); its bound and rows are the largest of test_gpu's
        # autograd world, where this check sizes the group's low-latency buffer
        kw = {"max_tokens_per_rank": 16, **kw} if kw else kw
        with ck.case(f"combine without the routing {kw}, {label} needs a gradient"):
            xi, wi = (x, w.detach()) if leaf is x else (x.detach(), w)
            recv, _, handle = gocomm.moe.dispatch(xi, idx, wi, experts, **kw)
            handle.routing = (None, None, 0)  # as a torch.ops caller that passes none
            out = gocomm.moe.combine(recv * 2, handle)
            if leaf is w:  # topk_weights' edge is one of those arguments: without it, no graph
                ck.expect("no graph to topk_weights", out.grad_fn is None, str(out.grad_fn))
                continue
            try:
                out.sum().backward()
                ck.fail(label, f"backward returned; the gradient is {leaf.grad}")
            except RuntimeError as e:
                ck.expect("names the op", "gocomm::moe_combine" in str(e) and "not implemented" in str(e), str(e))
            with torch.no_grad():
                recv, _, handle = gocomm.moe.dispatch(xi, idx, wi, experts, **kw)
                ck.expect("no_grad: no graph", gocomm.moe.combine(recv, handle).grad_fn is None)
    with ck.case("topk_idx changed in place after the forward: the backward raises"):
        mine = idx.clone()
        recv, _, handle = gocomm.moe.dispatch(x, mine, w, experts)
        out = gocomm.moe.combine(recv * 2, handle)
        mine[:, 0] = mine[:, 1]  # another routing than the forward's
        try:
            out.sum().backward()
            ck.fail("in-place topk_idx", "backward returned")
        except RuntimeError as e:
            ck.expect("names topk_idx", "topk_idx was modified by an inplace operation" in str(e), str(e))
    with ck.case("topk_idx an inference tensor (no version to check): the backward runs"):
        with torch.inference_mode():
            frozen = idx.clone()
        xi = x.detach().clone().requires_grad_()
        recv, _, handle = gocomm.moe.dispatch(xi, frozen, w.detach(), experts)
        gocomm.moe.combine(recv * 2, handle).sum().backward()
        ck.expect("x has a gradient", xi.grad is not None and bool(torch.isfinite(xi.grad).all()), str(xi.grad))
    splits = torch.tensor([5 if d == me else 0 for d in range(n)], device=dev)
    with ck.case("all_to_all_v with out= refuses a gradient at the call, as torch's out= ops"):
        try:
            gocomm.all_to_all_v(x, splits, out=torch.empty(5 * n, 128, device=dev))
            ck.fail("out=", "called")
        except RuntimeError as e:
            ck.expect("says why", "no backward" in str(e), str(e))
        got, _ = gocomm.all_to_all_v(x.detach(), splits, out=torch.empty(5 * n, 128, device=dev))
        ck.same("detached, the rows", got[:5].cpu(), x.detach().cpu())
    return ck.done()


@pytest.mark.parametrize("size", [1, 2])
def test_no_silent_backward(worlds, seed, size):
    worlds.get(size).run(check_no_silent_backward, seed=seed)


def check_sparse_choice(rk):
    """The sidecar says which sparse transport it chose for this client and why (info and
    the group agree); a client without CUDA NCCL gets NCCL."""
    detail = gocomm.info()["engines"]["sparse"][1]
    transport = _state(rk.world.pg)._routes.transport
    if not detail.startswith(transport + ": ") or len(detail) <= len(transport) + 2:
        raise AssertionError(f"rank {rk.rank}: info says {detail!r}, the group {transport!r}")
    if not torch.cuda.is_available() and transport != "nccl":
        raise AssertionError(f"rank {rk.rank}: {transport} without a GPU ({detail})")
    return detail


def test_sparse_choice_reported(worlds):
    details = worlds.get(2).run(check_sparse_choice)
    assert len(set(details)) == 1, details
