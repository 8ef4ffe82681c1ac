"""The compiled client's cache of CUDA IPC registrations (csrc/client/ipc_cache.cc) over a fake
driver and ring (gocomm._C._IpcCacheProbe), so it runs without a GPU: what it writes into the ring
when tensors are registered, when torch's allocator reports memory it gave back (the hook), and
when addresses come back under a new allocation that nobody reported; and that the hook never
waits for the ring. Memory mapped with cuMemMap (expandable segments) goes as chunks by fd:
over a fake sidecar, a real FdChannel against a fake fd socket, and pgserver's own fd socket.
The same cache on a GPU, against the sidecar: test_gpu.py (test_freed_memory_leaves_the_sidecar,
test_expandable_segments)."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest

MiB = 1 << 20
CHUNKS = 0x7F0000000000  # where the fake chunks (memory mapped with cuMemMap) lie


@pytest.fixture
def probe():
    from gocomm._client import C

    p = C._IpcCacheProbe()
    yield p
    p.close()


@pytest.fixture(scope="module")
def C():
    from gocomm._client import C

    return C


def _flush(p) -> list[tuple[int, int]]:
    assert p.flush(10.0), "queued drops not written within 10s"
    return p.records()


def test_registers_once_per_allocation(probe, C):
    probe.alloc(0x10000000, 4 * MiB)
    seg, off, n = probe.ref(0x10000000 + 4096, 100)
    assert seg & C.CUDA_SEGMENT and (off, n) == (4096, 100)
    assert probe.ref(0x10000000 + 8192, 50) == (seg, 8192, 50)
    assert probe.ref(0x10000000, 0) == (C.CUDA_SEGMENT, 0, 0)  # empty: names nothing
    assert probe.records() == [(C.REC_IPC, seg)]
    assert probe.size() == 1


def test_released_segment_is_dropped_once(probe, C):
    """What empty_cache does: the allocator hook names the segment; its registration is dropped
    (by the sender thread), and the same addresses under a new allocation register afresh
    without a second drop."""
    probe.alloc(0x20000000, 2 * MiB)
    probe.alloc(0x30000000, 2 * MiB)
    a = probe.ref(0x20000000, 16)[0]
    b = probe.ref(0x30000000, 16)[0]
    C._IpcCacheProbe.released(0x20000000, 2 * MiB)
    assert probe.size() == 1  # forgotten at once, not when the drop is written
    assert _flush(probe) == [(C.REC_IPC, a), (C.REC_IPC, b), (C.REC_IPC_DROP, a)]
    C._IpcCacheProbe.released(0x20000000, 2 * MiB)  # reported again: nothing left to drop
    C._IpcCacheProbe.released(0x50000000, 2 * MiB)  # memory never registered
    probe.free(0x20000000)
    probe.alloc(0x20000000, 2 * MiB)
    c = probe.ref(0x20000000, 16)[0]
    assert c not in (a, b)
    assert _flush(probe)[3:] == [(C.REC_IPC, c)]


def test_unmapped_part_drops_what_it_overlaps(probe, C):
    """SEGMENT_UNMAP names part of a segment: every registration the range touches goes."""
    probe.alloc(0x40000000, 20 * MiB)
    probe.alloc(0x41400000, 20 * MiB)  # right after the first
    a = probe.ref(0x40000000, 16)[0]
    b = probe.ref(0x41400000, 16)[0]
    C._IpcCacheProbe.released(0x41300000, 2 * MiB)  # the first's last MiB and the second's first
    assert sorted(s for t, s in _flush(probe) if t == C.REC_IPC_DROP) == sorted([a, b])
    assert probe.size() == 0


def test_unreported_reuse_drops_before_registering(probe, C):
    """Memory the hook never reported (another allocator): an allocation over its addresses
    replaces the stale registration, dropped in the ring before the new one is registered."""
    probe.alloc(0x60000000, 4 * MiB)
    a = probe.ref(0x60000000, 16)[0]
    probe.free(0x60000000)
    probe.alloc(0x60100000, 1 * MiB)  # inside the old range
    b = probe.ref(0x60100000, 16)[0]
    assert probe.records() == [(C.REC_IPC, a), (C.REC_IPC_DROP, a), (C.REC_IPC, b)]
    assert probe.size() == 1


def test_no_ipc_handle_names_the_cause(probe):
    probe.alloc(0x70000000, 20 * MiB, ipc=False)
    with pytest.raises(RuntimeError) as e:
        probe.ref(0x70000000, 16)
    msg = str(e.value)
    for words in ("cannot be shared with the sidecar", "memory pool", "cudaMallocAsync", "0029"):
        assert words in msg, msg
    assert probe.records() == [] and probe.size() == 0


def test_hook_never_waits_for_the_ring(probe, C):
    """The hook runs under torch's allocator lock: with the ring full (its writers held) it
    must still return at once; the drops go out once the ring has room."""
    bases = [0x80000000 + i * 4 * MiB for i in range(64)]
    for base in bases:
        probe.alloc(base, 4 * MiB)
    segs = [probe.ref(base, 16)[0] for base in bases]
    probe.hold(True)
    start = time.monotonic()
    for base in bases:
        C._IpcCacheProbe.released(base, 4 * MiB)
    took = time.monotonic() - start
    assert took < 1.0, f"released() took {took:.3f}s with the ring full"
    assert not probe.flush(0.2)  # nothing can be written yet
    probe.hold(False)
    drops = [s for t, s in _flush(probe) if t == C.REC_IPC_DROP]
    assert sorted(drops) == sorted(segs)


@pytest.mark.parametrize("kind", ["ipc", "chunks"])
def test_registration_and_release_race(probe, C, kind):
    """Threads register and the hook releases at once, many rounds: every registration in
    the ring is dropped at most once, and never before it was registered. chunks: runs of one
    to three chunks mapped with cuMemMap, registered over the (fake) fd socket."""
    rng = random.Random(time.time_ns())
    bases = [0x100000000 + i * 2 * MiB for i in range(16)]
    if kind == "ipc":
        for base in bases:
            probe.alloc(base, 2 * MiB)
    else:
        probe.map_chunks(bases[0], 2 * MiB, len(bases))
    stop = threading.Event()
    errors: list[BaseException] = []

    def register():
        r = random.Random(rng.random())
        try:
            while not stop.is_set():
                if kind == "ipc":
                    probe.ref(r.choice(bases) + r.randrange(2 * MiB - 64), 64)
                else:
                    i = r.randrange(len(bases) - 2)
                    probe.ref(bases[i] + r.randrange(2 * MiB), r.randrange(1, 4 * MiB))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=register) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        C._IpcCacheProbe.released(rng.choice(bases), 2 * MiB)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors
    for base in bases:
        C._IpcCacheProbe.released(base, 2 * MiB)
    records = _flush(probe)
    registered, dropped = set(), set()
    for typ, seg in records:
        if typ in (C.REC_IPC, C._IpcCacheProbe.FD_RECORD):
            assert seg not in registered, f"segment {seg:#x} registered twice"
            registered.add(seg)
        else:
            assert seg in registered, f"segment {seg:#x} dropped before it was registered"
            assert seg not in dropped, f"segment {seg:#x} dropped twice"
            dropped.add(seg)
    assert dropped == registered and probe.size() == 0
    assert _probe_fds() == []


def test_chunks_replace_an_unreported_allocation(probe, C):
    """Chunks mapped over addresses an IPC registration covered (its allocation freed with no
    report) drop that registration before registering the run."""
    probe.alloc(CHUNKS, 20 * MiB)
    seg_a, _, _ = probe.ref(CHUNKS, 64)
    probe.free(CHUNKS)
    probe.map_chunks(CHUNKS, 20 * MiB, 1)
    seg_b, _, _ = probe.ref(CHUNKS + 64, 64)
    assert probe.records() == [(C.REC_IPC, seg_a), (C.REC_IPC_DROP, seg_a), (C._IpcCacheProbe.FD_RECORD, seg_b)]
    assert probe.size() == 1


# ----- memory mapped with cuMemMap (torch's expandable segments): chunks by fd (decision 0029)


def _probe_fds() -> list[str]:
    """What this process's fds open on the probe's memory files name (none once every fd the
    cache exported was closed)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:gocomm-probe-"):
            out.append(target)
    return out


