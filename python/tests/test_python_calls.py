"""Every op torch calls on a gocomm group runs in the compiled client: while 1,000 ops of each
kind run, a profiler (sys.setprofile) on the calling thread counts the Python-level calls made
into the gocomm package (functions defined in python/gocomm/**, or built-ins of gocomm._C), and
finds none. gocomm.all_to_all_v is one Python call (its wrapper in python/gocomm/sparse.py,
which names the group) and nothing else, on every path: the host-count path on CPU tensors
here (two exchanges and a read of the counts, all in the compiled client); gocomm.moe's
dispatch and combine are their wrappers, the handle and the path probe, on CPU tensors (where
the in-process kernels serve CUDA tensors, dispatch without padded=True makes a few host
lookups more to size its output), each once a call. That the counter sees the wrappers is the
control case: the test can fail.

CPU tensors on worlds of 1 and 2 ranks here; CUDA tensors (marked gpu) on one GPU per rank,
and on 2 ranks with the in-process engine forced (GOCOMM_TRANSPORT=nvshmem; the ranks share
one GPU through CUDA IPC where there is one), where all_reduce and all_to_all_single run as
kernels the compiled client launches (docs/decisions/0021): counted like every other op."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from _harness import GPU_RUN_LIMIT_S
from ranklib import Checker

OPS_PER_KIND = 1000
A2AV_CALLS = 200  # gocomm.all_to_all_v calls counted (each is two exchanges on the host-count path)


def _package_dir() -> str:
    import gocomm

    return os.path.dirname(os.path.abspath(gocomm.__file__)) + os.sep


class _Counter:
    """Python-level calls into the gocomm package on this thread while active."""

    def __init__(self):
        self.pkg = _package_dir()
        self.calls: dict[str, int] = {}

    def _profile(self, frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(self.pkg):
                key = f"{os.path.relpath(f, self.pkg)}:{frame.f_code.co_name}"
                self.calls[key] = self.calls.get(key, 0) + 1
        elif event == "c_call":
            mod = getattr(arg, "__module__", None) or ""
            if mod.startswith("gocomm"):
                key = f"{mod}.{getattr(arg, '__name__', '?')}"
                self.calls[key] = self.calls.get(key, 0) + 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def _kinds(rk, dev: torch.device) -> dict:
    """op kind -> a callable that runs one op of that kind (and what it needs, made once)."""
    n, me = rk.size, rk.rank
    x = torch.ones(256, device=dev)
    big = torch.empty(256 * n, device=dev)
    part = torch.empty(256 // n if 256 % n == 0 else 256, device=dev)
    rs_in = torch.ones(part.numel() * n, device=dev)
    splits = [(i % 3) + 1 for i in range(n)]  # rows this rank sends to each rank
    a2a_in = torch.ones(sum(splits), 4, device=dev)
    # every rank sends rank j splits[j] rows, so each receives splits[me] from every rank
    a2a_out = torch.empty(splits[me] * n, 4, device=dev)
    coalesced = [torch.ones(8, device=dev), torch.ones(16, device=dev)]
    ag_outs = [torch.empty(8 * n, device=dev), torch.empty(16 * n, device=dev)]
    rs_ins = [torch.ones(8 * n, device=dev), torch.ones(16 * n, device=dev)]
    rs_outs = [torch.empty(8, device=dev), torch.empty(16, device=dev)]
    kinds = {
        "all_reduce": lambda: dist.all_reduce(x),
        "broadcast": lambda: dist.broadcast(x, 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(big, x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, rs_in),
        "all_to_all_single": lambda: dist.all_to_all_single(a2a_out, a2a_in, [splits[me]] * n, splits),
        "barrier": lambda: dist.barrier(),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced(coalesced),
    }

    # _coalescing_manager without a device: torch collects the ops and calls the backend's
    # *_coalesced form; with one: startCoalescing, the ops one by one, endCoalescing
    def ag_coalesced(device=None):
        with dist._coalescing_manager(device=device, async_ops=True) as cm:
            for o, i in zip(ag_outs, coalesced, strict=True):
                dist.all_gather_into_tensor(o, i, async_op=True)
        cm.wait()

    def rs_coalesced(device=None):
        with dist._coalescing_manager(device=device, async_ops=True) as cm:
            for o, i in zip(rs_outs, rs_ins, strict=True):
                dist.reduce_scatter_tensor(o, i, async_op=True)
        cm.wait()

    kinds["all_gather_into_tensor_coalesced"] = ag_coalesced
    kinds["reduce_scatter_tensor_coalesced"] = rs_coalesced
    kinds["start/end coalescing"] = lambda: (ag_coalesced(dev), rs_coalesced(dev))
    if n > 1:
        peer = 1 - me if n == 2 else (me + 1) % n
        src = 1 - me if n == 2 else (me - 1) % n
        got = torch.empty(64, device=dev)
        msg = torch.ones(64, device=dev)

        def send_recv():
            # even ranks send first; odd ranks receive first: no rank waits on itself
            if me % 2 == 0:
                dist.send(msg, peer)
                dist.recv(got, src)
            else:
                dist.recv(got, src)
                dist.send(msg, peer)

        kinds["send_recv"] = send_recv
    return kinds


def check_no_python_per_op(rk, seed, cuda: bool, only: tuple[str, ...] = ()):
    from gocomm._backend import state

    ck = Checker(f"python calls per op ({'cuda' if cuda else 'cpu'})", seed, rk.rank)
    if cuda:
        dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    g = state(dist.group.WORLD)
    seen = {}
    for kind, op in _kinds(rk, dev).items():
        if only and kind not in only:
            continue
        with ck.case(kind):
            for _ in range(3):  # warm: links, communicators, IPC registrations, lazy imports
                op()
            with _Counter() as c:
                for _ in range(OPS_PER_KIND):
                    op()
            if cuda:
                torch.cuda.synchronize(dev)
            seen[kind] = sum(c.calls.values())
            ck.expect(f"{kind}: no Python call into gocomm", not c.calls, str(c.calls))
    # gocomm.all_to_all_v: its wrapper (sparse.py) and nothing else per call, the counter
    # seeing the wrapper being the control: it sees a gocomm function that is Python
    if not only or "all_to_all_v" in only:
        with ck.case("gocomm.all_to_all_v: the wrapper only"):
            import gocomm

            inp = torch.arange(rk.size * 2.0, device=dev).view(rk.size, 2)
            splits = torch.ones(rk.size, dtype=torch.int64)
            for _ in range(3):
                gocomm.all_to_all_v(inp, splits)
            with _Counter() as c:
                for _ in range(A2AV_CALLS):
                    got, got_splits = gocomm.all_to_all_v(inp, splits)
            ck.expect("the wrapper, once a call", c.calls == {"sparse.py:all_to_all_v": A2AV_CALLS}, str(c.calls))
            ck.same("splits", got_splits.cpu(), torch.ones(rk.size, dtype=torch.int64))
    # gocomm.moe on CPU tensors (routing, the host-count exchange, grouping, combine's sums and
    # its exchange back, all in the compiled client's moe_dispatch_any / moe_combine_any): the
    # wrappers, the handle's __init__, and the path probe dispatch asks (sparse.py, which finds
    # the group's state)
    if not only or "moe" in only:
        with ck.case("gocomm.moe: the wrappers only"):
            import gocomm
            from gocomm import _client
            from gocomm.sparse import _device_path

            x = torch.ones(4, 16, device=dev)
            ids = torch.arange(4, device=dev).remainder(rk.size).unsqueeze(1)  # token i to rank i % n
            w = torch.ones(4, 1, device=dev)
            for _ in range(3):
                recv, _, hd = gocomm.moe.dispatch(x, ids, w, rk.size)
                gocomm.moe.combine(recv, hd)
            with _Counter() as c:
                for _ in range(A2AV_CALLS):
                    recv, _, hd = gocomm.moe.dispatch(x, ids, w, rk.size)
                    out = gocomm.moe.combine(recv, hd)
            wrappers = ("moe.py:dispatch", "moe.py:__init__", "moe.py:combine", "sparse.py:_device_path")
            wrappers += ("_backend.py:state",)
            if isinstance(_device_path(dist.group.WORLD, x), _client.C.A2Path):
                # the in-process kernels (GPUs that share NVLink, world size 1 included):
                # dispatch without padded=True also asks the path, the kernels' limits, whether
                # a capture is open and the receive buffer's rows, host lookups once a call
                lookups = ("_backend.py:_a2av_path", "gocomm._C.moe_takes", "_capture.py:capturing")
                lookups += ("moe.py:_dispatch_inprocess", "sparse.py:_capacity_rows", "_sidecar.py:current")
                lookups += ("gocomm._C.moe_row_bytes",)
                ck.expect("the wrappers, once a call", set(c.calls) <= set(wrappers + lookups), str(c.calls))
                ck.expect("each once a call", set(c.calls.values()) == {A2AV_CALLS}, str(c.calls))
                ck.expect("the wrappers seen", set(c.calls) >= set(wrappers), str(c.calls))
            else:
                ck.expect("the wrappers, once a call", c.calls == dict.fromkeys(wrappers, A2AV_CALLS), str(c.calls))
            ck.same("combine", out.cpu(), torch.ones(4, 16))
    # which ops the in-process engine ran: its paths set up, and its launch record
    inprocess = []
    if cuda:
        from gocomm import _client

        b = g._ref.get()
        ran = {r["op"] for r in _client.C.inprocess_launches()}
        if b.ar_path(dev.index) is not None and "all_reduce" in ran:
            inprocess.append("all_reduce")
        if g._routes.a2a_inprocess and b.a2av_path(dev.index) is not None and "all_to_all_single" in ran:
            inprocess.append("all_to_all_single")
    ck.done()
    return {"ops": seen, "inprocess": inprocess}


@pytest.mark.parametrize("size", [1, 2])
def test_no_python_per_op_cpu(worlds, seed, size):
    results = worlds.get(size).run(check_no_python_per_op, seed=seed, cuda=False, timeout=600)
    assert set(results[0]["ops"]) >= {"all_reduce", "broadcast", "barrier", "all_to_all_single"}


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 2])
def test_no_python_per_op_cuda(worlds, seed, size):
    if size > torch.cuda.device_count():
        pytest.skip(
            f"{size} ranks need {size} GPUs (NCCL takes one rank per GPU); this machine has {torch.cuda.device_count()}"
        )
    os.environ["GOCOMM_CUDA"] = "1"
    results = worlds.get(size).run(check_no_python_per_op, seed=seed, cuda=True, timeout=GPU_RUN_LIMIT_S)
    assert set(results[0]["ops"]) >= {"all_reduce", "broadcast", "barrier", "all_to_all_single"}
    print(f"in-process ops (counted too): {results[0]['inprocess']}")


@pytest.mark.gpu
def test_no_python_per_op_cuda_inprocess(worlds, seed):
    """2 ranks with the in-process engine forced (the sidecars take NVSHMEM as their sparse
    transport, so the route table sends all_reduce and all_to_all_single to the in-process
    kernels): both ops run through it, with no Python call. Only those two: on one GPU the
    ranks' other CUDA ops would take NCCL, which refuses two ranks on a GPU."""
    w = worlds.fresh(2, label="calls-inprocess", env={"GOCOMM_CUDA": "1", "GOCOMM_TRANSPORT": "nvshmem"})
    try:
        results = w.run(
            check_no_python_per_op,
            seed=seed,
            cuda=True,
            only=("all_reduce", "all_to_all_single"),
            timeout=GPU_RUN_LIMIT_S,
        )
    finally:
        w.close()
    for r in results:
        assert r["inprocess"] == ["all_reduce", "all_to_all_single"], r
        assert set(r["ops"]) == {"all_reduce", "all_to_all_single"}, r
