"""The wheel, installed apart from the checkout, runs a 2-rank CPU job (make test-wheel).

    python python/tests/wheel_check.py dist/gocomm-<version>-<tags>.whl
    python python/tests/wheel_check.py --cuda 8 dist/gocomm-...whl   # a GPU machine: 8 ranks, MPS

A scratch venv (deleted after, pass or fail) gets the wheel with `pip install --no-deps`; it
sees this venv's torch, grpcio and protobuf through a .pth naming this venv's site-packages
(the .pth files in that directory are not read then, so the checkout's gocomm-inplace.pth
stays out). Everything then runs from a directory outside the checkout with a PATH that has
no Go and nothing of the checkout, and no PYTHONPATH or GOCOMM_* variables: `gocomm --version`, `gocomm info --json`,
`gocomm doctor --json`, and `gocomm launch -- --nproc-per-node 2 job.py`, whose ranks check
that gocomm comes from the scratch venv and that all_reduce, all_gather and broadcast over
the gocomm backend equal their references. With --cuda N the job runs N ranks on CUDA tensors
(one GPU each) under `gocomm launch --mps`, adds all_to_all_single and gocomm.all_to_all_v,
and prints rank 0's route table; NCCL_*, NVSHMEM_*, TORCH_* and CUDA_* variables pass through
(the GPU machines' NVLink-multicast settings). Each step has a deadline; the job's ranks and
their sidecars die with the launcher's process group.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile

JOB = r"""
import os, sys
import torch
import torch.distributed as dist
import gocomm

env, cuda = sys.argv[1], sys.argv[2] == "cuda"
assert gocomm.__file__.startswith(env), f"gocomm imported from {gocomm.__file__}, not the scratch env {env}"
dev = torch.device("cpu")
if cuda:
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
dist.init_process_group("gocomm")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.arange(1000, dtype=torch.float32, device=dev) * (rank + 1)
dist.all_reduce(x)
want = torch.arange(1000, dtype=torch.float32, device=dev) * sum(r + 1 for r in range(world))
assert torch.equal(x, want), x[:4]
got = [torch.empty(3, dtype=torch.int64, device=dev) for _ in range(world)]
dist.all_gather(got, torch.full((3,), rank, dtype=torch.int64, device=dev))
assert all(torch.equal(g.cpu(), torch.full((3,), r, dtype=torch.int64)) for r, g in enumerate(got)), got
b = torch.full((5,), float(rank), device=dev)
dist.broadcast(b, src=world - 1)  # the last rank: not the default root, any world size
assert torch.equal(b.cpu(), torch.full((5,), float(world - 1))), b
if cuda:
    # rank r sends (r + 1) * 100 + d to rank d, r + d + 1 rows of 4 bf16 each
    rows = [rank + d + 1 for d in range(world)]
    inp = torch.cat([torch.full((n, 4), (rank + 1) * 100 + d, dtype=torch.bfloat16, device=dev) for d, n in enumerate(rows)])
    out, out_splits = gocomm.all_to_all_v(inp, torch.tensor(rows, dtype=torch.int64, device=dev))
    want = torch.cat([torch.full((s + rank + 1, 4), (s + 1) * 100 + rank, dtype=torch.bfloat16) for s in range(world)])
    assert out_splits.tolist() == [s + rank + 1 for s in range(world)], out_splits
    assert torch.equal(out[: want.shape[0]].cpu(), want), out
    a = torch.arange(world * 8, dtype=torch.float32, device=dev) + 1000 * rank
    o = torch.empty_like(a)
    dist.all_to_all_single(o, a)
    ref = torch.cat([torch.arange(rank * 8, rank * 8 + 8, dtype=torch.float32) + 1000 * s for s in range(world)])
    assert torch.equal(o.cpu(), ref), o
    torch.cuda.synchronize()
info = gocomm.info()
assert info["version"] == gocomm.__version__, (info["version"], gocomm.__version__)
if rank == 0:
    for op, (engine, why) in next(iter(info["groups"].values()))["routes"].items():
        print(f"rank 0 route: {op}: {engine} ({why})", flush=True)
