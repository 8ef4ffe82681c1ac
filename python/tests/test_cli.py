"""The `gocomm` command (info, doctor, bench, launch), the one version shared by the package, pgserver
and the wheel, and the shim's refusal of a sidecar of another version. Each command runs in a
subprocess of its own (info and doctor run `pgserver info` / `pgserver doctor`, whose checks
cmd/pgserver/*_test.go test case by case); the wheel itself is checked by wheel_check.py (make
test-wheel)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OTHER = "0.0.0-other"
TIMEOUT = 120


def _gocomm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GOCOMM_")}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gocomm", *args], env=e, capture_output=True, text=True, timeout=TIMEOUT
    )


def _version_file() -> str:
    with open(os.path.join(ROOT, "VERSION")) as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def other_pgserver(tmp_path_factory):
    """A pgserver linked with another version (go build; the build cache makes it a link)."""
    go = shutil.which("go")
    assert go, "these tests build a pgserver of another version and need Go, as make does"
    exe = str(tmp_path_factory.mktemp("other") / "pgserver")
    subprocess.run(
        [go, "build", "-trimpath", "-ldflags", f"-X main.version={OTHER}", "-o", exe, "./cmd/pgserver"],
        cwd=ROOT,
        check=True,
        timeout=600,
    )
    return exe


def test_one_version():
    import gocomm

    want = _version_file()
    assert gocomm.__version__ == want
    for exe in (os.path.join(ROOT, "bin", "pgserver"), gocomm.find_pgserver()):
        got = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=TIMEOUT, check=True)
        assert got.stdout.strip() == want, exe
    assert gocomm._version.build_info()["version"] == want


def test_sidecar_of_another_version_is_refused(other_pgserver):
    code = (
        "from gocomm import _sidecar\ntry:\n    _sidecar.Sidecar(0)\nexcept _sidecar.SidecarError as e:\n    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOCOMM_")}
    env["GOCOMM_PGSERVER"] = other_pgserver
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    msg = p.stdout.strip()
    assert f"gocomm {_version_file()} cannot use pgserver {OTHER}" in msg, msg
    assert other_pgserver in msg, msg


def test_info_json():
    p = _gocomm("info", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(p.stdout)
    v = _version_file()
    assert d["version"] == v and d["pgserver"]["version"] == v and d["sidecar"]["version"] == v
    assert d["build"]["cuda_arch"].startswith("sm_")
    caps = d["sidecar"]["capabilities"]
    for fact in ("host", "gpus", "nvlink_domain", "mps", "nccl", "nvshmem"):
        value, reason = caps[fact]
        assert value and reason, (fact, caps[fact])
    transport, reason = d["sidecar"]["sparse_transport"]
    assert transport in ("nccl", "nvshmem") and reason, d["sidecar"]
    assert d["sidecar"]["engines"]["host"][0] is True
    table = d["routes"]["table"]
    assert set(table) == {"all_reduce", "all_to_all_single", "all_to_all_v", "moe", "other CUDA ops", "CPU tensors"}
    assert table["CPU tensors"][0] == "host engine"
    if caps["nvlink_domain"][0] != "yes":  # no NVLink domain here: no in-process kernel route
        assert all(engine != "in-process kernel" for engine, _ in table.values()), table


def test_info_text_matches_json():
    p = _gocomm("info")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"gocomm {_version_file()} " in p.stdout
    assert f"pgserver {_version_file()} " in p.stdout
    for line in ("capabilities:", "engines:", "routes of a ", "nvlink_domain", "CPU tensors        host engine"):
        assert line in p.stdout, p.stdout
    d = json.loads(_gocomm("info", "--json").stdout)
    for name, (value, reason) in d["sidecar"]["capabilities"].items():  # pgserver's rows, as the JSON has them
        assert f"  {name:14s} {value:10s} {reason}" in p.stdout, (name, p.stdout)


def test_info_names_a_pgserver_of_another_version(other_pgserver):
    p = _gocomm("info", env={"GOCOMM_PGSERVER": other_pgserver})
    assert p.returncode == 1, p.stdout + p.stderr
    want = f"pgserver {OTHER} ({other_pgserver}): gocomm {_version_file()} cannot use pgserver {OTHER}"
    assert want in p.stdout, p.stdout


def test_doctor_passes_here():
    p = _gocomm("doctor", "--json")
    listed = json.loads(p.stdout)  # a check may have several rows (driver: torch's, the kernels')
    rows = {r["check"]: r for r in listed}
    for r in listed:
        assert r["status"] in ("ok", "warn", "fail"), r
        assert (r["status"] == "ok") == (r["fix"] == ""), r  # every problem names its fix
    assert rows["torch"]["status"] == "ok" and rows["pgserver"]["status"] == "ok", rows
    assert {"/dev/shm", "fd limit", "ptrace scope"} <= set(rows)
    assert p.returncode == (1 if any(r["status"] == "fail" for r in listed) else 0)
    text = _gocomm("doctor").stdout.splitlines()
    want = [r["check"] for r in listed]
    assert [line[7:19].strip() for line in text if line.startswith("[")] == want, text  # same rows, in order


def test_doctor_names_a_pgserver_of_another_version(other_pgserver):
    p = _gocomm("doctor", env={"GOCOMM_PGSERVER": other_pgserver})
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"[fail] pgserver     {other_pgserver} is pgserver {OTHER}, gocomm is {_version_file()}" in p.stdout
    assert "fix: install the matching wheel" in p.stdout


def test_doctor_names_a_missing_pgserver(tmp_path):
    for path in (tmp_path / "nope", tmp_path):  # a directory passes os.access(X_OK) too
        p = _gocomm("doctor", env={"GOCOMM_PGSERVER": str(path)})
        assert p.returncode == 1
        assert f"[fail] pgserver     GOCOMM_PGSERVER={path} is not an executable file" in p.stdout, p.stdout


def test_bad_knobs_are_named_without_a_traceback():
    """A bad value of the shim's knobs (_config) or of the sidecar's (config/config.go): info and
    doctor name the variable and what it accepts, and exit 1, with no traceback."""
    for cmd in ("info", "doctor"):
        p = _gocomm(cmd, env={"GOCOMM_START_TIMEOUT": "-1"})
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stdout + p.stderr
        assert "GOCOMM_START_TIMEOUT='-1': want seconds" in p.stdout, p.stdout
    p = _gocomm("doctor", "--json", env={"GOCOMM_SPIN": "forever"})
    rows = {r["check"]: r for r in json.loads(p.stdout)}
    assert p.returncode == 1 and rows["config"]["status"] == "fail", rows
    assert 'GOCOMM_SPIN="forever": want a Go duration up to 1s' in rows["config"]["found"], rows["config"]


def test_bench_names_the_benchmarks():
    p = _gocomm("bench")
    assert p.returncode == 2 and "gocomm bench takes one of cpu, gpu, moe, fsdp, links" in p.stderr, p.stderr


def test_sdist_without_go_names_what_is_missing(tmp_path):
    """The sdist carries sources only; building it where Go is missing fails naming Go."""
    code = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert p.returncode == 0, p.stderr
    name = p.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as t:
        members = t.getnames()
        t.extractall(tmp_path, filter="data")
    top = name.removesuffix(".tar.gz")
    assert f"{top}/cmd/pgserver/main.go" in members and f"{top}/python/gocomm/v1/pgserver_pb2.py" in members
    assert not [m for m in members if "/bin/" in m or m.endswith((".cubin", ".so"))], members
    empty = tmp_path / "empty-bin"  # PATH without go (nor g++, make, strip): all named
    empty.mkdir()
    p = subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=tmp_path / top,
        env={"PATH": str(empty), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert p.returncode != 0
    assert "building pgserver and the kernels from source needs:\n  go: install Go" in p.stderr, p.stderr


_RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist
import gocomm
dist.init_process_group("gocomm")
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
n = dist.get_world_size()
assert torch.equal(t, torch.full((1000,), n * (n + 1) / 2)), t[:4]
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as f:
    f.write(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""))
dist.destroy_process_group()
"""

