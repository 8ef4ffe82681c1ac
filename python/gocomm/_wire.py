"""The data-plane wire format shared with pgserver.

Every number here mirrors a Go constant (wire/descriptor.go, wire/dtype.go); the Go
tests and python/tests/test_wire.py pin both sides to the same values.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

# Ring record types (the ring package reserves types below 16).
REC_PAD = 0
REC_OP = 16
REC_DONE = 17

# Op kinds.
ALL_REDUCE = 1
BROADCAST = 2
REDUCE = 3
ALL_GATHER = 4
REDUCE_SCATTER = 5
ALL_TO_ALL = 6
GATHER = 7
SCATTER = 8
SEND = 9
RECV = 10
BARRIER = 11
ALL_TO_ALL_V = 12  # splits on the GPU (the sidecar's NVSHMEM path; CUDA only)

OP_NAMES = {
    ALL_REDUCE: "all_reduce",
    BROADCAST: "broadcast",
    REDUCE: "reduce",
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    ALL_TO_ALL: "all_to_all",
    GATHER: "gather",
    SCATTER: "scatter",
    SEND: "send",
    RECV: "recv",
    BARRIER: "barrier",
    ALL_TO_ALL_V: "all_to_all_v",
}

# Devices.
DEVICE_HOST = 0
DEVICE_CUDA = 1

# Element types (wire.DType).
DTYPES: dict[torch.dtype, int] = {
    torch.bool: 1,
    torch.uint8: 2,
    torch.int8: 3,
    torch.int16: 4,
    torch.int32: 5,
    torch.int64: 6,
    torch.float16: 7,
    torch.bfloat16: 8,
    torch.float32: 9,
    torch.float64: 10,
    torch.complex64: 11,
    torch.complex128: 12,
    torch.float8_e4m3fn: 13,
    torch.float8_e5m2: 14,
    torch.uint16: 15,
    torch.uint32: 16,
    torch.uint64: 17,
}

# Reduce ops (wire.RedOp).
SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR = range(1, 9)
REDUCE_OPS = [
    (dist.ReduceOp.SUM, SUM, "sum"),
    (dist.ReduceOp.AVG, AVG, "avg"),
    (dist.ReduceOp.PRODUCT, PRODUCT, "product"),
    (dist.ReduceOp.MIN, MIN, "min"),
    (dist.ReduceOp.MAX, MAX, "max"),
    (dist.ReduceOp.BAND, BAND, "band"),
    (dist.ReduceOp.BOR, BOR, "bor"),
    (dist.ReduceOp.BXOR, BXOR, "bxor"),
]

_INTEGER = {
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
}
_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def reduce_support(dtype: torch.dtype, op: int) -> str | None:
    """Why op cannot reduce dtype on CPU tensors, or None if it can (mirrors reduce.Check)."""
    if dtype in _FLOAT8:
        return f"{dtype} tensors can be moved but not reduced on CPU"
    if dtype == torch.bool:
        return "avg is not defined for bool" if op == AVG else None
    if dtype in _INTEGER:
        return None
    if op in (BAND, BOR, BXOR):
        return f"bitwise ops are not defined for {dtype}"
    if dtype.is_complex and op in (MIN, MAX):
        return f"min and max are not defined for {dtype}"
    return None


_CUDA_REDUCE_INT = {torch.uint8, torch.int8, torch.int32, torch.int64, torch.uint32, torch.uint64}


def cuda_reduce_support(dtype: torch.dtype, op: int) -> str | None:
    """Why op cannot reduce dtype on CUDA tensors (NCCL), or None (mirrors collectives/device)."""
    if op in (BAND, BOR, BXOR):
        return "bitwise reductions are not supported on CUDA tensors (NCCL has none)"
    if dtype == torch.bool:
        return "avg is not defined for bool" if op == AVG else None
    if dtype.is_complex:
        return None if op in (SUM, AVG) else f"{REDUCE_NAMES[op]} is not supported for {dtype} on CUDA tensors"
    if dtype in _CUDA_REDUCE_INT or dtype.is_floating_point:
        return None
    return f"{dtype} cannot be reduced on CUDA tensors (NCCL has no such type)"


REDUCE_NAMES = {code: name for _, code, name in REDUCE_OPS}

# Completion statuses (pg.Status*).
STATUS_OK = 0
STATUS_INVALID = 1
STATUS_UNSUPPORTED = 2
STATUS_TIMEOUT = 3
STATUS_MISMATCH = 4
STATUS_PEER_LOST = 5
STATUS_ABORTED = 6
STATUS_BROKEN = 7
STATUS_INTERNAL = 8

STATUS_NAMES = {
    STATUS_INVALID: "invalid",
    STATUS_UNSUPPORTED: "unsupported",
    STATUS_TIMEOUT: "timeout",
    STATUS_MISMATCH: "mismatch",
    STATUS_PEER_LOST: "peer lost",
    STATUS_ABORTED: "aborted",
    STATUS_BROKEN: "group broken",
    STATUS_INTERNAL: "internal error",
}

# Descriptor: see wire/descriptor.go for the field table.
DESC = struct.Struct("<QIBBBBiiQQHHIII")
BUFREF = struct.Struct("<IIQQ")
DONE = struct.Struct("<Qii")
assert DESC.size == 56 and BUFREF.size == 24 and DONE.size == 16

# CUDA allocations registered with REC_IPC carry this bit in their segment id.
CUDA_SEGMENT = 1 << 31
REC_IPC = 18
REC_IPC_DROP = 19
IPC = struct.Struct("<IIQ")  # segment, reserved, size; then the 64-byte IPC handle


# The longest timeout the sidecar takes (wire.MaxTimeout, 100 years): a longer one, such as
# timedelta.max, is sent as this instead of overflowing into a short or negative one.
MAX_TIMEOUT_MS = 100 * 365 * 24 * 3600 * 1000


def timeout_ms(seconds: float) -> int:
    """A timeout in seconds as the descriptor's milliseconds, clamped to MAX_TIMEOUT_MS."""
    if not seconds > 0:  # also NaN
        return 0
    if seconds * 1000 >= MAX_TIMEOUT_MS:
        return MAX_TIMEOUT_MS
    return int(seconds * 1000)


def encode_desc(
    seq: int,
    group: int,
    kind: int,
    dtype: int,
    redop: int,
    root: int,
    tag: int,
    count: int,
    timeout_ms: int,
    bufs: list[tuple[int, int, int]],
    splits: list[int] | None = None,
    device: int = DEVICE_HOST,
    stream_value: int = 0,
) -> bytes:
    """Pack an op descriptor; bufs are (segment, offset, length) triples."""
    splits = splits or []
    parts = [
        DESC.pack(
            seq,
            group,
            kind,
            dtype,
            redop,
            device,
            root,
            tag,
            count,
            timeout_ms,
            len(bufs),
            0,
            len(splits),
            stream_value,
            0,
        )
    ]
    parts.extend(BUFREF.pack(seg, 0, off, n) for seg, off, n in bufs)
    if splits:
        parts.append(struct.pack(f"<{len(splits)}q", *splits))
    return b"".join(parts)


def decode_done(payload: bytes) -> tuple[int, int, int, str]:
    """Unpack a completion: (seq, status, source rank, message)."""
    seq, status, source = DONE.unpack_from(payload)
    return seq, status, source, payload[DONE.size :].decode("utf-8", "replace")
