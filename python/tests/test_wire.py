"""The wire format the shim (python/gocomm/_wire.py) and pgserver share: every number is read out
of the Go sources and compared, and the shim's idea of which reduce ops each dtype supports
is checked against what the sidecar accepts."""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path

import pytest
from ranklib import Checker

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTOR_GO = ROOT / "wire" / "descriptor.go"
DTYPE_GO = ROOT / "wire" / "dtype.go"


def _go_consts(path: Path, typ: str) -> dict[str, int]:
    """NAME -> value for `NAME Type = 12` lines."""
    text = path.read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"^\s*(\w+)\s+{typ}\s*=\s*(\d+)", text, re.MULTILINE)}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).upper()


@pytest.fixture(scope="module")
def wire():
    from gocomm import _wire

    return _wire


def test_op_kinds_match_go(wire):
    go = _go_consts(DESCRIPTOR_GO, "OpKind")
    assert go, f"no OpKind constants found in {DESCRIPTOR_GO}"
    for name, value in go.items():
        py = _snake(name[len("Op") :])
        assert getattr(wire, py) == value, f"{name} = {value} in Go, _wire.{py} = {getattr(wire, py)}"
    assert set(wire.OP_NAMES) == set(go.values())


def test_statuses_match_go(wire):
    go = _go_consts(DESCRIPTOR_GO, "int32")
    statuses = {k: v for k, v in go.items() if k.startswith("Status")}
    assert len(statuses) >= 9
    for name, value in statuses.items():
        py = "STATUS_" + _snake(name[len("Status") :])
        assert getattr(wire, py) == value, f"{name} = {value} in Go, _wire.{py} = {getattr(wire, py)}"
        if value:
            assert value in wire.STATUS_NAMES


def test_record_types_and_devices_match_go(wire):
    go16 = _go_consts(DESCRIPTOR_GO, "uint16")
    assert (go16["RecOp"], go16["RecDone"]) == (wire.REC_OP, wire.REC_DONE)
    go8 = _go_consts(DESCRIPTOR_GO, "uint8")
    assert (go8["DeviceHost"], go8["DeviceCUDA"]) == (
        wire.DEVICE_HOST,
        wire.DEVICE_CUDA,
    )


def test_dtypes_match_go(wire):
    codes = _go_consts(DTYPE_GO, "DType")
    text = DTYPE_GO.read_text()
    table = {
        m.group(1): (m.group(2), int(m.group(3)))
        for m in re.finditer(r'^\s*(\w+):\s*\{"(\w+)",\s*(\d+)', text, re.MULTILINE)
    }
    by_torch_name = {tname: (codes[go], size) for go, (tname, size) in table.items()}
    assert by_torch_name, f"no dtype table found in {DTYPE_GO}"
    for dtype, code in wire.DTYPES.items():
        name = str(dtype).removeprefix("torch.")
        assert name in by_torch_name, f"{name} is in _wire.DTYPES but not in the Go dtype table"
        go_code, size = by_torch_name[name]
        assert code == go_code, f"{name}: _wire says {code}, Go says {go_code}"
        assert size == dtype.itemsize, f"{name}: Go says {size} bytes, torch {dtype.itemsize}"
    assert len(wire.DTYPES) == len(by_torch_name)


def test_reduce_ops_match_go(wire):
    go = _go_consts(DTYPE_GO, "RedOp")
    names = {
        "Sum": "SUM",
        "Avg": "AVG",
        "Product": "PRODUCT",
        "Min": "MIN",
        "Max": "MAX",
    }
    names.update({"BAnd": "BAND", "BOr": "BOR", "BXor": "BXOR"})
    for go_name, py in names.items():
        assert getattr(wire, py) == go[go_name], f"{go_name}"


