"""Launch a gocomm job: start the CUDA MPS control daemon if asked and none runs, then torchrun.

    python -m gocomm.launch [--mps] [--mps-dir DIR] -- --nproc-per-node 4 train.py args...

Without MPS every hand-off between a rank and its sidecar costs a GPU context switch (about
0.3 ms on H200); with MPS a few microseconds (docs/decisions/0002-mps.md). MPS has to be up before any
rank creates a CUDA context, which is why it is started here, before torchrun. --mps allows
starting the daemon (it is left alone if one already answers on the pipe directory); without
--mps nothing is started and the job runs as is (correct, slower). A daemon started here is
stopped when the job ends.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys


def mps_running(env: dict) -> bool:
    """Whether an MPS control daemon answers on the pipe directory of env."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        return False
    try:
        r = subprocess.run([ctl], input=b"get_server_list\n", env=env, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def start_mps(env: dict) -> bool:
    """Start the MPS control daemon with env's pipe and log directories; True if started."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        print("gocomm.launch: nvidia-cuda-mps-control is not on PATH; running without MPS", file=sys.stderr)
        return False
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        os.makedirs(env[key], exist_ok=True)
    r = subprocess.run([ctl, "-d"], env=env, capture_output=True)
    if r.returncode != 0:
        print(f"gocomm.launch: could not start MPS: {r.stderr.decode().strip()}", file=sys.stderr)
        return False
    return mps_running(env)


def stop_mps(env: dict) -> None:
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl:
        subprocess.run([ctl], input=b"quit\n", env=env, capture_output=True, timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mps", action="store_true", help="start the MPS control daemon if none runs")
    ap.add_argument(
        "--mps-dir",
        default=None,
        help="MPS pipe/log directory (default: $CUDA_MPS_PIPE_DIRECTORY or /tmp/gocomm-mps-<uid>)",
    )
    ap.add_argument("torchrun", nargs=argparse.REMAINDER, help="torchrun's arguments (after --)")
    args = ap.parse_args(argv)
    rest = args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun
    if not rest:
        ap.error("give torchrun's arguments after --")
    env = dict(os.environ)
    base = args.mps_dir or os.path.join("/tmp", f"gocomm-mps-{os.getuid()}")
    for key, sub in (("CUDA_MPS_PIPE_DIRECTORY", "pipe"), ("CUDA_MPS_LOG_DIRECTORY", "log")):
        env[key] = os.path.join(base, sub) if args.mps_dir or key not in env else env[key]  # --mps-dir wins
    started = False
    if args.mps and not mps_running(env):
        started = start_mps(env)
        print(
            f"gocomm.launch: MPS {'started' if started else 'not started'} (pipe {env['CUDA_MPS_PIPE_DIRECTORY']})",
            file=sys.stderr,
        )
    elif not args.mps and not mps_running(env):
        print("gocomm.launch: no MPS daemon; ranks and sidecars will time-slice the GPUs (pass --mps)", file=sys.stderr)
    try:
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", *rest], env=env)
    finally:
        if started:
            stop_mps(env)


if __name__ == "__main__":
    sys.exit(main())
