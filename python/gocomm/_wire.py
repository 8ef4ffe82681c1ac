"""The wire numbers the Python side still uses itself. The compiled client owns the wire format
(csrc/client/wire.h: descriptors, completions, record types, dtype and reduce-op codes);
python/tests/test_wire.py pins both to wire/descriptor.go and wire/dtype.go."""

from __future__ import annotations

# Op kinds (wire.OpKind): the sparse all-to-all the Python API hands to the sidecar's NVSHMEM
# kernel through the client (_Group._cuda_now).
ALL_TO_ALL_V = 12

# Reduce ops (wire.RedOp) the in-process all_reduce kernel takes.
SUM = 1
AVG = 2
