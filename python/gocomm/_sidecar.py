"""This process's sidecar: finding or starting pgserver, the gRPC control channel and the
session (watch stream). The session's data plane (ring, host arena, CUDA IPC registrations,
completion thread) is the compiled client's Dispatcher (csrc/client/dispatcher.h); this module
answers its rare control-plane needs: a new arena segment, the GPU's attachment."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import grpc
import torch
import torch.distributed as dist

from . import _client, _config, _version
from .v1 import pgserver_pb2 as pb
from .v1 import pgserver_pb2_grpc as pb_grpc

log = logging.getLogger("gocomm")


class SidecarError(RuntimeError):
    """pgserver could not be found, started or reached, or it went away."""


def find_pgserver() -> str:
    """The pgserver binary: $GOCOMM_PGSERVER, then next to this package, then on PATH."""
    env = _config.pgserver()
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise SidecarError(f"GOCOMM_PGSERVER={env} is not an executable file")
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "pgserver")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("pgserver")
    if found:
        return found
    there = f"{here} is there but not executable (chmod +x it, or reinstall gocomm)" if os.path.exists(here) else ""
    raise SidecarError(
        f"gocomm cannot find pgserver: {there or 'set GOCOMM_PGSERVER'}, run `make` in the gocomm checkout "
        f"(it puts the binary at {here}), or put pgserver on PATH"
    )


def runtime_dir() -> str:
    """Private directory for sockets and logs ($XDG_RUNTIME_DIR/gocomm or /tmp/gocomm-<uid>).

    Made 0700 if missing. An existing one must be a directory of this user's, not a symbolic
    link (never followed): someone else could otherwise pre-create it, or point it at a
    directory of theirs. A mode open to others is tightened through a descriptor of the
    directory that was checked, never by name."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "gocomm") if base else os.path.join(tempfile.gettempdir(), f"gocomm-{os.getuid()}")
    fix = "remove it, or set XDG_RUNTIME_DIR to a directory of your own (the runtime dir is $XDG_RUNTIME_DIR/gocomm)"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SidecarError(f"cannot make the runtime directory {path} ({e}): {fix}") from e
    try:
        st = os.lstat(path)
    except OSError as e:  # a file where a directory above it should be
        raise SidecarError(f"runtime directory {path}: {e}: {fix}") from e
    if stat.S_ISLNK(st.st_mode):
        raise SidecarError(f"runtime directory {path} is a symbolic link, which gocomm does not follow: {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise SidecarError(f"runtime directory {path} is not a directory: {fix}")
    if st.st_uid != os.getuid():
        raise SidecarError(
            f"runtime directory {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): {fix}"
        )
    if st.st_mode & 0o077:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fst = os.fstat(fd)
            if (fst.st_ino, fst.st_dev, fst.st_uid) != (st.st_ino, st.st_dev, os.getuid()):
                raise SidecarError(f"runtime directory {path} changed while it was checked: {fix}")
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    return path


def rendezvous_host(store, one_host: bool) -> str:
    """The host the sidecar picks its peer address towards (pgserver --rendezvous): loopback
    where every rank of the first group is on this host; else the torch Store's host (every
    rank reached it, so the local address of the route there is one peers can route to: the
    case of env:// and tcp://), else MASTER_ADDR; "" where neither is known (a file store on
    a shared file system: pgserver takes the default route's address)."""
    if one_host:
        return "127.0.0.1"
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    host = getattr(store, "host", "") if isinstance(store, dist.TCPStore) else ""
    return host or os.environ.get("MASTER_ADDR", "")


def usable_socket(path: str, attached: bool) -> str:
    """path, refused at once where no Unix socket can have it (108 bytes with its NUL; a sidecar
    started here also binds <path less .sock>.fd.sock, 3 bytes longer), and for an attached
    sidecar where nothing listens on it (a pgserver that exited left it behind)."""
    where, most = ("GOCOMM_SIDECAR", 107) if attached else ("XDG_RUNTIME_DIR (the runtime directory)", 104)
    if len(os.fsencode(path)) > most:
        raise SidecarError(f"socket path {path} is over {most} bytes, too long for a Unix socket here: shorten {where}")
    if attached and os.path.exists(path):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            try:
                s.connect(path)
            except ConnectionRefusedError:
                raise SidecarError(f"GOCOMM_SIDECAR: nothing listens on {path} (a stale socket?)") from None
            except TimeoutError:
                pass  # a listener that does not accept yet: the start's wait decides
            except OSError as e:
                raise SidecarError(f"GOCOMM_SIDECAR: cannot connect to {path}: {e}") from None
    return path


class Sidecar:
    """The connection to this process's pgserver: started here, or attached to with
    GOCOMM_SIDECAR=unix:///path. One per process, shared by every gocomm group."""

    def __init__(self, rank: int, rendezvous: str = ""):
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.log_file: str | None = None
        self._closed = False
        self._lost: str | None = None
        self._failed = True  # until attached, and once a group broke: its log is kept at close
        self._on_broken: dict[int, weakref.WeakMethod] = {}  # group handle -> its hook
        address = _config.sidecar()  # unix:///path: the table refuses anything else
        if address:
            self.socket = usable_socket(address[len("unix://") :], attached=True)
        else:
            self.socket = self._start(rank, rendezvous)
        self.channel = grpc.insecure_channel(
            "unix://" + self.socket,
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_http_proxy", 0)],
        )
        self.stub = pb_grpc.PGServerStub(self.channel)
        try:  # a pgserver started here goes with a start that fails after it answered
            self._wait_ready()
            self.info = self.call("Info", pb.InfoRequest())
            self._check_version(self.info.version)
            nccl = _client.C.nccl_path() if self.info.cuda_available and torch.cuda.is_available() else ""
            env = {k: v for k, v in os.environ.items() if k.startswith("GOCOMM_")}
            req = pb.AttachRequest(client_pid=os.getpid(), rank=rank, nccl_path=nccl, client_env=env)
            resp = self.call("Attach", req)
            for line in resp.knob_warnings:  # a sidecar started apart (GOCOMM_SIDECAR) read its own environment
                log.warning("gocomm rank %d: %s", rank, line)
            self.session = resp.session
            # how all_to_all_v of this process's CUDA tensors moves, chosen by the sidecar at attach
            self.sparse_transport = resp.sparse_transport or "nccl"
            self.sparse_reason = resp.sparse_reason
            # the node's and this client's facts, each with its reason (name -> (value, reason))
            self.capabilities = {c.name: (c.value, c.reason) for c in resp.capabilities}
            # the knobs as the sidecar read them from its environment (config/config.go), so both
            # sides use one reading: the sparse all-to-all's settings (pb.A2AConfig: recv_bytes,
            # blocks, threads) and the client's own (pb.ClientKnobs: cuda, ar_*, ...)
            if not (resp.HasField("a2a") and resp.HasField("knobs")):
                raise SidecarError(f"pgserver on {self.socket} reported no settings at attach: older than this shim?")
            self.a2a, self.knobs = resp.a2a, resp.knobs
            # why this client's CUDA tensors cannot be served ("" where they can): the sidecar's word
            self.cuda_refusal = resp.cuda_refusal
            # GOCOMM_TRACE_BUFFER_SIZE as the sidecar read it: the shim's kernel launch record uses it too
            self.trace_size = resp.trace_buffer_size
            self.info = self.call("Info", pb.InfoRequest())  # now naming that choice
            self._watch = self.stub.Watch(pb.WatchRequest(session=self.session))
            first = next(self._watch)
            if first.kind != "attached":
                raise SidecarError(f"pgserver answered the watch with {first.kind!r}")
            # the session's data plane: ring, arena (its first segment now), IPC registrations, and
            # the fd socket that takes the chunks of expandable segments (decision 0029)
            self.fd_socket, self.fd_token = resp.fd_socket, resp.fd_token
            self.client = _client.C.Dispatcher(
                resp.ring_path,
                resp.ring_bytes,
                self._grow,
                16 << 20,
                self._attach,
                fd_socket=resp.fd_socket,
                session=self.session,
                fd_token=resp.fd_token,
                rank=rank,
                log=log.log,
            )
            threading.Thread(target=self._watch_loop, name="gocomm-watch", daemon=True).start()
            self._failed = False
        except BaseException:
            self.close()
            raise

    def _start(self, rank: int, rendezvous: str) -> str:
        exe = find_pgserver()
        rdir = os.path.abspath(runtime_dir())  # the socket, a gRPC target, must be absolute
        sock = usable_socket(os.path.join(rdir, f"pgserver-{os.getpid()}-r{rank}.sock"), attached=False)
        log_dir = _config.log_dir() or rdir
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as e:
            raise SidecarError(f"GOCOMM_LOG_DIR={log_dir}: cannot make the sidecar's log directory there ({e})") from e
        self.log_file = os.path.join(log_dir, f"pgserver-rank{rank}-{os.getpid()}.log")
        cmd = [
            exe,
            "--socket",
            sock,
            "--runtime-dir",
            rdir,
            "--log-file",
            self.log_file,
            # where peers reach this sidecar: pgserver picks it (transport.ChooseAddress: its
            # GOCOMM_ADVERTISE_ADDR, GOCOMM_SOCKET_IFNAME, else the route to this host) and
            # listens there only
            "--rendezvous",
            rendezvous,
            "--parent-pid",
            str(os.getpid()),
        ]
        # the rest of its settings (GOCOMM_LOG_LEVEL, GOCOMM_SPIN, ...) it reads from the environment it
        # inherits; its log is never opened through a link; a session of its own: Ctrl-C is the rank's
        self._own_log = not os.path.lexists(self.log_file)  # an earlier sidecar's of this process is kept
        try:
            fd = os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise SidecarError(f"cannot write the sidecar's log {self.log_file} ({e}): set GOCOMM_LOG_DIR") from e
        with open(fd, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        return sock

    def _check_version(self, theirs: str) -> None:
        """Refuse a sidecar of another gocomm version (rings, descriptors and rpcs are one contract
        between a shim and its own build's pgserver); "dev" (unversioned, by hand) only warns."""
        ours = _version.__version__
        if theirs == ours:
            return
        if theirs == "dev":
            log.warning("gocomm %s: pgserver on %s is an unversioned (dev) build", ours, self.socket)
            return
        where = f"started from {find_pgserver()}" if self.proc is not None else "attached through GOCOMM_SIDECAR"
        raise SidecarError(
            f"gocomm {ours} cannot use pgserver {theirs or '(no version)'} ({where}, {self.socket}): "
            f"install the matching gocomm, or point GOCOMM_PGSERVER/GOCOMM_SIDECAR at a pgserver {ours}"
        )

    def _wait_ready(self) -> None:
        timeout, start = _config.start_timeout(), time.monotonic()
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise SidecarError(f"pgserver exited with status {self.proc.returncode} at start; {self._log_tail()}")
            try:
                grpc.channel_ready_future(self.channel).result(timeout=0.2)
                return
            except grpc.FutureTimeoutError:
                waited = time.monotonic() - start
                # an attached sidecar (GOCOMM_SIDECAR) makes its socket at once: a few seconds without one is a wrong path
                if self.proc is None and waited > min(timeout, 3) and not os.path.exists(self.socket):
                    raise SidecarError(f"GOCOMM_SIDECAR: no pgserver socket at {self.socket}") from None
                if waited > timeout:
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

    def _grow(self, nbytes: int) -> tuple[int, str, int]:
        """A new arena segment of at least nbytes for the client: (id, file to map, bytes)."""
        resp = self.call("AllocSegment", pb.AllocSegmentRequest(session=self.session, bytes=nbytes))
        return resp.segment, resp.path, resp.bytes

    def attach_device(self, device: torch.device) -> int:
        """Bind the sidecar to this process's GPU (once); returns the device address of the
        groups' stream counters (shared host memory, registered here for the device)."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return self.client.counters(idx)

    def _attach(self, idx: int, uuid: bytes) -> str:
        """attach_device's rpc, AttachDevice, made by the client the first time it needs the
        GPU (cuda:idx, of that UUID): the file of the groups' stream counters, which the
        client maps (csrc/client/dispatcher.cc, Dispatcher::attach)."""
        if not self.info.cuda_available:
            raise NotImplementedError(f"gocomm: pgserver cannot run CUDA ops here: {self.info.cuda_error}")
        req = pb.AttachDeviceRequest(session=self.session, device_uuid=uuid)
        return self.call("AttachDevice", req).counters_path

    def cuda_segments(self) -> dict:
        """This client's CUDA allocations as the sidecar maps them: registered (and not
        dropped), mapped (dropped ones an op still holds included), bytes_mapped, and unmapped
        since the session began."""
        resp = self.call("Stats", pb.StatsRequest(session=self.session))
        for s in resp.sessions:
            if s.session == self.session:
                return {
                    "registered": s.cuda_segments,
                    "mapped": s.cuda_segments_mapped,
                    "bytes_mapped": s.cuda_bytes_mapped,
                    "unmapped": s.cuda_segments_unmapped,
                }
        return {}

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
        self._failed = True
        log.error("gocomm: %s (flight record: %s)", detail, self.log_file or "the sidecar's log")
        ref = self._on_broken.get(handle)
        hook = ref() if ref is not None else None
        if hook is not None:
            try:
                hook(detail)
            except Exception as e:  # noqa: BLE001
                log.error("gocomm: after group %d broke: %s", handle, e)
        if self.knobs.async_error_handling in (1, 3):
            sys.stderr.write(
                f"gocomm: tearing the process down (GOCOMM_ASYNC_ERROR_HANDLING="
                f"{self.knobs.async_error_handling}): {detail}\n"
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
        # every op in flight fails, and CUDA streams waiting on this sidecar go on
        self.client.fail_all(why)

    @property
    def lost(self) -> str | None:
        """Why the sidecar is gone, or None while it serves."""
        return self._lost

    def close(self) -> None:
        """Detach; a sidecar started here exits with the session."""
        if self._closed:
            return
        self._closed = True
        session = getattr(self, "session", None)  # None where closed before attaching
        if session is not None:
            try:  # leaving in order: peers still waiting for this rank are told it left
                self.stub.Detach(pb.DetachRequest(session=session, reason="client closed"), timeout=5)
            except grpc.RpcError:
                pass
        watch = getattr(self, "_watch", None)  # None where closed before attaching
        if watch is not None:
            watch.cancel()
        client = getattr(self, "client", None)  # None where attaching failed
        if client is not None:
            client.close()
        if self.proc is not None:
            try:
                self.stub.Shutdown(pb.ShutdownRequest(reason="client closed"), timeout=5)
            except grpc.RpcError:
                self.proc.kill()  # not answering (a start that timed out): it cannot be asked to go
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.returncode == 0 and self._own_log and not (self._failed or self._lost or _config.log_dir()):
                with contextlib.suppress(OSError):  # a clean run's log goes (GOCOMM_LOG_DIR keeps them)
                    os.unlink(self.log_file)
        self.channel.close()


_lock = threading.Lock()
_sidecar: Sidecar | None = None


def get(rank: int, rendezvous=lambda: "") -> Sidecar:
    """This process's sidecar, started (or attached to) on first use; rendezvous() gives the
    host its peer address is picked towards (rendezvous_host), asked only when it starts."""
    global _sidecar
    with _lock:
        if _sidecar is None or _sidecar.lost:
            _sidecar = Sidecar(rank, rendezvous())
        return _sidecar


def current() -> Sidecar | None:
    return _sidecar


def shutdown() -> None:
    """Stop this process's sidecar (also at exit; a forked child forgets its parent's and the lock)."""
    global _sidecar
    with _lock:
        sc, _sidecar = _sidecar, None
    if sc is not None:
        sc.close()


atexit.register(shutdown)
os.register_at_fork(after_in_child=lambda: globals().update(_sidecar=None, _lock=threading.Lock()))
