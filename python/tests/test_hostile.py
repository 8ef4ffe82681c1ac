"""Hostile peers and local hygiene: a flood of unauthenticated connections on a sidecar whose
fd limit was lowered leaves a running group working and the sidecar's descriptors back at their
baseline; the runtime directory is never someone else's or a link; huge timeouts are clamped or
refused, not turned into immediate ones."""

from __future__ import annotations

import datetime
import os
import re
import resource
import signal
import statistics
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as dist
from flood import Flood, fd_count

from gocomm import _config, _sidecar

SIZES = (4 << 10, 32 << 20)


def check_peer_info(rk):
    import gocomm

    i = gocomm.info()
    return {"pid": i["pid"], "peer": i["peer_address"]}


def check_all_reduce_times(rk, iters):
    """iters all_reduces of each size on the world; checks every result against the sum of
    the ranks' inputs; returns each size's per-op times."""
    times = {}
    for nbytes in SIZES:
        n = nbytes // 4
        ts = []
        for it in range(iters):
            t = torch.full((n,), float(rk.rank + it), dtype=torch.float32)
            t0 = time.monotonic()
            dist.all_reduce(t)
            ts.append(time.monotonic() - t0)
            want = float(sum(r + it for r in range(rk.size)))
            if t[0].item() != want or t[-1].item() != want or not torch.all(t == want):
                raise AssertionError(f"all_reduce of {nbytes} bytes, iteration {it}: wrong sum")
        times[nbytes] = ts
    return times


def _medians(results):
    return {s: max(statistics.median(r[s]) for r in results) for s in SIZES}


def check_new_group(rk):
    """A gocomm group made now (new links, so new descriptors in the sidecars) works."""
    g = dist.new_group(backend="gocomm", timeout=datetime.timedelta(seconds=rk.timeout_s))
    t = torch.full((1024,), float(rk.rank + 1))
    dist.all_reduce(t, group=g)
    want = float(sum(r + 1 for r in range(rk.size)))
    if not torch.all(t == want):
        raise AssertionError("all_reduce on a group made during the flood: wrong sum")
    dist.destroy_process_group(g)


class _Peak:
    """Samples a process's fd count from a thread, keeping the largest."""

    def __init__(self, pid):
        self.pid, self.peak, self._stop = pid, fd_count(pid), False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, fd_count(self.pid))
            time.sleep(0.01)

    def stop(self):
        self._stop = True
        self._t.join()
        return self.peak


def flood_trial(world, connections: int, fd_headroom: int | None) -> dict:
    """One flood of rank 1's sidecar (its fd limit lowered to fd_headroom above what it uses,
    unless None) while the ranks loop all_reduce and make a new group; returns what was
    measured and the failures of what must hold (empty: it held)."""
    info = world.run(check_peer_info)
    pid, addr = info[1]["pid"], info[1]["peer"]
    base_times = _medians(world.run(check_all_reduce_times, iters=6))
    base_fds = fd_count(pid)
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    if fd_headroom is not None:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (base_fds + fd_headroom, old[1]))
    t0 = time.monotonic()
    try:
        peak = _Peak(pid)
        with Flood(addr, hold=connections) as flood:
            give_up = time.monotonic() + 120  # a starved generator fails the trial, never hangs it
            while flood.opened < connections and not flood.done() and time.monotonic() < give_up:
                time.sleep(0.05)
            flooded = world.run(check_all_reduce_times, iters=6)
            world.run(check_new_group)
        peak = peak.stop()
        flood_s = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while fd_count(pid) > base_fds and time.monotonic() < deadline:
            time.sleep(0.1)
        after = fd_count(pid)
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
    world.run(check_all_reduce_times, iters=1)
    times = _medians(flooded)
    failures = []
    if flood.opened < connections:
        failures.append(f"the flood opened only {flood.opened} connections ({flood.failed} failed)")
    for s in SIZES:
        if times[s] > 2 * base_times[s] + 0.05:
            failures.append(f"{s} bytes: {times[s]:.4f}s flooded, {base_times[s]:.4f}s before")
    if peak > base_fds + 2 * 64 + 16:
        failures.append(f"sidecar fds: {base_fds} before, {peak} during the flood")
    if after > base_fds:
        failures.append(f"sidecar fds: {base_fds} before, {peak} during, {after} 10 s after the flood")
    return {
        "opened": flood.opened,
        "failed": flood.failed,
        "fds": (base_fds, peak, after),
        "before_s": base_times,
        "during_s": times,
        "flood_s": flood_s,
        "failures": failures,
    }


