"""torch.ops.gocomm (csrc/client/ops.cc): gocomm.all_to_all_v as registered operators, every
path (csrc/client/a2av.cc). Here, without a group, their schemas and Meta kernels (what
torch.compile traces with): the padded output is out_rows rows shaped like input's (the out
form: out itself), out_splits has in_splits' dtype, size and device. test_moe's
check_all_to_all_v runs them on CPU tensors (through gocomm.all_to_all_v), test_gpu's
check_all_to_all_v_op on CUDA tensors."""

import re

import pytest
import torch

import gocomm  # noqa: F401 - loads the compiled client, which registers the ops


def test_all_to_all_v_meta():
    x = torch.empty(5, 3, 2, dtype=torch.bfloat16, device="meta")
    for dtype in (torch.int32, torch.int64):
        s = torch.empty(4, dtype=dtype, device="meta")
        out, got = torch.ops.gocomm.all_to_all_v(x, s, 17, "any group")
        assert (out.shape, out.dtype, out.device.type) == ((17, 3, 2), torch.bfloat16, "meta")
        assert (got.shape, got.dtype, got.device.type) == ((4,), dtype, "meta")


def test_all_to_all_v_out_meta():
    x = torch.empty(5, 8, device="meta")
    out = torch.empty(30, 8, device="meta")
    got_out, got = torch.ops.gocomm.all_to_all_v_out(x, torch.empty(3, dtype=torch.int64, device="meta"), out, "g")
    assert got_out is out
    assert (got.shape, got.dtype) == ((3,), torch.int64)


def test_all_to_all_v_default_rows_have_no_meta_shape():
    # out_rows -1 (the path's default: on the host-count path exactly the rows received)
    # cannot be traced; the error says what to pass
    x = torch.empty(5, 3, device="meta")
    with pytest.raises(NotImplementedError, match="pass out_rows"):
        torch.ops.gocomm.all_to_all_v(x, torch.empty(2, dtype=torch.int64, device="meta"), -1, "g")


def test_a_meta_tensor_among_real_ones_is_refused():
    # the dispatcher sends any call with a meta tensor to the Meta kernel, which exchanges
    # nothing: it checks the devices as the real kernels do instead of returning quietly
    x, s = torch.ones(4, 2), torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="in_splits is on meta, input on cpu"):
        torch.ops.gocomm.all_to_all_v(x, s.to("meta"), 8, "g")
    with pytest.raises(ValueError, match="in_splits is on meta, input on cpu"):
        torch.ops.gocomm.all_to_all_v_out(x, s.to("meta"), torch.empty(8, 2), "g")
    with pytest.raises(ValueError, match="out is on meta, input on cpu"):
        torch.ops.gocomm.all_to_all_v_out(x, s, torch.empty(8, 2, device="meta"), "g")
    # CPU splits with meta tensors are what a trace passes, as the real kernels take them
    out, got = torch.ops.gocomm.all_to_all_v(x.to("meta"), s, 8, "g")
    assert (out.shape, got.device.type) == ((8, 2), "cpu")


def test_schemas_name_the_mutation():
    a = torch.ops.gocomm.all_to_all_v.default._schema
    b = torch.ops.gocomm.all_to_all_v_out.default._schema
    assert not any(arg.alias_info for arg in a.arguments), str(a)
    assert [arg.name for arg in b.arguments if arg.alias_info and arg.alias_info.is_write] == ["out"], str(b)


def test_cpu_tensors_reach_the_op():
    # a CPU kernel is registered (the host-count path): it resolves the group by name first
    with pytest.raises(RuntimeError, match="no-such-group"):
        torch.ops.gocomm.all_to_all_v(torch.ones(2, 2), torch.ones(2, dtype=torch.int64), 4, "no-such-group")
    with pytest.raises(ValueError, match="out_rows must be >= 0"):
        torch.ops.gocomm.all_to_all_v(torch.ones(2, 2), torch.ones(2, dtype=torch.int64), -2, "g")


