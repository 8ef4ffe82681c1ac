"""CUDA graph capture: which of a group's ops a graph can hold, and the error for the rest.

The compiled client captures every collective of CUDA tensors: an in-process kernel as
itself, a sidecar op as a graph op (registered with the sidecar at capture, run by it at each
replay; docs/decisions/0020). What cannot be captured is what hands the sidecar a call whose
shape is decided on the host per call, or that the graph lane does not carry: moe.dispatch
without padded calls refuse() for it, and the client refuses send/recv and gocomm.all_to_all_v
without the in-process kernel (Backend::refuse_capture, with the same words); each raises at
capture, before anything is queued or sent, so the capture can end and the group stays usable. A group's first call of an
in-process kernel on a device sets the kernel up, collectively, and must run outside the
capture (the compiled client's engine refuses it: csrc/client/inprocess.cc,
refuse_setup)."""

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