def test_flood_with_lowered_fd_limit(worlds):
    """Rank 1's sidecar gets an fd limit 300 above what it uses; 1,500 junk, half-open and
    unknown-group connections then arrive while the ranks loop all_reduce of 4 KiB and 32 MiB
    and make a new group. Every result is right, each size's median time stays within 2x the
    unflooded one (plus 50 ms for this shared machine), the sidecar never holds more than its
    cap of unauthenticated links (GOCOMM_PEER_HANDSHAKES_MAX, twice: before and after their
    hello) beyond its baseline, and its fds are back at the baseline within 10 s after.
    (make soak floods 10,000 connections at the default limits: soak_flood.py.)"""
    with worlds.fresh(2, label="-flood") as world:
        r = flood_trial(world, 1500, fd_headroom=300)
    print(f"flood: {r}")
    assert not r["failures"], r


@pytest.fixture
def runtime_base(tmp_path, monkeypatch):
    """XDG_RUNTIME_DIR at a fresh directory: runtime_dir() is <it>/gocomm."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_runtime_dir_is_made_private(runtime_base):
    path = _sidecar.runtime_dir()
    assert os.stat(path).st_mode & 0o777 == 0o700
    os.chmod(path, 0o755)
    assert _sidecar.runtime_dir() == path
    assert os.stat(path).st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another uid needs root (CI runs as root)")
def test_runtime_dir_of_another_user(runtime_base):
    path = runtime_base / "gocomm"
    path.mkdir(mode=0o755)
    os.chown(path, 65534, 65534)
    with pytest.raises(_sidecar.SidecarError, match=f"{path} belongs to uid 65534.*XDG_RUNTIME_DIR"):
        _sidecar.runtime_dir()


def test_runtime_dir_symlink_not_followed(runtime_base, tmp_path_factory):
    target = tmp_path_factory.mktemp("elsewhere")
    os.chmod(target, 0o777)
    (runtime_base / "gocomm").symlink_to(target)
    with pytest.raises(_sidecar.SidecarError, match="symbolic link.*XDG_RUNTIME_DIR"):
        _sidecar.runtime_dir()
    assert os.stat(target).st_mode & 0o777 == 0o777, "the link's target was changed"


@pytest.mark.parametrize("value", ["1e400", "inf", "86401", "nan"])
def test_huge_start_timeout_refused(monkeypatch, value):
    """A start timeout too large to mean anything (or infinite) is refused, naming the knob."""
    monkeypatch.setenv("GOCOMM_START_TIMEOUT", value)
    _config.reload()
    try:
        with pytest.raises(ValueError, match="GOCOMM_START_TIMEOUT"):
            _config.start_timeout()
    finally:
        monkeypatch.delenv("GOCOMM_START_TIMEOUT")
        _config.reload()


def check_huge_group_timeout(rk):
    """A group whose timeout is timedelta.max (the longest torch takes) works: the timeout is
    clamped, not wrapped into a negative one that fails every op at once."""
    g = dist.new_group(backend="gocomm", timeout=datetime.timedelta.max)
    t = torch.full((256,), float(rk.rank + 1))
    dist.all_reduce(t, group=g)
    ok = bool(torch.all(t == float(sum(r + 1 for r in range(rk.size)))))
    dist.destroy_process_group(g)
    return ok


def test_huge_group_timeout(worlds):
    assert worlds.get(2).run(check_huge_group_timeout) == [True, True]


def test_stale_sockets_of_killed_sidecars_removed(worlds):
    """Ranks and sidecars SIGKILLed leave their control sockets; the next sidecar to start
    removes them."""
    rdir = _sidecar.runtime_dir()
    world = worlds.fresh(2, label="-stale")
    socks = [os.path.join(rdir, f"pgserver-{p.pid}-r{r}.sock") for r, p in enumerate(world.procs)]
    for i in world.info:  # the sidecars first: killed ranks would let them shut down cleanly
        os.kill(i["sidecar_pid"], signal.SIGKILL)
    world.kill()
    left = [s for s in socks if os.path.exists(s)]
    assert left, f"no socket left by the killed sidecars ({socks}): nothing to test"
    # the next sidecar to start: a bare pgserver with the same runtime dir
    sock = os.path.join(rdir, f"pgserver-{os.getpid()}-rtest.sock")
    proc = subprocess.Popen(
        [_sidecar.find_pgserver(), "--runtime-dir", rdir, "--socket", sock, "--listen", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(sock), "the new pgserver did not start"
    finally:
        proc.terminate()
        proc.wait(10)
    assert not [s for s in left if os.path.exists(s)], f"stale sockets still there: {left}"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def check_unreceived_isends(rk, n):
    """Rank 0 isends n messages of 60 KiB that rank 1 never receives, then both all_reduce;
    returns how each rank's calls ended."""
    t0 = time.monotonic()
    err = ""
    try:
        if rk.rank == 0:
            t = torch.ones(15 << 10)  # 60 KiB: inline, under the by-reference threshold
            works = [dist.isend(t, 1, tag=7) for _ in range(n)]
            for w in works:
                w.wait()
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001
        err = str(e)
    return {"error": err, "elapsed": time.monotonic() - t0}


