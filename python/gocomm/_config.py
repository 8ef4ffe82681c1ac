"""The shim's knob table: the GOCOMM_* variables the training process needs before a sidecar
answers (where pgserver is, or which running one to attach to, where it logs, how long to wait
for it), with their defaults, the values they accept and what they mean (NCCL's NCCL_PARAM is
the model).

Every other knob is in the sidecar's table (config/config.go): pgserver reads it from the
environment it inherits (or was started with, for GOCOMM_SIDECAR) and reports what the shim
needs in its Attach response (Sidecar.knobs, Sidecar.a2a), so one table parses each knob and
both sides use one reading; a bad value stops pgserver at start, naming the variable.
docs/config.md lists both tables.

The table is read once, at the first use of any knob, and cached; a value it does not accept
raises ValueError naming the variable and what it takes. No other module of the package reads
GOCOMM_* variables (python/tests/test_config.py checks). Environment that is not gocomm's
stays where it is used: XDG_RUNTIME_DIR and MASTER_ADDR (gocomm/_sidecar.py), and the
variables the launcher and benchmarks set for the processes they start.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
        "GOCOMM_START_TIMEOUT",
        "30",
        _seconds,
        "seconds, above 0 and at most 86400",
        "how long the shim waits for a pgserver it started to answer",
    ),
)

_BY_NAME = {k.name: k for k in KNOBS}
_lock = threading.Lock()
_values: dict[str, Any] | None = None


def load(environ: dict[str, str]) -> dict[str, Any]:
    """Every knob's value from environ (unset ones: None where the default is "", else the
    parsed default). Raises ValueError naming each variable whose value is not accepted."""
    out, bad = {}, []
    for k in KNOBS:
        v = environ.get(k.name, "").strip() or k.default
        if not v:
            out[k.name] = None
            continue
        try:
            out[k.name] = k.parse(v)
        except ValueError:
            bad.append(f"{k.name}={v!r}: want {k.accepts}")
    if bad:
        raise ValueError("gocomm: " + "; ".join(bad))
    return out


def get(name: str) -> Any:
    """The value of knob name, from this process's environment as first read."""
    global _values
    if name not in _BY_NAME:
        raise KeyError(f"gocomm: no knob {name}")
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


def start_timeout() -> float:
    return get("GOCOMM_START_TIMEOUT")
