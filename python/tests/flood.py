"""A flood of connections to a sidecar's peer port that never authenticate: half-open ones that
send nothing, junk, and hellos that name a group the sidecar does not have. Shared by
test_hostile.py (a lowered fd limit, in make test) and soak_flood.py (10,000 connections at the
default limits, in make soak)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

HELLO_MAGIC, HELLO_VERSION = 0x49484347, 4  # transport/auth.go


def unknown_hello() -> bytes:
    """A well-formed hello for a random group (88 bytes, transport/auth.go)."""
    return struct.pack(
        "<II16sII32sII16s", HELLO_MAGIC, HELLO_VERSION, os.urandom(16), 0, 1, os.urandom(32), 0, 0, bytes(16)
    )


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Flood:
    """Opens connections to addr from a thread until stopped, holding at most hold of them open
    at once (the oldest closed first); kinds cycle half-open, junk, unknown hello."""

    def __init__(self, addr: str, hold: int, total: int | None = None):
        host, port = addr.rsplit(":", 1)
        self.addr = (host.strip("[]"), int(port))
        self.hold, self.total = hold, total
        self.opened = self.failed = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for c in self._conns:
            c.close()
        self._conns.clear()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def _run(self) -> None:
        junk = b"junk" * 40
        i = 0
        while not self._stop.is_set() and (self.total is None or i < self.total):
            kind = i % 3
            i += 1
            try:
                c = socket.create_connection(self.addr, timeout=2)
                if kind == 1:
                    c.sendall(junk)
                elif kind == 2:
                    c.sendall(unknown_hello())
            except OSError:
                self.failed += 1
                time.sleep(0.01)
                continue
            self.opened += 1
            self._conns.append(c)
            if len(self._conns) > self.hold:
                self._conns.pop(0).close()
