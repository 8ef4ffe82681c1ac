"""The GPU tests' float-sum measure (test_gpu._float_err with _sum_scale), checked on the CPU:
a sum NCCL's ring may legitimately produce (a rounding per step, in any ring order) passes
against gocomm's (summed in float32, rounded once), and a sum missing one rank's input fails,
on fresh inputs and on the seed that failed on 4 GPUs when the error was taken relative to
the result's size. fp8 sums are compared exactly instead: their inputs make every order agree."""

from __future__ import annotations

import pytest
import torch
from test_gpu import FP8, _float_err, _input, _sum_scale

FLOATS = [torch.bfloat16, torch.float16]


def _ring_sums(xs):
    """The sums a ring reaches over xs: every start rank, both directions, a rounding per step."""
    n = len(xs)
    for start in range(n):
        for way in (1, -1):
            acc = xs[start]
            for k in range(1, n):
                acc = (acc.float() + xs[(start + way * k) % n].float()).to(acc.dtype)
            yield acc


def _once(xs):
    return sum(x.double() for x in xs).float().to(xs[0].dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_sums_pass_and_a_missing_rank_fails(seed, dtype, n):
    count = 1 << 14
    xs = [_input(seed, "tol", q, count, dtype, "cpu") for q in range(n)]
    scale = _sum_scale(xs)
    once = _once(xs)
    for w in _ring_sums(xs):
        err, tol = _float_err(once, w, steps=n, scale=scale)
        assert err <= tol, f"seed {seed}: a ring order errs {err} over {tol}"
    for q in range(n):
        err, tol = _float_err(_once(xs[:q] + xs[q + 1 :]), once, steps=n, scale=scale)
        assert err > tol, f"seed {seed}: without rank {q}'s input the sum errs only {err} (tol {tol})"


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_sums_are_exact_in_any_order(seed, dtype):
    """fp8 all_reduce inputs (exact_sum) sum to the same bits in every ring order on 8 ranks,
    so the GPU tests compare them exactly; a missing rank shows."""
    n = 8
    xs = [_input(seed, "fp8", q, 1 << 14, dtype, "cpu", exact_sum=True) for q in range(n)]
    once = _once(xs)
    assert all(len(x.float().unique()) == 3 for x in xs)
    for w in _ring_sums(xs):
        assert torch.equal(w.view(torch.uint8), once.view(torch.uint8))
    assert not torch.equal(_once(xs[1:]).view(torch.uint8), once.view(torch.uint8))


def test_the_seed_that_failed():
    """x4 run v6: bf16 all_reduce sum of 2^18 elements on 4 ranks, seed 76811082. Against the
    result's size the ring order starting at rank 0 errs 0.01596 (the figure the GPU test
    reported) over 0.015625; against the inputs' sizes it stays under 0.01."""
    seed, n, count, dtype = 76811082, 4, 1 << 18, torch.bfloat16
    key = f"arbfloat16{count}sum"
    xs = [_input(seed, key, q, count, dtype, "cpu") for q in range(n)]
    ring = next(_ring_sums(xs))
    old, tol = _float_err(_once(xs), ring, steps=n)
    assert abs(old - 0.01596) < 1e-5 and old > tol, old
    new, tol = _float_err(_once(xs), ring, steps=n, scale=_sum_scale(xs))
    assert new < 0.01, new
