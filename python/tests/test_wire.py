"""The wire format the compiled client (csrc/client/wire.h, as gocomm._C exposes it) and pgserver
share: every number is read out of the Go sources and compared, and the client's idea of which
reduce ops each dtype supports is checked against what the sidecar accepts."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch
from ranklib import Checker

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTOR_GO = ROOT / "wire" / "descriptor.go"
DTYPE_GO = ROOT / "wire" / "dtype.go"
GPU_GO = ROOT / "gpu" / "gpu.go"


def _go_consts(path: Path, typ: str) -> dict[str, int]:
    """NAME -> value for `NAME Type = 12` lines."""
    text = path.read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"^\s*(\w+)\s+{typ}\s*=\s*(\d+)", text, re.MULTILINE)}


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).upper()


@pytest.fixture(scope="module")
def wire():
    """The compiled client's wire format (gocomm._C: csrc/client/wire.h)."""
    from gocomm._client import C

    return C


# dtypes torch has, for the client's dtype table (each must be in Go's, with its code)
_TORCH_DTYPES = [getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)]


def test_op_kinds_match_go(wire):
    go = _go_consts(DESCRIPTOR_GO, "OpKind")
    assert go, f"no OpKind constants found in {DESCRIPTOR_GO}"
    want = {_snake(name[len("Op") :]): value for name, value in go.items()}
    assert wire.KINDS == want


def test_statuses_match_go(wire):
    go = _go_consts(DESCRIPTOR_GO, "int32")
    statuses = {k: v for k, v in go.items() if k.startswith("Status")}
    assert len(statuses) >= 9
    assert statuses["StatusOK"] == 0
    for name, value in statuses.items():
        if value:
            said = wire.status_name(value)
            assert not said.startswith("status "), f"{name} = {value} in Go: the client has no name for it"
    assert wire.status_name(max(statuses.values()) + 1).startswith("status ")


def test_record_types_and_devices_match_go(wire):
    go16 = _go_consts(DESCRIPTOR_GO, "uint16")
    assert (go16["RecOp"], go16["RecDone"], go16["RecIPC"], go16["RecIPCDrop"]) == (
        wire.REC_OP,
        wire.REC_DONE,
        wire.REC_IPC,
        wire.REC_IPC_DROP,
    )
    assert (go16["RecGraphOp"], go16["RecGraphDrop"]) == (wire.REC_GRAPH_OP, wire.REC_GRAPH_DROP)
    header = re.search(r"GraphOpHeader\s*=\s*(\d+)", DESCRIPTOR_GO.read_text())
    assert header and int(header.group(1)) == wire.GRAPH_OP_HEADER
    go8 = _go_consts(DESCRIPTOR_GO, "uint8")
    assert (go8["DeviceHost"], go8["DeviceCUDA"]) == (wire.DEVICE_HOST, wire.DEVICE_CUDA)
    assert re.search(r"CUDASegment\s*=\s*1\s*<<\s*31", DESCRIPTOR_GO.read_text())
    assert wire.CUDA_SEGMENT == 1 << 31


def test_graph_triggers_match_go(wire):
    """Where the client finds a graph op's D word (after the stream counters) and how many
    triggers there are: gpu/gpu.go's constants (docs/decisions/0020)."""
    text = GPU_GO.read_text()
    consts = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(\w+)\s*=\s*(\w+)\s*$", text, re.MULTILINE)}
    assert int(consts["TriggerSlots"]) == wire.TRIGGER_SLOTS
    assert consts["TriggerOffset"] == "CounterBytes" and int(consts["CounterBytes"]) == wire.TRIGGER_OFFSET


def test_dtypes_match_go(wire):
    codes = _go_consts(DTYPE_GO, "DType")
    text = DTYPE_GO.read_text()
    table = {
        m.group(1): (m.group(2), int(m.group(3)))
        for m in re.finditer(r'^\s*(\w+):\s*\{"(\w+)",\s*(\d+)', text, re.MULTILINE)
    }
    by_torch_name = {tname: (codes[go], size) for go, (tname, size) in table.items()}
    assert by_torch_name, f"no dtype table found in {DTYPE_GO}"
    carried = {}
    for dtype in _TORCH_DTYPES:
        code = wire.wire_dtype(dtype)
        name = str(dtype).removeprefix("torch.")
        if code == 0:
            assert name not in by_torch_name, f"Go carries {name}, the client does not"
            continue
        carried[name] = code
        assert name in by_torch_name, f"the client carries {name}, Go's dtype table does not"
        go_code, size = by_torch_name[name]
        assert code == go_code, f"{name}: the client says {code}, Go says {go_code}"
        assert size == dtype.itemsize, f"{name}: Go says {size} bytes, torch {dtype.itemsize}"
    assert set(carried) == set(by_torch_name)


