"""The shim's knob table: every GOCOMM_* variable the training process reads, with its
default, the values it accepts and what it means (NCCL's NCCL_PARAM is the model).

The table is read once, at the first use of any knob, and cached; a value it does not accept
raises ValueError naming the variable and what it takes. No other module of the package reads
GOCOMM_* variables (python/tests/test_config.py checks). Knobs the sidecar needs too (the
sparse all-to-all's receive buffer and launch shape) are in the sidecar's table
(config/config.go): it reports them at Attach and the shim takes them from there
(Sidecar.a2a), so both use one reading. docs/config.md lists both tables.

Environment that is not gocomm's stays where it is used: XDG_RUNTIME_DIR and MASTER_ADDR
(gocomm/_sidecar.py), and the variables the launcher and benchmarks set for the processes
they start.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SIZE = re.compile(r"^(\d+(\.\d*)?|\.\d+)([KMG]?)$", re.IGNORECASE)
_DURATION = re.compile(r"^0$|^((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+$")


def _size(v: str) -> int:
    """Bytes: an integer or decimal, optionally with K, M or G (powers of 1024)."""
    m = _SIZE.match(v)
    if not m:
        raise ValueError
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(3).upper()])


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(v: str) -> int:
        n = int(v)
        if not lo <= n <= hi:
            raise ValueError
        return n

    return parse


def _size_at_least(lo: int) -> Callable[[str], int]:
    def parse(v: str) -> int:
        n = _size(v)
        if n < lo:
            raise ValueError
        return n

    return parse


def _flag(v: str) -> bool:
    if v not in ("0", "1"):
        raise ValueError
    return v == "1"


def _choice(*names: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v.lower() not in names:
            raise ValueError
        return v.lower()

    return parse


def _duration(v: str) -> str:
    if not _DURATION.match(v):
        raise ValueError
    return v


def _seconds(v: str) -> float:
    """Seconds above 0 and at most a day: a larger or infinite value would never time out."""
    f = float(v)
    if not 0 < f <= 86400:
        raise ValueError
    return f


def _sidecar_address(v: str) -> str:
    if not v.startswith("unix://") or len(v) == len("unix://"):
        raise ValueError
    return v


@dataclass(frozen=True)
class Knob:
    """One variable: its default (as written in the environment; "" is unset: the accessor
    says what that means), what it accepts, and its meaning."""

    name: str
    default: str
    parse: Callable[[str], Any]
    accepts: str
    doc: str
    aliases: tuple[str, ...] = ()


KNOBS: tuple[Knob, ...] = (
    Knob("GOCOMM_PGSERVER", "", str, "a path", "the pgserver binary (unset: next to the package, then on PATH)"),
    Knob(
        "GOCOMM_SIDECAR",
        "",
        _sidecar_address,
        "unix:///path",
        "a running pgserver to attach to instead of starting one",
    ),
    Knob("GOCOMM_LOG_DIR", "", str, "a directory", "where each rank's sidecar logs (unset: the runtime directory)"),
    Knob(
        "GOCOMM_LOG_LEVEL",
        "info",
        _choice("debug", "info", "warn", "error"),
        "debug, info, warn or error",
        "how much the sidecar logs",
    ),
    Knob(
        "GOCOMM_SPIN",
        "",
        _duration,
        "a Go duration (2ms, 500us) or 0",
        "how long the sidecar polls its ring before sleeping (unset: 2ms where CUDA is available, else none)",
    ),
    Knob(
        "GOCOMM_START_TIMEOUT",
        "30",
        _seconds,
        "seconds, above 0 and at most 86400",
        "how long the shim waits for a pgserver it started to answer",
    ),
    Knob(
        "GOCOMM_CUDA", "1", _flag, "0 or 1", "0 turns the CUDA engine off: CUDA tensors raise before anything is sent"
    ),
    Knob(
        "GOCOMM_AR_MAX",
        "",
        _size_at_least(0),
        "a size in bytes (K, M, G suffixes)",
        "the largest message the in-process all_reduce kernel takes (unset: any; 0 turns it off). The same on every rank",
    ),
    Knob(
        "GOCOMM_AR_STAGE",
        "32M",
        _size_at_least(16),
        "a size in bytes of at least 16 (K, M, G suffixes)",
        "bytes of the message per two-shot round of the in-process all_reduce, rounded down to a multiple of 16; "
        "it allocates four times this per group and GPU. The same on every rank",
    ),
    Knob(
        "GOCOMM_AR_ONESHOT",
        "256K",
        _size_at_least(0),
        "a size in bytes (K, M, G suffixes)",
        "the size up to which the in-process all_reduce is one-shot. The same on every rank",
    ),
    Knob(
        "GOCOMM_AR_BLOCKS",
        "128",
        _int_in(1, 128),
        "an integer, 1 to 128",
        "the most blocks the in-process all_reduce kernel uses. The same on every rank",
    ),
    Knob(
        "GOCOMM_A2AV_INPROCESS",
        "1",
        _flag,
        "0 or 1",
        "0 leaves all_to_all_v with splits on the GPU to the sidecar's NVSHMEM kernel; 1 runs the in-process kernel where it can. "
        "The same on every rank",
        aliases=("GOCOMM_A2AV_HERE",),
    ),
    Knob(
        "GOCOMM_ASYNC_ERROR_HANDLING",
        "2",
        _int_in(0, 3),
        "0, 1, 2 or 3",
        "what a group that breaks while nobody waits on it does to the process, as TORCH_NCCL_ASYNC_ERROR_HANDLING: "
        "0 and 2 raise from the next wait() or call on the group (the sidecar aborts the group either way); "
        "1 and 3 tear the process down (SIGABRT) as soon as the sidecar reports the break",
    ),
)

_BY_NAME = {k.name: k for k in KNOBS}
_lock = threading.Lock()
_values: dict[str, Any] | None = None


def load(environ: dict[str, str], knobs: tuple[Knob, ...] = KNOBS) -> dict[str, Any]:
    """Every knob's value (of knobs: the table) from environ (unset ones: None where the default is "", else the
    parsed default). Raises ValueError naming each variable whose value is not accepted;
    warns (DeprecationWarning) for each old name read."""
    out, bad = {}, []
    for k in knobs:
        name, v = k.name, environ.get(k.name, "").strip()
        for old in k.aliases:
            ov = environ.get(old, "").strip()
            if not v and ov:
                name, v = old, ov
                warnings.warn(f"{old} is deprecated: set {k.name} instead", DeprecationWarning, stacklevel=3)
        if not v:
            v = k.default
        if not v:
            out[k.name] = None
            continue
        try:
            out[k.name] = k.parse(v)
        except ValueError:
            bad.append(f"{name}={v!r}: want {k.accepts}")
    if bad:
        raise ValueError("gocomm: " + "; ".join(bad))
    return out


def get(name: str) -> Any:
    """The value of knob name, from this process's environment as first read."""
    global _values
    if name not in _BY_NAME:
        raise KeyError(f"gocomm: no knob {name}")
    values = _values
    if values is not None:  # the hot path: some are read per op
        return values[name]
    with _lock:
        if _values is None:
            _values = load(dict(os.environ))
        return _values[name]


