"""The shim's knob table (gocomm/_config.py): defaults as before the table, bad values
refused by name, docs/config.md in step, no GOCOMM_* read outside the table; and the knobs
the sidecar's table (config/config.go) reads for the shim: taken from its Attach response,
a bad value stopping pgserver at start with the shim saying why."""

import contextlib
import json
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

from gocomm import _config, _sidecar

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _world_backend_settings() -> dict:
    """The settings the default group's backend took from its sidecar (Backend.settings), in a
    world of one made in a process of its own with this environment."""
    code = (
        "import json, torch, torch.distributed as dist, gocomm\n"
        "dist.init_process_group('gocomm', store=dist.HashStore(), rank=0, world_size=1)\n"
        "print(json.dumps(dist.group.WORLD._get_backend(torch.device('cpu')).settings))\n"
        "dist.destroy_process_group()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])


@pytest.fixture
def fresh(monkeypatch):
    """A clean GOCOMM_* environment, read afresh; put back (and forgotten) after the test."""
    for k in list(os.environ):
        if k.startswith("GOCOMM_") and not k.startswith(("GOCOMM_TEST_", "GOCOMM_GPU_TEST_")):
            monkeypatch.delenv(k)
    _config.reload()
    yield monkeypatch
    _config.reload()


def test_defaults(fresh):
    """Unset, every knob gives what the code used before the table."""
    assert _config.pgserver() is None and _config.sidecar() is None and _config.log_dir() is None
    assert _config.start_timeout() == 30.0


@pytest.mark.parametrize(
    "name,value,want",
    [
        ("GOCOMM_START_TIMEOUT", " 1.5 ", 1.5),
        ("GOCOMM_SIDECAR", "unix:///tmp/x.sock", "unix:///tmp/x.sock"),
        ("GOCOMM_LOG_DIR", "/tmp/logs", "/tmp/logs"),
    ],
)
def test_values(fresh, name, value, want):
    fresh.setenv(name, value)
    got = {
        "GOCOMM_START_TIMEOUT": _config.start_timeout,
        "GOCOMM_SIDECAR": _config.sidecar,
        "GOCOMM_LOG_DIR": _config.log_dir,
    }[name]()
    assert got == want


@pytest.mark.parametrize(
    "name,value",
    [
        ("GOCOMM_START_TIMEOUT", "0"),
        ("GOCOMM_START_TIMEOUT", "inf"),
        ("GOCOMM_START_TIMEOUT", "1e9"),
        ("GOCOMM_SIDECAR", "tcp://host:1"),
        ("GOCOMM_SIDECAR", "unix://"),
    ],
)
def test_bad_value_names_the_variable(fresh, name, value):
    """A bad value raises at the first read of any knob, naming the variable and what it
    accepts, never a silent default."""
    fresh.setenv(name, value)
    accepts = next(k.accepts for k in _config.KNOBS if k.name == name)
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}: want {accepts}")):
        _config.pgserver()


