"""Rank-side helpers: deterministic inputs (every rank can build every rank's inputs from the
shared seed), float64/int64 references, dtype-aware comparisons, and a Checker that collects
every failing case of a check instead of stopping at the first."""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
import zlib

import torch
import torch.distributed as dist

R = dist.ReduceOp

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
ALL_DTYPES = FLOATS + INTS + [torch.bool, torch.complex64]

SUM, AVG, PRODUCT, MIN, MAX = R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX
BAND, BOR, BXOR = R.BAND, R.BOR, R.BXOR
ALL_OPS = [SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR]
OP_NAMES = {
    SUM: "SUM",
    AVG: "AVG",
    PRODUCT: "PRODUCT",
    MIN: "MIN",
    MAX: "MAX",
    BAND: "BAND",
    BOR: "BOR",
    BXOR: "BXOR",
}


def opname(op) -> str:
    for k, v in OP_NAMES.items():
        if op == k:
            return v
    return str(op)


def dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def ops_for(dtype: torch.dtype) -> list:
    """The reduce ops that mean something for dtype."""
    if dtype == torch.bool:
        return [SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR]
    if dtype.is_complex:
        return [SUM, AVG]
    if dtype.is_floating_point:
        return [SUM, AVG, PRODUCT, MIN, MAX]
    return list(ALL_OPS)


def gloo_reduces(dtype: torch.dtype, op) -> bool:
    """Whether gloo (torch 2.11, CPU) reduces dtype with op so that it can serve as an oracle.
    gloo has no int16, no integer AVG; bool reductions are checked against the reference only."""
    if dtype in (torch.int16, torch.bool):
        return False
    return op != AVG or dtype.is_floating_point or dtype.is_complex


def gloo_moves(dtype: torch.dtype) -> bool:
    return dtype != torch.int16


# ----- inputs ---------------------------------------------------------------------------------


def gen(seed: int, key: str, rank: int, shape, dtype: torch.dtype, small: bool = False) -> torch.Tensor:
    """Deterministic random tensor for (seed, key, rank). small: integers in [-3, 3] (uint8 [0, 3])
    so sums and products stay exact; otherwise integers cover the dtype's whole range."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{key}|{rank}".encode()))
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.float64:
        return torch.randn(shape, generator=g, dtype=torch.float64)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    if small:
        lo = max(info.min, -3)
        return torch.randint(lo, 4, shape, generator=g, dtype=torch.int64).to(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def seeded_int(seed: int, key: str, lo: int, hi: int) -> int:
    """A shared random integer in [lo, hi] (the same on every rank)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{key}".encode()))
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


# ----- references ------------------------------------------------------------------------------


def reference(xs: list[torch.Tensor], op, dtype: torch.dtype) -> torch.Tensor:
    """op over every rank's input: float64/complex128 for floating dtypes, the exact torch result
    in dtype (integers wrap) for integers and bool."""
    n = len(xs)
    if dtype.is_floating_point or dtype.is_complex:
        wide = torch.complex128 if dtype.is_complex else torch.float64
        s = torch.stack([x.to(wide) for x in xs])
        if op == SUM:
            return s.sum(0)
        if op == AVG:
            return s.sum(0) / n
        if op == PRODUCT:
            return s.prod(0)
        if op == MIN:
            return s.amin(0)
        if op == MAX:
            return s.amax(0)
        raise ValueError(f"no reference for {opname(op)} on {dtype}")
    if dtype == torch.bool:
        s = torch.stack(xs)
        if op in (SUM, MAX, BOR):
            return s.any(0)
        if op in (PRODUCT, MIN, BAND):
            return s.all(0)
        if op == BXOR:
            return (s.to(torch.int64).sum(0) % 2).bool()
        raise ValueError(f"no reference for {opname(op)} on bool")
    if op == AVG:  # sum (inputs are small: no wrap), then divide truncating toward zero
        s = torch.stack([x.to(torch.int64) for x in xs]).sum(0)
        return torch.div(s, n, rounding_mode="trunc").to(dtype)
    acc = xs[0].clone()
    for x in xs[1:]:
        if op == SUM:
            acc = acc + x
        elif op == PRODUCT:
            acc = acc * x
        elif op == MIN:
            acc = torch.minimum(acc, x)
        elif op == MAX:
            acc = torch.maximum(acc, x)
        elif op == BAND:
            acc = acc & x
        elif op == BOR:
            acc = acc | x
        elif op == BXOR:
            acc = acc ^ x
    return acc.to(dtype)


def small_inputs(dtype: torch.dtype, op) -> bool:
    return op in (PRODUCT, AVG) and not (dtype.is_floating_point or dtype.is_complex)


