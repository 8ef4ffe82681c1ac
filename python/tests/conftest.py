"""Fixtures for the gocomm test suite.

worlds: the session's rank worlds (python/tests/_harness.py): worlds.get(n) is a running world of
n ranks (gocomm default group + a gloo group over the same ranks), shared by every test that asks
for that size; worlds.fresh(n) is one of the test's own. Checks run on every rank through
World.run(fn, seed=seed, ...); fn is a module-level function taking the rank context first.

seed: fresh per test (from the clock), printed in every failure report; set GOCOMM_TEST_SEED to
replay one.

gpu marker: tests that need CUDA skip, saying why, when torch.cuda.is_available() is False.

GOCOMM_TEST_FAIL_NOW=1 prints each failure's report to stderr the moment it fails, not only in
pytest's summary at the end: a device run cut off at its time limit keeps what failed before
(make test-gpu sets it).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import Worlds


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped when torch.cuda.is_available() is False)")


def pytest_runtest_logreport(report):
    if report.failed and os.environ.get("GOCOMM_TEST_FAIL_NOW") == "1":
        sys.stderr.write(
            f"\n=== FAILED {report.nodeid} ({report.when}, {report.duration:.1f}s)\n{report.longreprtext}\n"
        )
        sys.stderr.flush()


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA: torch.cuda.is_available() is False on this machine")


@pytest.fixture(scope="session")
def worlds():
    w = Worlds()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def seed(request):
    env = os.environ.get("GOCOMM_TEST_SEED")
    s = int(env) if env else int(time.time() * 1000) % (2**31)
    print(f"{request.node.nodeid}: seed {s} (rerun with GOCOMM_TEST_SEED={s})")
    return s