def reload() -> None:
    """Forget what was read: the next get() reads the environment again (tests)."""
    global _values
    with _lock:
        _values = None


# Typed accessors, one per knob.


def pgserver() -> str | None:
    return get("GOCOMM_PGSERVER")


def sidecar() -> str | None:
    return get("GOCOMM_SIDECAR")


def log_dir() -> str | None:
    return get("GOCOMM_LOG_DIR")


def log_level() -> str:
    return get("GOCOMM_LOG_LEVEL")


def spin() -> str | None:
    return get("GOCOMM_SPIN")


def start_timeout() -> float:
    return get("GOCOMM_START_TIMEOUT")


def cuda() -> bool:
    return get("GOCOMM_CUDA")


def ar_max() -> int:
    v = get("GOCOMM_AR_MAX")
    return 1 << 62 if v is None else v


def ar_stage() -> int:
    return get("GOCOMM_AR_STAGE") // 16 * 16


def ar_oneshot() -> int:
    return get("GOCOMM_AR_ONESHOT")


def ar_blocks() -> int:
    return get("GOCOMM_AR_BLOCKS")


def a2av_inprocess() -> bool:
    return get("GOCOMM_A2AV_INPROCESS")


def async_error_handling() -> int:
    return get("GOCOMM_ASYNC_ERROR_HANDLING")


@dataclass(frozen=True)
class A2A:
    """The sparse all-to-all's settings, as the sidecar read them (config/config.go's
    config.A2A, from its Attach response)."""

    recv_bytes: int
    blocks: int
    threads: int

    @classmethod
    def from_attach(cls, msg) -> A2A | None:
        """From an AttachResponse's a2a; None where the sidecar sent none (a pgserver older
        than this shim)."""
        if not msg.recv_bytes or not msg.blocks or not msg.threads:
            return None
        return cls(msg.recv_bytes, msg.blocks, msg.threads)
