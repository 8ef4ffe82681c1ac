"""Client half of the shared-memory rings (layout and invariants: ring/ring.go).

The client produces on the submission queue and consumes the completion queue. It relies on
x86-64's ordered stores (a record's bytes are written before the tail that publishes them)
and on the futex syscall for waking and sleeping; see invariant 3 in ring.go.

The shared counters are read and written through ctypes scalars over the mapping: one aligned
8-byte load or store each. struct.pack_into/unpack_from go byte by byte, so the other side
could see a torn counter: a GPU run saw the sidecar read tail 0 in the middle of a store of
tail 0x370 and stop reading the ring ("queue corrupt").
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import threading

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_REC = struct.Struct("<IHH")

_MAGIC = 0x31524D4D4F434F47  # "GOCOMMR1"
_VERSION = 1
_SUB_HEAD, _SUB_TAIL, _SUB_NOTIFY = 64, 128, 136
_CMP_HEAD, _CMP_TAIL, _CMP_NOTIFY, _CMP_WAITERS = 192, 256, 264, 268

# x86-64 only: the ring relies on its ordered stores (a record before the tail that publishes
# it); aarch64 would need fences this pure-Python client cannot issue.
_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall  # drops the GIL: for FUTEX_WAIT, which sleeps
_syscall.restype = ctypes.c_long
# FUTEX_WAKE returns at once; keeping the GIL through it spares the submitting thread a
# hand-over to the completion thread and back (see _cuda._fast).
_wake_syscall = ctypes.PyDLL(None).syscall
_wake_syscall.restype = ctypes.c_long


class RingError(RuntimeError):
    """The ring file is not what pgserver should have made."""


class Ring:
    """The two queues of one session, mapped from the file Attach returned.

    submit() may be called from any thread (it takes a lock); poll() and wait() belong to the
    single completion thread.
    """

    def __init__(self, path: str, size: int):
        if _SYS_FUTEX is None:
            raise RingError(f"gocomm's shared-memory ring runs on x86-64 hosts only, not {platform.machine()}")
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        os.unlink(path)  # mapped on both sides now; nothing else may open it
        mm = self._mm
        if _U64.unpack_from(mm, 0)[0] != _MAGIC or _U32.unpack_from(mm, 8)[0] != _VERSION:
            raise RingError(f"{path} is not a gocomm ring of version {_VERSION}")
        self._sub_off, self._sub_size, self._cmp_off, self._cmp_size = struct.unpack_from("<4Q", mm, 16)
        for off, n in ((self._sub_off, self._sub_size), (self._cmp_off, self._cmp_size)):
            if n < 4096 or n & (n - 1) or off + n > size:
                raise RingError(f"{path}: queue at {off} of {n} bytes in a {size}-byte file")
        self._w_sub_head = ctypes.c_uint64.from_buffer(mm, _SUB_HEAD)
        self._w_sub_tail = ctypes.c_uint64.from_buffer(mm, _SUB_TAIL)
        self._w_sub_notify = ctypes.c_uint32.from_buffer(mm, _SUB_NOTIFY)
        self._w_cmp_head = ctypes.c_uint64.from_buffer(mm, _CMP_HEAD)
        self._w_cmp_tail = ctypes.c_uint64.from_buffer(mm, _CMP_TAIL)
        self._w_cmp_notify = ctypes.c_uint32.from_buffer(mm, _CMP_NOTIFY)
        self._w_cmp_waiters = ctypes.c_uint32.from_buffer(mm, _CMP_WAITERS)
        self._sub_tail = self._w_sub_tail.value
        self._cmp_head = self._w_cmp_head.value
        self._sub_notify_addr = ctypes.addressof(self._w_sub_notify)
        self._cmp_notify_addr = ctypes.addressof(self._w_cmp_notify)
        self._lock = threading.Lock()
        self.max_record = self._sub_size // 4 - 8

    def submit(self, typ: int, payload: bytes) -> bool:
        """Append one record; False when the queue is full (the sidecar is behind)."""
        n = len(payload)
        size = 8 + ((n + 7) & ~7)
        if size > self._sub_size // 4:
            raise ValueError(f"gocomm: op descriptor of {n} bytes exceeds the ring's limit")
        mm = self._mm
        with self._lock:
            tail = self._sub_tail
            head = self._w_sub_head.value
            off = tail & (self._sub_size - 1)
            rest = self._sub_size - off
            pad = rest if rest < size else 0
            if self._sub_size - (tail - head) < pad + size:
                return False
            base = self._sub_off
            if pad:
                _REC.pack_into(mm, base + off, pad - 8, 0, 0)
                off = 0
            _REC.pack_into(mm, base + off, n, typ, 0)
            mm[base + off + 8 : base + off + 8 + n] = payload
            tail += pad + size
            self._sub_tail = tail
            self._w_sub_tail.value = tail  # publishes the record (stores stay ordered)
            self._w_sub_notify.value = (self._w_sub_notify.value + 1) & 0xFFFFFFFF
            # Always wake: without a fence we cannot order the notify store before a load of
            # the sidecar's waiters count (ring.go invariant 3). A wake with no waiter is cheap.
            _wake_syscall(_SYS_FUTEX, ctypes.c_void_p(self._sub_notify_addr), _FUTEX_WAKE, 1, None, None, 0)
            return True

    def poll(self) -> list[tuple[int, bytes]]:
        """Take every completion record waiting (type, payload copy)."""
        mm = self._mm
        out = []
        head = self._cmp_head
        tail = self._w_cmp_tail.value
        mask = self._cmp_size - 1
        while head != tail:
            off = head & mask
            n, typ, _ = _REC.unpack_from(mm, self._cmp_off + off)
            size = 8 + ((n + 7) & ~7)
            if size > tail - head or off + size > self._cmp_size:
                raise RingError("completion queue corrupt")
            if typ != 0:
                start = self._cmp_off + off + 8
                out.append((typ, bytes(mm[start : start + n])))
            head += size
        if head != self._cmp_head:
            self._cmp_head = head
            self._w_cmp_head.value = head
        return out

    def wait(self, timeout: float) -> None:
        """Sleep until a completion may be waiting, at most timeout seconds."""
        notify = self._w_cmp_notify.value
        self._w_cmp_waiters.value = 1
        if self._w_cmp_tail.value == self._cmp_head:
            sec = int(timeout)
            ts = _Timespec(sec, int((timeout - sec) * 1e9))
            _syscall(
                _SYS_FUTEX,
                ctypes.c_void_p(self._cmp_notify_addr),
                _FUTEX_WAIT,
                notify,
                ctypes.byref(ts),
                None,
                0,
            )
        self._w_cmp_waiters.value = 0
