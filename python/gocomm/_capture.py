"""CUDA graph capture: which of a group's ops a graph can hold, and the error for the rest.

An op that runs in the sidecar is handed over on the host, one descriptor per call: a graph
would record the stream's signal to the sidecar but not the hand-off, so a replay would leave
the outputs stale without an error. Such an op therefore raises when called under capture,
before anything is queued or sent: the capture can end and the group stays usable. What a
graph can hold runs as kernels in this process with no per-call host state:
all_reduce (sum, avg of bf16, fp16, fp32) and all_to_all_single on groups whose GPUs share
NVLink, gocomm.all_to_all_v there, and gocomm.moe.dispatch(padded=True) and combine there.
A group's first such call on a device sets its kernel up, collectively, and must run outside
the capture (the compiled client's engine refuses it: csrc/client/inprocess.cc, refuse_setup)."""

from __future__ import annotations

import torch


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph; call only where the op's tensors
    are on a GPU (it initializes CUDA)."""
    return torch.cuda.is_current_stream_capturing()


def capturable(pg) -> str:
    """What group pg can capture, in words, for error messages (its route table says)."""
    from . import _backend

    routes = getattr(_backend.state(pg), "_routes", None)
    if routes is None:
        return "none of its ops"
    return routes.capturable()


def refuse(op: str, pg, why: str) -> None:
    """Raise for op on group pg under capture; why says what runs it instead of an in-process kernel."""
    raise RuntimeError(
        f"gocomm {op} cannot be captured in a CUDA graph on group {pg.group_name!r}: {why}, so a replay "
        f"would not run it. Run it outside the capture. This group can capture: {capturable(pg)}."
    )


# what runs an op that refuse() names, where it is the sidecar
SIDECAR = "it runs in the sidecar (NCCL), which is handed each call on the host"
SIDECAR_NVSHMEM = "it runs in the sidecar's NVSHMEM kernel, which is handed each call on the host"
