"""The GPU tests' float-sum tolerance (test_gpu._sum_scale), checked on the CPU: a sum that
NCCL's ring may legitimately produce (one bf16/fp16 rounding per step, in any ring order)
must pass against gocomm's (summed in float32, rounded once), on fresh inputs and on the
seed that failed on 4 GPUs when the error was taken relative to the result's size."""

from __future__ import annotations

import pytest
import torch
from test_gpu import _input, _sum_scale


def _ring_sums(xs):
    """The sums a ring reaches over xs: every start rank, both directions, a rounding per step."""
    n = len(xs)
    for start in range(n):
        for way in (1, -1):
            acc = xs[start]
            for k in range(1, n):
                acc = (acc.float() + xs[(start + way * k) % n].float()).to(acc.dtype)
            yield acc.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_sums_pass(seed, dtype, n):
    count = 1 << 16
    xs = [_input(seed, "tol", q, count, dtype, "cpu") for q in range(n)]
    once = sum(x.double() for x in xs).float().to(dtype).double()
    scale = _sum_scale(seed, "tol", range(n), count, dtype)
    tol = max(1e-2, n * torch.finfo(dtype).eps / 2)
    for w in _ring_sums(xs):
        err = ((once - w).abs() / (scale + 1)).max().item()
        assert err <= tol, f"seed {seed}: {err} over {tol}"


def test_the_seed_that_failed():
    """x4 run v6: bf16 all_reduce sum of 2^18 elements on 4 ranks, seed 76811082. Against the
    result's size the ring order starting at rank 0 errs 0.01596 (the figure the GPU test
    reported) over 0.015625; against the inputs' sizes it stays under 0.01."""
    seed, n, count, dtype = 76811082, 4, 1 << 18, torch.bfloat16
    key = f"arbfloat16{count}sum"
    xs = [_input(seed, key, q, count, dtype, "cpu") for q in range(n)]
    once = sum(x.double() for x in xs).float().to(dtype).double()
    ring = next(_ring_sums(xs))
    old = ((once - ring).abs() / (ring.abs() + 1)).max().item()
    assert abs(old - 0.01596) < 1e-5, old
    new = ((once - ring).abs() / (_sum_scale(seed, key, range(n), count, dtype) + 1)).max().item()
    assert new < 0.01, new
