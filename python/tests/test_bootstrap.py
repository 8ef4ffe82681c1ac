"""The NVSHMEM unique id of the sidecar's all_to_all_v kernel travels between the ranks
through the group's torch Store (_Group._shmem_id): rank 0's sidecar makes it,
the others' are handed it. Runs without a GPU, against a stand-in for the sidecar."""

from __future__ import annotations

import datetime
import types

import pytest
import torch
import torch.distributed as dist

from gocomm._backend import _Group
from gocomm._sidecar import SidecarError


class _Sidecar:
    """Answers ShmemID as pgserver does: a new id to rank 0, the id handed in elsewhere; or
    fails every call with fail."""

    def __init__(self, fail: str = ""):
        self.session, self.fail, self.calls = 7, fail, []

    def attach_device(self, device):
        return 0

    def call(self, method, req, timeout=120.0):
        self.calls.append((method, req.group, bytes(req.id)))
        if self.fail:
            raise SidecarError(f"pgserver {method}: {self.fail}")
        return types.SimpleNamespace(id=bytes(req.id) or b"U" * 128)


def _member(store, rank, sc):
    return types.SimpleNamespace(
        _shmem_ready=False,
        _slot=0,
        _rank=rank,
        _sc=sc,
        _store=store,
        _handle=40 + rank,
        _group_name="g",
        _need_slot=lambda op: None,
    )


def test_unique_id_goes_through_the_store():
    store = dist.HashStore()
    sc0, sc1 = _Sidecar(), _Sidecar()
    g0, g1 = _member(store, 0, sc0), _member(store, 1, sc1)
    _Group._shmem_id(g0, torch.device("cpu"))
    assert store.get("gocomm/nvshmem_uid") == b"U" * 128
    _Group._shmem_id(g1, torch.device("cpu"))
    assert sc0.calls == [("ShmemID", 40, b"")]
    assert sc1.calls == [("ShmemID", 41, b"U" * 128)]
    _Group._shmem_id(g1, torch.device("cpu"))  # once per group
    assert len(sc1.calls) == 1 and g0._shmem_ready and g1._shmem_ready


def test_rank0_failure_reaches_the_others_at_once():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=60))
    g0 = _member(store, 0, _Sidecar(fail="INVALID_ARGUMENT: NVSHMEM: no library"))
    with pytest.raises(SidecarError, match="no library"):
        _Group._shmem_id(g0, torch.device("cpu"))
    sc1 = _Sidecar()
    g1 = _member(store, 1, sc1)
    with pytest.raises(RuntimeError, match="rank 0 could not make the NVSHMEM unique id"):
        _Group._shmem_id(g1, torch.device("cpu"))
    assert sc1.calls == [] and not g1._shmem_ready
