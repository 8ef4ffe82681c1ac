"""The benchmarks' sections in docs/perf.md: a run replaces its own section and no other."""

from __future__ import annotations

from gocomm.bench import _perf


def test_record_replaces_its_own_section(tmp_path):
    doc = tmp_path / "perf.md"
    doc.write_text("# Performance\n\nhand-written\n")
    _perf.record(str(doc), "bench.gpu: 1x H100", "table one")
    _perf.record(str(doc), "bench.cpu: 2 cores", "cpu table")
    _perf.record(str(doc), "bench.gpu: 1x H100", "table two")
    text = doc.read_text()
    assert text.startswith("# Performance\n\nhand-written\n")
    assert text.count("<!-- bench: bench.gpu: 1x H100 -->") == 1
    assert "table two" in text and "table one" not in text
    assert "cpu table" in text
    assert text.index("bench.gpu: 1x H100") < text.index("bench.cpu: 2 cores")


def test_tee_prints_and_keeps(capsys):
    with _perf.tee() as printed:
        print("a row")
    assert printed == ["a row\n"]
    assert capsys.readouterr().out == "a row\n"


def test_fsdp_bench_on_cpu():
    """The FSDP2 benchmark runs end to end (gocomm against gloo on CPU, a tiny model): both
    backends train the same model from the same weights, so their losses agree (the
    benchmark exits 1 when they differ by more than its tolerance)."""
    import subprocess
    import sys

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gocomm.bench.fsdp",
            "--device",
            "cpu",
            "--world",
            "2",
            "--layers",
            "2",
            "--dim",
            "64",
            "--ff",
            "128",
            "--heads",
            "4",
            "--vocab",
            "256",
            "--seq",
            "32",
            "--batch",
            "2",
            "--steps",
            "4",
            "--tolerance",
            "1e-4",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gocomm / gloo:" in p.stdout and "largest loss difference over 4 steps" in p.stdout, p.stdout
