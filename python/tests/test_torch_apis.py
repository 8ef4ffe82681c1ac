"""torch's own distributed APIs that sit on a process group run on gocomm as they do on NCCL,
on CPU tensors here: functional collectives (what DTensor, tensor and expert parallelism and
compiled graphs call), their autograd all-to-all (expert parallelism's token exchange), the
same under torch.compile, gocomm's own all_to_all_v op padded and compiled, DTensor
redistribution and distributed checkpointing. Each against a reference every rank computes."""

from __future__ import annotations

import torch
import torch._functorch.config  # noqa: F401 - its patch() below (torch.compile imports it too)
import torch.distributed as dist
from ranklib import SUM, Checker, gen


def check_torch_apis(rk, seed, ckpt_dir):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ck, n, me = Checker("torch's APIs on gocomm", seed, rk.rank), rk.size, rk.rank
    w = dist.group.WORLD
    xs = [gen(seed, "api/x", r, (4 * n, 3), torch.float64) for r in range(n)]
    with ck.case("functional collectives"):
        ck.reduced("all_reduce", funcol.all_reduce(xs[me], "sum", w), xs, SUM, torch.float64)
        ck.same("all_gather_tensor", funcol.all_gather_tensor(xs[me], 0, w), torch.cat(xs))
        rs = funcol.reduce_scatter_tensor(xs[me], "sum", 0, w)
        ck.reduced("reduce_scatter_tensor", rs, [x[4 * me : 4 * me + 4] for x in xs], SUM, torch.float64)
    # an uneven all-to-all, for the two all-to-all cases: what each rank sends and receives,
    # and each row's gradient when a row's loss weight is its receiver's rank + 1
    ins = [(me + r) % 3 + 1 for r in range(n)]  # rows this rank sends to rank r
    outs = [(s + me) % 3 + 1 for s in range(n)]  # rows rank s sends here
    rows = [gen(seed, "api/a2a", s, (sum((s + r) % 3 + 1 for r in range(n)), 2), torch.float64) for s in range(n)]
    want = torch.cat([rows[s][sum((s + r) % 3 + 1 for r in range(me)) :][: outs[s]] for s in range(n)])
    grads = [torch.full((ins[r], 2), r + 1.0, dtype=torch.float64) for r in range(n)]
    with ck.case("all_to_all_single_autograd, uneven splits, and its backward"):
        x = rows[me].clone().requires_grad_()
        y = funcol.wait_tensor(funcol.all_to_all_single_autograd(x, outs, ins, w))
        ck.same("rows by source rank", y.detach(), want)
        (y * (me + 1)).sum().backward()
        ck.same("gradient back to the senders", x.grad, torch.cat(grads))
    with ck.case("functional collectives under torch.compile (fullgraph)"):

        @torch.compile(backend="aot_eager", fullgraph=True)
        def step(u, v):
            return funcol.all_reduce(u * 2, "sum", w), funcol.all_to_all_single_autograd(v * 2, [2] * n, [2] * n, w) + 1

        v = xs[me][: 2 * n].clone().requires_grad_()
        total, got = step(xs[me], v)
        ck.reduced("compiled all_reduce", total, [x * 2 for x in xs], SUM, torch.float64)
        ck.same("compiled all-to-all", got.detach(), torch.cat([x[2 * me : 2 * me + 2] * 2 for x in xs]) + 1)
        got.sum().backward()
        ck.same("compiled backward", v.grad, torch.full_like(v, 2.0))
    with ck.case("gocomm's all_to_all_v op with out_rows: padded, sent back, compiled"):
        # out_rows rows on every path (the Meta kernel's shape), the received rows first; input
        # rows past sum(in_splits) are not sent, so the padded output goes back as it is
        cap, name = 3 * n + 1, w.group_name
        x = torch.cat([rows[me], torch.full((2, 2), 9.0, dtype=torch.float64)]).requires_grad_()  # 2 unsent
        out, got = torch.ops.gocomm.all_to_all_v(x, torch.tensor(ins), cap, name)
        ck.expect("out_rows rows", tuple(out.shape) == (cap, 2), str(tuple(out.shape)))
        ck.same("rows", out[: sum(outs)].detach(), want)
        ck.same("out_splits", got, torch.tensor(outs))
        back, _ = torch.ops.gocomm.all_to_all_v(out.detach(), got, sum(ins), name)
        ck.same("the padded output sent back", back, rows[me])
        (out[: sum(outs)] * (me + 1)).sum().backward()
        ck.same(
            "gradient back to the senders, none to the rows not sent",
            x.grad,
            torch.cat([*grads, torch.zeros(2, 2, dtype=torch.float64)]),
        )

        @torch.compile(backend="aot_eager", fullgraph=True)
        def doubled(x, s):
            o, g = torch.ops.gocomm.all_to_all_v(x, s, cap, name)
            return o * 2, g + 1

        # outputs sharing a storage are an error in a custom op from torch 2.12 (2.11 warns)
        with torch._functorch.config.patch(error_on_custom_op_aliasing=True):
            out, got = doubled(rows[me], torch.tensor(ins))
        ck.expect("compiled: out_rows rows", tuple(out.shape) == (cap, 2), str(tuple(out.shape)))
        ck.same("compiled: rows", out[: sum(outs)], want * 2)
        ck.same("compiled: out_splits", got, torch.tensor(outs) + 1)
    with ck.case("all_to_all_v_into (out written in place) compiled through AOTAutograd"):
        name = w.group_name

        @torch.compile(backend="aot_eager", fullgraph=True)
        def into(x, s, buf):
            return torch.ops.gocomm.all_to_all_v_into(x * 2, s, buf, name) + 1

        buf = torch.full((3 * n + 1, 2), -1.0, dtype=torch.float64)
        got = into(rows[me], torch.tensor(ins), buf)
        ck.same("compiled into: out_splits", got, torch.tensor(outs) + 1)
        ck.same("compiled into: out's rows", buf[: sum(outs)], want * 2)
    with ck.case("gocomm.moe on CPU tensors under torch.compile: a graph break, eager's result"):
        import gocomm

        k, experts, tok = 2, 2 * n, 5
        x = gen(seed, "api/moex", me, (tok, 4), torch.float32)
        idx = gen(seed, "api/moei", me, (tok, experts), torch.float32).argsort(1)[:, :k]
        wt = gen(seed, "api/moew", me, (tok, k), torch.float32).abs()

        def layer(x, idx, wt):
            recv, _tpe, h = gocomm.moe.dispatch(x * 2, idx, wt, experts)
            return gocomm.moe.combine(recv + 1, h)

        eager = layer(x, idx, wt)
        for backend in ("eager", "aot_eager"):
            ck.same(f"compiled ({backend})", torch.compile(layer, backend=backend)(x, idx, wt), eager)
    mesh = init_device_mesh("cpu", (n,))
    full = gen(seed, "api/dt", 0, (4 * n, 5), torch.float32)  # the same on every rank
    with ck.case("DTensor redistribution"):
        d = distribute_tensor(full, mesh, [Shard(0)])
        ck.same("a shard", d.to_local(), full[4 * me : 4 * me + 4])
        ck.same("Shard(0) -> Replicate()", d.redistribute(mesh, [Replicate()]).to_local(), full)
        ck.same("Shard(0) -> Shard(1)", d.redistribute(mesh, [Shard(1)]).full_tensor(), full)
    with ck.case("distributed checkpoint save and load"):
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=ckpt_dir)
        state = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
        dcp.load(state, checkpoint_id=ckpt_dir)
        ck.same("loaded", state["w"].full_tensor(), full)
    return ck.done()


def test_torch_apis(worlds, seed, tmp_path):
    worlds.get(3).run(check_torch_apis, seed=seed, ckpt_dir=str(tmp_path / "ckpt"))
