"""The `gocomm` command (also `python -m gocomm`).

gocomm info [--json]                     this build and this node, as a sidecar sees it (pgserver info)
gocomm doctor [--json]                   what a job needs here, each check ok/warn/fail (pgserver doctor)
gocomm launch [--mps] -- <torchrun args> a job, under MPS where asked (gocomm.launch)
gocomm bench {cpu,gpu,moe,fsdp,links} [args]  the benchmarks (gocomm.bench)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from . import _version


def _pgserver() -> tuple[str, str]:
    """(path, error): the pgserver a job would start."""
    from . import _sidecar

    try:
        return _sidecar.find_pgserver(), ""
    except (_sidecar.SidecarError, ValueError) as e:  # ValueError: a knob's value (_config)
        return "", str(e)


def _probe(exe: str) -> tuple[str, str]:
    """(stdout, error) of `pgserver info --json` (cmd/pgserver/info.go): what a sidecar started
    here would report to this process at attach, naming the NCCL this torch loads, with that
    report's text as `pgserver info` prints it."""
    import torch

    from . import _client

    nccl = _client.C.nccl_path() if torch.cuda.is_available() else ""
    try:
        r = subprocess.run([exe, "info", "--nccl", nccl, "--json"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", f"{exe} info: {e}"
    if r.returncode != 0:
        return "", f"{exe} info exited with {r.returncode}: {r.stderr.strip()[-500:]}"
    return r.stdout, ""


def _node_routes(s: dict) -> tuple[int, dict]:
    """The route table of a one-host group of this node's GPUs (2 ranks without GPUs), from
    what the sidecar decides at attach (s: `pgserver info --json`): which engine each op class
    would use here."""
    from . import _client

    gpus = s["capabilities"].get("gpus", ("0", ""))[0]
    n = int(gpus) if gpus.isdigit() and int(gpus) >= 2 else 2
    transport, reason = s["sparse_transport"]
    return n, _client.C.Routes([f"{transport} here"] * n, s["ar_max"], "gocomm info", reason).table()


def info() -> dict:
    """This build and what a sidecar started here would report: the body of `gocomm info`."""
    import torch

    exe, err = _pgserver()
    out = {
        "version": _version.__version__,
        "package": os.path.dirname(os.path.abspath(__file__)),
        "build": _version.build_info(),
        "torch": torch.__version__,
        "pgserver": {"path": exe, "version": "", "error": err},
    }
    if not err:
        body, err = _probe(exe)
        out["pgserver"]["error"] = err
    if err:
        return out
    s = out["sidecar"] = json.loads(body)
    v = out["pgserver"]["version"] = s["version"]
    if v not in (_version.__version__, "dev"):  # as a job's start refuses it (_sidecar.Sidecar)
        out["pgserver"]["error"] = f"gocomm {_version.__version__} cannot use pgserver {v}: install the matching gocomm"
    n, table = _node_routes(s)
    out["routes"] = {"ranks": n, "table": table}
    return out


def _print_info(d: dict) -> None:
    """`gocomm info`: this build, then pgserver's report as it prints it, then the routes."""
    b = d["build"]
    print(f"gocomm {d['version']} ({d['package']})")
    print(
        f"  built for torch {b.get('torch', '?')}, kernels {b.get('cuda_arch', '?')} (nvcc {b.get('nvcc', '?')}),"
        f" compiled client: {'yes' if b.get('compiled_client') else 'no'}; torch here {d['torch']}"
    )
    p = d["pgserver"]
    if p["error"]:
        print(f"pgserver {p['version'] or '?'} ({p['path']}): {p['error']}" if p["path"] else p["error"])
        return
    print(d["sidecar"]["text"], end="")  # the same probe the routes come from
    r = d["routes"]
    print(f"routes of a {r['ranks']}-rank group on this node:")
    for op, (engine, reason) in r["table"].items():
        print(f"  {op:18s} {engine:18s} {reason}")


def doctor(as_json: bool = False) -> int:
    """`gocomm doctor`: pgserver's checks (cmd/pgserver/doctor.go), handed what only this
    process knows: the torch it runs and gocomm was built for, the CUDA versions they need,
    the in-process kernels' arch and a CUDA IPC handle of a tensor of ours for pgserver to map.
    Prints a row per check; returns 1 where one failed."""
    import torch

    exe, err = _pgserver()
    if err:
        return _cannot_check(
            "pgserver", err, "fix the variable named, or reinstall gocomm (or GOCOMM_PGSERVER)", as_json
        )
    b, gpu = _version.build_info(), torch.cuda.is_available()
    args = [exe, "doctor", "--gocomm", _version.__version__, "--torch-here", torch.__version__]
    args += ["--torch-built", b.get("torch", ""), "--torch-cuda", "yes" if gpu else "no"]
    args += ["--kernels", b.get("cuda_arch", "")] + (["--json"] if as_json else [])
    for who, v in (("torch", torch.version.cuda or ""), ("the kernels' nvcc", b.get("nvcc", ""))):
        if v:
            args += ["--needs-cuda", f"{who}={v}"]
    if gpu:
        from . import _client

        try:
            torch.cuda.init()
            args += ["--ipc", _client.C.cuda_ipc_probe(0).hex()]  # our allocation; pgserver maps it
        except Exception as e:  # noqa: BLE001
            args += ["--ipc-error", str(e)]
    sys.stdout.flush()
    try:
        return subprocess.run(args, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return _cannot_check("node", f"{exe} doctor: {e}", "reinstall the gocomm wheel", as_json)


def _cannot_check(check: str, found: str, fix: str, as_json: bool) -> int:
    """The one failed row `gocomm doctor` prints where no pgserver can check, in pgserver's format."""
    row = {"check": check, "status": "fail", "found": found, "fix": fix}
    print(json.dumps([row], indent=2) if as_json else f"[fail] {check:12s} {found}\n{'':19s} fix: {fix}")
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="gocomm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", action="version", version=f"gocomm {_version.__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="this build and this node's capabilities and routes")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("doctor", help="check what a job needs here; exits 1 on a failed check")
    p.add_argument("--json", action="store_true")
    sub.add_parser("launch", help="gocomm launch [--mps] -- <torchrun args>", add_help=False)
    p = sub.add_parser("bench", help="gocomm bench {cpu,gpu,moe,fsdp,links} [args] (--help for each)", add_help=False)
    if argv[:1] in (["launch"], ["bench"]):  # their own parsers take the rest
        if argv[0] == "launch":
            from . import launch

            return launch.main(argv[1:])
        kinds = ("cpu", "gpu", "moe", "fsdp", "links")
        if len(argv) < 2 or argv[1] not in kinds:
            ap.error(f"gocomm bench takes one of {', '.join(kinds)}, then that benchmark's arguments")
        import importlib

        return importlib.import_module(f"gocomm.bench.{argv[1]}").main(argv[2:]) or 0
    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        return doctor(args.json)
    d = info()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        _print_info(d)
    return 1 if d["pgserver"]["error"] else 0
