"""The `gocomm` command (also `python -m gocomm`).

gocomm info [--json]                     this build and this node, as a sidecar sees it
gocomm doctor [--json]                   what a job needs here, each check ok/warn/fail
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

OK, WARN, FAIL = "ok", "warn", "fail"


def _pgserver() -> tuple[str, str, str]:
    """(path, version, error): the pgserver a job would start, and what it says it is."""
    from . import _sidecar

    try:
        exe = _sidecar.find_pgserver()
    except _sidecar.SidecarError as e:
        return "", "", str(e)
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return exe, "", f"{exe} --version: {e}"
    if r.returncode != 0:
        return exe, "", f"{exe} --version exited with {r.returncode}: {r.stderr.strip()[-500:]}"
    return exe, r.stdout.strip(), ""


def _node_routes(sc) -> tuple[int, dict]:
    """The route table of a one-host group of this node's GPUs (2 ranks without GPUs), from
    what the sidecar decided at attach: which engine each op class would use here."""
    from . import _client

    gpus = sc.capabilities.get("gpus", ("0", ""))[0]
    n = int(gpus) if gpus.isdigit() and int(gpus) >= 2 else 2
    choices = [f"{sc.sparse_transport} here"] * n
    return n, _client.C.Routes(choices, sc.knobs.ar_max, "gocomm info", sc.sparse_reason).table()


def info() -> dict:
    """This build and what a sidecar started here reports: the body of `gocomm info`."""
    import torch

    from . import _sidecar

    exe, pv, err = _pgserver()
    out = {
        "version": _version.__version__,
        "package": os.path.dirname(os.path.abspath(__file__)),
        "build": _version.build_info(),
        "torch": torch.__version__,
        "pgserver": {"path": exe, "version": pv, "error": err},
    }
    if err:
        return out
    sc = _sidecar.Sidecar(rank=0)
    try:
        i = sc.info
        out["sidecar"] = {
            "version": i.version,
            "cuda_available": i.cuda_available,
            "cuda_error": i.cuda_error,
            "devices": [f"{d.index}: {d.name}" for d in i.devices],
            "engines": {e.name: (e.available, e.detail) for e in i.engines},
            "capabilities": dict(sc.capabilities),
            "sparse_transport": (sc.sparse_transport, sc.sparse_reason),
        }
        n, table = _node_routes(sc)
        out["routes"] = {"ranks": n, "table": table}
    finally:
        sc.close()
    return out


def _print_info(d: dict) -> None:
    b = d["build"]
    print(f"gocomm {d['version']} ({d['package']})")
    print(
        f"  built for torch {b.get('torch', '?')}, kernels {b.get('cuda_arch', '?')} (nvcc {b.get('nvcc', '?')}),"
        f" compiled client: {'yes' if b.get('compiled_client') else 'no'}; torch here {d['torch']}"
    )
    p = d["pgserver"]
    print(f"pgserver {p['version'] or '?'} ({p['path'] or 'not found'})" + (f": {p['error']}" if p["error"] else ""))
    s = d.get("sidecar")
    if not s:
        return
    print(f"CUDA: {'yes' if s['cuda_available'] else 'no'}" + (f" ({s['cuda_error']})" if s["cuda_error"] else ""))
    for dev in s["devices"]:
        print(f"  GPU {dev}")
    print("engines:")
    for name, (ok, detail) in s["engines"].items():
        print(f"  {name:10s} {'yes' if ok else 'no':4s} {detail}")
    print("capabilities:")
    for name, (value, reason) in s["capabilities"].items():
        print(f"  {name:14s} {value:10s} {reason}")
    r = d["routes"]
    print(f"routes of a {r['ranks']}-rank group on this node:")
    for op, (engine, reason) in r["table"].items():
        print(f"  {op:18s} {engine:18s} {reason}")


# doctor: each check returns (status, what it found, how to fix it: "" when ok)


def _check_torch() -> tuple[str, str, str]:
    import torch

    built = _version.build_info().get("torch", "")
    here = torch.__version__
    if not built:
        return WARN, f"torch {here}; no build record (bin/build.json)", "run `make` (checkout) or reinstall the wheel"
    if built.split("+")[0] != here.split("+")[0]:
        return (
            FAIL,
            f"gocomm was built for torch {built}, this is torch {here}",
            f"pip install torch=={built.split('+')[0]}",
        )
    if "+" in built and "+" in here and built != here:
        return WARN, f"built for {built}, running {here} (other CUDA build)", f"install torch {built}"
    return OK, f"torch {here} (built for {built})", ""


def _check_pgserver(exe: str, pv: str, err: str) -> tuple[str, str, str]:
    if err:
        return FAIL, err, "reinstall the gocomm wheel, or set GOCOMM_PGSERVER to a pgserver of this version"
    if pv != _version.__version__:
        return FAIL, f"{exe} is pgserver {pv}, gocomm is {_version.__version__}", "install the matching wheel"
    return OK, f"{exe} runs, version {pv}", ""


def _node_checks(exe: str) -> list[tuple[str, str, str, str]]:
    """pgserver's node checks (shared memory, fd limit, ptrace scope, the driver against what
    torch and the kernels need, a CUDA IPC mapping of a tensor of ours in its process):
    `pgserver doctor`, which sees the node as the sidecar will."""
    import torch

    args = [exe, "doctor"]
    for who, v in (("torch", torch.version.cuda or ""), ("the kernels' nvcc", _version.build_info().get("nvcc", ""))):
        if v:
            args += ["--needs-cuda", f"{who}={v}"]
    ipc_err = ""
    if torch.cuda.is_available():
        from . import _client

        try:
            torch.cuda.init()
            args += ["--ipc", _client.C.cuda_ipc_probe(0).hex()]  # our allocation; pgserver maps it
        except Exception as e:  # noqa: BLE001
            ipc_err = f"CUDA IPC of a tensor: this process could not export one: {e}"
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
        rows = [(x["check"], x["status"], x["found"], x["fix"]) for x in json.loads(r.stdout)]
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
        return [("node", FAIL, f"{exe} doctor: {e}", "reinstall the gocomm wheel")]
    if ipc_err:
        rows.append(
            (
                "CUDA IPC",
                FAIL,
                ipc_err,
                "in a container, share the host's IPC namespace (docker --ipc=host); MIG instances and some vGPUs "
                "have no CUDA IPC",
            )
        )
    return rows


def _check_cuda() -> list[tuple[str, str, str, str]]:
    """The torch-side CUDA checks: a GPU torch sees, the kernels' arch, MPS."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    arch = _version.build_info().get("cuda_arch", "")
    cap = torch.cuda.get_device_capability(0)
    here = f"sm_{cap[0]}{cap[1]}"
    if arch and arch != here:
        out.append(
            (
                "kernels",
                WARN,
                f"the in-process kernels are built for {arch}, GPU 0 is {here}: their ops take sidecar NCCL",
                f"build with make CUDA_ARCH={here}",
            )
        )
    else:
        out.append(("kernels", OK, f"kernels built for {arch}, GPU 0 is {here}", ""))
    from . import launch

    env = dict(os.environ)
    env.setdefault("CUDA_MPS_PIPE_DIRECTORY", os.path.join("/tmp", f"gocomm-mps-{os.getuid()}", "pipe"))
    if launch.mps_running(env):
        out.append(("MPS", OK, f"an MPS daemon answers on {env['CUDA_MPS_PIPE_DIRECTORY']}", ""))
    else:
        out.append(
            (
                "MPS",
                WARN,
                "no MPS daemon: each op's hand-off to the sidecar costs a GPU context switch (~0.29 ms)",
                "start jobs with `gocomm launch --mps -- <torchrun args>`",
            )
        )
    return out


def doctor() -> list[tuple[str, str, str, str]]:
    """[(check, status, found, fix)] for what a job needs on this machine."""
    rows = [("torch", *_check_torch())]
    exe, pv, err = _pgserver()
    rows.append(("pgserver", *_check_pgserver(exe, pv, err)))
    if not err:
        rows += _node_checks(exe)
    import torch

    if any(r[0] == "driver" for r in rows) and not torch.cuda.is_available():
        rows.append(("CUDA", WARN, "a driver, but torch sees no GPU", "check CUDA_VISIBLE_DEVICES and /dev/nvidia*"))
    return rows + _check_cuda()


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
    if args.cmd == "info":
        d = info()
        if args.json:
            print(json.dumps(d, indent=2))
        else:
            _print_info(d)
        return 1 if d["pgserver"]["error"] else 0
    rows = doctor()
    if args.json:
        print(json.dumps([{"check": c, "status": s, "found": f, "fix": x} for c, s, f, x in rows], indent=2))
    else:
        for c, s, f, x in rows:
            print(f"[{s:4s}] {c:12s} {f}")
            if x:
                print(f"{'':19s} fix: {x}")
    return 1 if any(s == FAIL for _, s, _, _ in rows) else 0
