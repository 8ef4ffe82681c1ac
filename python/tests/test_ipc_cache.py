"""The compiled client's cache of CUDA IPC registrations (csrc/client/ipc_cache.cc) over a fake
driver and ring (gocomm._C._IpcCacheProbe), so it runs without a GPU: what it writes into the ring
when tensors are registered, when torch's allocator reports memory it gave back (the hook), and
when addresses come back under a new allocation that nobody reported; and that the hook never
waits for the ring. The same cache on a GPU, against the sidecar: test_gpu.py
(test_freed_memory_leaves_the_sidecar)."""

from __future__ import annotations

import random
import threading
import time

import pytest

MiB = 1 << 20


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
    for words in ("cannot be shared with the sidecar", "cuMemMap", "expandable_segments:False", "0028"):
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


def test_registration_and_release_race(probe, C):
    """Threads register and the hook releases at once, many rounds: every registration in
    the ring is dropped at most once, and never before it was registered."""
    rng = random.Random(time.time_ns())
    bases = [0x100000000 + i * 2 * MiB for i in range(16)]
    for base in bases:
        probe.alloc(base, 2 * MiB)
    stop = threading.Event()
    errors: list[BaseException] = []

    def register():
        r = random.Random(rng.random())
        try:
            while not stop.is_set():
                probe.ref(r.choice(bases) + r.randrange(2 * MiB - 64), 64)
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
        if typ == C.REC_IPC:
            assert seg not in registered, f"segment {seg:#x} registered twice"
            registered.add(seg)
        else:
            assert seg in registered, f"segment {seg:#x} dropped before it was registered"
            assert seg not in dropped, f"segment {seg:#x} dropped twice"
            dropped.add(seg)
    assert dropped == registered and probe.size() == 0
