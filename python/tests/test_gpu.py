"""Tests that need CUDA (marked gpu: they skip, saying why, where torch.cuda.is_available() is
False). gocomm does not run CUDA tensors yet: every op on one must raise NotImplementedError
before anything is sent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranklib import Checker

pytestmark = pytest.mark.gpu


def check_cuda_tensors_refused(rk, seed):
    ck = Checker("CUDA tensors", seed, rk.rank)
    dev = torch.device("cuda", rk.rank % torch.cuda.device_count())
    x = torch.ones(8, device=dev)
    n = rk.size
    for label, call in [
        ("all_reduce", lambda: dist.all_reduce(x)),
        ("broadcast", lambda: dist.broadcast(x, 0)),
        (
            "all_gather_into_tensor",
            lambda: dist.all_gather_into_tensor(torch.zeros(8 * n, device=dev), x),
        ),
        ("send", lambda: dist.send(x, dst=(rk.rank + 1) % n)),
    ]:
        with ck.case(label):
            try:
                call()
                ck.fail(label, "no error")
            except NotImplementedError as e:
                ck.expect(label, "cuda" in str(e).lower(), str(e))
    with ck.case("CPU ops still work"):
        t = torch.ones(3)
        dist.all_reduce(t)
        ck.same("all_reduce", t, torch.full((3,), float(n)))
    return ck.done()


def test_cuda_tensors_raise_not_implemented(worlds, seed):
    worlds.get(2).run(check_cuda_tensors_refused, seed=seed)
