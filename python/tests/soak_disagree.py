"""Soak of the disagree case (`make soak`): ranks that call different collectives, over and
over on one world of 3 ranks (rank 0 all_reduce, ranks 1 and 2 all_gather, a fresh gocomm
group each run). Every rank of every run must raise a DistBackendError that names the
mismatch and both calls, before the group timeout. Exits 1 on any other outcome.

    .venv/bin/python python/tests/soak_disagree.py --runs 1000
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import RUN_TIMEOUT_S, Worlds  # noqa: E402
from test_failures import check_disagree_loop, disagree_failures  # noqa: E402

WORDS = ["mismatch", "all_reduce", "all_gather"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=100, help="runs per command sent to the ranks")
    ap.add_argument("--seed", type=int, default=int(time.time()) % (2**31))
    args = ap.parse_args()
    worlds = Worlds()
    # the sidecars' logs beside the ranks' (a failed run's message names its group, as the logs do)
    os.environ.setdefault("GOCOMM_LOG_DIR", worlds.log_dir)
    t0 = time.monotonic()
    done, bad = 0, []
    try:
        world = worlds.get(3)
        started = time.monotonic() - t0
        print(f"world of 3 ranks up in {started:.1f}s; logs in {worlds.log_dir}", flush=True)
        while done < args.runs:
            n = min(args.chunk, args.runs - done)
            results = world.run(check_disagree_loop, seed=args.seed, case="kind", runs=n, timeout=RUN_TIMEOUT_S + 2 * n)
            bad += disagree_failures(results, WORDS, first=done)
            done += n
            print(f"{done} runs, {len({i for i, _ in bad})} failed, {time.monotonic() - t0:.1f}s", flush=True)
    finally:
        worlds.close()
    took = time.monotonic() - t0
    for _, line in bad:
        print(line)
    print(
        f"soak: {done} runs of w3 all_reduce-vs-all_gather, {len({i for i, _ in bad})} failed "
        f"({len(bad)} rank errors not naming the mismatch), {took:.1f}s (world start included)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
