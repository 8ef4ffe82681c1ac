"""The benchmarks' tables in docs/perf.md: each run replaces its own section (one per
benchmark and machine), so the file always holds the latest figures with the command and
date that produced them."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import shlex
import sys


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


def record(path: str, key: str, text: str) -> None:
    """Put text (a benchmark's printed table) in path's section for key, with the command
    and the date: replaced where the section exists, appended where it does not."""
    cmd = "python -m " + (sys.modules["__main__"].__spec__.name if sys.modules["__main__"].__spec__ else "gocomm.bench")
    cmd += "".join(" " + shlex.quote(a) for a in sys.argv[1:])
    start, end = f"<!-- bench: {key} -->", f"<!-- /bench: {key} -->"
    section = (
        f"{start}\n### {key}\n\n`{cmd}` on {datetime.date.today().isoformat()}"
        f"{' (under MPS)' if os.environ.get('CUDA_MPS_PIPE_DIRECTORY') else ''}:\n\n"
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
