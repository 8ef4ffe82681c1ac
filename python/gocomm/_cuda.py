"""The few CUDA driver calls the shim makes itself (ctypes on the libcuda torch loaded):
naming a tensor's allocation for CUDA IPC, and ordering the sidecar's work against the
caller's stream with 32-bit counters in shared host memory (stream memory operations)."""

from __future__ import annotations

import ctypes
import os

import torch

_ATTR_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID: unique per allocation, never reused
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_HOST_REGISTER = 0x1 | 0x2  # PORTABLE | DEVICEMAP

_lib = None


class CudaError(RuntimeError):
    """A driver call the shim made failed."""


def _load():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        lib.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.cuStreamWriteValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        lib.cuStreamWaitValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


def _check(what: str, r: int) -> None:
    if r != 0:
        s = ctypes.c_char_p()
        _load().cuGetErrorString(r, ctypes.byref(s))
        raise CudaError(f"{what}: {s.value.decode() if s.value else r}")


_bid = ctypes.c_uint64()


def buffer_id(ptr: int) -> int:
    """The process-unique id of the allocation holding device address ptr."""
    _check("cuPointerGetAttribute", _load().cuPointerGetAttribute(ctypes.byref(_bid), _ATTR_BUFFER_ID, ptr))
    return _bid.value


def allocation(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation holding device address ptr."""
    lib = _load()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check("cuMemGetAddressRange", lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr))
    return base.value, size.value


def ipc_handle(base: int) -> bytes:
    """The CUDA IPC handle of the allocation starting at base (64 bytes)."""
    h = (ctypes.c_char * 64)()
    _check("cuIpcGetMemHandle", _load().cuIpcGetMemHandle(h, base))
    return bytes(h)


def write_value(stream: int, addr: int, value: int) -> None:
    """Queue on stream: *addr = value (32 bits)."""
    _check("cuStreamWriteValue32", _load().cuStreamWriteValue32_v2(stream, addr, value & 0xFFFFFFFF, 0))


def wait_value(stream: int, addr: int, value: int) -> None:
    """Queue on stream: wait until (int32)(*addr - value) >= 0."""
    _check("cuStreamWaitValue32", _load().cuStreamWaitValue32_v2(stream, addr, value & 0xFFFFFFFF, _WAIT_GEQ))


def register_host(addr: int, size: int) -> int:
    """Pin and map host memory for the GPU; returns its device address."""
    lib = _load()
    _check("cuMemHostRegister", lib.cuMemHostRegister_v2(addr, size, _HOST_REGISTER))
    dev = ctypes.c_uint64()
    _check("cuMemHostGetDevicePointer", lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), addr, 0))
    return dev.value


def unregister_host(addr: int) -> None:
    _load().cuMemHostUnregister(addr)


def mps_client(device: torch.device) -> bool:
    """Whether contexts on this device are MPS clients (CU_DEVICE_ATTRIBUTE_MPS_ENABLED)."""
    lib = _load()
    d, v = ctypes.c_int(), ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(d), device.index or 0) != 0:
        return False
    if lib.cuDeviceGetAttribute(ctypes.byref(v), 133, d) != 0:
        return False
    return v.value != 0


def device_uuid(device: torch.device) -> bytes:
    """The 16-byte UUID of a CUDA device, as the driver reports it."""
    u = torch.cuda.get_device_properties(device).uuid
    b = getattr(u, "bytes", None)
    if isinstance(b, (bytes, bytearray)) and len(b) == 16:
        return bytes(b)
    s = str(u).removeprefix("GPU-").replace("-", "")
    return bytes.fromhex(s)


def nccl_path() -> str:
    """The libnccl this process has loaded (torch's), else the one torch's wheel ships, else ""."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith("libnccl.so"):
                    return path
    except OSError:
        pass
    try:
        import nvidia.nccl as nv

        cand = os.path.join(list(nv.__path__)[0], "lib", "libnccl.so.2")
        if os.path.exists(cand):
            return cand
    except ImportError:
        pass
    return ""