def test_doc_lists_every_knob():
    """docs/config.md has a row for every knob of the shim's table, with its default."""
    rows = {}
    for line in (ROOT / "docs" / "config.md").read_text().splitlines():
        m = re.match(r"^\| `(GOCOMM_[A-Z0-9_]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    for k in _config.KNOBS:
        assert k.name in rows, f"docs/config.md has no row for {k.name}"
        default = f"| `{k.default}` |" if k.default else "| (none) |"
        assert default in rows[k.name], f"docs/config.md: {k.name}'s row does not give its default {default}"
        assert "shim" in rows[k.name]


def test_no_environ_reads_outside_config():
    """Only gocomm/_config.py reads GOCOMM_* variables (setting them for child processes, as
    the benchmarks do, is fine)."""
    read = re.compile(r"""os\.(environ\.get|getenv)\(\s*["']GOCOMM_|os\.environ\[\s*["']GOCOMM_[^]]*\](?!\s*=[^=])""")
    bad = []
    for path in sorted((ROOT / "python" / "gocomm").rglob("*.py")):
        if path.name == "_config.py" or "v1" in path.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if read.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "GOCOMM_* read outside gocomm/_config.py:\n" + "\n".join(bad)


def test_sidecar_reports_knobs(fresh, tmp_path):
    """The sidecar reads the training process's knobs (old names too, with a warning in its
    log) from the environment it inherits and reports them at Attach; the shim's settings for
    the in-process engine and its CUDA refusal are what it reported: one reading for both
    sides. GOCOMM_SPIN reaches pgserver the same way."""
    for k, v in {
        "GOCOMM_NVSHMEM_RECV_MB": "64",
        "GOCOMM_A2AV_BLOCKS": "32",
        "GOCOMM_AR_MAX": "1G",
        "GOCOMM_AR_STAGE": "1000",
        "GOCOMM_AR_ONESHOT": "1.5k",
        "GOCOMM_AR_BLOCKS": "64",
        "GOCOMM_A2AV_HERE": "0",
        "GOCOMM_CUDA": "0",
        "GOCOMM_ASYNC_ERROR_HANDLING": "1",
        "GOCOMM_SPIN": "500us",
        "GOCOMM_MOE_LL_MB": "0",
        "GOCOMM_LOG_DIR": str(tmp_path),  # a log of this sidecar's only
    }.items():
        fresh.setenv(k, v)
    with contextlib.closing(_sidecar.Sidecar(0)) as sc:
        assert (sc.a2a.recv_bytes, sc.a2a.blocks, sc.a2a.threads) == (64 << 20, 32, 256)
        assert sc.knobs.async_error_handling == 1
    assert _world_backend_settings() == {  # what a group's backend took from its sidecar
        "cuda_refusal": "and gocomm's CUDA engine is turned off (GOCOMM_CUDA=0)",
        "ar_max": 1 << 30,
        "ar_stage": 992,  # rounded down to a multiple of 16
        "ar_oneshot": 1536,
        "ar_blocks": 64,
        "a2av": False,
        "a2a_recv_bytes": 64 << 20,
        "a2a_threads": 256,
        "a2a_blocks": 32,
        "moe_ll_bytes": 0,
    }
    log = pathlib.Path(sc.log_file).read_text()
    assert "GOCOMM_NVSHMEM_RECV_MB is deprecated" in log and "GOCOMM_A2AV_HERE is deprecated" in log
    assert re.search(r"msg=serving .* spin=500µs", log), log


def test_sidecar_knob_defaults(fresh, tmp_path):
    """Unset, the knobs the sidecar reports are what the shim used before they moved; GOCOMM_LOG_LEVEL
    reaches pgserver from the environment (warn: no info lines)."""
    fresh.setenv("GOCOMM_LOG_LEVEL", "WARN")
    fresh.setenv("GOCOMM_LOG_DIR", str(tmp_path))
    with contextlib.closing(_sidecar.Sidecar(0)) as sc:
        k = sc.knobs
        assert (k.cuda, k.async_error_handling, k.a2av_inprocess) == (True, 2, True)
        assert (k.ar_max, k.ar_stage, k.ar_oneshot, k.ar_blocks) == (1 << 62, 32 << 20, 256 << 10, 128)
        assert k.moe_ll_bytes == 256 << 20
        assert (sc.a2a.recv_bytes, sc.a2a.blocks, sc.a2a.threads) == (512 << 20, 128, 256)
        refusal = (
            "" if sc.info.cuda_available else f"but this rank's pgserver cannot run CUDA ops: {sc.info.cuda_error}"
        )
        assert sc.cuda_refusal == refusal
    log = pathlib.Path(sc.log_file).read_text()
    assert "level=INFO" not in log, log


@pytest.mark.parametrize(
    "name,value,accepts",
    [
        ("GOCOMM_A2AV_THREADS", "100", "a multiple of 32"),
        ("GOCOMM_AR_MAX", "-1", "bytes, with K, M or G"),
        ("GOCOMM_AR_STAGE", "8", "bytes, at least 16"),
        ("GOCOMM_AR_ONESHOT", "32MB", "bytes, with K, M or G"),
        ("GOCOMM_AR_BLOCKS", "129", "an integer, 1 to 128"),
        ("GOCOMM_A2AV_INPROCESS", "2", "0 or 1"),
        ("GOCOMM_A2AV_HERE", "yes", "0 or 1"),
        ("GOCOMM_CUDA", "no", "0 or 1"),
        ("GOCOMM_ASYNC_ERROR_HANDLING", "4", "0, 1, 2 or 3"),
        ("GOCOMM_LOG_LEVEL", "loud", "debug, info, warn or error"),
        ("GOCOMM_SPIN", "2", "a Go duration"),
        ("GOCOMM_MOE_LL_MB", "-1", "an integer of MiB, 0 to 1048576"),
    ],
)
def test_sidecar_refuses_bad_value(fresh, name, value, accepts):
    """A value the sidecar's table does not take stops pgserver at start, and the shim says
    why (the first group creation raises this), with the log's tail naming the variable."""
    fresh.setenv(name, value)
    want = rf"(?s)pgserver exited with status 1 at start; log .* ends with:.*{name}=\"{value}\": want {accepts}"
    with pytest.raises(_sidecar.SidecarError, match=want):
        _sidecar.Sidecar(0)


def test_attached_sidecar_missing_socket_fails_at_once(fresh, tmp_path):
    """GOCOMM_SIDECAR naming a socket that does not come within 3 s raises, naming it, rather
    than waiting all of GOCOMM_START_TIMEOUT (a sidecar started apart makes it at once)."""
    sock = tmp_path / "none.sock"
    fresh.setenv("GOCOMM_SIDECAR", f"unix://{sock}")
    t0 = time.monotonic()
    with pytest.raises(_sidecar.SidecarError, match=f"GOCOMM_SIDECAR: no pgserver socket at {sock}"):
        _sidecar.Sidecar(0)
    assert time.monotonic() - t0 < 5


def test_attached_sidecar_stale_socket_fails_at_once(fresh, tmp_path):
    """GOCOMM_SIDECAR naming a socket nothing listens on any more (its pgserver exited) raises
    at once, saying so, rather than waiting all of GOCOMM_START_TIMEOUT."""
    sock = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))  # bound, never listening, closed: the file a dead server leaves
    fresh.setenv("GOCOMM_SIDECAR", f"unix://{sock}")
    fresh.setenv("GOCOMM_START_TIMEOUT", "30")
    t0 = time.monotonic()
    with pytest.raises(_sidecar.SidecarError, match=f"GOCOMM_SIDECAR: nothing listens on {sock}"):
        _sidecar.Sidecar(0)
    assert time.monotonic() - t0 < 2


