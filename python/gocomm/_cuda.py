"""The CUDA driver calls the Python side makes itself (ctypes on the libcuda torch loaded): the
in-process engine's (module loads, launches, events, peer buffers) and the control plane's
(mapping the sidecar's stream counters at attach). The per-op path's calls (stream counters,
IPC registration) are the compiled client's (csrc/client/cuda_driver.cc)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import torch


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_lib = None  # calls that may block: they release the GIL (ctypes.CDLL)
_fast = None  # calls that return at once: they keep the GIL (ctypes.PyDLL)


class CudaError(RuntimeError):
    """A driver call the shim made failed."""


def _load():
    global _lib, _fast
    if _lib is None:
        # A ctypes call through CDLL drops the GIL and takes it back after: with the
        # completion thread waiting for the GIL, every such call hands it over and back, two
        # thread wake-ups of tens of microseconds on an op's path. The calls an op makes
        # (pointer queries, stream memory ops) return in a microsecond, so they go through a
        # PyDLL handle, which keeps the GIL.
        fast = ctypes.PyDLL("libcuda.so.1")
        for name, args in (
            ("cuLaunchKernel", [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3),
            ("cuEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
            ("cuStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
            ("cuEventQuery", [ctypes.c_void_p]),
        ):
            getattr(fast, name).argtypes = args
        _fast = fast
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_size_t,
        ]
        _lib = lib
    return _lib


def _check(what: str, r: int) -> None:
    if r != 0:
        s = ctypes.c_char_p()
        _load().cuGetErrorString(r, ctypes.byref(s))
        raise CudaError(f"{what}: {s.value.decode() if s.value else r}")


def on_device(idx: int):
    """A context in which device idx is current. The driver calls here act in the current
    context, and a caller may hold tensors of a device other than its current one (torch's
    NCCL backend allows it): they failed then (cuMemGetAddressRange: not found; stream
    memory operations: invalid argument, seen on H200)."""
    # torch.cuda.current_device() runs torch's lazy-init check first: microseconds per op
    cur = torch._C._cuda_getDevice() if torch.cuda._initialized else torch.cuda.current_device()
    return _SAME if cur == idx else torch.cuda.device(idx)


_SAME = contextlib.nullcontext()  # reusable: it holds no state


def ipc_handle(base: int) -> bytes:
    """The CUDA IPC handle of the allocation starting at base (64 bytes)."""
    h = (ctypes.c_char * 64)()
    _check("cuIpcGetMemHandle", _load().cuIpcGetMemHandle(h, base))
    return bytes(h)


def open_ipc(handle: bytes) -> int:
    """Map another process's allocation (its 64-byte CUDA IPC handle); its device address."""
    h = _IpcHandle()
    ctypes.memmove(ctypes.addressof(h), handle, 64)
    dev = ctypes.c_uint64()
    _check("cuIpcOpenMemHandle", _load().cuIpcOpenMemHandle_v2(ctypes.byref(dev), h, 1))
    return dev.value


_ctx_ready = threading.local()


def ensure_context(idx: int) -> None:
    """Make device idx's primary context current on this thread where none is. torch creates
    it lazily, at a thread's first runtime call that needs one, so a driver call can come first
    (a fresh process whose tensors are not yet made, another thread). On 8x H200 the MoE
    module's first load, in a process that had made no tensor, failed and the kernels were
    taken as not usable; a load without a current context fails that way."""
    done = getattr(_ctx_ready, "devs", None)
    if done is None:
        done = _ctx_ready.devs = set()
    if idx in done:
        return
    lib = _load()
    cur = ctypes.c_void_p()
    _check("cuCtxGetCurrent", lib.cuCtxGetCurrent(ctypes.byref(cur)))
    if not cur.value:
        d, ctx = ctypes.c_int(), ctypes.c_void_p()
        _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(d), idx))
        _check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d))
        _check("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
    done.add(idx)


def launch(fn: int, grid: int, block: int, stream: int, params, smem: int = 0) -> None:
    """Queue kernel fn (a CUfunction) on stream: grid x block threads, smem bytes of dynamic
    shared memory; params is the driver's array of pointers to each argument."""
    if _fast is None:
        _load()
    _check("cuLaunchKernel", _fast.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, smem, stream, params, None))


def mem_alloc(nbytes: int) -> int:
    """A zeroed device allocation of its own (outside torch's caching allocator, so that its
    IPC handle names it alone); never freed: it lives as long as the process."""
    lib = _load()
    ptr = ctypes.c_uint64()
    _check("cuMemAlloc", lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)))
    _check("cuMemsetD8", lib.cuMemsetD8_v2(ptr, ctypes.c_ubyte(0), ctypes.c_size_t(nbytes)))
    return ptr.value


class _Range:
    """A device address range as __cuda_array_interface__ (bytes), for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def tensor_at(ptr: int, nbytes: int, idx: int) -> torch.Tensor:
    """A uint8 tensor over nbytes of device idx's memory at ptr, which torch does not own (the
    caller keeps the memory alive as long as the tensor)."""
    return torch.as_tensor(_Range(ptr, nbytes), device=torch.device("cuda", idx))


def max_resident(fn: int, threads: int, idx: int) -> int:
    """How many blocks of kernel fn (threads each, no dynamic shared memory) device idx holds
    at once, on all its SMs."""
    per = ctypes.c_int()
    _check(
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        _load().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(per), fn, threads, 0),
    )
    return per.value * torch.cuda.get_device_properties(idx).multi_processor_count


def host_word() -> tuple[int, int]:
    """64 zeroed bytes of pinned host memory the GPU writes to (a few u32 words): (host
    address, device address)."""
    lib = _load()
    h, d = ctypes.c_void_p(), ctypes.c_uint64()
    _check("cuMemHostAlloc", lib.cuMemHostAlloc(ctypes.byref(h), ctypes.c_size_t(64), 3))  # PORTABLE | DEVICEMAP
    ctypes.memset(h.value, 0, 64)
    _check("cuMemHostGetDevicePointer", lib.cuMemHostGetDevicePointer_v2(ctypes.byref(d), h, 0))
    return h.value, d.value


def event_create() -> int:
    """A CUDA event without timing (in the current context)."""
    ev = ctypes.c_void_p()
    _check("cuEventCreate", _load().cuEventCreate(ctypes.byref(ev), 2))  # CU_EVENT_DISABLE_TIMING
    return ev.value


def event_record(ev: int, stream: int) -> None:
    if _fast is None:
        _load()
    _check("cuEventRecord", _fast.cuEventRecord(ev, stream))


def stream_wait_event(stream: int, ev: int) -> None:
    """Queue on stream: wait for ev's last record."""
    if _fast is None:
        _load()
    _check("cuStreamWaitEvent", _fast.cuStreamWaitEvent(stream, ev, 0))


def event_done(ev: int) -> bool:
    """Whether the work before ev's last record has finished (no wait)."""
    if _fast is None:
        _load()
    r = _fast.cuEventQuery(ev)
    if r == 600:  # CUDA_ERROR_NOT_READY
        return False
    _check("cuEventQuery", r)
    return True


def event_sync(ev: int) -> None:
    """Block (without the GIL) until the work before ev's last record has finished."""
    _check("cuEventSynchronize", _load().cuEventSynchronize(ev))


def current_stream(index: int) -> int:
    """The raw handle of the caller's current stream on device index (no Stream object)."""
    return torch._C._cuda_getCurrentRawStream(index)


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
