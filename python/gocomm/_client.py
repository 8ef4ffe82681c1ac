"""The compiled client (gocomm._C, built by `make` from csrc/): loaded only once it is known
to match the running torch. The build records the torch it compiled against
(lib/build.json: version, C++ ABI, CUDA variant); an extension built for another torch
would fail to load with an unreadable symbol error, or worse, load and misbehave."""

from __future__ import annotations

import json
import os

import torch

RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "build.json")
REBUILD = (
    "run `make client` in the gocomm checkout (`make client CLIENT_PY=python3` where there is "
    "no .venv; it needs g++ and the torch it builds against)"
)


def running() -> dict:
    """What the extension must have been built for: this process's torch."""
    return {
        "torch": torch.__version__,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "cuda": torch.version.cuda,
    }


def check(record: str = RECORD) -> None:
    """Raise ImportError, saying how to rebuild, unless the extension was built for this torch."""
    try:
        with open(record) as f:
            built = json.load(f)
    except FileNotFoundError:
        raise ImportError(f"gocomm's compiled client is not built ({record} is missing): {REBUILD}") from None
    except (OSError, ValueError) as e:
        raise ImportError(f"gocomm's compiled client: cannot read {record} ({e}): {REBUILD}") from None
    diff = [f"{k} {built.get(k)!r}, running {v!r}" for k, v in running().items() if built.get(k) != v]
    if diff:
        raise ImportError(f"gocomm's compiled client was built for another torch ({'; '.join(diff)}): {REBUILD}")


check()
import torch.distributed  # noqa: E402,F401 - registers c10d.Backend, the extension's base class

try:
    from . import _C as C  # noqa: E402,F401 - gocomm._client.C is the extension
except ImportError as e:
    raise ImportError(f"gocomm's compiled client does not load ({e}): {REBUILD}") from None