# A stand-in for nvidia-cuda-mps-control: `-d` starts "the daemon" (a state file), stdin
# get_server_list answers 0 once started, quit stops it; every call logs its pipe directory.
_FAKE_MPS = """#!/bin/sh
echo "$* $(cat -) $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
case "$(tail -1 "$FAKE_MPS_LOG")" in
  -d*) touch "$FAKE_MPS_LOG.up" ;;
  *quit*) rm -f "$FAKE_MPS_LOG.up" ;;
  *) [ -e "$FAKE_MPS_LOG.up" ] || exit 1 ;;
esac
"""


def _fake_mps(tmp_path) -> str:
    """A directory holding _FAKE_MPS as nvidia-cuda-mps-control, for PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-cuda-mps-control").write_text(_FAKE_MPS)
    (bindir / "nvidia-cuda-mps-control").chmod(0o755)
    return str(bindir)


def _launch_env(path: str = "/usr/bin:/bin", **extra) -> dict:
    """The environment of a `python -m gocomm.launch` run from the checkout: no GOCOMM_ or
    CUDA_MPS_ variables of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOCOMM_", "CUDA_MPS"))}
    return env | {"PATH": path, "PYTHONPATH": os.path.join(ROOT, "python"), **extra}


def test_launch_runs_torchrun(tmp_path):
    """`gocomm launch -- <torchrun args>` runs the job under torchrun: two ranks create the
    gocomm group and all_reduce; without --mps and no daemon it says the ranks will
    time-slice, and starts nothing."""
    (tmp_path / "job.py").write_text(_RANK_SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    with socket.socket() as s:  # a free port for torchrun's store
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    args = ("launch", "--", "--nproc-per-node", "2", "--master-port", port, str(tmp_path / "job.py"), str(tmp_path))
    r = _gocomm(*args, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no MPS daemon" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1"]


def test_launch_mps_dir_wins(tmp_path):
    """`--mps --mps-dir D` starts MPS on D's pipe directory even where the environment names
    another, the job sees D, and the daemon it started is stopped when the job ends."""
    bindir = _fake_mps(tmp_path)
    (tmp_path / "job.py").write_text("import os, sys\nprint('pipe', os.environ['CUDA_MPS_PIPE_DIRECTORY'])\n")
    log, d = tmp_path / "mps.log", tmp_path / "mps"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_MPS_LOG": str(log), "CUDA_MPS_PIPE_DIRECTORY": "/elsewhere"}
    r = _gocomm(
        "launch", "--mps", "--mps-dir", str(d), "--", "--nproc-per-node", "1", str(tmp_path / "job.py"), env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"pipe {d}/pipe" in r.stdout, r.stdout
    calls = log.read_text().splitlines()
    assert calls and all(c.endswith(f"{d}/pipe") for c in calls), calls
    assert calls[0].startswith(" get_server_list") and any(c.startswith("-d") for c in calls), calls
    assert "quit" in calls[-1] and not os.path.exists(f"{log}.up"), calls


_SLEEPER = """import os, sys, time
open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
time.sleep(600)
"""


def test_launch_sigterm_ends_the_job(tmp_path):
    """A SIGTERM to `python -m gocomm.launch` (a scheduler's preemption) reaches torchrun, which
    ends its workers; the launcher exits with a failure status within seconds and stops the MPS
    daemon it started."""
    import signal
    import time

    (tmp_path / "job.py").write_text(_SLEEPER)
    log = tmp_path / "mps.log"
    env = _launch_env(f"{_fake_mps(tmp_path)}:/usr/bin:/bin", FAKE_MPS_LOG=str(log))
    args = ["--mps", "--mps-dir", str(tmp_path / "mps"), "--", "--nproc-per-node", "2", "--master-port", "0"]
    p = subprocess.Popen(
        [sys.executable, "-m", "gocomm.launch", *args, str(tmp_path / "job.py"), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid*"))) < 2:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate(timeout=5)[0]
            time.sleep(0.1)
        time.sleep(0.5)  # the pid files are written first thing: let the workers reach their sleep
        workers = [int(f.read_text()) for f in tmp_path.glob("pid*")]
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=40)[0]
    finally:
        p.kill()
        for f in tmp_path.glob("pid*"):  # a launcher that failed leaves them behind
            text = f.read_text()
            if text.isdigit() and int(text) > 1:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(text), signal.SIGKILL)
    assert p.returncode != 0, out
    assert time.monotonic() - sent < 35, out
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    calls = log.read_text().splitlines()
    assert any(c.startswith("-d") for c in calls) and "quit" in calls[-1], calls


def test_launch_killed_takes_its_job(tmp_path):
    """A launcher killed outright (SIGKILL, nothing of it runs) still ends its job: the job gets
    SIGTERM as the launcher goes (no orphan holding the GPUs)."""
    import signal
    import time

    env = _launch_env()
    pid_file = tmp_path / "pid"
    job = f"echo $$ > {pid_file}; exec sleep 60"
    p = subprocess.Popen([sys.executable, "-m", "gocomm.launch", "--run", "--", "sh", "-c", job], env=env)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert p.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the job outlived its launcher by 5 s")
    finally:
        p.kill()
