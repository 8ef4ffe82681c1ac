"""The NVSHMEM unique id of the sidecar's all_to_all_v kernel travels between the ranks
through the group's torch Store (the compiled client's exchange_shmem_id, which a group's
backend runs at its first such call, around the control plane's ShmemID rpc,
_Group._shmem_id): rank 0's sidecar makes it, the others' are handed it. Runs without a GPU,
against a stand-in for the sidecar."""

from __future__ import annotations

import datetime
import types

import pytest
import torch.distributed as dist

from gocomm._backend import _Group
from gocomm._client import C
from gocomm._sidecar import SidecarError


class _Sidecar:
    """Answers ShmemID as pgserver does: a new id to rank 0, the id handed in elsewhere; or
    fails every call with fail."""

    def __init__(self, fail: str = ""):
        self.session, self.fail, self.calls, self.attached = 7, fail, [], []

    def attach_device(self, device):
        self.attached.append(device)
        return 0

    def call(self, method, req, timeout=120.0):
        self.calls.append((method, req.group, bytes(req.id)))
        if self.fail:
            raise SidecarError(f"pgserver {method}: {self.fail}")
        return types.SimpleNamespace(id=bytes(req.id) or b"U" * 128)


def _rpc(sc, handle):
    """The rpc a group's backend is handed: _Group._shmem_id of a group on handle."""
    member = types.SimpleNamespace(_sc=sc, _handle=handle, _slot=0)
    return lambda idx, uid: _Group._shmem_id(member, idx, uid)


def test_unique_id_goes_through_the_store():
    store = dist.HashStore()
    sc0, sc1 = _Sidecar(), _Sidecar()
    C.exchange_shmem_id(store, 0, "g", 1, _rpc(sc0, 40))
    assert store.get("gocomm/nvshmem_uid") == b"U" * 128
    C.exchange_shmem_id(store, 1, "g", 1, _rpc(sc1, 41))
    assert sc0.calls == [("ShmemID", 40, b"")]
    assert sc1.calls == [("ShmemID", 41, b"U" * 128)]
    assert [str(d) for d in sc0.attached + sc1.attached] == ["cuda:1", "cuda:1"]  # the GPU, attached first


def test_rank0_failure_reaches_the_others_at_once():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=60))
    with pytest.raises(SidecarError, match="no library"):
        C.exchange_shmem_id(store, 0, "g", 0, _rpc(_Sidecar(fail="INVALID_ARGUMENT: NVSHMEM: no library"), 40))
    sc1 = _Sidecar()
    with pytest.raises(RuntimeError, match="group 'g': rank 0 could not make the NVSHMEM unique id"):
        C.exchange_shmem_id(store, 1, "g", 0, _rpc(sc1, 41))
    assert sc1.calls == []


class _GoneStore(dist.Store):
    """A Store whose host went away: every call fails as torch's TCPStore fails then."""

    def set(self, key, value):
        raise dist.DistNetworkError("Connection reset by peer")

    def get(self, key):
        raise dist.DistNetworkError("Connection reset by peer")


def test_group_creation_names_why_the_store_failed_it():
    """A rank that never creates the group (its key never comes: the Store's wait timeout) is
    told apart from a Store whose host went away; both raise
    DistBackendError naming the group and the rank, before any sidecar is started."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=0.5))
    with pytest.raises(
        dist.DistBackendError, match=r"group 'g' \(rank 0 of 2\): a rank did not create the group within the timeout"
    ):
        _Group(store, 0, 2, datetime.timedelta(seconds=0.5), "g")
    with pytest.raises(dist.DistBackendError, match=r"group 'h' \(rank 1 of 2\): the torch Store stopped answering"):
        _Group(_GoneStore(), 1, 2, datetime.timedelta(seconds=0.5), "h")
