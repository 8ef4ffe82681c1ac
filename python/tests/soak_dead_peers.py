"""Soak of the dead-peer faults (python/tests/faults.py): every fault at 4 KiB, 1 MiB and
64 MiB, --trials times each (`make soak`; not part of `make test`). Prints a table of the worst
time to raise on every survivor and what was left behind, and fails unless every survivor of
every trial raised within the dead-peer limit naming the dead rank, with nothing left."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import faults  # noqa: E402

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20}


def soak(fault: str, world: int, name: str, nbytes: int, trials: int) -> int:
    """trials of one fault; prints its table row and each failure; returns the failures."""
    failed, worst, fds, shm, socks, procs = 0, 0.0, 0, 0, 0, 0
    for i in range(trials):
        res = faults.trial(fault, nbytes, world=world, seed=i)
        worst = max(worst, res["worst"])
        fds += sum(1 for s in res["survivors"].values() if (s.get("fds_after") or 0) > s.get("fds_before", 0))
        shm += len(res["leaks"]["shm"])
        socks += len(res["leaks"]["sockets"])
        procs += len(res["leaks"]["processes"])
        bad = faults.problems(res)
        if bad:
            failed += 1
            print(
                f"FAIL {fault} {world} ranks {name} trial {i}: " + "; ".join(bad) + f" (logs: {res['logs']})",
                flush=True,
            )
        else:
            shutil.rmtree(res["logs"], ignore_errors=True)
    print(f"| {fault} | {world} | {name} | {trials} | {worst:.2f} | {fds} | {shm} | {socks} | {procs} |", flush=True)
    return failed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--faults", default=",".join(faults.FAULTS))
    ap.add_argument("--worlds", default="2,3", help="ranks per trial, each in turn")
    args = ap.parse_args()
    fault_list = args.faults.split(",")
    if "unreachable" in fault_list and (why := faults.netns_usable()):
        print(f"unreachable: skipped ({why})")
        fault_list.remove("unreachable")
    failed = 0
    head = "| fault | ranks | size | trials | worst time to raise (s) | fds after > before | /dev/shm left | sockets left |"
    print(head + " processes left |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world in map(int, args.worlds.split(",")):
        for fault in fault_list:
            for name, nbytes in SIZES.items():
                failed += soak(fault, world, name, nbytes, args.trials)
    print("ok" if not failed else f"{failed} trials failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
