"""gocomm's version and what its binaries were built as, from one source: the VERSION file at
the checkout's root, copied next to the package in a wheel; pgserver gets the same at link
time (-X main.version) and reports it in Info."""

from __future__ import annotations

import json
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def _read_version() -> str:
    # installed (wheel): gocomm/VERSION; checkout: <root>/VERSION
    for path in (os.path.join(_HERE, "VERSION"), os.path.join(_HERE, "..", "..", "VERSION")):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            continue
    return "unknown"


__version__ = _read_version()


def build_info() -> dict:
    """What `make` (or the wheel's build) recorded in bin/build.json: version, cuda_arch (the
    cubins' GPU architecture), torch (built against), nvcc, and in a wheel python and
    compiled_client; {} where nothing was built."""
    try:
        with open(os.path.join(_HERE, "bin", "build.json")) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    # the compiled client's own record (csrc/client.mk) says it is built, in a checkout too
    info.setdefault("compiled_client", os.path.exists(os.path.join(_HERE, "lib", "build.json")))
    return info