def test_reduce_ops_match_go(wire):
    go = _go_consts(DTYPE_GO, "RedOp")
    names = {"Sum": "SUM", "Avg": "AVG", "Product": "PRODUCT", "Min": "MIN", "Max": "MAX"}
    names.update({"BAnd": "BAND", "BOr": "BOR", "BXor": "BXOR"})
    assert wire.REDOPS == {py: go[go_name] for go_name, py in names.items()}


def test_descriptor_layout(wire):
    """The client's encoder puts each field at the offset the table in wire/descriptor.go gives."""
    text = DESCRIPTOR_GO.read_text()
    assert re.search(r"DescHeader\s*=\s*56", text) and re.search(r"bufRefSize\s*=\s*24", text)
    send = wire.KINDS["SEND"]
    b = wire.encode_desc(
        0x0102030405060708, 7, send, 9, 3, wire.DEVICE_CUDA, -1, -5, 1234, 5678, 0xDEADBEEF,
        [(3, 64, 128), (4, 0, 8)], [1, -2, 3],
    )  # fmt: skip
    assert len(b) == 56 + 2 * 24 + 3 * 8
    seq, group = struct.unpack_from("<QI", b, 0)
    kind, dtype, redop, device = b[12], b[13], b[14], b[15]
    root, tag = struct.unpack_from("<ii", b, 16)
    count, timeout = struct.unpack_from("<QQ", b, 24)
    nbufs, nsplits = struct.unpack_from("<H", b, 40)[0], struct.unpack_from("<I", b, 44)[0]
    assert (seq, group, kind, dtype, redop, device) == (0x0102030405060708, 7, send, 9, 3, wire.DEVICE_CUDA)
    assert (root, tag, count, timeout, nbufs, nsplits) == (-1, -5, 1234, 5678, 2, 3)
    assert struct.unpack_from("<I", b, 48)[0] == 0xDEADBEEF
    assert struct.unpack_from("<IIQQ", b, 56) == (3, 0, 64, 128)
    assert struct.unpack_from("<IIQQ", b, 80) == (4, 0, 0, 8)
    assert struct.unpack_from("<3q", b, 104) == (1, -2, 3)
    mismatch = _go_consts(DESCRIPTOR_GO, "int32")["StatusMismatch"]
    done = struct.pack("<Qii", 42, mismatch, 3) + "ünï".encode()
    assert wire.decode_done(done) == (42, mismatch, 3, "ünï")


def check_reduce_support_agrees(rk, seed):
    """For every dtype and reduce op, submit an all_reduce descriptor straight to the sidecar (1-rank
    group), past the client's own checks: it must accept exactly the pairs the client's
    reduce_refusal accepts for CPU tensors. A refused collective breaks its group, so each
    refusal moves on to a fresh group."""
    import datetime

    import torch.distributed as dist

    from gocomm._backend import state
    from gocomm._client import C

    ck = Checker("reduce support, client vs sidecar", seed, rk.rank)

    def group():
        return dist.new_group(backend="gocomm", timeout=datetime.timedelta(seconds=rk.timeout_s))

    g = group()
    for dtype in _TORCH_DTYPES:
        dcode = C.wire_dtype(dtype)
        if dcode == 0:
            continue
        for oname, ocode in C.REDOPS.items():
            label = f"{dtype} {oname}"
            with ck.case(label):
                st = state(g)
                # nothing else is in flight on this 1-rank world: the arena's first bytes are free
                seg, _ = st._sc.client.segments()[0]
                desc = C.encode_desc(
                    0, st._handle, C.KINDS["ALL_REDUCE"], dcode, ocode, C.DEVICE_HOST, 0, 0, 4, 0, 0,
                    [(seg, 0, 4 * dtype.itemsize)], [],
                )  # fmt: skip
                try:
                    g._get_backend(torch.device("cpu"))._submit_raw("all_reduce", desc).wait()
                    accepted, msg = True, ""
                except dist.DistBackendError as e:
                    accepted, msg = False, str(e)
                client_ok = C.reduce_refusal(dtype, ocode, False) == ""
                ck.expect(
                    label,
                    accepted == client_ok,
                    f"the client {'accepts' if client_ok else 'refuses'} it, the sidecar "
                    f"{'accepts' if accepted else 'refuses'} it {msg}",
                )
                if not accepted:
                    dist.destroy_process_group(g)
                    g = group()
    dist.destroy_process_group(g)
    return ck.done()


def test_reduce_support_agrees_with_sidecar(worlds, seed):
    worlds.get(1).run(check_reduce_support_agrees, seed=seed)