def test_moe_dispatch_meta():
    # the padded form's shapes (moe.dispatch's in-process path; csrc/client/moe.cc): recv
    # [cap x k, hidden] in x's dtype, tokens_per_expert [experts / ranks] int64, a uint8
    # workspace, and no host counts
    x = torch.empty(128, 7168, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(128, 8, dtype=torch.int64, device="meta")
    w = torch.empty(128, 8, dtype=torch.float32, device="meta")
    recv, tpe, ws, counts = torch.ops.gocomm.moe_dispatch(x, idx, w, 256, 2, 256, True, "g")
    assert (recv.shape, recv.dtype, recv.device.type) == ((256 * 8, 7168), torch.bfloat16, "meta")
    assert (tpe.shape, tpe.dtype) == ((128,), torch.int64)
    assert ws.dtype == torch.uint8 and ws.dim() == 1 and ws.shape[0] > 0 and ws.shape[0] % 256 == 0
    assert (counts.shape, counts.dtype) == ((0,), torch.int64)
    # the workspace grows with what it holds: more received rows, more room
    assert torch.ops.gocomm.moe_dispatch(x, idx, w, 256, 2, 512, True, "g")[2].shape[0] > ws.shape[0]
    with pytest.raises(NotImplementedError, match="depend on the routing"):
        torch.ops.gocomm.moe_dispatch(x, idx, w, 256, 2, 256, False, "g")
    with pytest.raises(ValueError, match="spread evenly"):
        torch.ops.gocomm.moe_dispatch(x, idx, w, 255, 2, 256, True, "g")


def test_moe_combine_meta():
    y = torch.empty(2048, 7168, dtype=torch.float16, device="meta")
    ws = torch.empty(4096, dtype=torch.uint8, device="meta")
    out = torch.ops.gocomm.moe_combine(y, ws, 128, 256, 8, 256, 256, 256, "g")
    assert (out.shape, out.dtype, out.device.type) == ((128, 7168), torch.float16, "meta")


def test_moe_low_latency_meta():
    # the low-latency ops' Meta kernels give padded's shapes (torch.compile traces them)
    x = torch.empty(128, 7168, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(128, 8, dtype=torch.int64, device="meta")
    w = torch.empty(128, 8, dtype=torch.float32, device="meta")
    recv, tpe, ws = torch.ops.gocomm.moe_dispatch_ll(x, idx, w, 256, 8, 128, "g")
    padded = torch.ops.gocomm.moe_dispatch(x, idx, w, 256, 8, 128 * 8, True, "g")
    assert (recv.shape, recv.dtype) == (padded[0].shape, torch.bfloat16) == ((128 * 8 * 8, 7168), torch.bfloat16)
    assert (tpe.shape, ws.shape, ws.dtype) == ((32,), padded[2].shape, torch.uint8)
    out = torch.ops.gocomm.moe_combine_ll(recv, ws, 128, 128, 8, 256, "g")
    assert (out.shape, out.dtype, out.device.type) == ((128, 7168), torch.bfloat16, "meta")
    with pytest.raises(ValueError, match="spread evenly"):
        torch.ops.gocomm.moe_dispatch_ll(x, idx, w, 255, 8, 128, "g")


def test_moe_schemas_mutate_nothing():
    for op in (
        torch.ops.gocomm.moe_dispatch,
        torch.ops.gocomm.moe_combine,
        torch.ops.gocomm.moe_dispatch_ll,
        torch.ops.gocomm.moe_combine_ll,
    ):
        s = op.default._schema
        assert not any(arg.alias_info for arg in s.arguments), str(s)


def test_moe_ops_refuse_cpu_tensors():
    x = torch.ones(4, 8)
    with pytest.raises(NotImplementedError):
        torch.ops.gocomm.moe_dispatch(x, torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2), 4, 2, 8, True, "g")
    with pytest.raises(NotImplementedError):
        torch.ops.gocomm.moe_combine(x, torch.zeros(64, dtype=torch.uint8), 4, 8, 2, 4, 8, 8, "g")
    # the low-latency ops too (gocomm.moe then takes the padded path)
    with pytest.raises(NotImplementedError):
        torch.ops.gocomm.moe_dispatch_ll(x, torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2), 4, 2, 4, "g")
    with pytest.raises(NotImplementedError):
        torch.ops.gocomm.moe_combine_ll(x, torch.zeros(64, dtype=torch.uint8), 4, 4, 2, 4, "g")


def test_moe_any_ops_schemas():
    # the other paths' ops (csrc/client/moe_any.cc), CPU and CUDA in one function: they mutate
    # nothing, moe_check raises what gocomm.moe.dispatch documents, and the ATen routing raises
    # for ids out of range
    for op in (
        torch.ops.gocomm.moe_check,
        torch.ops.gocomm.moe_dispatch_any,
        torch.ops.gocomm.moe_route_any,
        torch.ops.gocomm.moe_receive_any,
        torch.ops.gocomm.moe_combine_any,
    ):
        s = op.default._schema
        assert not any(arg.alias_info for arg in s.arguments), str(s)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    for args, exc, words in (
        ((torch.zeros(3), ids, torch.ones(3, 2), 4, 2, False, None, False), ValueError, "[tokens, hidden]"),
        ((torch.zeros(3, 8), ids.float(), torch.ones(3, 2), 4, 2, False, None, False), TypeError, "integers"),
        ((torch.zeros(3, 8), ids, torch.ones(3, 2), 5, 2, False, None, False), ValueError, "spread evenly"),
        ((torch.zeros(3, 100), ids, torch.ones(3, 2), 4, 2, True, None, False), ValueError, "multiple of 128"),
        ((torch.zeros(3, 8), ids, torch.ones(3, 2), 4, 2, False, None, True), ValueError, "needs max_tokens"),
        ((torch.zeros(3, 8), ids, torch.ones(3, 2), 4, 2, False, 2, False), ValueError, "2 < this rank's 3"),
    ):
        with pytest.raises(exc, match=re.escape(words)):
            torch.ops.gocomm.moe_check(*args)
    torch.ops.gocomm.moe_check(torch.zeros(3, 128), ids, torch.ones(3, 2), 4, 2, True, 3, True)
    with pytest.raises(ValueError, match=re.escape("topk_idx must be in [-1, 4), got -1..9")):
        bad = torch.tensor([[0, 9], [-1, 1], [2, 3]])
        torch.ops.gocomm.moe_route_any(torch.zeros(3, 8), bad, torch.ones(3, 2), 4, 2, False, True)


