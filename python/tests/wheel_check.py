"""The wheel, installed apart from the checkout, runs a 2-rank CPU job (make test-wheel).

    python python/tests/wheel_check.py dist/gocomm-<version>-<tags>.whl

A scratch venv (deleted after, pass or fail) gets the wheel with `pip install --no-deps`; it
sees this venv's torch, grpcio and protobuf through a .pth naming this venv's site-packages
(the .pth files in that directory are not read then, so the checkout's gocomm-inplace.pth
stays out). Everything then runs from a directory outside the checkout with a PATH that has
no Go, and no PYTHONPATH or GOCOMM_* variables: `gocomm --version`, `gocomm info --json`,
`gocomm doctor --json`, and `gocomm launch -- --nproc-per-node 2 job.py`, whose ranks check
that gocomm comes from the scratch venv and that all_reduce, all_gather and broadcast over
the gocomm backend equal their references. Each step has a deadline; the job's ranks and
their sidecars die with the launcher's process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time

JOB = r"""
import os, sys
import torch
import torch.distributed as dist
import gocomm

env = sys.argv[1]
assert gocomm.__file__.startswith(env), f"gocomm imported from {gocomm.__file__}, not the scratch env {env}"
dist.init_process_group("gocomm")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
dist.all_reduce(x)
assert torch.equal(x, torch.arange(1000, dtype=torch.float32) * sum(r + 1 for r in range(world))), x[:4]
got = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
dist.all_gather(got, torch.full((3,), rank, dtype=torch.int64))
assert all(torch.equal(g, torch.full((3,), r, dtype=torch.int64)) for r, g in enumerate(got)), got
b = torch.full((5,), float(rank))
dist.broadcast(b, src=1)
assert torch.equal(b, torch.full((5,), 1.0)), b
info = gocomm.info()
assert info["version"] == gocomm.__version__, (info["version"], gocomm.__version__)
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank}/{world}: ok, gocomm {gocomm.__version__} from {os.path.dirname(gocomm.__file__)}", flush=True)
"""


def run(cmd: list[str], env: dict, cwd: str, timeout: float) -> str:
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise SystemExit(f"wheel check: {' '.join(cmd)} did not finish within {timeout}s:\n{out}") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever the command left behind (ranks, sidecars)
        except ProcessLookupError:
            pass
    if p.returncode != 0:
        raise SystemExit(f"wheel check: {' '.join(cmd)} exited with {p.returncode}:\n{out}")
    print(
        f"wheel check: {' '.join(os.path.basename(c) if c.startswith('/') else c for c in cmd)}: {time.monotonic() - t0:.1f}s"
    )
    return out


def main() -> int:
    wheel = os.path.abspath(sys.argv[1])
    checkout = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    tmp = tempfile.mkdtemp(prefix="gocomm-wheel-")
    try:
        env_dir = os.path.join(tmp, "env")
        clean = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "TMPDIR": tmp}
        # the base interpreter of this venv: the scratch env must not inherit this venv's paths
        base = getattr(sys, "_base_executable", sys.executable)
        run([base, "-m", "venv", "--without-pip", env_dir], clean, tmp, 120)
        py = os.path.join(env_dir, "bin", "python")
        site = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True)
        with open(os.path.join(site.strip(), "_torch_from_project_venv.pth"), "w") as f:
            f.write(sysconfig.get_path("purelib") + "\n")
        # this venv's pip installs into the scratch env (--python): the scratch env needs no pip
        run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel], clean, tmp, 300)
        env = dict(clean, PATH=os.path.join(env_dir, "bin") + ":/usr/bin:/bin")
        if shutil.which("go", path=env["PATH"]):
            raise SystemExit(f"wheel check: go is on {env['PATH']}; the check must run without Go")
        where = run([py, "-c", "import gocomm; print(gocomm.__file__)"], env, tmp, 120).strip().splitlines()[-1]
        if not where.startswith(env_dir) or where.startswith(checkout):
            raise SystemExit(f"wheel check: gocomm imported from {where}, not from {env_dir}")
        gocomm = os.path.join(env_dir, "bin", "gocomm")
        print(run([gocomm, "--version"], env, tmp, 120).strip())
        info = json.loads(run([gocomm, "info", "--json"], env, tmp, 120))
        pgs = info["pgserver"]
        if not pgs["path"].startswith(env_dir) or pgs["version"] != info["version"]:
            raise SystemExit(f"wheel check: pgserver {pgs} is not the wheel's of version {info['version']}")
        if info["sidecar"]["version"] != info["version"]:
            raise SystemExit(f"wheel check: the sidecar reports {info['sidecar']['version']}, not {info['version']}")
        doctor = {r["check"]: r for r in _doctor(gocomm, env, tmp)}
        for check in ("torch", "pgserver"):
            if doctor[check]["status"] != "ok":
                raise SystemExit(f"wheel check: doctor's {check} check: {doctor[check]}")
        job = os.path.join(tmp, "job.py")
        with open(job, "w") as f:
            f.write(JOB)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = run(
            [gocomm, "launch", "--", "--nproc-per-node", "2", "--master-port", str(port), job, env_dir],
            dict(env, OMP_NUM_THREADS="1"),
            tmp,
            240,
        )
        oks = [line for line in out.splitlines() if ": ok, gocomm " in line]
        if len(oks) != 2:
            raise SystemExit(f"wheel check: expected 2 ranks to report ok:\n{out}")
        print("\n".join(oks))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _doctor(gocomm: str, env: dict, cwd: str) -> list[dict]:
    # doctor exits 1 when a check fails (a small /dev/shm on a CI machine, say): its report
    # is what is checked here, not its exit status
    p = subprocess.run([gocomm, "doctor", "--json"], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    if p.returncode not in (0, 1):
        raise SystemExit(f"wheel check: gocomm doctor exited with {p.returncode}:\n{p.stdout}{p.stderr}")
    rows = json.loads(p.stdout)
    for r in rows:
        print(f"wheel check: doctor [{r['status']}] {r['check']}: {r['found']}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
