"""Bad input is refused before anything reaches the sidecar, with an error naming the argument;
the group keeps working afterwards.

"Before anything is sent" is checked with the sidecar's own counters (gocomm._backend.state(pg).stats():
every op the sidecar accepted or refused is counted): they must not move while the bad calls
are made.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranklib import Checker, gen
from torch.distributed.distributed_c10d import AllgatherOptions

R = dist.ReduceOp


def _fake_cuda(shape, dtype=torch.float32):
    """A tensor whose device is cuda, without CUDA: a FakeTensor (no storage). None if this torch
    cannot make one."""
    if torch.cuda.is_available():
        return torch.zeros(shape, dtype=dtype, device="cuda")
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            t = torch.zeros(shape, dtype=dtype, device="cuda")
        return t if t.device.type == "cuda" else None
    except Exception:  # noqa: BLE001
        return None


def _opts(cls, **kw):
    o = cls()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def _cases(rk):
    """(label, call, exception types, substrings the message must hold (lower case))."""
    pg = rk.world.pg
    n, me = rk.size, rk.rank
    f32 = torch.ones(4)
    c64 = torch.ones(4, dtype=torch.complex64)
    nc = torch.ones(4, 6).t()  # not contiguous
    cases = [
        # --- reduce op / dtype
        (
            "MAX on complex64 (torch API)",
            lambda: dist.all_reduce(c64.clone(), op=R.MAX),
            ValueError,
            ["complex"],
        ),
        (
            "MAX on complex64 (pg.allreduce)",
            lambda: pg.allreduce([c64.clone()], _opts(dist.AllreduceOptions, reduceOp=R.MAX)),
            TypeError,
            ["complex64", "max"],
        ),
        (
            "MIN on complex64 (pg.reduce_scatter_tensor)",
            lambda: pg._reduce_scatter_base(
                torch.zeros(2, dtype=torch.complex64),
                torch.zeros(2 * n, dtype=torch.complex64),
                _opts(dist.ReduceScatterOptions, reduceOp=R.MIN),
            ),
            TypeError,
            ["complex64", "min"],
        ),
        (
            "BAND on float32",
            lambda: dist.all_reduce(f32.clone(), op=R.BAND),
            TypeError,
            ["bitwise", "float32"],
        ),
        (
            "BXOR on bfloat16 (reduce)",
            lambda: dist.reduce(torch.ones(3, dtype=torch.bfloat16), 0, op=R.BXOR),
            TypeError,
            ["bfloat16"],
        ),
        (
            "AVG on bool",
            lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=R.AVG),
            TypeError,
            ["avg", "bool"],
        ),
        (
            "SUM on float8_e5m2",
            lambda: dist.all_reduce(torch.zeros(3, dtype=torch.float8_e5m2)),
            TypeError,
            ["float8_e5m2"],
        ),
        (
            "unsupported dtype float8_e4m3fnuz (broadcast)",
            lambda: dist.broadcast(torch.zeros(3, dtype=torch.float8_e4m3fnuz), 0),
            TypeError,
            ["tensor", "float8_e4m3fnuz"],
        ),
        # --- dtype mismatches between arguments
        (
            "all_gather_into_tensor float64 output, float32 input",
            lambda: dist.all_gather_into_tensor(torch.zeros(4 * n, dtype=torch.float64), f32),
            TypeError,
            ["output_tensor", "float64"],
        ),
        (
            "reduce_scatter_tensor int32 output, float32 input",
            lambda: dist.reduce_scatter_tensor(torch.zeros(4, dtype=torch.int32), torch.ones(4 * n)),
            TypeError,
            ["output", "int32"],
        ),
        (
            "all_to_all_single float64 output, float32 input",
            lambda: dist.all_to_all_single(torch.zeros(2 * n, dtype=torch.float64), torch.ones(2 * n)),
            (
                TypeError,
                ValueError,
            ),  # torch itself refuses mixed dtypes here, before gocomm
            ["float64"],
        ),
        (
            "all_to_all_single float64 output, float32 input (pg)",
            lambda: pg.alltoall_base(
                torch.zeros(2 * n, dtype=torch.float64),
                torch.ones(2 * n),
                [],
                [],
                dist.AllToAllOptions(),
            ),
            TypeError,
            ["output", "float64"],
        ),
        (
            "all_gather: tensor_list[-1] of another dtype",
            lambda: dist.all_gather(
                [torch.zeros(4) for _ in range(n - 1)] + [torch.zeros(4, dtype=torch.int64)],
                f32,
            ),
            (TypeError, ValueError),
            ["int64"],
        ),
        (
            "all_gather: tensor_list[-1] of another dtype (pg)",
            lambda: pg.allgather(
                [[torch.zeros(4) for _ in range(n - 1)] + [torch.zeros(4, dtype=torch.int64)]],
                [f32],
                AllgatherOptions(),
            ),
            TypeError,
            [f"tensor_list[{n - 1}]", "int64"],
        ),
        (
            "all_reduce_coalesced: mixed dtypes",
            lambda: dist.all_reduce_coalesced([torch.ones(2), torch.ones(2, dtype=torch.int64)]),
            (TypeError, ValueError),
            ["int64"],
        ),
        (
            "all_reduce_coalesced: mixed dtypes (pg)",
            lambda: pg.allreduce_coalesced(
                [torch.ones(2), torch.ones(2, dtype=torch.int64)],
                dist.AllreduceCoalescedOptions(),
            ),
            TypeError,
            ["tensors[1]", "int64"],
        ),
        (
            "all_to_all: output of another dtype (pg)",
            lambda: pg.alltoall(
                [torch.zeros(2, dtype=torch.int32) for _ in range(n)],
                [torch.ones(2) for _ in range(n)],
                dist.AllToAllOptions(),
            ),
            TypeError,
            ["output_tensor_list", "int32"],
        ),
        # --- layout
        (
            "non-contiguous all_reduce",
            lambda: dist.all_reduce(nc),
            ValueError,
            ["tensor", "contiguous"],
        ),
        (
            "non-contiguous broadcast",
            lambda: dist.broadcast(nc, 0),
            ValueError,
            ["tensor", "contiguous"],
        ),
        (
            "non-contiguous all_gather_into_tensor output",
            lambda: dist.all_gather_into_tensor(torch.zeros(6, 4 * n).t(), torch.ones(6, 4)),
            ValueError,
            ["output_tensor", "contiguous"],
        ),
        (
            "non-contiguous all_gather input",
            lambda: dist.all_gather([torch.zeros(4, 6) for _ in range(n)], torch.ones(6, 4).t()),
            ValueError,
            ["tensor", "contiguous"],
        ),
        (
            "sparse tensor (pg.allreduce)",
            lambda: pg.allreduce([torch.eye(3).to_sparse()], dist.AllreduceOptions()),
            ValueError,
            ["tensor", "sparse"],
        ),
        (
            "not a tensor (pg.allreduce)",
            lambda: pg.allreduce(["x"], dist.AllreduceOptions()),
            TypeError,
            ["tensor"],
        ),
        (
            "two tensors (pg.allreduce)",
            lambda: pg.allreduce([f32.clone(), f32.clone()], dist.AllreduceOptions()),
            ValueError,
            ["tensor"],
        ),
        # --- output sizes
        (
            "all_gather: one tensor too many",
            lambda: dist.all_gather([torch.zeros(4) for _ in range(n + 1)], f32),
            ValueError,
            ["tensor_list"],
        ),
        (
            "all_gather: wrong element count",
            lambda: dist.all_gather([torch.zeros(4) for _ in range(n - 1)] + [torch.zeros(5)], f32),
            ValueError,
            [f"tensor_list[{n - 1}]", "5"],
        ),
        (
            "all_gather_into_tensor: output too small",
            lambda: dist.all_gather_into_tensor(torch.zeros(4 * n - 1), f32),
            ValueError,
            ["output_tensor"],
        ),
        (
            "reduce_scatter_tensor: input not world_size * output",
            lambda: dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * n + 1)),
            ValueError,
            ["input"],
        ),
        (
            "reduce_scatter: input_list too short",
            lambda: dist.reduce_scatter(torch.zeros(4), [torch.ones(4) for _ in range(n + 1)]),
            ValueError,
            ["input_list"],
        ),
        # (every rank passes a list: too long on the root, not allowed elsewhere)
        (
            "gather: gather_list too long (pg)",
            lambda: pg.gather(
                [[torch.zeros(4) for _ in range(n + 1)]],
                [f32],
                _opts(dist.GatherOptions, rootRank=0),
            ),
            ValueError,
            ["gather_list"],
        ),
        (
            "scatter: scatter_list entries of the wrong size (pg)",
            lambda: pg.scatter(
                [torch.zeros(4)],
                [[torch.ones(3) for _ in range(n)]],
                _opts(dist.ScatterOptions, rootRank=0),
            ),
            ValueError,
            ["scatter_list"],
        ),
        (
            "gather: gather_list too long",
            lambda: dist.gather(f32, [torch.zeros(4) for _ in range(n + 1)], dst=0),
            ValueError,
            ["gather_list"],
        ),
        (
            "all_to_all: too few outputs",
            lambda: dist.all_to_all(
                [torch.zeros(2) for _ in range(n - 1)],
                [torch.ones(2) for _ in range(n)],
            ),
            ValueError,
            ["output"],
        ),
        # --- all_to_all_single splits
        (
            "all_to_all_single: input splits do not add up",
            lambda: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(2 * n), None, [1] * n),
            ValueError,
            ["input_split_sizes"],
        ),
        (
            "all_to_all_single: output splits do not add up",
            lambda: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(2 * n), [3] * n, None),
            ValueError,
            ["output_split_sizes"],
        ),
        (
            "all_to_all_single: negative split",
            lambda: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(2 * n), None, [-1] + [2] * (n - 2) + [5]),
            ValueError,
            ["input_split_sizes", "negative"],
        ),
        (
            "all_to_all_single: wrong number of splits",
            lambda: dist.all_to_all_single(torch.zeros(2 * n), torch.ones(2 * n), None, [2 * n] + [0] * n),
            ValueError,
            ["input_split_sizes"],
        ),
        (
            "all_to_all_single: row shapes differ",
            lambda: dist.all_to_all_single(torch.zeros(n, 2), torch.ones(n, 3)),
            ValueError,
            ["output"],
        ),
        # --- roots and peers
        (
            "broadcast root out of range (pg)",
            lambda: pg.broadcast([f32.clone()], _opts(dist.BroadcastOptions, rootRank=n)),
            ValueError,
            ["root", str(n)],
        ),
        (
            "broadcast src out of range (torch API)",
            lambda: dist.broadcast(f32.clone(), src=n),
            ValueError,
            [str(n)],
        ),
        (
            "reduce root -1 (pg)",
            lambda: pg.reduce([f32.clone()], _opts(dist.ReduceOptions, rootRank=-1)),
            ValueError,
            ["root", "-1"],
        ),
        (
            "gather root out of range (pg)",
            lambda: pg.gather(
                [[torch.zeros(4) for _ in range(n)]],
                [f32],
                _opts(dist.GatherOptions, rootRank=n + 3),
            ),
            ValueError,
            ["root"],
        ),
        (
            "scatter root out of range (pg)",
            lambda: pg.scatter([torch.zeros(4)], [[f32] * n], _opts(dist.ScatterOptions, rootRank=n)),
            ValueError,
            ["root"],
        ),
        (
            "send dst out of range (pg)",
            lambda: pg.send([f32], n, 0),
            ValueError,
            ["dst", str(n)],
        ),
        (
            "recv src out of range (pg)",
            lambda: pg.recv([torch.zeros(4)], -5, 0),
            ValueError,
            ["src", "-5"],
        ),
        (
            "send to self (pg)",
            lambda: pg.send([f32], me, 0),
            ValueError,
            ["dst", "this rank"],
        ),
        ("send to self (torch API)", lambda: dist.send(f32, dst=me), ValueError, []),
        (
            "send dst out of range (torch API)",
            lambda: dist.send(f32, dst=n + 1),
            ValueError,
            [],
        ),
        # --- async calls raise at the call, not at wait()
        (
            "async all_reduce of a non-contiguous tensor",
            lambda: dist.all_reduce(nc, async_op=True),
            ValueError,
            ["tensor", "contiguous"],
        ),
    ]
    # Meta tensors and FakeTensors (a "cuda" tensor without a GPU) never reach a backend:
    # torch's dispatcher answers them with the c10d ops' meta and fake kernels, for gocomm as
    # for its own backends. test_meta_and_fake_tensors_reach_no_backend checks that.
    return cases


def check_bad_input(rk, seed):
    ck = Checker(f"bad input on world {rk.size}", seed, rk.rank)
    from gocomm._backend import state

    pg = rk.world.pg
    n = rk.size
    dist.barrier(group=rk.world.gloo)
    before = state(pg).stats()
    cases = _cases(rk)
    for label, call, exc, words in cases:
        with ck.case(label):
            try:
                call()
            except exc as e:
                msg = str(e).lower()
                missing = [w for w in words if w.lower() not in msg]
                ck.expect(
                    label,
                    not missing,
                    f"{type(e).__name__} does not name {missing}: {e}",
                )
            except Exception as e:  # noqa: BLE001
                ck.fail(label, f"raised {type(e).__name__}, want {exc.__name__}: {e}")
            else:
                ck.fail(label, f"no error, want {exc.__name__}")
    # every rank is done with the bad calls, and has read its counters before anyone
    # starts the next op
    dist.barrier(group=rk.world.gloo)
    after = state(pg).stats()
    dist.barrier(group=rk.world.gloo)
    ck.expect(
        "nothing reached the sidecar",
        before == after,
        f"the sidecar's counters moved: {before} -> {after}",
    )
    with ck.case("the group still works"):
        xs = [gen(seed, "after", r, (1000,), torch.float64) for r in range(n)]
        t = xs[rk.rank].clone()
        dist.all_reduce(t)
        ck.reduced("all_reduce after the bad calls", t, xs, R.SUM, torch.float64)
        b = torch.arange(5) if rk.rank == n - 1 else torch.zeros(5, dtype=torch.int64)
        dist.broadcast(b, n - 1)
        ck.same("broadcast after the bad calls", b, torch.arange(5))
    return {"cases": ck.done()}


@pytest.mark.parametrize("size", [2, 3])
def test_bad_input_raises_before_sending(worlds, seed, size):
    results = worlds.get(size).run(check_bad_input, seed=seed)
    assert all(r["cases"] > 30 for r in results)


def check_meta_and_fake(rk, seed):
    from gocomm._backend import state

    ck = Checker("meta and fake tensors", seed, rk.rank)
    pg = rk.world.pg
    dist.barrier(group=rk.world.gloo)
    before = state(pg).stats()
    with ck.case("meta all_reduce"):
        dist.all_reduce(torch.empty(4, device="meta"))
    fake = _fake_cuda((4,)) if not torch.cuda.is_available() else None
    if fake is not None:
        with ck.case("fake cuda all_reduce"):
            dist.all_reduce(fake)
    dist.barrier(group=rk.world.gloo)
    after = state(pg).stats()
    dist.barrier(group=rk.world.gloo)
    ck.expect("nothing reached the sidecar", before == after, f"{before} -> {after}")
    return ck.done()


def test_meta_and_fake_tensors_reach_no_backend(worlds, seed):
    """torch's dispatcher answers meta tensors and FakeTensors itself (the c10d ops' meta and
    fake kernels): the call returns and nothing is sent, as with torch's own backends."""
    worlds.get(2).run(check_meta_and_fake, seed=seed)