def test_unreceived_isends_capped(worlds):
    """4,000 never-received 60 KiB isends (240 MiB) to a sidecar whose GOCOMM_UNMATCHED_BYTES_MAX
    is 16 MiB: the receiving sidecar grows by about the cap, not by 240 MiB, and every rank
    raises (the receiver naming the knob)."""
    world = worlds.fresh(2, label="-unmatched", env={"GOCOMM_UNMATCHED_BYTES_MAX": str(16 << 20)})
    try:
        pid = world.run(check_peer_info)[1]["pid"]
        before = _rss(pid)
        results = world.run(check_unreceived_isends, n=4000)
        grew = _rss(pid) - before
    finally:
        world.kill()  # its group is broken
    print(f"unreceived isends: sidecar grew {grew >> 20} MiB; {results}")
    # both name the knob: the receiver broke the group, the sender heard why in its abort
    for r in (0, 1):
        assert "(aborted)" in results[r]["error"] and "GOCOMM_UNMATCHED_BYTES_MAX" in results[r]["error"], results[r]
    for r, res in enumerate(results):
        assert res["elapsed"] < 30, f"rank {r}: {res}"
    assert grew < 64 << 20, f"the receiving sidecar grew by {grew >> 20} MiB"


def check_ipc_claim(rk):
    """A CUDA tensor's allocation registered with its real size works; one whose claimed
    size is far past the allocation (the client lying about it) is refused by the sidecar:
    the op on it fails (its Work says so once its completion came: a CUDA op's wait() only
    queues a stream wait, and the stream is released without the op having run) and the
    next call on the group raises, both naming the claim. Returns what happened."""
    from gocomm import _sidecar

    torch.cuda.set_device(0)
    # broadcast: the sidecar's NCCL runs it (no in-process kernel), so it maps the tensor
    t = torch.full((1 << 20,), 3.0, device="cuda")
    dist.broadcast(t, 0)
    torch.cuda.synchronize()
    ok = bool(torch.all(t == 3.0))
    # a new allocation (64 MiB: not carved from t's cached segment), registered with the lie
    u = torch.ones(1 << 24, device="cuda")
    _sidecar.current().client.cuda_ref(u.data_ptr(), u.nbytes, 0, claim=1 << 30)
    # a world of one: an op whose output is another tensor, so the sidecar reads u
    out = torch.empty_like(u)
    w = dist.all_gather_into_tensor(out, u, async_op=True)
    w.wait()
    torch.cuda.synchronize()  # returns: the sidecar released the stream when it refused the op
    until = time.monotonic() + 30
    while not w.is_completed() and time.monotonic() < until:
        time.sleep(0.01)
    op_err = ""
    try:
        w.wait()
    except Exception as e:  # noqa: BLE001
        op_err = str(e)
    next_err = ""
    try:
        dist.all_gather_into_tensor(out, u)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        next_err = str(e)
    return {"ok": ok, "completed": w.is_completed(), "error": op_err, "next": next_err}


@pytest.mark.gpu
def test_ipc_claim_checked_against_the_driver(worlds):
    """On a GPU: the sidecar checks a CUDA registration's size with cuMemGetAddressRange."""
    world = worlds.fresh(1, label="-ipc")
    try:
        (res,) = world.run(check_ipc_claim, timeout=120)
    finally:
        world.kill()
    assert res["ok"], res
    assert res["completed"], res
    for err in (res["error"], res["next"]):
        real = re.search(r"claims 1073741824 bytes at 0x[0-9a-f]+, the allocation there is (\d+) bytes", err)
        assert real and 64 << 20 <= int(real[1]) < 1 << 30, res
