"""The shim's knob table (gocomm/_config.py): defaults as before the table, bad values
refused by name, old names still read, docs/config.md in step, no GOCOMM_* read outside the
table, and the knobs the sidecar reads for both sides taken from its Attach response."""

import os
import pathlib
import re
import warnings

import pytest

from gocomm import _config, _sidecar
from gocomm.v1 import pgserver_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
    assert _config.spin() is None
    assert _config.log_level() == "info"
    assert _config.start_timeout() == 30.0
    assert _config.cuda() is True and _config.a2av_inprocess() is True
    assert _config.ar_max() == 1 << 62
    assert _config.ar_stage() == 32 << 20
    assert _config.ar_oneshot() == 256 << 10
    assert _config.ar_blocks() == 128


@pytest.mark.parametrize(
    "name,value,want",
    [
        ("GOCOMM_AR_STAGE", "1M", 1 << 20),
        ("GOCOMM_AR_STAGE", "1000", 992),  # rounded down to a multiple of 16
        ("GOCOMM_AR_ONESHOT", "1.5k", 1536),
        ("GOCOMM_AR_MAX", "0", 0),
        ("GOCOMM_AR_BLOCKS", " 64 ", 64),
        ("GOCOMM_CUDA", "0", False),
        ("GOCOMM_LOG_LEVEL", "DEBUG", "debug"),
        ("GOCOMM_SPIN", "500us", "500us"),
        ("GOCOMM_SIDECAR", "unix:///tmp/x.sock", "unix:///tmp/x.sock"),
    ],
)
def test_values(fresh, name, value, want):
    fresh.setenv(name, value)
    got = {
        "GOCOMM_AR_STAGE": _config.ar_stage,
        "GOCOMM_AR_ONESHOT": _config.ar_oneshot,
        "GOCOMM_AR_MAX": _config.ar_max,
        "GOCOMM_AR_BLOCKS": _config.ar_blocks,
        "GOCOMM_CUDA": _config.cuda,
        "GOCOMM_LOG_LEVEL": _config.log_level,
        "GOCOMM_SPIN": _config.spin,
        "GOCOMM_SIDECAR": _config.sidecar,
    }[name]()
    assert got == want


@pytest.mark.parametrize(
    "name,value",
    [
        ("GOCOMM_AR_STAGE", "8"),
        ("GOCOMM_AR_STAGE", "32MB"),
        ("GOCOMM_AR_MAX", "-1"),
        ("GOCOMM_AR_BLOCKS", "0"),
        ("GOCOMM_AR_BLOCKS", "129"),
        ("GOCOMM_CUDA", "no"),
        ("GOCOMM_A2AV_INPROCESS", "2"),
        ("GOCOMM_LOG_LEVEL", "loud"),
        ("GOCOMM_SPIN", "2"),
        ("GOCOMM_START_TIMEOUT", "0"),
        ("GOCOMM_SIDECAR", "tcp://host:1"),
    ],
)
def test_bad_value_names_the_variable(fresh, name, value):
    """A bad value raises at the first read of any knob, naming the variable and what it
    accepts, never a silent default."""
    fresh.setenv(name, value)
    accepts = next(k.accepts for k in _config.KNOBS if k.name == name)
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}: want {accepts}")):
        _config.cuda()


def test_alias():
    """A renamed knob's old name is read, with a DeprecationWarning, while the new is unset."""
    knob = _config.Knob("GOCOMM_NEW", "7", int, "an integer", "test", aliases=("GOCOMM_OLD",))
    with pytest.warns(DeprecationWarning, match="GOCOMM_OLD is deprecated: set GOCOMM_NEW"):
        assert _config.load({"GOCOMM_OLD": "3"}, (knob,)) == {"GOCOMM_NEW": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _config.load({"GOCOMM_NEW": "5"}, (knob,)) == {"GOCOMM_NEW": 5}
        assert _config.load({}, (knob,)) == {"GOCOMM_NEW": 7}
    with pytest.raises(ValueError, match="GOCOMM_OLD='x'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _config.load({"GOCOMM_OLD": "x"}, (knob,))


def test_a2av_here_is_read_as_inprocess():
    """GOCOMM_A2AV_HERE, the in-process all_to_all_v's knob before its rename, still turns it off."""
    with pytest.warns(DeprecationWarning, match="GOCOMM_A2AV_HERE is deprecated: set GOCOMM_A2AV_INPROCESS"):
        assert _config.load({"GOCOMM_A2AV_HERE": "0"})["GOCOMM_A2AV_INPROCESS"] is False


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
        for a in k.aliases:
            assert f"`{a}`" in rows[k.name], f"docs/config.md: {k.name}'s row does not name its old name {a}"


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


def test_a2a_from_attach():
    msg = pb.A2AConfig(recv_bytes=64 << 20, blocks=64, threads=128)
    assert _config.A2A.from_attach(msg) == _config.A2A(64 << 20, 64, 128)
    assert _config.A2A.from_attach(pb.A2AConfig()) is None  # an older pgserver


def test_sidecar_reports_a2a(fresh):
    """The sidecar reads the all-to-all knobs (the old name of the receive buffer's, too) and
    the shim takes them from its Attach response: one reading for both sides."""
    fresh.setenv("GOCOMM_NVSHMEM_RECV_MB", "64")
    fresh.setenv("GOCOMM_A2AV_BLOCKS", "32")
    sc = _sidecar.Sidecar(0)
    try:
        assert sc.a2a == _config.A2A(64 << 20, 32, 256)
    finally:
        sc.close()
    with open(sc.log_file) as f:
        assert "GOCOMM_NVSHMEM_RECV_MB is deprecated" in f.read()


def test_sidecar_refuses_bad_value(fresh):
    """A value the sidecar's table does not take stops pgserver at start, and the shim says
    why, naming the variable."""
    fresh.setenv("GOCOMM_A2AV_THREADS", "100")
    with pytest.raises(_sidecar.SidecarError, match="GOCOMM_A2AV_THREADS=.*multiple of 32"):
        _sidecar.Sidecar(0)