def _memfile(base: int) -> str:
    return f"/memfd:gocomm-probe-{base} (deleted)"


def test_chunks_register_by_fd(probe, C):
    """A tensor in chunks is registered as the run of chunks it spans: each chunk's fd goes to
    the sidecar (closed here after), a tensor inside a registered run reuses it, one that
    reaches past it registers the run it spans."""
    probe.map_chunks(CHUNKS, 20 * MiB, 3)
    seg, off, n = probe.ref(CHUNKS + 5 * MiB, 30 * MiB)  # chunks 0 and 1
    assert (off, n) == (5 * MiB, 30 * MiB)
    assert probe.records() == [(C._IpcCacheProbe.FD_RECORD, seg)]
    files, sizes = probe.sent(seg)
    assert files == [_memfile(CHUNKS), _memfile(CHUNKS + 20 * MiB)]
    assert sizes == [20 * MiB, 20 * MiB]
    assert probe.ref(CHUNKS + 39 * MiB, MiB) == (seg, 39 * MiB, MiB)  # inside the run
    seg2, off2, _ = probe.ref(CHUNKS + 30 * MiB, 20 * MiB)  # chunks 1 and 2
    assert seg2 != seg and off2 == 10 * MiB
    assert probe.sent(seg2)[0] == [_memfile(CHUNKS + 20 * MiB), _memfile(CHUNKS + 40 * MiB)]
    assert len(probe.records()) == 2 and probe.size() == 2
    assert _probe_fds() == []


