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