dist.barrier()
dist.destroy_process_group()
# one write per line: the ranks share the launcher's stdout, and print's text and newline, two
# writes where stdout is unbuffered, can interleave with the other rank's line
os.write(1, f"rank {rank}/{world}: ok, gocomm {gocomm.__version__} from {os.path.dirname(gocomm.__file__)}\n".encode())
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", type=int, default=0, metavar="N", help="run the job on N GPUs (under MPS)")
    ap.add_argument(
        "--show", action="store_true", help="also print `gocomm info` and `gocomm doctor` as a user sees them"
    )
    ap.add_argument(
        "--sdist", metavar="TAR_GZ", help="also build a wheel from this sdist and compare it with the wheel"
    )
    ap.add_argument("wheel")
    args = ap.parse_args()
    wheel = os.path.abspath(args.wheel)
    checkout = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    tmp = tempfile.mkdtemp(prefix="gocomm-wheel-")
    try:
        env_dir = os.path.join(tmp, "env")
        # PATH without Go and without the checkout; the driver's and MPS's settings pass
        path = [
            d
            for d in os.environ.get("PATH", "/usr/bin:/bin").split(":")
            if d and not os.path.exists(os.path.join(d, "go")) and not os.path.abspath(d).startswith(checkout)
        ]
        clean = {"PATH": ":".join(path), "HOME": tmp, "LANG": "C.UTF-8", "TMPDIR": tmp}
        passed = ("NCCL_", "NVSHMEM_", "TORCH_", "CUDA_", "NVIDIA_", "LD_LIBRARY_PATH")
        clean.update({k: v for k, v in os.environ.items() if k.startswith(passed)})
        # the base interpreter of this venv: the scratch env must not inherit this venv's paths
        base = getattr(sys, "_base_executable", sys.executable)
        run([base, "-m", "venv", "--without-pip", env_dir], clean, tmp, 120)
        py = os.path.join(env_dir, "bin", "python")
        site = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True)
        with open(os.path.join(site.strip(), "_torch_from_project_venv.pth"), "w") as f:
            f.write(sysconfig.get_path("purelib") + "\n")
        # this venv's pip installs into the scratch env (--python): the scratch env needs no pip
        run(
            [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-index", "--no-deps", wheel],
            clean,
            tmp,
            300,
        )
        env = dict(clean, PATH=os.path.join(env_dir, "bin") + ":" + clean["PATH"])
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
        if args.show:
            print(run([gocomm, "info"], env, tmp, 120))
            print(
                subprocess.run([gocomm, "doctor"], env=env, cwd=tmp, capture_output=True, text=True, timeout=120).stdout
            )
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
        ranks = args.cuda or 2
        launch = [gocomm, "launch"] + (["--mps"] if args.cuda else []) + ["--"]
        out = run(
            launch
            + [
                "--nproc-per-node",
                str(ranks),
                "--master-port",
                str(port),
                job,
                env_dir,
                "cuda" if args.cuda else "cpu",
            ],
            dict(env, OMP_NUM_THREADS="1"),
            tmp,
            240,
        )
        oks = [line for line in out.splitlines() if ": ok, gocomm " in line]
        if len(oks) != ranks:
            raise SystemExit(f"wheel check: expected {ranks} ranks to report ok:\n{out}")
        print("\n".join(oks + [line for line in out.splitlines() if line.startswith("rank 0 route:")]))
        if args.sdist:
            _check_sdist(os.path.abspath(args.sdist), wheel, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _check_sdist(sdist: str, wheel: str, tmp: str) -> None:
    """The sdist, unpacked apart from the checkout, builds (make package with this Python:
    Go, nvcc, the generated code it carries) a wheel of the same name and files."""
    src = os.path.join(tmp, "sdist")
    os.makedirs(src)
    with tarfile.open(sdist) as t:
        t.extractall(src, filter="data")
    (top,) = os.listdir(src)
    out = os.path.join(tmp, "from-sdist")
    env = dict(os.environ)
    env.pop("GOCOMM_PGSERVER", None)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-cache-dir", "--no-index", "--no-build-isolation"]
    run(pip + ["--no-deps", "-w", out, os.path.join(src, top)], env, tmp, 600)
    (built,) = os.listdir(out)
    if built != os.path.basename(wheel):
        raise SystemExit(f"wheel check: the sdist built {built}, the checkout {os.path.basename(wheel)}")
    with zipfile.ZipFile(os.path.join(out, built)) as a, zipfile.ZipFile(wheel) as b:
        if sorted(a.namelist()) != sorted(b.namelist()):
            raise SystemExit(
                f"wheel check: the sdist's wheel holds {sorted(set(a.namelist()) ^ set(b.namelist()))} apart"
            )
        for name in ("METADATA", "WHEEL"):
            info = f"{built.split('-')[0]}-{built.split('-')[1]}.dist-info/{name}"
            if a.read(info) != b.read(info):
                raise SystemExit(f"wheel check: {name} differs between the sdist's wheel and the checkout's")
        a.extract("gocomm/bin/pgserver", os.path.join(tmp, "x"))
    exe = os.path.join(tmp, "x", "gocomm", "bin", "pgserver")
    os.chmod(exe, 0o755)
    v = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    with zipfile.ZipFile(wheel) as b:
        want = b.read("gocomm/VERSION").decode().strip()
    if v != want:
        raise SystemExit(f"wheel check: the sdist's pgserver is {v}, not {want}")
    print(f"wheel check: the sdist builds {built} with the same files and metadata, pgserver {v}")


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