def test_unmapped_chunk_drops_its_runs(probe, C):
    """torch unmapping a chunk (SEGMENT_UNMAP) drops every run it is part of, once, after its
    registration; the chunks left are registered anew when used."""
    probe.map_chunks(CHUNKS, 20 * MiB, 3)
    a, _, _ = probe.ref(CHUNKS, 40 * MiB)
    b, _, _ = probe.ref(CHUNKS + 30 * MiB, 20 * MiB)
    c, _, _ = probe.ref(CHUNKS + 45 * MiB, MiB)  # inside run b: no registration
    assert c == b
    probe.free(CHUNKS + 20 * MiB)
    C._IpcCacheProbe.released(CHUNKS + 20 * MiB, 20 * MiB)
    recs = _flush(probe)
    fd = C._IpcCacheProbe.FD_RECORD
    assert recs[:2] == [(fd, a), (fd, b)]
    assert sorted(recs[2:]) == sorted([(C.REC_IPC_DROP, a), (C.REC_IPC_DROP, b)])
    assert probe.size() == 0
    d, _, _ = probe.ref(CHUNKS, MiB)
    assert d not in (a, b) and probe.sent(d)[1] == [20 * MiB]


def test_chunks_without_fd_handle_are_refused(probe):
    """Chunks torch created with no POSIX fd handle (TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0, or
    a fabric handle) are refused naming why and the way out; the fds of the chunks exported
    before the refusal are closed, and nothing was sent."""
    probe.map_chunks(CHUNKS, 20 * MiB, 1)
    probe.map_chunks(CHUNKS + 20 * MiB, 20 * MiB, 1, exportable=False)
    with pytest.raises(RuntimeError) as e:
        probe.ref(CHUNKS + 10 * MiB, 20 * MiB)
    msg = str(e.value)
    for words in (
        "cuMemMap",
        "cannot be exported to a file descriptor",
        "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0",
        "expandable_segments:False",
        "0029",
    ):
        assert words in msg, msg
    assert probe.records() == [] and probe.size() == 0
    assert _probe_fds() == []


def test_chunks_need_the_hook(probe):
    """Without torch's allocator hook nothing would tell chunks unmapped: they are refused."""
    probe.set_hooked(False)
    probe.map_chunks(CHUNKS, 2 * MiB, 1)
    with pytest.raises(RuntimeError, match="reports what it unmaps"):
        probe.ref(CHUNKS, 16)
    assert probe.records() == [] and _probe_fds() == []


def test_refused_chunks_raise_and_are_dropped(probe, C):
    """A registration the sidecar refuses raises its words; a drop follows (harmless where it
    mapped nothing, needed where it answered too late), and the next use registers again."""
    probe.map_chunks(CHUNKS, 2 * MiB, 2)
    probe.refuse(True)
    with pytest.raises(RuntimeError, match="could not map this tensor's memory chunks"):
        probe.ref(CHUNKS, 3 * MiB)
    assert probe.size() == 0 and _probe_fds() == []
    recs = _flush(probe)
    assert len(recs) == 1 and recs[0][0] == C.REC_IPC_DROP
    probe.refuse(False)
    seg, _, _ = probe.ref(CHUNKS, 3 * MiB)
    assert seg != recs[0][1] and probe.records()[-1] == (C._IpcCacheProbe.FD_RECORD, seg)


