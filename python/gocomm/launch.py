"""Launch a gocomm job: start the CUDA MPS control daemon if asked and none runs, then torchrun.

    python -m gocomm.launch [--mps] [--mps-dir DIR] -- --nproc-per-node 4 train.py args...

Without MPS every hand-off between a rank and its sidecar costs a GPU context switch (about
0.3 ms on H200); with MPS a few microseconds (docs/decisions/0002-mps.md). MPS has to be up
before any rank creates a CUDA context, which is why it is started here, before torchrun.
This is pgserver's `launch` (cmd/pgserver/launch.go), which becomes this process: it passes
the signals it gets on to torchrun, stops a daemon it started when the job ends, and exits
with the job's status. `pgserver launch -h` lists its flags.
"""

from __future__ import annotations

import os
import sys

from ._sidecar import SidecarError, find_pgserver


def main(argv=None) -> None:
    try:
        exe = find_pgserver()
    except SidecarError as e:
        sys.exit(f"gocomm launch: {e}")
    os.execv(exe, [exe, "launch", "--python", sys.executable, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
