"""Every collective on gocomm against gloo (where gloo has the op and dtype) and against a
reference every rank computes from every rank's inputs, for worlds of 1 to 4 ranks and for
subgroups of a 4-rank world.

Each test runs one check function on every rank of a shared world (see conftest.py); a check
goes through all its cases (dtypes, ops, roots, shapes) and reports every failing one.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from ranklib import (
    ALL_DTYPES,
    AVG,
    BAND,
    BXOR,
    MAX,
    MIN,
    PRODUCT,
    SUM,
    Checker,
    dname,
    gen,
    gloo_moves,
    gloo_reduces,
    opname,
    ops_for,
    seeded_int,
    small_inputs,
)

# (world size, subgroup ranks or None for the world group)
SPECS = [(1, None), (2, None), (3, None), (4, None), (4, [1, 3]), (4, [0, 1, 2])]
SPEC_IDS = ["w1", "w2", "w3", "w4", "w4-sub13", "w4-sub012"]


def _start(rk, group, what, seed):
    gc = rk.group(group)
    where = f"world {rk.size}" + (f" subgroup {group}" if group else "")
    return gc, Checker(f"{what} on {where}", seed, rk.rank)


def _junk(like: torch.Tensor, seed, key, rank) -> torch.Tensor:
    """A tensor shaped like `like` with other contents (outputs start as junk, never as zeros)."""
    return gen(seed, "junk/" + key, rank + 1000, like.shape, like.dtype)


# ----- all_reduce ---------------------------------------------------------------------------


def check_all_reduce(rk, seed, group):
    gc, ck = _start(rk, group, "all_reduce", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            shapes = [(37,)]
            if dtype == torch.float32 and op == SUM:
                shapes = [
                    (0,),
                    (1,),
                    (3,),
                    (37,),
                    (3, 5, 7),
                    (65539,),
                    ((1 << 20) + 5,),
                    ((5 << 20) + 1,),  # 20 MiB: more than the shim's first 16 MiB arena segment
                ]
            elif op == SUM:
                shapes = [(1,), (37,), (4099,)]
            for shape in shapes:
                label = f"all_reduce {opname(op)} {dname(dtype)} {shape}"
                with ck.case(label):
                    key = f"ar/{dname(dtype)}/{opname(op)}/{shape}"
                    xs = [gen(seed, key, r, shape, dtype, small_inputs(dtype, op)) for r in range(n)]
                    t = xs[me].clone()
                    ret = dist.all_reduce(t, op=op, group=gc.pg)
                    ck.expect(label + " returns None", ret is None, f"returned {ret!r}")
                    g = None
                    if gloo_reduces(dtype, op):
                        g = xs[me].clone()
                        dist.all_reduce(g, op=op, group=gc.gloo)
                    ck.reduced(label, t, xs, op, dtype, g)
    return ck.done()


# ----- broadcast ------------------------------------------------------------------------------


def check_broadcast(rk, seed, group):
    gc, ck = _start(rk, group, "broadcast", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    cases = [(dt, (5, 7)) for dt in ALL_DTYPES] + [
        (torch.float32, (0,)),
        (torch.float32, ((1 << 20) + 3,)),
    ]
    for root in range(n):
        for dtype, shape in cases:
            label = f"broadcast root {root} {dname(dtype)} {shape}"
            with ck.case(label):
                key = f"bc/{root}/{dname(dtype)}/{shape}"
                x = gen(seed, key, root, shape, dtype)
                t = x.clone() if me == root else _junk(x, seed, key, me)
                dist.broadcast(t, src=gc.glob(root), group=gc.pg)
                ck.same(label, t, x)
                if gloo_moves(dtype):
                    g = x.clone() if me == root else _junk(x, seed, key, me)
                    dist.broadcast(g, src=gc.glob(root), group=gc.gloo)
                    ck.same(label + " vs gloo", t, g)
    with ck.case("the low-level options' rootTensor past the one tensor is refused"):
        opts = dist.BroadcastOptions()
        opts.rootTensor = 1
        try:
            gc.pg.broadcast([torch.ones(2)], opts)
            ck.fail("rootTensor 1", "no error")
        except ValueError as e:
            ck.expect("names rootTensor", "rootTensor" in str(e), str(e))
    return ck.done()


# ----- reduce ---------------------------------------------------------------------------------


def check_reduce(rk, seed, group):
    gc, ck = _start(rk, group, "reduce", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    for root in range(n):
        for dtype in ALL_DTYPES:
            ops = ops_for(dtype) if dtype in (torch.float32, torch.int32, torch.bool) else [SUM]
            for op in ops:
                label = f"reduce {opname(op)} {dname(dtype)} root {root}"
                with ck.case(label):
                    key = f"red/{root}/{dname(dtype)}/{opname(op)}"
                    xs = [gen(seed, key, r, (3, 11), dtype, small_inputs(dtype, op)) for r in range(n)]
                    t = xs[me].clone()
                    dist.reduce(t, dst=gc.glob(root), op=op, group=gc.pg)
                    g = None
                    if gloo_reduces(dtype, op) and op in (SUM, PRODUCT, MIN, MAX):
                        g = xs[me].clone()
                        dist.reduce(g, dst=gc.glob(root), op=op, group=gc.gloo)
                    if me == root:
                        ck.reduced(label, t, xs, op, dtype, g)
    return ck.done()


# ----- all_gather, all_gather_into_tensor -----------------------------------------------------


def check_all_gather(rk, seed, group):
    gc, ck = _start(rk, group, "all_gather", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    cases = [(dt, (2, 5)) for dt in ALL_DTYPES] + [
        (torch.float32, (0,)),
        (torch.float64, (70001,)),
    ]
    for dtype, shape in cases:
        label = f"all_gather {dname(dtype)} {shape}"
        with ck.case(label):
            key = f"ag/{dname(dtype)}/{shape}"
            xs = [gen(seed, key, r, shape, dtype) for r in range(n)]
            outs = [_junk(xs[0], seed, f"{key}/{i}", me) for i in range(n)]
            dist.all_gather(outs, xs[me], group=gc.pg)
            for r in range(n):
                ck.same(f"{label} [{r}]", outs[r], xs[r])
            if gloo_moves(dtype):
                gl = [_junk(xs[0], seed, f"{key}/{i}", me) for i in range(n)]
                dist.all_gather(gl, xs[me], group=gc.gloo)
                for r in range(n):
                    ck.same(f"{label} [{r}] vs gloo", outs[r], gl[r])
    return ck.done()


def check_all_gather_coalesced(rk, seed, group):
    """dist.all_gather_coalesced: output_tensor_lists[r][j] is rank r's input j, for inputs of
    several shapes (empty ones too) of one dtype (complex travels as its real view), against
    gloo; and a call through the group directly that breaks the rules raises before sending."""
    gc, ck = _start(rk, group, "all_gather_coalesced", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    shape_sets = [[(2, 2), (1,), (3,)], [(0,), (4, 3)], [(5,)], [(0,), (0, 2)]]
    for dtype in ALL_DTYPES:
        for k, shapes in enumerate(shape_sets):
            if k and dtype not in (torch.float32, torch.complex64, torch.bool):
                continue
            for async_op in (False, True):
                label = f"all_gather_coalesced {dname(dtype)} {shapes}{' async' if async_op else ''}"
                with ck.case(label):
                    key = f"agc/{dname(dtype)}/{k}"
                    xs = [[gen(seed, f"{key}/{j}", r, s, dtype) for j, s in enumerate(shapes)] for r in range(n)]
                    outs = [[_junk(x, seed, f"{key}/{q}", me) for x in xs[0]] for q in range(n)]
                    w = dist.all_gather_coalesced(outs, xs[me], group=gc.pg, async_op=async_op)
                    if async_op:
                        w.wait()
                    for r in range(n):
                        for j in range(len(shapes)):
                            ck.same(f"{label} [{r}][{j}]", outs[r][j], xs[r][j])
                    if gloo_moves(dtype) and any(x.numel() for x in xs[me]):
                        gl = [[_junk(x, seed, f"{key}/{q}", me) for x in xs[0]] for q in range(n)]
                        dist.all_gather_coalesced(gl, xs[me], group=gc.gloo)
                        for r in range(n):
                            for j in range(len(shapes)):
                                ck.same(f"{label} [{r}][{j}] vs gloo", outs[r][j], gl[r][j])
    bad = {
        "too few lists": ([[torch.zeros(2)]] * (n + 1), [torch.ones(2)]),
        "too few tensors in a list": ([[torch.zeros(2)]] * n, [torch.ones(2), torch.ones(3)]),
        "wrong size": ([[torch.zeros(3)]] * n, [torch.ones(2)]),
        "mixed dtypes": (
            [[torch.zeros(2), torch.zeros(2, dtype=torch.int64)]] * n,
            [torch.ones(2), torch.ones(2, dtype=torch.int64)],
        ),
    }
    for what, (outs, ins) in bad.items():
        with ck.case(f"all_gather_coalesced refuses: {what}"):
            try:
                gc.pg.allgather_coalesced(outs, ins).wait()
                ck.fail(what, "no error")
            except (TypeError, ValueError) as e:
                ck.expect(what, "all_gather_coalesced" in str(e), str(e))
    return ck.done()


def check_all_gather_into_tensor(rk, seed, group):
    gc, ck = _start(rk, group, "all_gather_into_tensor", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    cases = [(dt, (2, 5)) for dt in ALL_DTYPES] + [
        (torch.float32, (0,)),
        (torch.float32, (100003,)),
    ]
    for dtype, shape in cases:
        # cat: inputs concatenated along dim 0 (the form gloo takes); flat: as one 1-d tensor;
        # stack: stacked along a new dim 0 (the form NCCL also takes).
        for form in ("cat", "flat", "stack"):
            label = f"all_gather_into_tensor {dname(dtype)} {shape} {form}"
            with ck.case(label):
                key = f"agt/{dname(dtype)}/{shape}"
                xs = [gen(seed, key, r, shape, dtype) for r in range(n)]
                if form == "cat":
                    want = torch.cat(xs)
                elif form == "flat":
                    want = torch.cat([x.reshape(-1) for x in xs])
                else:
                    want = torch.stack(xs)
                out = _junk(want, seed, key, me)
                dist.all_gather_into_tensor(out, xs[me], group=gc.pg)
                ck.same(label, out, want)
                if gloo_moves(dtype) and (form == "cat" or len(shape) == 1 and form == "flat"):
                    g = _junk(want, seed, key, me)
                    dist.all_gather_into_tensor(g, xs[me], group=gc.gloo)
                    ck.same(label + " vs gloo", out, g)
    return ck.done()


# ----- reduce_scatter, reduce_scatter_tensor ---------------------------------------------------


def _rs_ops(dtype):
    if dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
        return ops_for(dtype)
    return [SUM]


def check_reduce_scatter(rk, seed, group):
    gc, ck = _start(rk, group, "reduce_scatter", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    for dtype in ALL_DTYPES:
        for op in _rs_ops(dtype):
            shape = (4, 3)
            label = f"reduce_scatter {opname(op)} {dname(dtype)}"
            with ck.case(label):
                key = f"rs/{dname(dtype)}/{opname(op)}"
                small = small_inputs(dtype, op)
                ins = [[gen(seed, f"{key}/{j}", r, shape, dtype, small) for j in range(n)] for r in range(n)]
                out = _junk(ins[0][0], seed, key, me)
                dist.reduce_scatter(out, [t.clone() for t in ins[me]], op=op, group=gc.pg)
                g = None
                if gloo_reduces(dtype, op) and op in (SUM, MIN, MAX, PRODUCT):
                    g = _junk(ins[0][0], seed, key, me)
                    dist.reduce_scatter(g, [t.clone() for t in ins[me]], op=op, group=gc.gloo)
                ck.reduced(label, out, [ins[r][me] for r in range(n)], op, dtype, g)
    return ck.done()


def check_reduce_scatter_tensor(rk, seed, group):
    gc, ck = _start(rk, group, "reduce_scatter_tensor", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    cases = [(dt, op, 7) for dt in ALL_DTYPES for op in _rs_ops(dt)]
    cases += [
        (torch.float32, SUM, 0),
        (torch.float32, SUM, 1),
        (torch.float32, SUM, 50021),
    ]
    for dtype, op, m in cases:
        for stacked in (False, True):
            label = f"reduce_scatter_tensor {opname(op)} {dname(dtype)} m={m} {'stacked' if stacked else 'flat'}"
            with ck.case(label):
                key = f"rst/{dname(dtype)}/{opname(op)}/{m}"
                small = small_inputs(dtype, op)
                ins = [gen(seed, key, r, (n, m), dtype, small) for r in range(n)]
                x = ins[me].clone() if stacked else ins[me].reshape(-1).clone()
                out = _junk(ins[0][0], seed, key, me)
                dist.reduce_scatter_tensor(out, x, op=op, group=gc.pg)
                g = None
                if gloo_reduces(dtype, op) and op in (SUM, MIN, MAX, PRODUCT) and not stacked:  # gloo: flat only
                    g = _junk(ins[0][0], seed, key, me)
                    dist.reduce_scatter_tensor(g, x.clone(), op=op, group=gc.gloo)
                ck.reduced(label, out, [ins[r][me] for r in range(n)], op, dtype, g)
    return ck.done()


# ----- all_to_all, all_to_all_single -----------------------------------------------------------


def _split_matrix(seed, case, n):
    """rows[s][d]: rows rank s sends rank d, the same on every rank."""
    if case == "equal":
        return [[2] * n for _ in range(n)]
    if case == "uneven":
        return [[seeded_int(seed, f"split/{s}/{d}", 0, 4) for d in range(n)] for s in range(n)]
    if case == "zeros":
        return [[0 if (s + d) % 2 == 0 else 3 for d in range(n)] for s in range(n)]
    if case == "one-to-one":  # rank 0 sends everything to the last rank; everyone else sends nothing
        return [[5 if (s == 0 and d == n - 1) else 0 for d in range(n)] for s in range(n)]
    if case == "empty":
        return [[0] * n for _ in range(n)]
    raise ValueError(case)


def check_all_to_all(rk, seed, group):
    gc, ck = _start(rk, group, "all_to_all", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    for dtype in ALL_DTYPES:
        for case in ("equal", "uneven", "zeros"):
            S = _split_matrix(seed, case, n)
            label = f"all_to_all {case} {dname(dtype)} rows={S}"
            with ck.case(label):
                key = f"a2a/{case}/{dname(dtype)}"

                def chunk(s, d, key=key, S=S, dtype=dtype):
                    return gen(seed, f"{key}/{s}->{d}", s, (S[s][d], 2), dtype)

                ins = [chunk(me, d) for d in range(n)]
                outs = [_junk(chunk(s, me), seed, f"{key}/{s}", me) for s in range(n)]
                dist.all_to_all(outs, ins, group=gc.pg)
                for s in range(n):
                    ck.same(f"{label} from {s}", outs[s], chunk(s, me))
    return ck.done()


def check_all_to_all_single(rk, seed, group):
    gc, ck = _start(rk, group, "all_to_all_single", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    cases = [(dt, "equal", False, 3) for dt in ALL_DTYPES] + [(dt, "uneven", True, 3) for dt in ALL_DTYPES]
    cases += [
        (torch.float32, "equal", True, 3),
        (torch.int64, "equal", False, None),  # 1-d, no splits
        (torch.int64, "uneven", True, None),  # 1-d with splits
        (torch.float32, "zeros", True, 3),
        (torch.float32, "one-to-one", True, 3),
        (torch.float64, "one-to-one", True, None),
        (torch.float32, "empty", True, 3),
        (torch.float32, "empty", False, 3),
        (torch.float32, "uneven", True, 4099),
    ]
    for dtype, case, with_splits, cols in cases:
        S = _split_matrix(seed, case, n)
        label = (
            f"all_to_all_single {case} {dname(dtype)} cols={cols} splits={'given' if with_splits else 'none'} rows={S}"
        )
        with ck.case(label):
            key = f"a2as/{case}/{dname(dtype)}/{cols}"

            def chunk(s, d, key=key, S=S, dtype=dtype, cols=cols):
                shape = (S[s][d],) if cols is None else (S[s][d], cols)
                return gen(seed, f"{key}/{s}->{d}", s, shape, dtype)

            x = torch.cat([chunk(me, d) for d in range(n)])
            want = torch.cat([chunk(s, me) for s in range(n)])
            in_splits = [S[me][d] for d in range(n)] if with_splits else None
            out_splits = [S[s][me] for s in range(n)] if with_splits else None
            out = _junk(want, seed, key, me)
            dist.all_to_all_single(out, x, out_splits, in_splits, group=gc.pg)
            ck.same(label, out, want)
            if gloo_moves(dtype):
                g = _junk(want, seed, key, me)
                dist.all_to_all_single(g, x, out_splits, in_splits, group=gc.gloo)
                ck.same(label + " vs gloo", out, g)
    return ck.done()


# ----- gather, scatter -------------------------------------------------------------------------


def check_gather(rk, seed, group):
    gc, ck = _start(rk, group, "gather", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    cases = [(dt, (3, 4)) for dt in ALL_DTYPES] + [
        (torch.float32, (0,)),
        (torch.float32, (30011,)),
    ]
    for root in range(n):
        for dtype, shape in cases:
            label = f"gather root {root} {dname(dtype)} {shape}"
            with ck.case(label):
                key = f"ga/{root}/{dname(dtype)}/{shape}"
                xs = [gen(seed, key, r, shape, dtype) for r in range(n)]
                outs = [_junk(xs[0], seed, f"{key}/{i}", me) for i in range(n)] if me == root else None
                dist.gather(xs[me], outs, dst=gc.glob(root), group=gc.pg)
                if me == root:
                    for r in range(n):
                        ck.same(f"{label} [{r}]", outs[r], xs[r])
                if gloo_moves(dtype) and not dtype.is_complex:  # gloo cannot gather complex
                    gl = [_junk(xs[0], seed, f"{key}/{i}", me) for i in range(n)] if me == root else None
                    dist.gather(xs[me], gl, dst=gc.glob(root), group=gc.gloo)
                    if me == root:
                        for r in range(n):
                            ck.same(f"{label} [{r}] vs gloo", outs[r], gl[r])
    return ck.done()


def check_scatter(rk, seed, group):
    gc, ck = _start(rk, group, "scatter", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    cases = [(dt, (3, 4)) for dt in ALL_DTYPES] + [
        (torch.float32, (0,)),
        (torch.float32, (30011,)),
    ]
    for root in range(n):
        for dtype, shape in cases:
            label = f"scatter root {root} {dname(dtype)} {shape}"
            with ck.case(label):
                key = f"sc/{root}/{dname(dtype)}/{shape}"
                chunks = [gen(seed, f"{key}/{j}", root, shape, dtype) for j in range(n)]
                t = _junk(chunks[0], seed, key, me)
                dist.scatter(
                    t,
                    [c.clone() for c in chunks] if me == root else None,
                    src=gc.glob(root),
                    group=gc.pg,
                )
                ck.same(label, t, chunks[me])
                if gloo_moves(dtype):
                    g = _junk(chunks[0], seed, key, me)
                    dist.scatter(
                        g,
                        [c.clone() for c in chunks] if me == root else None,
                        src=gc.glob(root),
                        group=gc.gloo,
                    )
                    ck.same(label + " vs gloo", t, g)
    return ck.done()


# ----- barrier ---------------------------------------------------------------------------------


def check_barrier(rk, seed, group):
    gc, ck = _start(rk, group, "barrier", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    with ck.case("barrier x5"):
        for _ in range(5):
            ck.expect("barrier returns None", dist.barrier(group=gc.pg) is None)
    with ck.case("barrier waits for the last rank"):
        # Rank i arrives 0.15*i s late; nobody may leave before the last one arrived.
        time.sleep(0.15 * me)
        arrive = time.time()
        dist.barrier(group=gc.pg)
        leave = time.time()
        times = [None] * n
        dist.all_gather_object(times, (arrive, leave), group=gc.gloo)
        last = max(a for a, _ in times)
        for r, (_, lv) in enumerate(times):
            ck.expect(
                "barrier waits for the last rank",
                lv >= last - 0.002,
                f"rank {r} left at {lv:.4f}, before the last rank arrived ({last:.4f})",
            )
    with ck.case("async barrier"):
        w = dist.barrier(group=gc.pg, async_op=True)
        ck.expect("async barrier wait", w.wait() is True)
        ck.expect("async barrier is_completed", w.is_completed() is True)
    return ck.done()


# ----- all_reduce_coalesced, coalescing manager ------------------------------------------------


def check_all_reduce_coalesced(rk, seed, group):
    gc, ck = _start(rk, group, "all_reduce_coalesced", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    shapes = [(3,), (2, 4), (0,), (5,), (1, 1, 3)]
    cases = [(dt, SUM) for dt in ALL_DTYPES] + [
        (torch.int32, MAX),
        (torch.float32, MIN),
        (torch.int64, BAND),
    ]
    cases += [(torch.uint8, BXOR), (torch.float64, PRODUCT), (torch.float32, AVG)]
    for dtype, op in cases:
        for async_op in (False, True):
            label = f"all_reduce_coalesced {opname(op)} {dname(dtype)}{' async' if async_op else ''}"
            with ck.case(label):
                key = f"arc/{dname(dtype)}/{opname(op)}/{async_op}"
                small = small_inputs(dtype, op)
                xs = [[gen(seed, f"{key}/{i}", r, s, dtype, small) for i, s in enumerate(shapes)] for r in range(n)]
                ts = [t.clone() for t in xs[me]]
                w = dist.all_reduce_coalesced(ts, op=op, group=gc.pg, async_op=async_op)
                if async_op:
                    w.wait()
                gl = None
                if gloo_reduces(dtype, op):
                    gl = [t.clone() for t in xs[me]]
                    dist.all_reduce_coalesced(gl, op=op, group=gc.gloo)
                for i in range(len(shapes)):
                    ck.reduced(
                        f"{label} [{i}]",
                        ts[i],
                        [xs[r][i] for r in range(n)],
                        op,
                        dtype,
                        gl[i] if gl else None,
                    )
    with ck.case("coalescing manager, 3 all_reduces"):
        xs = [[gen(seed, f"cm/{i}", r, (4 + i,), torch.float32) for i in range(3)] for r in range(n)]
        ts = [t.clone() for t in xs[me]]
        with dist._coalescing_manager(group=gc.pg, async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, group=gc.pg)
        cm.wait()
        for i in range(3):
            ck.reduced(
                f"coalescing manager [{i}]",
                ts[i],
                [xs[r][i] for r in range(n)],
                SUM,
                torch.float32,
            )
    with ck.case("coalescing manager, 2 all_gather_into_tensor"):
        xs = [[gen(seed, f"cmag/{i}", r, (3 + i,), torch.int32) for i in range(2)] for r in range(n)]
        outs = [torch.zeros(n * (3 + i), dtype=torch.int32) for i in range(2)]
        with dist._coalescing_manager(group=gc.pg, async_ops=True) as cm:
            for i in range(2):
                dist.all_gather_into_tensor(outs[i], xs[me][i], group=gc.pg)
        cm.wait()
        for i in range(2):
            ck.same(
                f"coalesced all_gather_into_tensor [{i}]",
                outs[i],
                torch.cat([xs[r][i] for r in range(n)]),
            )
    with ck.case("coalescing manager, 2 reduce_scatter_tensor"):
        xs = [[gen(seed, f"cmrs/{i}", r, (n * (2 + i),), torch.float64) for i in range(2)] for r in range(n)]
        outs = [torch.zeros(2 + i, dtype=torch.float64) for i in range(2)]
        with dist._coalescing_manager(group=gc.pg, async_ops=True) as cm:
            for i in range(2):
                dist.reduce_scatter_tensor(outs[i], xs[me][i].clone(), group=gc.pg)
        cm.wait()
        for i in range(2):
            m = 2 + i
            chunks = [xs[r][i][m * me : m * me + m] for r in range(n)]
            ck.reduced(
                f"coalesced reduce_scatter_tensor [{i}]",
                outs[i],
                chunks,
                SUM,
                torch.float64,
            )
    # gloo's coalesced all_gather_into_tensor returns zeros for some tensors of a call whose
    # dtypes differ (torch 2.11), so it is the reference only where they are the same
    agitc = {
        "one dtype": [((3,), torch.float32), ((0,), torch.float32), ((2, 5), torch.float32)],
        "mixed dtypes": [((3,), torch.float32), ((0,), torch.int64), ((2, 5), torch.complex64), ((7,), torch.bool)],
    }
    for what, specs in agitc.items():
        with ck.case(f"all_gather_into_tensor_coalesced, {what}, complex and empty"):
            xs = [[gen(seed, f"agitc/{what}/{i}", r, s, dt) for i, (s, dt) in enumerate(specs)] for r in range(n)]
            outs = [
                _junk(torch.empty((n * s[0],) + s[1:], dtype=dt), seed, f"agitc/{i}", me)
                for i, (s, dt) in enumerate(specs)
            ]
            gl = [o.clone() for o in outs]
            gc.pg.allgather_into_tensor_coalesced(outs, [x.clone() for x in xs[me]]).wait()
            if what == "one dtype":
                gc.gloo.allgather_into_tensor_coalesced(gl, [x.clone() for x in xs[me]]).wait()
            for i in range(len(specs)):
                want = torch.cat([xs[r][i] for r in range(n)])
                ck.same(f"all_gather_into_tensor_coalesced {what} [{i}]", outs[i], want)
                if what == "one dtype":
                    ck.same(f"all_gather_into_tensor_coalesced {what} [{i}] vs gloo", outs[i], gl[i])
    with ck.case("reduce_scatter_tensor_coalesced, mixed dtypes, complex and empty, against gloo"):
        specs = [((2,), torch.float64), ((0,), torch.int32), ((3,), torch.complex64), ((4, 2), torch.int64)]
        xs = [[gen(seed, f"rstc/{i}", r, (n * s[0],) + s[1:], dt) for i, (s, dt) in enumerate(specs)] for r in range(n)]
        outs = [torch.zeros(s, dtype=dt) for s, dt in specs]
        gl = [o.clone() for o in outs]
        opts = dist.ReduceScatterOptions()
        gc.pg.reduce_scatter_tensor_coalesced(outs, [x.clone() for x in xs[me]], opts).wait()
        gc.gloo.reduce_scatter_tensor_coalesced(gl, [x.clone() for x in xs[me]], opts).wait()
        for i, (s, dt) in enumerate(specs):
            chunks = [xs[r][i].chunk(n)[me] if s[0] else xs[r][i] for r in range(n)]
            ck.reduced(f"reduce_scatter_tensor_coalesced [{i}]", outs[i], chunks, SUM, dt, gl[i])
    with ck.case("all_reduce_coalesced with mixed dtypes is refused"):
        try:
            dist.all_reduce_coalesced([torch.ones(2), torch.ones(2, dtype=torch.float64)], group=gc.pg)
            ck.fail("mixed dtypes", "no error")
        except (TypeError, ValueError, RuntimeError) as e:
            ck.expect("mixed dtypes error names the dtypes", "float64" in str(e), str(e))
    return ck.done()


# ----- async ops -------------------------------------------------------------------------------


def check_async(rk, seed, group):
    gc, ck = _start(rk, group, "async ops", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    f32 = torch.float32

    with ck.case("8 all_reduces in flight, waited in reverse order"):
        xs = [[gen(seed, f"as/ar/{i}", r, (1000 * i + 1,), f32) for i in range(8)] for r in range(n)]
        ts = [t.clone() for t in xs[me]]
        works = [dist.all_reduce(t, group=gc.pg, async_op=True) for t in ts]
        for w in works:
            ck.expect(
                "is_completed is a bool",
                isinstance(w.is_completed(), bool),
                repr(w.is_completed()),
            )
        for i in reversed(range(8)):
            ck.expect("wait() returns True", works[i].wait() is True)
            ck.expect("is_completed after wait", works[i].is_completed() is True)
            ck.expect("is_success after wait", works[i].is_success() is True)
            ck.reduced(f"async all_reduce [{i}]", ts[i], [xs[r][i] for r in range(n)], SUM, f32)

    with ck.case("get_future().wait()"):
        xs = [gen(seed, "as/fut", r, (33,), f32) for r in range(n)]
        t = xs[me].clone()
        fut = dist.all_reduce(t, group=gc.pg, async_op=True).get_future()
        val = fut.wait()
        ck.expect(
            "future value is a list of tensors",
            isinstance(val, list) and len(val) == 1,
            repr(type(val)),
        )
        ck.reduced("future value", val[0], xs, SUM, f32)
        ck.reduced("future's tensor is the input", t, xs, SUM, f32)
        ck.expect("future done", fut.done())

    with ck.case("get_future().then()"):
        xs = [gen(seed, "as/then", r, (9,), torch.float64) for r in range(n)]
        t = xs[me].clone()
        fut = dist.all_reduce(t, group=gc.pg, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
        doubled = fut.wait()
        ck.reduced("then() value", doubled / 2, xs, SUM, torch.float64)

    with ck.case("wait after completion, twice"):
        t = torch.ones(4)
        w = dist.all_reduce(t, group=gc.pg, async_op=True)
        deadline = time.monotonic() + 10
        while not w.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        ck.expect("completes without wait()", w.is_completed(), "not completed after 10 s")
        ck.expect("first wait", w.wait() is True)
        ck.expect("second wait", w.wait() is True)
        ck.same("value", t, torch.full((4,), float(n)))

    with ck.case("async broadcast / all_gather / reduce_scatter_tensor / all_to_all_single / gather / scatter"):
        root = n - 1
        b = gen(seed, "as/bc", root, (17,), f32)
        bt = b.clone() if me == root else torch.zeros(17)
        xs = [gen(seed, "as/ag", r, (5,), torch.int32) for r in range(n)]
        ag = [torch.zeros(5, dtype=torch.int32) for _ in range(n)]
        rs_in = [gen(seed, "as/rs", r, (n * 3,), f32) for r in range(n)]
        rs_out = torch.zeros(3)
        a2a_in = torch.arange(2 * n, dtype=torch.int64) + 100 * me
        a2a_out = torch.zeros(2 * n, dtype=torch.int64)
        gl = [torch.zeros(5, dtype=torch.int32) for _ in range(n)] if me == 0 else None
        sc = torch.zeros(2, dtype=torch.int64)
        sc_in = [torch.tensor([j, 10 * j]) for j in range(n)] if me == root else None
        works = [
            dist.broadcast(bt, src=gc.glob(root), group=gc.pg, async_op=True),
            dist.all_gather(ag, xs[me], group=gc.pg, async_op=True),
            dist.reduce_scatter_tensor(rs_out, rs_in[me].clone(), group=gc.pg, async_op=True),
            dist.all_to_all_single(a2a_out, a2a_in, group=gc.pg, async_op=True),
            dist.gather(xs[me], gl, dst=gc.glob(0), group=gc.pg, async_op=True),
            dist.scatter(sc, sc_in, src=gc.glob(root), group=gc.pg, async_op=True),
            dist.barrier(group=gc.pg, async_op=True),
        ]
        for w in reversed(works):
            w.wait()
        ck.same("async broadcast", bt, b)
        for r in range(n):
            ck.same(f"async all_gather [{r}]", ag[r], xs[r])
            if me == 0:
                ck.same(f"async gather [{r}]", gl[r], xs[r])
        ck.reduced(
            "async reduce_scatter_tensor",
            rs_out,
            [x[3 * me : 3 * me + 3] for x in rs_in],
            SUM,
            f32,
        )
        want = torch.cat([torch.arange(2 * me, 2 * me + 2) + 100 * s for s in range(n)])
        ck.same("async all_to_all_single", a2a_out, want)
        ck.same("async scatter", sc, torch.tensor([me, 10 * me]))

    with ck.case("async all_reduce overlapping sync ops"):
        xs = [gen(seed, "as/ov", r, (50000,), f32) for r in range(n)]
        t = xs[me].clone()
        w = dist.all_reduce(t, group=gc.pg, async_op=True)
        u = torch.full((3,), float(me))
        dist.all_reduce(u, op=MAX, group=gc.pg)
        w.wait()
        ck.same("sync all_reduce between", u, torch.full((3,), float(n - 1)))
        ck.reduced("overlapped async all_reduce", t, xs, SUM, f32)
    return ck.done()


# ----- object collectives ----------------------------------------------------------------------


def _obj(seed, r):
    return {
        "rank": r,
        "text": "ünïcødé ✓ " * r,
        "blob": bytes(range(256)) * (40 * r + 1),
        "seed": seed,
        "l": [r] * r,
    }


def check_objects(rk, seed, group):
    gc, ck = _start(rk, group, "object collectives", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    with ck.case("all_gather_object"):
        out = [None] * n
        dist.all_gather_object(out, _obj(seed, me), group=gc.pg)
        ck.expect(
            "all_gather_object",
            out == [_obj(seed, r) for r in range(n)],
            f"got ranks {[o and o['rank'] for o in out]}",
        )
    with ck.case("all_gather_object, 1 MiB objects"):
        out = [None] * n
        dist.all_gather_object(out, bytes([me]) * (1 << 20), group=gc.pg)
        ck.expect("big objects", out == [bytes([r]) * (1 << 20) for r in range(n)])
    for root in range(n):
        with ck.case(f"broadcast_object_list root {root}"):
            objs = [_obj(seed, root), "x" * root, None, 3.5] if me == root else [None] * 4
            dist.broadcast_object_list(objs, src=gc.glob(root), group=gc.pg)
            ck.expect(
                f"broadcast_object_list root {root}",
                objs == [_obj(seed, root), "x" * root, None, 3.5],
            )
        with ck.case(f"gather_object root {root}"):
            out = [None] * n if me == root else None
            dist.gather_object(_obj(seed, me), out, dst=gc.glob(root), group=gc.pg)
            if me == root:
                ck.expect(
                    f"gather_object root {root}",
                    out == [_obj(seed, r) for r in range(n)],
                )
        with ck.case(f"scatter_object_list root {root}"):
            out = [None]
            ins = [_obj(seed, 10 + j) for j in range(n)] if me == root else None
            dist.scatter_object_list(out, ins, src=gc.glob(root), group=gc.pg)
            ck.expect(f"scatter_object_list root {root}", out[0] == _obj(seed, 10 + me))
    return ck.done()


# ----- views, aliasing, scalars ------------------------------------------------------------------


def check_views(rk, seed, group):
    """Outputs that are views into bigger tensors get exactly their bytes written (the rest of the
    base is untouched); in-place all_gather_into_tensor / reduce_scatter_tensor with the input
    aliasing the output (as FSDP does); 0-dim tensors."""
    gc, ck = _start(rk, group, "views and aliasing", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    f32, i64 = torch.float32, torch.int64
    with ck.case("all_reduce into a slice"):
        xs = [gen(seed, "v/ar", r, (10,), i64) for r in range(n)]
        base = torch.full((30,), -7, dtype=i64)
        base[10:20] = xs[me]
        dist.all_reduce(base[10:20], group=gc.pg)
        ck.reduced("slice", base[10:20], xs, SUM, i64)
        ck.same("bytes before the slice", base[:10], torch.full((10,), -7, dtype=i64))
        ck.same("bytes after the slice", base[20:], torch.full((10,), -7, dtype=i64))
    with ck.case("broadcast into a row of a matrix"):
        x = gen(seed, "v/bc", 0, (6,), f32)
        base = torch.full((3, 6), 5.0)
        if me == 0:
            base[1] = x
        dist.broadcast(base[1], src=gc.glob(0), group=gc.pg)
        ck.same("row", base[1], x)
        ck.same("other rows", base[[0, 2]], torch.full((2, 6), 5.0))
    with ck.case("all_gather_into_tensor in place (input is this rank's chunk of the output)"):
        xs = [gen(seed, "v/agt", r, (7,), f32) for r in range(n)]
        out = torch.zeros(7 * n)
        out[7 * me : 7 * me + 7] = xs[me]
        dist.all_gather_into_tensor(out, out[7 * me : 7 * me + 7], group=gc.pg)
        ck.same("in-place all_gather_into_tensor", out, torch.cat(xs))
    with ck.case("reduce_scatter_tensor in place (output is this rank's chunk of the input)"):
        xs = [gen(seed, "v/rst", r, (5 * n,), torch.float64) for r in range(n)]
        inp = xs[me].clone()
        dist.reduce_scatter_tensor(inp[5 * me : 5 * me + 5], inp, group=gc.pg)
        chunk = [x[5 * me : 5 * me + 5] for x in xs]
        ck.reduced(
            "in-place reduce_scatter_tensor",
            inp[5 * me : 5 * me + 5],
            chunk,
            SUM,
            torch.float64,
        )
    with ck.case("all_to_all_single between two halves of one tensor"):
        buf = torch.zeros(4 * n, dtype=i64)
        buf[: 2 * n] = torch.arange(2 * n) + 100 * me
        dist.all_to_all_single(buf[2 * n :], buf[: 2 * n], group=gc.pg)
        want = torch.cat([torch.arange(2 * me, 2 * me + 2) + 100 * s for s in range(n)])
        ck.same("output half", buf[2 * n :], want)
        ck.same("input half", buf[: 2 * n], torch.arange(2 * n) + 100 * me)
    with ck.case("0-dim tensors"):
        t = torch.tensor(float(me + 1))
        dist.all_reduce(t, op=PRODUCT, group=gc.pg)
        prod = 1.0
        for r in range(n):
            prod *= r + 1
        ck.same("0-dim all_reduce", t, torch.tensor(prod))
        b = torch.tensor(42 if me == n - 1 else 0)
        dist.broadcast(b, src=gc.glob(n - 1), group=gc.pg)
        ck.same("0-dim broadcast", b, torch.tensor(42))
    cl, cl3 = torch.channels_last, torch.channels_last_3d
    with ck.case("channels_last tensors in the elementwise ops (as torch's NCCL backend takes them)"):
        xs = [gen(seed, "v/cl", r, (2, 3, 4, 5), torch.float64) for r in range(n)]
        t = xs[me].to(memory_format=cl)
        dist.all_reduce(t, group=gc.pg)
        ck.expect("all_reduce keeps channels_last", t.is_contiguous(memory_format=cl), str(t.stride()))
        ck.reduced("channels_last all_reduce", t.contiguous(), xs, SUM, torch.float64)
        ts = [gen(seed, "v/clc", r, (3, 2, 2, 3), torch.float64).to(memory_format=cl) for r in range(n)]
        pair = [ts[me].clone(memory_format=cl), xs[me].to(memory_format=cl)]
        dist.all_reduce_coalesced(pair, group=gc.pg)
        ck.reduced(
            "channels_last all_reduce_coalesced", pair[0].contiguous(), [x.contiguous() for x in ts], SUM, torch.float64
        )
        ck.reduced("its second tensor", pair[1].contiguous(), xs, SUM, torch.float64)
        x = gen(seed, "v/cl3", n - 1, (2, 3, 2, 4, 5), torch.float32)
        b = (x.clone() if me == n - 1 else _junk(x, seed, "v/cl3", me)).to(memory_format=cl3)
        dist.broadcast(b, src=gc.glob(n - 1), group=gc.pg)
        ck.same("channels_last_3d broadcast", b.contiguous(), x)
        r = xs[me].to(memory_format=cl)
        dist.reduce(r, dst=gc.glob(0), group=gc.pg)
        if me == 0:
            ck.reduced("channels_last reduce", r.contiguous(), xs, SUM, torch.float64)
        if n > 1:
            got = _junk(xs[0], seed, "v/clp", me).to(memory_format=cl)
            if me == 0:
                dist.send(xs[0].to(memory_format=cl), dst=gc.glob(n - 1), group=gc.pg, tag=78)
            elif me == n - 1:
                dist.recv(got, src=gc.glob(0), group=gc.pg, tag=78)
                ck.same("channels_last send / recv", got.contiguous(), xs[0])
    # stricter than torch's NCCL backend, which moves such tensors' bytes as they lie: a gather's
    # chunks follow the layout, right only where every tensor of the op has the same one
    with ck.case("channels_last where the op moves chunks: refused"):
        try:
            dist.all_gather_into_tensor(torch.zeros(n * 2, 3, 4, 5).to(memory_format=cl), xs[me].float(), group=gc.pg)
            ck.fail("channels_last all_gather_into_tensor output", "no error")
        except ValueError as e:
            ck.expect("names the output and contiguity", "output_tensor must be contiguous" in str(e), str(e))
    if n > 1:
        with ck.case("recv into a slice"):
            base = torch.full((12,), -1.0)
            if me == 0:
                dist.send(torch.arange(4, dtype=f32), dst=gc.glob(n - 1), group=gc.pg, tag=77)
            elif me == n - 1:
                dist.recv(base[4:8], src=gc.glob(0), group=gc.pg, tag=77)
                want = torch.full((12,), -1.0)
                want[4:8] = torch.arange(4, dtype=f32)
                ck.same("recv into a slice", base, want)
    return ck.done()


def check_premul_sum(rk, seed, group):
    """ReduceOp.PREMUL_SUM (torch.distributed._make_nccl_premul_sum, as FSDP2 reduce-scatters
    gradients with a divide factor): the sum of each rank's input times its own factor (here a
    different one per rank, as NCCL allows), given as a float or a one-element tensor; inputs
    that the op does not overwrite stay as they were."""
    gc, ck = _start(rk, group, "PREMUL_SUM", seed)
    if not gc.member:
        return 0
    n, me = gc.size, gc.rank
    fs = [0.5 + r for r in range(n)]

    def premul(f):
        return dist._make_nccl_premul_sum(f)

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        d = dname(dtype)
        xs = [gen(seed, f"pm/{d}", r, (6 * n,), dtype) for r in range(n)]
        want = [x * f for x, f in zip(xs, fs, strict=True)]  # each rank's scaled input, in dtype
        for kind, f in (("float", fs[me]), ("tensor", torch.tensor([fs[me]], dtype=torch.float64))):
            with ck.case(f"all_reduce {d} {kind} factor"):
                t = xs[me].clone()
                dist.all_reduce(t, op=premul(f), group=gc.pg)
                ck.reduced(f"all_reduce {d} {kind}", t, want, SUM, dtype)
        with ck.case(f"all_reduce_coalesced {d}"):
            ts = [xs[me][: 3 * n].clone(), xs[me][3 * n :].clone()]
            dist.all_reduce_coalesced(ts, op=premul(fs[me]), group=gc.pg)
            ck.reduced(f"all_reduce_coalesced {d}", torch.cat(ts), want, SUM, dtype)
        for root in range(n):
            with ck.case(f"reduce {d} root {root}"):
                t = xs[me].clone()
                dist.reduce(t, dst=gc.glob(root), op=premul(fs[me]), group=gc.pg)
                if me == root:
                    ck.reduced(f"reduce {d} root {root}", t, want, SUM, dtype)
                else:
                    ck.same(f"reduce {d}: a non-root's tensor is untouched", t, xs[me])
        with ck.case(f"reduce_scatter_tensor {d}"):
            inp, out = xs[me].clone(), _junk(xs[me][:6], seed, f"pm/rs/{d}", me)
            dist.reduce_scatter_tensor(out, inp, op=premul(fs[me]), group=gc.pg)
            ck.reduced(f"reduce_scatter_tensor {d}", out, [w[6 * me : 6 * me + 6] for w in want], SUM, dtype)
            ck.same(f"reduce_scatter_tensor {d}: the input is untouched", inp, xs[me])
        with ck.case(f"reduce_scatter list {d}"):
            ins = [c.clone() for c in xs[me].chunk(n)]
            out = _junk(xs[me][:6], seed, f"pm/rsl/{d}", me)
            dist.reduce_scatter(out, ins, op=premul(fs[me]), group=gc.pg)
            ck.reduced(f"reduce_scatter list {d}", out, [w[6 * me : 6 * me + 6] for w in want], SUM, dtype)
            ck.same(f"reduce_scatter list {d}: the inputs are untouched", torch.cat(ins), xs[me])
    with ck.case("a float factor and a tensor factor round alike (1/3, bf16)"):
        x = gen(seed, "pm/third", me, (64,), torch.bfloat16)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op=premul(1 / 3), group=gc.pg)
        dist.all_reduce(b, op=premul(torch.tensor([1 / 3], dtype=torch.float64)), group=gc.pg)
        ck.same("float and tensor factor", a, b)
    with ck.case("the scaling is the collective's, not a step of the caller's autograd graph"):
        w = torch.full((4,), 3.0, requires_grad=True)
        y = w * 2
        version = y._version
        dist.all_reduce(y, op=premul(fs[me]), group=gc.pg)
        ck.expect("no grad_fn added", type(y.grad_fn).__name__ == "MulBackward0", type(y.grad_fn).__name__)
        ck.expect("no version bump", y._version == version, f"{version} -> {y._version}")
        y.sum().backward()
        ck.same("d(sum y)/dw is 2, not 2 x the factor", w.grad, torch.full((4,), 2.0))
        leaf = torch.ones(3, requires_grad=True)
        dist.all_reduce(leaf, op=premul(fs[me]), group=gc.pg)  # raises on an in-place autograd op
        ck.same("a leaf that requires grad", leaf.detach(), torch.full((3,), float(sum(fs))))
    for dtype in (torch.int64, torch.float8_e4m3fn):
        with ck.case(f"{dname(dtype)} tensors are refused before anything is sent"):
            try:
                dist.all_reduce(torch.ones(3).to(dtype), op=premul(2.0), group=gc.pg)
                ck.fail(f"{dname(dtype)} PREMUL_SUM", "no error")
            except TypeError as e:
                ck.expect("names PREMUL_SUM and the dtype", "PREMUL_SUM" in str(e) and dname(dtype) in str(e), str(e))
    return ck.done()


CHECKS = {
    "all_reduce": check_all_reduce,
    "broadcast": check_broadcast,
    "reduce": check_reduce,
    "all_gather": check_all_gather,
    "all_gather_into_tensor": check_all_gather_into_tensor,
    "all_gather_coalesced": check_all_gather_coalesced,
    "reduce_scatter": check_reduce_scatter,
    "reduce_scatter_tensor": check_reduce_scatter_tensor,
    "all_to_all": check_all_to_all,
    "all_to_all_single": check_all_to_all_single,
    "gather": check_gather,
    "scatter": check_scatter,
    "barrier": check_barrier,
    "all_reduce_coalesced": check_all_reduce_coalesced,
    "async": check_async,
    "objects": check_objects,
    "views": check_views,
    "premul_sum": check_premul_sum,
}


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("check", list(CHECKS))
def test_collective(worlds, seed, spec, check):
    size, group = spec
    results = worlds.get(size).run(CHECKS[check], seed=seed, group=group)
    members = group if group is not None else range(size)
    for r in members:
        assert results[r] > 0, f"rank {r} ran no cases"