def _fake_sidecar(path: str, token: bytes, answered: threading.Event, got: dict, delay: float):
    """A one-connection fd socket (pg/fdchan.go's messages) that checks the hello, takes a
    registration's messages and fds, waits delay seconds, sets answered, then answers."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(10)

    def serve():
        conn, _ = srv.accept()
        conn.settimeout(10)
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 64, 4)
            hello, ver, session = struct.unpack_from("<IIQ", msg)
            got["hello"] = (hello, ver, session, msg[16:] == token)
            conn.send(struct.pack("<IIII", 0x594C5052, 0, 0 if msg[16:] == token else 1, 0))
            files, sizes, msgs = [], [], 0
            while True:
                msg, fds, _, _ = socket.recv_fds(conn, 8192, 253)
                magic, seg, chunks, first, count, _ = struct.unpack_from("<IIIIII", msg)
                msgs += 1
                sizes += struct.unpack_from(f"<{count}Q", msg, 24)
                for fd in fds:
                    files.append(os.readlink(f"/proc/self/fd/{fd}"))
                    os.close(fd)
                if first + count == chunks:
                    break
            got.update(seg=seg, files=files, sizes=sizes, messages=msgs)
            time.sleep(delay)
            answered.set()
            conn.send(struct.pack("<IIII", 0x594C5052, seg, 0, 0))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def test_fd_socket_answer_comes_before_ref_returns(probe, C, tmp_path):
    """Over a real fd socket (the client's FdChannel against a fake sidecar): the hello names
    the session with its token, 300 chunks go in two messages with their fds, and ref returns
    only after the sidecar answered, so no op naming the segment is written before it is
    mapped; the fds are closed here."""
    path = str(tmp_path / "fd.sock")
    token = bytes(range(32))
    answered, got = threading.Event(), {}
    srv, t = _fake_sidecar(path, token, answered, got, delay=0.3)
    try:
        probe.connect(path, 7, token)
        probe.map_chunks(CHUNKS, 2 * MiB, 300)
        start = time.monotonic()
        seg, off, n = probe.ref(CHUNKS + MiB, 598 * MiB)
        took = time.monotonic() - start
        assert answered.is_set(), "ref returned before the sidecar answered"
        assert took >= 0.3
        assert got["hello"] == (0x4F4C4548, 1, 7, True)
        assert got["seg"] == seg and got["messages"] == 2 and got["sizes"] == [2 * MiB] * 300
        assert got["files"] == [_memfile(CHUNKS + i * 2 * MiB) for i in range(300)]
        assert (off, n) == (MiB, 598 * MiB)
        assert probe.records() == [(C._IpcCacheProbe.FD_RECORD, seg)]
        assert _probe_fds() == []
    finally:
        probe.close()
        t.join(10)
        srv.close()


def test_fd_socket_of_a_real_sidecar(probe, tmp_path):
    """pgserver's fd socket lies beside its control socket, refuses a wrong token, takes the
    right one, and answers a registration (here: no GPU attached) with its reason, which ref
    raises; the fds are closed here either way, and the socket goes with the sidecar."""
    from gocomm import _sidecar

    # a rank of its own: the socket path is new to this process (grpc keeps a failing
    # connection's backoff per path, and earlier tests' sidecars of rank 0 are gone)
    sc = _sidecar.Sidecar(93)
    try:
        assert sc.fd_socket == sc.socket[: -len(".sock")] + ".fd.sock" and os.path.exists(sc.fd_socket)
        assert len(sc.fd_token) == 32
        probe.map_chunks(CHUNKS, 2 * MiB, 2)
        wrong = bytes([sc.fd_token[0] ^ 1]) + sc.fd_token[1:]
        probe.connect(sc.fd_socket, sc.session, wrong)
        with pytest.raises(RuntimeError, match="refused this process on its fd socket.*wrong token"):
            probe.ref(CHUNKS, 3 * MiB)
        probe.connect(sc.fd_socket, sc.session, sc.fd_token)
        with pytest.raises(RuntimeError, match="could not map.*before the device was attached"):
            probe.ref(CHUNKS, 3 * MiB)
        assert probe.size() == 0 and _probe_fds() == []
    finally:
        sc.close()
    deadline = time.monotonic() + 10
    while os.path.exists(sc.fd_socket) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(sc.fd_socket)
