"""DistributedDataParallel on gocomm trains like it does on gloo: the same small CPU model, seeds
and data, 20 SGD steps, per-step losses equal within float tolerance; also with DDP comm hooks.
FSDP2 with a gradient divide factor, which gloo cannot run (PREMUL_SUM), against a
single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranklib import Checker
from torch import nn

STEPS = 20
LR, MOMENTUM = 0.05, 0.9


def _train(rk, seed, pg, variant):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed + 1000 * rk.rank)  # different on every rank: DDP must broadcast rank 0's
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
    kw = {"bucket_cap_mb": 0.004} if variant != "default" else {}  # small buckets: several all_reduces a step
    ddp = DDP(model, process_group=pg, **kw)
    if variant == "allreduce_hook":
        ddp.register_comm_hook(pg, default_hooks.allreduce_hook)
    elif variant == "fp16_compress_hook":
        ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed)) / 4  # the same on every rank
    losses, gmax = [], 0.0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(seed * 7 + 100 * step + rk.rank)
        x = torch.randn(8, 16, generator=g)
        y = x @ target + 0.01 * torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        gmax = max([gmax] + [p.grad.abs().max().item() for p in model.parameters()])
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], gmax


def check_ddp(rk, seed, variant):
    ck = Checker(f"DDP ({variant}) on world {rk.size}", seed, rk.rank)
    # fp16 compression rounds the gradients to half: gloo and gocomm may round a sum differently
    rtol = 2e-3 if variant == "fp16_compress_hook" else 1e-5
    with ck.case("train on gocomm"):
        go_losses, go_params, _ = _train(rk, seed, rk.world.pg, variant)
    with ck.case("train on gloo"):
        gl_losses, gl_params, gmax = _train(rk, seed, rk.world.gloo, variant)
    if ck.failures:
        ck.done()
    # Each step's reduced gradient may differ by one half rounding (2^-11 of it, either side):
    # through momentum SGD a parameter moves by at most LR / (1 - MOMENTUM) per unit of
    # gradient, so after STEPS steps the two runs may differ by up to this much (seed
    # 72065178 drifted 3.5e-3 apart, against the fixed 1e-3 this test had).
    atol = LR / (1 - MOMENTUM) * STEPS * 2.0**-10 * gmax if variant == "fp16_compress_hook" else 1e-6
    for step, (a, b) in enumerate(zip(go_losses, gl_losses, strict=True)):
        ck.expect(
            f"step {step} loss",
            abs(a - b) <= rtol * abs(b) + 1e-7,
            f"gocomm {a!r} vs gloo {b!r} (rtol {rtol})",
        )
    for i, (a, b) in enumerate(zip(go_params, gl_params, strict=True)):
        ck.expect(
            f"final parameter {i}",
            torch.allclose(a, b, rtol=rtol * 10, atol=atol),
            f"max diff {(a - b).abs().max().item():.3g}",
        )
    # DDP keeps replicas in sync: every rank ends with the same parameters
    flat = torch.cat([p.reshape(-1) for p in go_params])
    mine = flat.clone()
    dist.broadcast(flat, src=0, group=rk.world.gloo)
    ck.expect(
        "replicas identical",
        torch.equal(flat, mine),
        "rank's parameters differ from rank 0's",
    )
    first, last = sum(go_losses[:5]) / 5, sum(go_losses[-5:]) / 5
    ck.expect(
        "the model learned",
        last < first,
        f"mean loss of the first 5 steps {first:.4f}, of the last 5 {last:.4f}",
    )
    ck.done()
    return go_losses


@pytest.mark.parametrize("variant", ["default", "allreduce_hook", "fp16_compress_hook"])
@pytest.mark.parametrize("size", [2, 3])
def test_ddp_matches_gloo(worlds, seed, size, variant):
    losses = worlds.get(size).run(check_ddp, seed=seed, variant=variant)
    assert all(len(rl) == STEPS for rl in losses)
    print("per-step losses of rank 0:", [round(x, 5) for x in losses[0]])


def check_fsdp_divide_factor(rk, seed):
    """FSDP2 (fully_shard on a gocomm mesh) with a gradient divide factor other than the group
    size reduce-scatters its gradients with PREMUL_SUM (1 / factor): each parameter's gradient,
    gathered, is the sum over ranks of that rank's own gradient divided by the factor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ck, n, me = Checker("FSDP2 gradient divide factor", seed, rk.rank), rk.size, rk.rank
    factor = 3.0
    torch.manual_seed(seed)  # the same weights on every rank
    ref = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6))
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6))
    model.load_state_dict(ref.state_dict())
    fully_shard(model, mesh=init_device_mesh("cpu", (n,)))
    model.set_gradient_divide_factor(factor)
    with ck.case("FSDP2 picks PREMUL_SUM for this"):  # what the gradients below go through
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

        op = _get_gradient_divide_factors(dist.group.WORLD, None, torch.float32, "cpu", factor)[2]
        ck.expect("reduce-scatter op", getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM, repr(op))
    xs = [torch.randn(5, 12, generator=torch.Generator().manual_seed(seed + r)) for r in range(n)]
    model(xs[me]).square().sum().backward()
    for x in xs:  # the reference: every rank's gradient, summed, then divided
        ref(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        with ck.case(name):
            got, want = p.grad.full_tensor(), q.grad / factor
            err = (got - want).abs().max().item()
            ck.expect(f"{name}'s gradient", err < 1e-5 * max(1.0, want.abs().max().item()), f"max error {err}")
    return ck.done()


def test_fsdp_gradient_divide_factor(worlds, seed):
    worlds.get(2).run(check_fsdp_divide_factor, seed=seed)
