"""This process's sidecar: finding or starting pgserver, the gRPC control channel, the
session (rings, watch stream) and the shared-memory arena host tensors are staged in."""

from __future__ import annotations

import atexit
import bisect
import logging
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

import grpc
import torch

from . import _config, _cuda, _ring, _wire
from .v1 import pgserver_pb2 as pb
from .v1 import pgserver_pb2_grpc as pb_grpc

log = logging.getLogger("gocomm")


class SidecarError(RuntimeError):
    """pgserver could not be found, started or reached, or it went away."""


def find_pgserver() -> str:
    """The pgserver binary: $GOCOMM_PGSERVER, then next to this package, then on PATH."""
    env = _config.pgserver()
    if env:
        if not os.access(env, os.X_OK):
            raise SidecarError(f"GOCOMM_PGSERVER={env} is not an executable file")
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "pgserver")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("pgserver")
    if found:
        return found
    raise SidecarError(
        "gocomm cannot find pgserver: set GOCOMM_PGSERVER, run `make` in the gocomm checkout "
        f"(it puts the binary at {here}), or put pgserver on PATH"
    )


def runtime_dir() -> str:
    """Private directory for sockets and logs ($XDG_RUNTIME_DIR/gocomm or /tmp/gocomm-<uid>)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "gocomm") if base else os.path.join(tempfile.gettempdir(), f"gocomm-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if st.st_uid != os.getuid():
        raise SidecarError(f"runtime directory {path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def advertise_host() -> str:
    """The address peers should dial to reach this host's sidecars.

    $GOCOMM_ADVERTISE_ADDR wins; otherwise the local address of the route towards MASTER_ADDR
    (the interface torchrun's store is reached over), else 127.0.0.1 for a one-host job.
    """
    env = _config.advertise_addr()
    if env:
        return env
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        infos = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)
        fam, _, _, _, addr = infos[0]
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # no packet is sent; this only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


@dataclass
class _Segment:
    id: int
    mm: mmap.mmap
    size: int
    bytes: torch.Tensor  # uint8 view of the whole mapping
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, length)


class Arena:
    """Host memory shared with the sidecar, carved into op buffers.

    Segments come from AllocSegment (the sidecar creates and registers them; descriptors name
    bytes by (segment, offset, length), which the sidecar bounds-checks). Buffers are 64-byte
    aligned; freed space coalesces; a request that fits nowhere adds a segment at least twice
    the size of the last.
    """

    ALIGN = 64

    def __init__(self, sidecar: Sidecar, first: int = 16 << 20):
        self._sc = sidecar
        self._lock = threading.Lock()
        self._segs: dict[int, _Segment] = {}
        self._next_size = first
        self._grow(first)

    def _grow(self, need: int) -> _Segment:
        size = max(need, self._next_size)
        resp = self._sc.call("AllocSegment", pb.AllocSegmentRequest(session=self._sc.session, bytes=size))
        fd = os.open(resp.path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, resp.bytes)
        finally:
            os.close(fd)
        os.unlink(resp.path)
        seg = _Segment(resp.segment, mm, resp.bytes, torch.frombuffer(mm, dtype=torch.uint8), [(0, resp.bytes)])
        self._segs[seg.id] = seg
        self._next_size = 2 * resp.bytes
        return seg

    def alloc(self, nbytes: int) -> tuple[int, int, torch.Tensor]:
        """Reserve nbytes: (segment id, offset, uint8 tensor over the bytes)."""
        want = max((nbytes + self.ALIGN - 1) // self.ALIGN * self.ALIGN, self.ALIGN)
        with self._lock:
            for seg in self._segs.values():
                for i, (off, n) in enumerate(seg.free):
                    if n >= want:
                        seg.free[i : i + 1] = [(off + want, n - want)] if n > want else []
                        return seg.id, off, seg.bytes[off : off + nbytes]
            seg = self._grow(want)
            off, n = seg.free[0]
            seg.free[0:1] = [(off + want, n - want)] if n > want else []
            return seg.id, off, seg.bytes[off : off + nbytes]

    def release(self, seg_id: int, off: int, nbytes: int) -> None:
        want = max((nbytes + self.ALIGN - 1) // self.ALIGN * self.ALIGN, self.ALIGN)
        with self._lock:
            free = self._segs[seg_id].free
            i = bisect.bisect(free, (off, 0))
            free.insert(i, (off, want))
            # coalesce with the neighbours
            if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
                free[i : i + 2] = [(free[i][0], free[i][1] + free[i + 1][1])]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
                free[i - 1 : i + 1] = [(free[i - 1][0], free[i - 1][1] + free[i][1])]


class Sidecar:
    """The connection to this process's pgserver: started here, or attached to with
    GOCOMM_SIDECAR=unix:///path. One per process, shared by every gocomm group."""

    def __init__(self, rank: int):
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.log_file: str | None = None
        self._closed = False
        self._lost: str | None = None
        self._on_lost: list = []
        self._on_broken: dict[int, weakref.WeakMethod] = {}  # group handle -> its hook
        address = _config.sidecar()  # unix:///path: the table refuses anything else
        if address:
            self.socket = address[len("unix://") :]
        else:
            self.socket = self._start(rank)
        self.channel = grpc.insecure_channel(
            "unix://" + self.socket,
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_http_proxy", 0)],
        )
        self.stub = pb_grpc.PGServerStub(self.channel)
        self._wait_ready()
        self.info = self.call("Info", pb.InfoRequest())
        nccl = _cuda.nccl_path() if self.info.cuda_available and torch.cuda.is_available() else ""
        resp = self.call("Attach", pb.AttachRequest(client_pid=os.getpid(), rank=rank, nccl_path=nccl))
        self.session = resp.session
        # how all_to_all_v of this process's CUDA tensors moves, chosen by the sidecar at attach
        self.sparse_transport = resp.sparse_transport or "nccl"
        self.sparse_reason = resp.sparse_reason
        # the node's and this client's facts, each with its reason (name -> (value, reason))
        self.capabilities = {c.name: (c.value, c.reason) for c in resp.capabilities}
        # the sparse all-to-all's settings, as the sidecar read them: the shim's kernel uses
        # the same (one reading of GOCOMM_A2A_RECV_MB, GOCOMM_A2AV_BLOCKS and _THREADS)
        a2a = _config.A2A.from_attach(resp.a2a)
        if a2a is None:
            raise SidecarError(
                f"pgserver on {self.socket} reported no all-to-all settings at attach: older than this shim?"
            )
        self.a2a = a2a
        # GOCOMM_TRACE_BUFFER_SIZE as the sidecar read it: the shim's kernel launch record uses it too
        self.trace_size = resp.trace_buffer_size
        self.info = self.call("Info", pb.InfoRequest())  # now naming that choice
        self.ring = _ring.Ring(resp.ring_path, resp.ring_bytes)
        self._watch = self.stub.Watch(pb.WatchRequest(session=self.session))
        first = next(self._watch)
        if first.kind != "attached":
            raise SidecarError(f"pgserver answered the watch with {first.kind!r}")
        threading.Thread(target=self._watch_loop, name="gocomm-watch", daemon=True).start()
        self.arena = Arena(self)
        self._device: torch.device | None = None
        self._counters_dev = 0
        self._dev_lock = threading.Lock()
        self._ipc: dict[int, tuple[int, int, int]] = {}  # allocation buffer id -> (segment, base, size)
        self._next_seg = 1

    def _start(self, rank: int) -> str:
        exe = find_pgserver()
        rdir = runtime_dir()
        sock = os.path.join(rdir, f"pgserver-{os.getpid()}-r{rank}.sock")
        log_dir = _config.log_dir() or rdir
        os.makedirs(log_dir, exist_ok=True)
        self.log_file = os.path.join(log_dir, f"pgserver-rank{rank}-{os.getpid()}.log")
        cmd = [
            exe,
            "--socket",
            sock,
            "--runtime-dir",
            rdir,
            "--log-file",
            self.log_file,
            "--log-level",
            _config.log_level(),
            "--advertise",
            advertise_host(),
            "--parent-pid",
            str(os.getpid()),
        ]
        # GPU hosts have cores to spare: polling the ring saves the sidecar's wake-up on every op
        spin = _config.spin()
        if spin is None:
            spin = "2ms" if torch.cuda.is_available() else ""
        if spin:
            cmd += ["--spin", spin]
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True)
        return sock

    def _wait_ready(self) -> None:
        timeout = _config.start_timeout()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise SidecarError(f"pgserver exited with status {self.proc.returncode} at start; {self._log_tail()}")
            try:
                grpc.channel_ready_future(self.channel).result(timeout=0.2)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline:
                    raise SidecarError(f"pgserver did not answer on {self.socket} within {timeout}s") from None

    def _log_tail(self) -> str:
        if not self.log_file:
            return "no log (attached sidecar)"
        try:
            with open(self.log_file, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_file) - 2000))
                return f"log {self.log_file} ends with:\n" + f.read().decode("utf-8", "replace")
        except OSError:
            return f"log: {self.log_file}"

    def call(self, method: str, request, timeout: float = 120.0):
        """One control-plane rpc; errors become SidecarError naming the method."""
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise SidecarError(f"pgserver {method}: {e.code().name}: {e.details()}") from None

    def attach_device(self, device: torch.device) -> int:
        """Bind the sidecar to this process's GPU (once); returns the device address of the
        groups' stream counters (device memory of the sidecar's, mapped here by IPC)."""
        if self._device is not None:
            if device != self._device:
                raise ValueError(f"gocomm: this process already uses {self._device}; one GPU per rank (got {device})")
            return self._counters_dev
        with self._dev_lock:
            if self._device is None:
                if not self.info.cuda_available:
                    raise NotImplementedError(f"gocomm: pgserver cannot run CUDA ops here: {self.info.cuda_error}")
                if device.index is None:
                    device = torch.device("cuda", torch.cuda.current_device())
                with torch.cuda.device(device):
                    torch.cuda.init()
                    resp = self.call(
                        "AttachDevice",
                        pb.AttachDeviceRequest(session=self.session, device_uuid=_cuda.device_uuid(device)),
                    )
                    self._counters_dev = _cuda.open_ipc(resp.counters_handle)
                    self.mps = _cuda.mps_client(device)
                self._device = device
                if self.mps:
                    log.info(
                        "gocomm: rank %d is an MPS client: a hand-off to its sidecar costs ~10 us back to back, "
                        "~19 us alone (measured on H200, docs/decisions/0002-mps.md)",
                        self.rank,
                    )
                else:
                    log.warning(
                        "gocomm: rank %d is not an MPS client: each op's hand-off to its sidecar costs a GPU context "
                        "switch (~0.29 ms measured on H200, vs ~10-19 us under MPS). Start the job with "
                        "`python -m gocomm.launch --mps -- <torchrun args>`.",
                        self.rank,
                    )
        return self._counters_dev

    def cuda_segment(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(segment, offset, length) naming t's bytes for the sidecar: its caching-allocator
        allocation is registered once by CUDA IPC handle. An allocation torch freed and the
        driver reused shows up with a new buffer id over the same addresses; the stale entry
        is dropped then."""
        return self.cuda_ref(t.data_ptr(), t.numel() * t.element_size(), t.get_device())

    def cuda_ref(self, ptr: int, n: int, device: int) -> tuple[int, int, int]:
        """cuda_segment for n bytes at device address ptr on CUDA device index device: a
        part of a tensor named without making a view of it (a view costs more host time
        than the rest of the lookup)."""
        if n == 0:
            return (_wire.CUDA_SEGMENT, 0, 0)
        bid = _cuda.buffer_id(ptr)
        e = self._ipc.get(bid)
        if e is None:
            # the sidecar takes IPC handles only once the client attached its device
            self.attach_device(torch.device("cuda", device))
            with _cuda.on_device(device):
                e = self._register(ptr, bid)
        return (e[0], ptr - e[1], n)

    def _register(self, ptr: int, bid: int) -> tuple[int, int, int]:
        """Register the allocation holding ptr (buffer id bid) with the sidecar, dropping
        entries it replaced; its (segment, base, size)."""
        base, size = _cuda.allocation(ptr)
        for obid, (oseg, obase, osize) in list(self._ipc.items()):
            if obase < base + size and base < obase + osize:
                del self._ipc[obid]
                self._ring_put(_wire.REC_IPC_DROP, _wire.IPC.pack(oseg, 0, 0)[:4])
        try:
            handle = _cuda.ipc_handle(base)
        except _cuda.CudaError as err:
            raise RuntimeError(
                f"gocomm: this tensor's memory cannot be shared with the sidecar ({err}); allocations "
                "from PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True have no CUDA IPC handle: unset it"
            ) from None
        seg = _wire.CUDA_SEGMENT | self._next_seg
        self._next_seg += 1
        self._ring_put(_wire.REC_IPC, _wire.IPC.pack(seg, 0, size) + handle)
        e = self._ipc[bid] = (seg, base, size)
        return e

    def _ring_put(self, typ: int, payload: bytes) -> None:
        while not self.ring.submit(typ, payload):
            if self.lost:
                raise SidecarError(self.lost)
            time.sleep(20e-6)

    def _watch_loop(self) -> None:
        try:
            for ev in self._watch:
                if ev.kind == "shutdown":
                    self._mark_lost(f"pgserver closed the session: {ev.detail}")
                    return
                if ev.kind == "group_broken":
                    self._group_broken(ev.group, ev.detail)
            self._mark_lost("pgserver closed the session")
        except grpc.RpcError as e:
            if not self._closed:
                self._mark_lost(f"lost the connection to pgserver ({e.code().name})")

    def on_group_broken(self, handle: int, method) -> None:
        """Call method(detail) (a bound method, held weakly) when the sidecar reports group
        handle broken."""
        self._on_broken[handle] = weakref.WeakMethod(method)

    def _group_broken(self, handle: int, detail: str) -> None:
        """A group broke (the sidecar aborted it): ops on it raise from now on, and its
        in-process kernels stop waiting for peers (the group's hook). With
        GOCOMM_ASYNC_ERROR_HANDLING 1 or 3, as torch's TORCH_NCCL_ASYNC_ERROR_HANDLING, the
        process is torn down at once instead, so a rank that waits on nothing cannot go on
        with a broken group."""
        log.error("gocomm: %s (flight record: %s)", detail, self.log_file or "the sidecar's log")
        ref = self._on_broken.get(handle)
        hook = ref() if ref is not None else None
        if hook is not None:
            try:
                hook(detail)
            except Exception as e:  # noqa: BLE001
                log.error("gocomm: after group %d broke: %s", handle, e)
        if _config.async_error_handling() in (1, 3):
            sys.stderr.write(
                f"gocomm: tearing the process down (GOCOMM_ASYNC_ERROR_HANDLING="
                f"{_config.async_error_handling()}): {detail}\n"
            )
            sys.stderr.flush()
            os.abort()

    def _mark_lost(self, why: str) -> None:
        if self._closed:
            return
        if self.proc is not None:
            try:
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
            rc = self.proc.returncode
            if rc is not None:
                why += f"; pgserver (pid {self.proc.pid}) exited with status {rc}"
                if rc < 0:
                    why += f" (killed by signal {-rc})"
            why += f"; see {self.log_file}"
        self._lost = why
        if getattr(self, "_counters_dev", 0):  # CUDA streams waiting on this sidecar must not hang
            try:
                with torch.cuda.device(self._device):
                    _cuda.release_counters(self._counters_dev, 4096)
            except Exception as e:  # noqa: BLE001
                log.error("gocomm: could not release CUDA streams waiting on the lost sidecar: %s", e)
        for fn in list(self._on_lost):
            fn(why)

    @property
    def lost(self) -> str | None:
        """Why the sidecar is gone, or None while it serves."""
        return self._lost

    def on_lost(self, fn) -> None:
        self._on_lost.append(fn)

    def close(self) -> None:
        """Detach; a sidecar started here exits with the session."""
        if self._closed:
            return
        self._closed = True
        try:  # leaving in order: peers still waiting for this rank are told it left
            self.stub.Detach(pb.DetachRequest(session=self.session, reason="client closed"), timeout=5)
        except grpc.RpcError:
            pass
        try:
            self._watch.cancel()
        except Exception:
            pass
        if self.proc is not None:
            try:
                self.stub.Shutdown(pb.ShutdownRequest(reason="client closed"), timeout=5)
            except grpc.RpcError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.channel.close()


_lock = threading.Lock()
_sidecar: Sidecar | None = None


def get(rank: int) -> Sidecar:
    """This process's sidecar, started (or attached to) on first use."""
    global _sidecar
    with _lock:
        if _sidecar is None or _sidecar.lost:
            _sidecar = Sidecar(rank)
        return _sidecar


def current() -> Sidecar | None:
    return _sidecar


def shutdown() -> None:
    """Stop this process's sidecar (also run at interpreter exit)."""
    global _sidecar
    with _lock:
        sc, _sidecar = _sidecar, None
    if sc is not None:
        sc.close()


atexit.register(shutdown)
