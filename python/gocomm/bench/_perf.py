"""The benchmarks' tables in docs/perf.md: each run replaces its own section (one per
benchmark and machine), so the file always holds the latest figures with the command and
date that produced them."""

from __future__ import annotations

import contextlib
import datetime
import glob
import io
import os
import re
import shlex
import sys

from .. import launch


@contextlib.contextmanager
def tee():
    """Print as usual and keep what was printed: yields a list that holds the text at exit."""
    buf, out = io.StringIO(), sys.stdout

    class _Tee(io.TextIOBase):
        def write(self, s):
            out.write(s)
            return buf.write(s)

        def flush(self):
            out.flush()

    got: list[str] = []
    with contextlib.redirect_stdout(_Tee()):
        yield got
    got.append(buf.getvalue())


def _mps_note() -> str:
    """' (under MPS)' or ' (without MPS)' on a machine with NVIDIA GPUs (whether a daemon
    answers on this process's pipe directory, as its CUDA clients would find it), else
    nothing."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return ""
    return " (under MPS)" if launch.mps_running(dict(os.environ)) else " (without MPS)"


def record(path: str, key: str, text: str) -> None:
    """Put text (a benchmark's printed table) in path's section for key, with the command
    and the date: replaced where the section exists, appended where it does not."""
    cmd = "python -m " + (sys.modules["__main__"].__spec__.name if sys.modules["__main__"].__spec__ else "gocomm.bench")
    cmd += "".join(" " + shlex.quote(a) for a in sys.argv[1:])
    start, end = f"<!-- bench: {key} -->", f"<!-- /bench: {key} -->"
    section = (
        f"{start}\n### {key}\n\n`{cmd}` on {datetime.date.today().isoformat()}"
        f"{_mps_note()}:\n\n"
        f"```text\n{text.rstrip()}\n```\n{end}"
    )
    try:
        with open(path) as f:
            doc = f.read()
    except FileNotFoundError:
        doc = "# Performance\n"
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    doc = pat.sub(lambda _: section, doc) if pat.search(doc) else doc.rstrip() + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(doc)


def save(perf: str | None, key: str, text: str, json_path: str | None, data) -> None:
    """A benchmark's outputs: its table in perf's section for key (record), its rows as JSON."""
    if perf:
        record(perf, key, text)
    if json_path:
        import json

        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