def bound(xs: list[torch.Tensor], op, dtype: torch.dtype, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise error bound for a float reduction, valid whatever the order of the n-1
    additions or multiplications (each step rounds by at most eps/2 relative)."""
    n = len(xs)
    real = torch.float32 if dtype == torch.complex64 else dtype
    eps = torch.finfo(real).eps
    tiny = torch.finfo(real).tiny * 4
    absx = torch.stack([x.to(torch.complex128 if dtype.is_complex else torch.float64).abs() for x in xs])
    if op == SUM:
        b = (n + 1) * eps * absx.sum(0)
    elif op == AVG:
        b = (n + 2) * eps * absx.sum(0) / n
    elif op == PRODUCT:
        b = (n + 1) * eps * ref.abs()
    else:
        b = torch.zeros_like(absx[0])
    return b + tiny


# ----- comparisons -----------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def same(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if a and b have the same dtype, shape and bytes; else what differs."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} != {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)  # compare 0/1 values
    if torch.equal(_bytes(a), _bytes(b)):
        return None
    diff = (_bytes(a) != _bytes(b)).nonzero().flatten()
    i = int(diff[0]) // max(1, a.element_size())
    fa, fb = a.reshape(-1), b.reshape(-1)
    return f"{len(diff)} bytes differ; first at element {i}: {fa[i].item()!r} != {fb[i].item()!r}"


def close(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> str | None:
    """None if |got - ref| <= tol elementwise (ref in float64/complex128)."""
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if got.numel() == 0:
        return None
    wide = torch.complex128 if got.is_complex() else torch.float64
    d = (got.to(wide) - ref.to(wide)).abs()
    bad = ~(d <= tol)
    if not bad.any():
        return None
    i = int(bad.reshape(-1).nonzero()[0])
    return (
        f"{int(bad.sum())} of {got.numel()} elements off; first at {i}: got {got.reshape(-1)[i].item()!r}, "
        f"want {ref.reshape(-1)[i].item()!r} +- {tol.reshape(-1)[i].item():.3g}"
    )


class Checker:
    """Collects failures of the cases of one check on one rank; done() raises them all."""

    def __init__(self, what: str, seed, rank: int):
        self.what, self.seed, self.rank = what, seed, rank
        self.failures: list[str] = []
        self.cases = 0

    def fail(self, label: str, why: str) -> None:
        self.failures.append(f"{label}: {why}")

    @contextlib.contextmanager
    def case(self, label: str):
        """A case: an exception in it is recorded, and the check goes on with the next case."""
        self.cases += 1
        t0, failed = time.monotonic(), len(self.failures)
        print(f"  case {label} ...", end="", file=sys.stderr, flush=True)
        try:
            yield
        except Exception as e:  # noqa: BLE001
            tb = traceback.extract_tb(e.__traceback__)
            where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
            self.fail(label, f"raised {type(e).__name__}: {e}{where}")
        # each case's outcome in the rank's log, so a run cut short still says where it was
        why = "; ".join(self.failures[failed:])[:2000]
        print(f" {'FAILED ' + why if why else 'ok'} in {time.monotonic() - t0:.2f}s", file=sys.stderr, flush=True)

    def same(self, label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        why = same(got, want)
        if why:
            self.fail(label, why)

    def reduced(
        self,
        label: str,
        got: torch.Tensor,
        xs: list[torch.Tensor],
        op,
        dtype,
        gloo=None,
    ) -> None:
        """got is op over xs: exact for integers, bool, MIN and MAX; within the rounding bound
        of the dtype for float sums, averages and products. gloo: the same op's gloo result."""
        ref = reference(xs, op, dtype)
        if got.dtype != dtype:
            self.fail(label, f"dtype {got.dtype}, want {dtype}")
            return
        if dtype.is_floating_point or dtype.is_complex:
            tol = bound(xs, op, dtype, ref)
            why = close(got, ref, tol)
            if why:
                self.fail(label + " vs float64 reference", why)
            if gloo is not None:
                why = close(got, gloo.to(ref.dtype), 2 * tol)
                if why:
                    self.fail(label + " vs gloo", why)
        else:
            why = same(got, ref.to(dtype))
            if why:
                self.fail(label + " vs reference", why)
            if gloo is not None:
                why = same(got, gloo)
                if why:
                    self.fail(label + " vs gloo", why)

    def expect(self, label: str, cond: bool, why: str = "") -> None:
        if not cond:
            self.fail(label, why or "expectation failed")

    def done(self) -> int:
        if self.failures:
            shown = self.failures[:40]
            more = f"\n  ... and {len(self.failures) - 40} more" if len(self.failures) > 40 else ""
            raise AssertionError(
                f"{self.what} on rank {self.rank}: {len(self.failures)} of {self.cases} cases failed "
                f"(seed {self.seed}):\n  " + "\n  ".join(shown) + more
            )
        return self.cases
