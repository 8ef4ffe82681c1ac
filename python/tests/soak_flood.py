"""Soak of the connection flood (`make soak`): 10,000 junk, half-open and unknown-group
connections to one sidecar's peer port at the default fd limit, while the ranks of a 2-rank
world loop all_reduce of 4 KiB and 32 MiB and make a new group; --trials times. Every trial
must keep the results right, each size's median time within 2x the unflooded one (+50 ms), the
sidecar's fds within its cap of unauthenticated links during the flood and back at the baseline
within 10 s after. Exits 1 otherwise.

    .venv/bin/python python/tests/soak_flood.py --trials 20
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Worlds  # noqa: E402
from test_hostile import flood_trial  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--connections", type=int, default=10_000)
    args = ap.parse_args()
    # this process holds the flood's client ends
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.connections + 1024)), hard))
    worlds = Worlds()
    bad = 0
    try:
        world = worlds.fresh(2, label="-flood")
        for i in range(args.trials):
            r = flood_trial(world, args.connections, fd_headroom=None)
            print(f"trial {i}: {r}", flush=True)
            bad += bool(r["failures"])
        world.close()
    finally:
        worlds.close()
    print(f"{args.trials - bad} of {args.trials} trials held; logs in {worlds.log_dir}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
