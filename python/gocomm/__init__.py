"""gocomm: a PyTorch process-group backend served by a Go sidecar (pgserver).

    import gocomm                                   # registers the "gocomm" backend
    dist.init_process_group(backend="gocomm")       # torchrun / env:// / tcp:// / file://

Every torch.distributed collective, point-to-point op and barrier then runs in this rank's
sidecar, which talks to the other ranks' sidecars. The sidecar is started for each rank
(GOCOMM_PGSERVER, next to this package, or on PATH) or attached to (GOCOMM_SIDECAR=unix:///...);
it logs to a per-rank file in GOCOMM_LOG_DIR (default: the runtime directory).
"""

from __future__ import annotations

import torch.distributed as dist

from . import moe
from ._backend import create
from ._client import C as _C
from ._sidecar import SidecarError, find_pgserver, shutdown
from ._version import __version__
from .sparse import all_to_all_v, receive_buffer

# the backend torch holds for each gocomm group (pg._get_backend(torch.device("cpu")))
Backend = _C.Backend

__all__ = [
    "Backend",
    "SidecarError",
    "__version__",
    "all_to_all_v",
    "find_pgserver",
    "flight_record",
    "info",
    "moe",
    "receive_buffer",
    "shutdown",
]


def _check_environment() -> None:
    if not dist.is_available():
        raise ImportError("gocomm needs torch.distributed, which this build of torch lacks")


def info() -> dict:
    """What this process's sidecar reports, and how this process's groups route their ops.

    Returns:
        {} where no sidecar runs; else its version, pid, hostname, engines, devices' state,
        peer address and log file, "capabilities" ({fact: (value, reason)}: the node's and
        this client's, as the sidecar decided them at attach) and "groups" ({group name:
        {"rank", "size", "hosts" (how many hosts its ranks are on), "transport", "routes":
        {op class: (engine, reason)}}} for each live group of this process, the default group
        included).
    """
    from . import _backend, _sidecar

    sc = _sidecar.current()
    if sc is None:
        return {}
    i = sc.info
    groups = {}
    for g in list(_backend._groups):
        if g._closed:
            continue
        groups[g.group_name] = {
            "rank": g.rank(),
            "size": g.size(),
            "hosts": g._routes.hosts,
            "transport": (g._routes.transport, g._routes.transport_reason),
            "routes": g._routes.table(),
        }
    return {
        "version": i.version,
        "pid": i.pid,
        "hostname": i.hostname,
        "engines": {e.name: (e.available, e.detail) for e in i.engines},
        "cuda_available": i.cuda_available,
        "cuda_error": i.cuda_error,
        "peer_address": i.peer_address,
        "log_file": sc.log_file or i.log_file,
        "capabilities": dict(sc.capabilities),
        "groups": groups,
    }


def flight_record(dump: bool = False) -> dict:
    """The flight recorder of this process's sidecar, as torch's ProcessGroupNCCL keeps one:
    the last ops of every group (GOCOMM_TRACE_BUFFER_SIZE per group) and how far each peer got.

    Args:
        dump: also write the record to the sidecar's log and its dump file
            (GOCOMM_DEBUG_INFO_TEMP_FILE followed by the rank; unset: next to the log), as a
            group that breaks or SIGUSR1 to pgserver does.

    Returns:
        {} where no sidecar runs; else {"version", "pid", "rank", "time", "reason", "groups":
        [{"handle", "name", "rank", "size", "broken" (why, once it broke), "last_enqueued",
        "last_started", "last_finished" (this rank's last collective seq submitted, started
        and finished, -1: none),
        "peers": [{"rank", "last_started", "last_finished", "heard_s_ago"}] (from the peers'
        heartbeats), "ops": [{"id", "seq" (collective number, the same call on every rank;
        -1: send/recv), "p2p_seq" (send/recv numbered on this rank), "op", "engine", "dtype", "reduce_op", "count", "bytes", "peer", "tag",
        "timeout_s", "enqueued", "started", "launched" (CUDA ops: their GPU work queued by the sidecar),
        "ended", "state", "error"}, ...] (oldest first)}],
        "path" (the dump file, when dump), "inprocess": [the last in-process kernel launches:
        {"group", "op", "dtype", "bytes", "device", "launched"}]}.
    """
    import json

    from . import _client, _sidecar
    from .v1 import pgserver_pb2 as pb

    sc = _sidecar.current()
    if sc is None:
        return {}
    resp = sc.call("FlightRecord", pb.FlightRecordRequest(dump=dump, reason="gocomm.flight_record()"))
    rec = json.loads(resp.json)
    rec["groups"] = rec.get("groups") or []
    if resp.path:
        rec["path"] = resp.path
    rec["inprocess"] = _client.C.inprocess_launches()
    return rec


_check_environment()
if "gocomm" not in dist.Backend.backend_list:
    dist.Backend.register_backend("gocomm", create, extended_api=True, devices=["cpu", "cuda"])
