"""The rank harness itself: a rank that raises is reported with its traceback and the world goes
on; ranks that hang or die are reported, killed with their sidecars, and the test fails rather
than hangs."""

from __future__ import annotations

import os
import time

import pytest
from _harness import HarnessError


def raise_on_rank1(rk, seed):
    if rk.rank == 1:
        raise ValueError(f"deliberate failure on rank 1 (seed {seed})")
    return "fine"


def hang_or_die(rk, seed):
    if rk.rank == 0:
        time.sleep(3600)
    os._exit(3)


def _alive(pid) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_harness_reports_errors_hangs_and_deaths(worlds, seed):
    world = worlds.fresh(2, label="-harness")
    try:
        with pytest.raises(HarnessError) as e:
            world.run(raise_on_rank1, seed=seed)
        text = str(e.value)
        assert "rank 0: ok" in text and "deliberate failure on rank 1" in text, text
        assert f"GOCOMM_TEST_SEED={seed}" in text, text
        assert world.alive, "a rank's exception must not cost the world"

        sidecars = [i["sidecar_pid"] for i in world.info]
        ranks = [p.pid for p in world.procs]
        t0 = time.monotonic()
        with pytest.raises(HarnessError) as e:
            world.run(hang_or_die, seed=seed, timeout=5)
        text = str(e.value)
        assert time.monotonic() - t0 < 30, "the harness waited too long"
        assert "rank 0: hung" in text and "no answer within 5s" in text, text
        assert "rank 1: died" in text and "exit status 3" in text, text
        assert not world.alive
        time.sleep(0.5)
        for pid in ranks + sidecars:
            assert not _alive(pid), f"process {pid} outlived the killed world"
    finally:
        world.kill()