def test_socket_path_too_long(fresh, tmp_path):
    """A runtime directory (or GOCOMM_SIDECAR path) too long for a Unix socket's path raises
    at once naming the path and what to shorten, before any pgserver starts."""
    deep = tmp_path / ("d" * 100)
    fresh.setenv("XDG_RUNTIME_DIR", str(deep))
    with pytest.raises(
        _sidecar.SidecarError, match="over 104 bytes, too long for a Unix socket here: shorten XDG_RUNTIME_DIR"
    ):
        _sidecar.Sidecar(0)
    fresh.delenv("XDG_RUNTIME_DIR")
    fresh.setenv("GOCOMM_SIDECAR", f"unix://{deep}/s.sock")
    _config.reload()
    with pytest.raises(
        _sidecar.SidecarError, match="over 107 bytes, too long for a Unix socket here: shorten GOCOMM_SIDECAR"
    ):
        _sidecar.Sidecar(0)


def test_unwritable_dirs_say_so(fresh, tmp_path):
    """A runtime directory that cannot be made (read-only parent) and a sidecar log that cannot
    be written raise SidecarError naming the path and the knob, not a bare OSError."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    fresh.setenv("XDG_RUNTIME_DIR", str(ro))
    if os.getuid() == 0:  # root writes anywhere: a file where the directory would go
        ro.chmod(0o700)
        (ro / "gocomm").mkdir()
        fresh.setenv("XDG_RUNTIME_DIR", str(ro / "gocomm" / "x" / "y"))
        (ro / "gocomm" / "x").write_text("")
    with pytest.raises(_sidecar.SidecarError, match="cannot make the runtime directory .*XDG_RUNTIME_DIR"):
        _sidecar.Sidecar(0)
    (tmp_path / "afile").write_text("")
    fresh.setenv("XDG_RUNTIME_DIR", str(tmp_path / "afile"))  # a file where the directory's parent goes
    with pytest.raises(_sidecar.SidecarError, match="runtime directory .*afile/gocomm.*XDG_RUNTIME_DIR"):
        _sidecar.Sidecar(0)
    fresh.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    logs = tmp_path / "logs"
    logs.mkdir()
    fresh.setenv("GOCOMM_LOG_DIR", str(logs))
    _config.reload()
    (logs / f"pgserver-rank0-{os.getpid()}.log").mkdir()  # where the log file would be
    with pytest.raises(_sidecar.SidecarError, match="cannot write the sidecar's log .*GOCOMM_LOG_DIR"):
        _sidecar.Sidecar(0)


def test_clean_runs_leave_no_log(fresh, tmp_path):
    """A sidecar that served and ended cleanly leaves no log in the runtime directory (logs
    of failed runs stay, and GOCOMM_LOG_DIR keeps every one)."""
    fresh.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    sc = _sidecar.Sidecar(0)
    assert os.path.exists(sc.log_file)
    sc.close()
    assert not os.path.exists(sc.log_file)
    fresh.setenv("GOCOMM_LOG_DIR", str(tmp_path / "keep"))
    _config.reload()
    sc = _sidecar.Sidecar(0)
    sc.close()
    assert os.path.exists(sc.log_file)
    fresh.delenv("GOCOMM_LOG_DIR")
    _config.reload()
    sc = _sidecar.Sidecar(0)
    sc._group_broken(0, "a test's broken group")
    sc.close()
    assert os.path.exists(sc.log_file)
    with open(sc.log_file, "a") as f:  # what an earlier sidecar of this process (lost, say) wrote
        f.write("an earlier sidecar's record\n")
    sc = _sidecar.Sidecar(0)  # appends to the same file, and leaves it
    sc.close()
    assert "an earlier sidecar's record" in open(sc.log_file).read()


def test_bundled_pgserver_not_executable(fresh, monkeypatch):
    """A bundled pgserver that lost its execute bit (a copy that dropped modes) is named as
    such, not as missing."""
    here, real = os.path.join(os.path.dirname(_sidecar.__file__), "bin", "pgserver"), os.access
    monkeypatch.setattr(_sidecar.os, "access", lambda p, m: p != here and real(p, m))
    monkeypatch.setattr(_sidecar.shutil, "which", lambda _: None)
    with pytest.raises(_sidecar.SidecarError, match=f"{here} is there but not executable"):
        _sidecar.find_pgserver()


def test_bad_log_dir_says_so(fresh, tmp_path):
    """A GOCOMM_LOG_DIR that cannot be made (here under a file) raises SidecarError naming it."""
    (tmp_path / "file").write_text("")
    fresh.setenv("GOCOMM_LOG_DIR", str(tmp_path / "file" / "logs"))
    with pytest.raises(_sidecar.SidecarError, match="GOCOMM_LOG_DIR=.*file/logs: cannot make the sidecar's log"):
        _sidecar.Sidecar(0)


def test_attached_sidecar_knobs_are_its_own(fresh, tmp_path, caplog):
    """With GOCOMM_SIDECAR (attaching to a running pgserver), the knobs the shim uses come from
    that sidecar's environment, not the training process's; the shim warns, naming each knob
    the training process sets otherwise (with both values), and no knob it sets alike."""
    sock = tmp_path / "s.sock"
    fresh.setenv("GOCOMM_AR_BLOCKS", "32")  # the training process's: not read
    fresh.setenv("GOCOMM_AR_STAGE", "1M")  # the same on both sides: not named
    fresh.setenv("GOCOMM_SIDECAR", f"unix://{sock}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOCOMM_")}
    env |= {"GOCOMM_AR_BLOCKS": "64", "GOCOMM_AR_STAGE": "1M"}
    cmd = [_sidecar.find_pgserver(), "--socket", str(sock), "--runtime-dir", str(tmp_path)]
    with open(tmp_path / "pgserver.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
    try:
        with caplog.at_level(logging.WARNING, logger="gocomm"), contextlib.closing(_sidecar.Sidecar(0)) as sc:
            assert sc.knobs.ar_blocks == 64
        said = [r.getMessage() for r in caplog.records if r.name == "gocomm" and r.levelno == logging.WARNING]
        want = "GOCOMM_AR_BLOCKS=32 in this process, GOCOMM_AR_BLOCKS=64 in the sidecar, whose reading holds"
        assert any(want in m for m in said), said
        assert not any("GOCOMM_AR_STAGE" in m for m in said), said
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _three_failed_starts(prelude: str, after: str, env: dict, why: str) -> None:
    """In a process of its own: prelude, three tries of init_process_group, after, then the
    pgservers the process started that still run. Each try must fail naming why, none left."""
    code = (
        "import os, torch.distributed as dist, gocomm\n" + prelude + "for _ in range(3):\n"
        "    try:\n"
        "        dist.init_process_group('gocomm', store=dist.HashStore(), rank=0, world_size=1)\n"
        "        print('started')\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__, e)\n" + after + _LEFT_PGSERVERS
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 4, p.stdout + p.stderr
    assert all(why in line for line in lines[:3]), p.stdout
    assert lines[3] == "left: []", p.stdout


# prints the pgservers this process started that still run ("left: [pids]")
_LEFT_PGSERVERS = (
    "mine = f'--parent-pid\\0{os.getpid()}\\0'.encode()\n"
    "def cmd(p):\n"
    "    try:\n"
    "        return open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "    except OSError:\n"
    "        return b''\n"
    "print('left:', [p for p in os.listdir('/proc') if p.isdigit() and mine in cmd(p)])\n"
)


def test_a_failed_start_leaves_no_pgserver(fresh, tmp_path):
    """A sidecar that does not answer within GOCOMM_START_TIMEOUT fails init_process_group;
    the pgserver started for it goes too, at each of three tries in one process (they shared
    a socket path and a log file before)."""
    import gocomm._sidecar as sc

    slow = tmp_path / "slowpg.sh"
    slow.write_text(f'#!/bin/sh\nsleep 3\nexec {sc.find_pgserver()} "$@"\n')
    slow.chmod(0o755)
    env = dict(os.environ, GOCOMM_START_TIMEOUT="0.5", GOCOMM_PGSERVER=str(slow), GOCOMM_LOG_DIR=str(tmp_path))
    # past the wrapper's sleep after the tries: a pgserver left behind would be up by then
    _three_failed_starts("import time\n", "time.sleep(4)\n", env, "did not answer")


def test_a_start_failing_after_pgserver_answered_leaves_none(fresh, tmp_path):
    """A start that fails after pgserver answered (here the data plane's client, at its last
    step) raises, and the pgserver started for it goes too, at each of three tries."""
    prelude = (
        "import gocomm._client as cl\n"
        "def refuse(*a, **k):\n"
        "    raise RuntimeError('no data plane today')\n"
        "cl.C.Dispatcher = refuse\n"
    )
    _three_failed_starts(prelude, "", dict(os.environ, GOCOMM_LOG_DIR=str(tmp_path)), "no data plane today")


def test_a_forked_child_leaves_the_parents_sidecar_be(fresh, tmp_path):
    """A child forked from a rank that exits normally (its atexit hooks run) does not close the
    parent's sidecar (it sees none): the parent's group works on after. The child's copy of
    the sidecar's client, closed there (as freeing it would), neither waits for the threads
    the fork did not copy nor fails the parent's ops or stores into its pages; an op of the
    child on the inherited group then raises (nothing goes into the parent's ring), and the
    child's destroy_process_group leaves the parent's group be."""
    code = (
        "import os, sys, torch, torch.distributed as dist, gocomm, gocomm._sidecar as sc\n"
        "dist.init_process_group('gocomm', store=dist.HashStore(), rank=0, world_size=1)\n"
        "t = torch.ones(4)\n"
        "dist.all_reduce(t)\n"
        "mine = sc.current()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('child sees', sc.current(), flush=True)\n"
        "    mine.client.close()\n"
        "    try:\n"
        "        dist.all_reduce(torch.ones(4))\n"
        "        print('child op ran', flush=True)\n"
        "    except dist.DistBackendError as e:\n"
        "        print('child op raised:', 'forked' in str(e), flush=True)\n"
        "    dist.destroy_process_group()\n"
        "    sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "dist.all_reduce(t)\n"
        "print('parent', t.tolist(), sc.current() is mine, flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    env = dict(os.environ, GOCOMM_LOG_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    want = ["child sees None", "child op raised: True", "parent [1.0, 1.0, 1.0, 1.0] True"]
    assert p.stdout.splitlines() == want, p.stdout + p.stderr


def test_an_orderly_close_lets_pgserver_exit_by_itself(fresh, tmp_path):
    """close() asks a started pgserver to shut down: the Shutdown rpc is answered and pgserver
    exits 0 after its cleanup (its sockets gone), five times over on a loaded machine.
    pgserver used to cut its rpc connections before that answer went out (6 of 6 tries under
    load), and the shim, seeing none, killed it, sometimes in the middle of its cleanup."""
    code = (
        "import os, subprocess, sys, torch, torch.distributed as dist, gocomm, gocomm._sidecar as sc\n"
        "busy = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(2)]\n"
        "try:\n"
        "    for _ in range(5):\n"
        "        dist.init_process_group('gocomm', store=dist.HashStore(), rank=0, world_size=1)\n"
        "        dist.all_reduce(torch.ones(4))\n"
        "        dist.destroy_process_group()\n"
        "        s, answered = sc._sidecar, []\n"
        "        real = s.stub.Shutdown\n"
        "        s.stub.Shutdown = lambda *a, **k: answered.append(real(*a, **k))\n"
        "        sc.shutdown()\n"
        "        socks = sorted(f for f in os.listdir(sc.runtime_dir()) if f.endswith('.sock'))\n"
        "        print(len(answered), s.proc.returncode, socks)\n"
        "finally:\n"
        "    for b in busy:\n"
        "        b.kill()\n"
    )
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), GOCOMM_LOG_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.splitlines() == ["1 0 []"] * 5, p.stdout + p.stderr


def test_nccl_path_is_the_loaded_one():
    """The NCCL the shim names to its sidecar at attach (the compiled client's nccl_path): the
    libnccl this process loaded with torch, as /proc/self/maps names it; where none is loaded,
    the NCCL wheel's beside torch, or none."""
    from gocomm._client import C

    with open("/proc/self/maps") as f:
        loaded = [
            p for p in (line.split()[-1] for line in f if line.strip()) if os.path.basename(p).startswith("libnccl.so")
        ]
    got = C.nccl_path()
    if loaded:
        assert got == loaded[0], (got, loaded)
    else:
        assert got == "" or (os.path.exists(got) and os.path.basename(got) == "libnccl.so.2"), got