def test_moe_kernel_ops_schemas():
    # the other paths' launches (csrc/client/moe_kernels.cc): each returns [] where the kernels
    # do not take the input, so moe.py falls back to torch ops; test_gpu runs them
    for op in (torch.ops.gocomm.moe_route_pack, torch.ops.gocomm.moe_group, torch.ops.gocomm.moe_wsum):
        s = op.default._schema
        assert not any(arg.alias_info for arg in s.arguments), str(s)
        assert [str(r.type) for r in s.returns] == ["List[Tensor]"], str(s)
    x = torch.ones(4, 8)
    with pytest.raises(NotImplementedError):  # moe.py routes CPU tensors with torch ops
        torch.ops.gocomm.moe_route_pack(x, torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2), 4, 2)
    with pytest.raises(NotImplementedError):
        torch.ops.gocomm.moe_wsum(x, torch.zeros(0, dtype=torch.int64), None, torch.zeros(5, dtype=torch.int64), 4)


def test_moe_row_layout():
    # the kernels' packed row (moe_row_bytes, what the in-process path sizes its receive
    # capacity by) is the one the other paths' ATen packing (moe_route_any on the CPU) gives:
    # x, int32 ids, float32 weights, each 16-byte aligned
    from gocomm import _client

    for h, dtype, k in [
        (7168, torch.bfloat16, 8),
        (64, torch.float32, 1),
        (8, torch.float16, 4),
        (2048, torch.bfloat16, 5),
    ]:
        x = torch.zeros(1, h, dtype=dtype)
        idx, w = torch.zeros(1, k, dtype=torch.int64), torch.ones(1, k)
        payload = torch.ops.gocomm.moe_route_any(x, idx, w, 2, 2, False, True)[0]
        assert _client.C.moe_row_bytes(h * x.element_size(), k) == payload.shape[1], (h, dtype, k)
        want = -(-h * x.element_size() // 16) * 16 + 2 * (-(-4 * k // 16) * 16)
        assert payload.shape[1] == want, (h, dtype, k)
    assert not _client.C.moe_takes(torch.ones(4, 8), 2, 4), "CPU tensors take torch ops"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_moe_route_receive_cpu(fp8):
    # the other paths' two halves on the CPU (ATen), with the exchange left out (one rank: what
    # it sends is what it receives), against tokens grouped by expert in Python; fp8 values and
    # scales are torch's quantization per 128 channels, bit for bit
    g = torch.Generator().manual_seed(7)
    t, h, k, experts = 9, 256, 3, 6
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    idx[2] = -1  # chooses nothing: never sent
    idx[4, 1] = -1
    w = torch.rand(t, k, generator=g)
    routed = torch.ops.gocomm.moe_route_any(x, idx.int(), w.double(), experts, 1, fp8, True)
    sent = [i for i in range(t) if bool((idx[i] >= 0).any())]
    assert routed[1].tolist() == [len(sent)] and routed[4].tolist() == sent
    if fp8:
        blocks = x.float().view(t, h // 128, 128)
        scale = blocks.abs().amax(dim=2).clamp(min=1e-12) / 448.0
        values = (blocks / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h)
    order = [(e, i) for e in range(experts) for i in range(t) if bool((idx[i] == e).any())]
    rows = [i for _, i in order]
    for padded in (0, 40):
        got = torch.ops.gocomm.moe_receive_any(routed[0], routed[1], routed, experts, fp8, padded)
        assert got[0].shape[0] == (padded or len(rows))
        if fp8:
            assert torch.equal(got[0][: len(rows)].view(torch.uint8), values[rows].view(torch.uint8))
            assert torch.equal(got[1][: len(rows)], scale[rows])
        else:
            assert torch.equal(got[0][: len(rows)], x[rows])
        assert got[2].tolist() == [sum(1 for e2, _ in order if e2 == e) for e in range(experts)]
        assert got[4].tolist() == [len(sent), len(sent)], "sent and received, by rank"


def test_all_to_all_v_backward_traces():
    # the backward is all_to_all_v of the gradient by out_splits into input's rows: traced
    # (symbolic sizes, as torch.compile traces) with no group, the graph has two exchanges
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, s):
        out, _ = torch.ops.gocomm.all_to_all_v(x, s, 3 * x.shape[0], "g")
        return torch.autograd.grad(out.sum(), x)[0]

    x = torch.empty(5, 4, device="meta", requires_grad=True)
    s = torch.empty(3, dtype=torch.int64, device="meta")
    gm = make_fx(step, tracing_mode="symbolic")(x, s)
    calls = [n for n in gm.graph.nodes if n.target == torch.ops.gocomm.all_to_all_v.default]
    assert len(calls) == 2, gm.code
    grad = step(x, s)
    assert (grad.shape, grad.dtype, grad.device.type) == ((5, 4), torch.float32, "meta")