def test_descriptor_layout(wire):
    """encode_desc puts each field at the offset the table in wire/descriptor.go gives."""
    text = DESCRIPTOR_GO.read_text()
    assert re.search(r"DescHeader\s*=\s*56", text) and re.search(r"bufRefSize\s*=\s*24", text)
    b = wire.encode_desc(
        0x0102030405060708,
        7,
        wire.SEND,
        9,
        3,
        -1,
        -5,
        1234,
        5678,
        [(3, 64, 128), (4, 0, 8)],
        [1, -2, 3],
        wire.DEVICE_CUDA,
        0xDEADBEEF,
    )
    assert len(b) == 56 + 2 * 24 + 3 * 8
    seq, group = struct.unpack_from("<QI", b, 0)
    kind, dtype, redop, device = b[12], b[13], b[14], b[15]
    root, tag = struct.unpack_from("<ii", b, 16)
    count, timeout = struct.unpack_from("<QQ", b, 24)
    nbufs, nsplits = (
        struct.unpack_from("<H", b, 40)[0],
        struct.unpack_from("<I", b, 44)[0],
    )
    assert (seq, group, kind, dtype, redop, device) == (
        0x0102030405060708,
        7,
        wire.SEND,
        9,
        3,
        wire.DEVICE_CUDA,
    )
    assert (root, tag, count, timeout, nbufs, nsplits) == (-1, -5, 1234, 5678, 2, 3)
    assert struct.unpack_from("<I", b, 48)[0] == 0xDEADBEEF
    assert struct.unpack_from("<IIQQ", b, 56) == (3, 0, 64, 128)
    assert struct.unpack_from("<IIQQ", b, 80) == (4, 0, 0, 8)
    assert struct.unpack_from("<3q", b, 104) == (1, -2, 3)
    done = struct.pack("<Qii", 42, wire.STATUS_MISMATCH, 3) + "ünï".encode()
    assert wire.decode_done(done) == (42, wire.STATUS_MISMATCH, 3, "ünï")


def check_reduce_support_agrees(rk, seed):
    """For every dtype and reduce op, submit an all_reduce descriptor straight to the sidecar (1-rank
    group): it must accept exactly the pairs _wire.reduce_support accepts. A refused collective
    breaks its group, so each refusal moves on to a fresh group."""
    import datetime

    import torch.distributed as dist

    from gocomm import _wire
    from gocomm._dispatch import _GRACE, _Pending
    from gocomm._work import Work

    ck = Checker("reduce support, shim vs sidecar", seed, rk.rank)

    def group():
        return dist.new_group(backend="gocomm", timeout=datetime.timedelta(seconds=rk.timeout_s))

    g = group()
    for dtype, dcode in _wire.DTYPES.items():
        for _, ocode, oname in _wire.REDUCE_OPS:
            label = f"{dtype} {oname}"
            with ck.case(label):
                nbytes = 4 * dtype.itemsize
                seg, off, view = g._sc.arena.alloc(nbytes)
                view.zero_()
                work = Work("all_reduce", [], g._timeout + _GRACE)
                p = _Pending(
                    work,
                    "all_reduce",
                    time.monotonic() + g._timeout + _GRACE,
                    allocs=[(seg, off, nbytes)],
                )

                def desc(seq, h=g._handle, dcode=dcode, ocode=ocode, buf=(seg, off, nbytes)):
                    return _wire.encode_desc(
                        seq,
                        h,
                        _wire.ALL_REDUCE,
                        dcode,
                        ocode,
                        0,
                        0,
                        4,
                        0,
                        [buf],
                    )

                g._disp.submit(desc, p)
                try:
                    work.wait()
                    accepted, msg = True, ""
                except dist.DistBackendError as e:
                    accepted, msg = False, str(e)
                shim_ok = _wire.reduce_support(dtype, ocode) is None
                ck.expect(
                    label,
                    accepted == shim_ok,
                    f"the shim {'accepts' if shim_ok else 'refuses'} it, the sidecar "
                    f"{'accepts' if accepted else 'refuses'} it {msg}",
                )
                if not accepted:
                    dist.destroy_process_group(g)
                    g = group()
    dist.destroy_process_group(g)
    return ck.done()


def test_reduce_support_agrees_with_sidecar(worlds, seed):
    worlds.get(1).run(check_reduce_support_agrees, seed=seed)
