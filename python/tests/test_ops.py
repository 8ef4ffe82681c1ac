"""torch.ops.gocomm (csrc/client/ops.cc): gocomm.all_to_all_v's in-process path as registered
operators. Here, without a GPU, their schemas and Meta kernels (what torch.compile traces
with): the padded output is out_rows rows shaped like input's, out_splits has in_splits'
dtype and size on input's device. test_gpu's check_all_to_all_v_op runs them."""

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
    got = torch.ops.gocomm.all_to_all_v_out(x, torch.empty(3, dtype=torch.int64, device="meta"), out, "g")
    assert (got.shape, got.dtype) == ((3,), torch.int64)


def test_schemas_name_the_mutation():
    a = torch.ops.gocomm.all_to_all_v.default._schema
    b = torch.ops.gocomm.all_to_all_v_out.default._schema
    assert not any(arg.alias_info for arg in a.arguments), str(a)
    assert [arg.name for arg in b.arguments if arg.alias_info and arg.alias_info.is_write] == ["out"], str(b)


def test_cpu_tensors_are_refused():
    with pytest.raises(NotImplementedError):
        torch.ops.gocomm.all_to_all_v(torch.ones(2, 2), torch.ones(2, dtype=torch.int64), 4, "g")
