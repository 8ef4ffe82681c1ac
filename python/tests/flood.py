"""A flood of connections to a sidecar's peer port that never authenticate: half-open ones that
send nothing, junk, and hellos that name a group the sidecar does not have. Shared by
test_hostile.py (a lowered fd limit, in make test) and soak_flood.py (10,000 connections at the
default limits, in make soak).

The flood runs in a process of its own at the lowest CPU priority: an attacker's CPU is not
the job's (it would be on another host), and on a small test machine a generator competing
with the ranks at equal priority would measure the machine's cores rather than the sidecar."""

from __future__ import annotations

import multiprocessing
import os
import resource
import socket
import struct
import time

HELLO_MAGIC, HELLO_VERSION = 0x49484347, 4  # transport/auth.go


def unknown_hello() -> bytes:
    """A well-formed hello for a random group (88 bytes, transport/auth.go)."""
    return struct.pack(
        "<II16sII32sII16s", HELLO_MAGIC, HELLO_VERSION, os.urandom(16), 0, 1, os.urandom(32), 0, 0, bytes(16)
    )


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _flood(host, port, hold, total, opened, failed, stop) -> None:
    os.nice(19)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, hold + 256)), hard))
    junk = b"junk" * 40
    conns: list[socket.socket] = []
    i = 0
    while not stop.is_set() and (total == 0 or i < total):
        kind = i % 3
        i += 1
        try:
            c = socket.create_connection((host, port), timeout=2)
            if kind == 1:
                c.sendall(junk)
            elif kind == 2:
                c.sendall(unknown_hello())
        except OSError:
            failed.value += 1
            time.sleep(0.01)
            continue
        opened.value += 1
        conns.append(c)
        if len(conns) > hold:
            conns.pop(0).close()
    stop.wait()
    for c in conns:
        c.close()


class Flood:
    """Opens connections to addr until stopped (or total were opened), holding at most hold of
    them open at once (the oldest closed first); kinds cycle half-open, junk, unknown hello.
    Stopping closes every one."""

    def __init__(self, addr: str, hold: int, total: int = 0):
        host, port = addr.rsplit(":", 1)
        ctx = multiprocessing.get_context("spawn")
        self._opened, self._failed = ctx.Value("q", 0), ctx.Value("q", 0)
        self._stop = ctx.Event()
        self._proc = ctx.Process(
            target=_flood,
            args=(host.strip("[]"), int(port), hold, total, self._opened, self._failed, self._stop),
            name="flood",
            daemon=True,
        )

    @property
    def opened(self) -> int:
        return self._opened.value

    @property
    def failed(self) -> int:
        return self._failed.value

    def __enter__(self) -> Flood:
        self._proc.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def done(self) -> bool:
        return not self._proc.is_alive()
