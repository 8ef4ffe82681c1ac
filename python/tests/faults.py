"""Fault injection for dead and silent peers: a world of rank processes of its own (one
`python faults.py rank ...` each, with its sidecar) loops an op on CPU tensors, one fault is
injected into one rank at a random point of an op, and every other rank must raise within the
dead-peer limit (GOCOMM_PEER_DEAD_TIMEOUT_SEC), naming the dead rank. Used by
test_dead_peers.py (a few trials) and soak_dead_peers.py (`make soak`, many).

Faults (the victim is rank 1; for "store", rank 0, which hosts the torch Store):
  kill_rank      SIGKILL the training process (its sidecar aborts its groups)
  kill_sidecar   SIGKILL the victim's pgserver
  stop_sidecar   SIGSTOP the victim's pgserver: a silent peer
  unreachable    the victim runs in a network namespace of its own, joined by a veth pair the
                 trial makes; the fault sets the link down: the victim's host drops off the net
  store          SIGKILL rank 0 (the Store's host) while every rank creates groups
  hang           SIGSTOP the victim's training process: not a death; the op times out on the
                 others (group timeout 3 s) and the flight record shows where each rank was
  teardown       SIGKILL the victim while the others wait on nothing, with
                 GOCOMM_ASYNC_ERROR_HANDLING=1: each of them must end itself (SIGABRT)

Each trial checks what it leaves: the sidecars' processes, their socket files and /dev/shm
files, and each survivor's sidecar fd count (at the first op, and after its group is gone).
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT_S = 5.0  # GOCOMM_PEER_DEAD_TIMEOUT_SEC's default
HANG_TIMEOUT_S = 3.0
# The group timeout of CUDA trials: it bounds the life of a kernel left waiting for a peer
# that will never come (an in-process kernel gives up its waits at the group's timeout). A
# SIGKILLed rank's kernels go on running on the GPU without it, and under MPS the server
# takes no new client while it cleans up after a client that died with work on the GPU.
GPU_TIMEOUT_S = 10.0
FAULTS = ("kill_rank", "kill_sidecar", "stop_sidecar", "unreachable", "store")


# ----- rank side --------------------------------------------------------------------------------


def _say(**kw) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def rank_main(rank: int, world: int, port: int, nbytes: int, fault: str, host: str, device: str) -> None:
    # no core files from the ranks a trial kills or tears down (SIGABRT), nor their sidecars
    # (set here, not in a preexec_fn: forking a process that runs gRPC's threads can hang)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    import torch
    import torch.distributed as dist

    import gocomm

    host_store = fault == "store" and rank == 0
    timeout = datetime.timedelta(
        seconds=HANG_TIMEOUT_S if fault == "hang" else GPU_TIMEOUT_S if device == "cuda" else 60
    )
    store = dist.TCPStore(host, port, world, is_master=host_store, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gocomm", rank=rank, world_size=world, timeout=timeout, store=store)
    if device == "cuda":  # ranks share the GPUs there are, round robin
        torch.cuda.set_device(rank % torch.cuda.device_count())
        engine = next(iter(gocomm.info()["groups"].values()))["routes"]["all_reduce"][0]
        if torch.cuda.device_count() < world and engine == "sidecar NCCL":
            # NCCL takes one rank per GPU: ranks sharing one need the in-process kernel
            _say(event="skip", rank=rank, why=f"{world} ranks on {torch.cuda.device_count()} GPU(s) take {engine}")
            return
        dev = torch.device("cuda", torch.cuda.current_device())
        x = torch.ones(max(4, nbytes // 2), dtype=torch.bfloat16, device=dev)
    else:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)

    # ops that completed with a wrong sum: data lost, unless it is the last one on CUDA (the
    # op in flight when the peer died returns, as CUDA ops do, with its kernel given up, and
    # the next call raises); when the first and last of them completed
    wrong, wrong_at, last_wrong = 0, [], False

    def op():
        nonlocal wrong, wrong_at, last_wrong
        x.fill_(1)
        dist.all_reduce(x)
        if device == "cuda":  # a kernel that waits for a dead peer must give up, or this hangs
            torch.cuda.synchronize()
        last_wrong = any(float(x[i]) != world for i in (0, x.numel() // 2, -1))
        if last_wrong:
            wrong += 1
            now = time.time()
            wrong_at = [wrong_at[0] if wrong_at else now, now]

    op()
    info = gocomm.info()
    sidecar = info["pid"]
    routes = {k: v["routes"] for k, v in info.get("groups", {}).items()}
    _say(
        event="ready",
        rank=rank,
        pid=os.getpid(),
        sidecar=sidecar,
        fds=_fds(sidecar),
        log=info["log_file"],
        routes=routes,
    )
    ops = 0
    if fault == "teardown":  # waits on nothing: only the break's report can end it
        time.sleep(60)
        _say(event="lived", rank=rank)
        return
    try:
        while True:
            if fault == "store":  # group creation, over and over, with one small op on each
                g = dist.new_group(backend="gocomm", timeout=timeout)
                dist.all_reduce(torch.ones(1024), group=g)
                dist.destroy_process_group(g)
            else:
                op()
            ops += 1
    except Exception as e:  # noqa: BLE001
        t = time.time()
        msg, kind = str(e), type(e).__name__
    rec = gocomm.flight_record() if fault == "hang" else {}
    _say(
        event="raised",
        rank=rank,
        t=t,
        ops=ops,
        wrong=wrong,
        wrong_at=wrong_at,
        last_wrong=last_wrong,
        error=kind,
        message=msg[:2000],
        flight=rec,
    )
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    time.sleep(0.5)
    _say(event="after", rank=rank, fds=_fds(sidecar))
    gocomm.shutdown()
    _say(event="done", rank=rank)


# ----- driver side ------------------------------------------------------------------------------


class Unfit(Exception):
    """The machine cannot run the trial as asked (trial's ranks said why)."""


class Netns:
    """A network namespace joined to this one by a veth pair on a /24 of its own: here is
    .1, there is .2. Needs root; removed by close() (and with it the veth)."""

    def __init__(self):
        n = os.getpid() % 100000
        self.name, self.veth = f"gocomm-t{n}", f"gct{n}"
        net = f"10.{100 + n % 100}.{n // 100 % 250}"
        self.here, self.there = f"{net}.1", f"{net}.2"
        run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
        run("ip", "netns", "add", self.name)
        try:
            run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", self.veth + "p")
            run("ip", "link", "set", self.veth + "p", "netns", self.name)
            run("ip", "addr", "add", f"{self.here}/24", "dev", self.veth)
            run("ip", "link", "set", self.veth, "up")
            for cmd in (
                f"ip addr add {self.there}/24 dev {self.veth}p",
                f"ip link set {self.veth}p up",
                "ip link set lo up",
            ):
                run("ip", "netns", "exec", self.name, *cmd.split())
        except BaseException:
            self.close()
            raise

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """Drop all traffic between the namespaces."""
        subprocess.run(["ip", "link", "set", self.veth, "down"], check=True)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def netns_usable() -> str | None:
    """Why a Netns cannot be made here (tried once), or None."""
    global _netns_why
    if _netns_why is None:
        if os.geteuid() != 0:
            _netns_why = "network namespaces need root"
        elif not shutil.which("ip"):
            _netns_why = "no ip command (iproute2)"
        else:
            try:
                Netns().close()
                _netns_why = ""
            except subprocess.CalledProcessError as e:
                _netns_why = f"cannot make a network namespace: {e.stderr.decode(errors='replace').strip()}"
    return _netns_why or None


_netns_why: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leftovers(pids: list[int], socks: list[str], shm_before: set[str]) -> dict:
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and not _zombie(p)]
    shm = sorted(set(glob.glob("/dev/shm/gocomm-*")) - shm_before)
    return {"processes": alive, "sockets": [s for s in socks if os.path.exists(s)], "shm": shm}


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def trial(
    fault: str,
    nbytes: int,
    world: int = 3,
    seed: int | None = None,
    env: dict | None = None,
    device: str = "cpu",
    start_timeout: float = 120.0,
) -> dict:
    """Run one trial; returns {"fault", "bytes", "victim", "survivors": {rank: {"elapsed",
    "message", ...}}, "worst", "leaks": {...}, "logs"}. Raises RuntimeError when the world
    does not start."""
    rnd = random.Random(seed)
    port = _free_port()
    victim = 0 if fault == "store" else 1
    log_dir = tempfile.mkdtemp(prefix="gocomm-faults-")
    env = dict(
        os.environ,
        GOCOMM_LOG_DIR=log_dir,
        GOCOMM_DEBUG_INFO_TEMP_FILE=os.path.join(log_dir, "trace_rank_"),
        **(env or {}),
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(HERE, ".."), env.get("PYTHONPATH", "")) if p)
    shm_before = set(glob.glob("/dev/shm/gocomm-*"))
    store, ns = None, None
    stopped: set[int] = set()  # pids SIGSTOPped by the fault
    host = "127.0.0.1"
    if fault == "unreachable":
        ns = Netns()
        host = ns.here
    if fault == "teardown":
        env["GOCOMM_ASYNC_ERROR_HANDLING"] = "1"
    if fault != "store":
        import torch.distributed as dist

        store = dist.TCPStore(host, port, world + 1, is_master=True, wait_for_workers=False)
    procs = []
    for r in range(world):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "rank",
            str(r),
            str(world),
            str(port),
            str(nbytes),
            fault,
            host,
            device,
        ]
        renv = dict(env)
        if ns is not None:
            renv["GOCOMM_ADVERTISE_ADDR"] = ns.there if r == victim else ns.here
            if r == victim:
                cmd = ns.prefix() + cmd
        out = open(os.path.join(log_dir, f"rank{r}.out"), "w+")
        procs.append((subprocess.Popen(cmd, env=renv, stdout=out, stderr=subprocess.STDOUT), out))
    events: dict[int, dict[str, dict]] = {r: {} for r in range(world)}
    pos = [0] * world

    def poll():
        for r, (_, out) in enumerate(procs):
            with open(out.name) as f:
                f.seek(pos[r])
                for line in f:
                    if line.endswith("\n"):
                        pos[r] += len(line.encode())
                        if line.startswith("{"):
                            ev = json.loads(line)
                            events[r][ev["event"]] = ev
                    else:
                        break

    def kill_all(stopped=()):
        # what was not stopped on purpose gets 5 s to end by itself (a sidecar whose client
        # died cleans up, and what it leaves is counted); then everything is killed. On a GPU
        # the stopped are let go first and given until their kernels' waits give up to end by
        # themselves: a training process SIGKILLed with a kernel on the GPU leaves the kernel
        # running, and under MPS the server takes no new client until it cleaned up after it
        # (docs/decisions/0018)
        pids = [p for r in range(world) for p in (events[r].get("ready", {}).get("sidecar"), procs[r][0].pid) if p]
        until = time.monotonic() + 5
        if device == "cuda":
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
            stopped = ()
            until = time.monotonic() + GPU_TIMEOUT_S + 5
        while time.monotonic() < until and any(not _zombie(p) for p in pids if p not in stopped):
            time.sleep(0.05)
        for r in range(world):
            sc = events[r].get("ready", {}).get("sidecar")
            for pid in (sc, procs[r][0].pid):
                if pid:
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            os.kill(pid, sig)
                        except OSError:
                            pass
        for p, out in procs:
            p.wait()
            out.close()

    try:
        deadline = time.monotonic() + start_timeout
        while not all("ready" in events[r] for r in range(world)):
            poll()
            if any("skip" in events[r] for r in range(world)):
                raise Unfit(next(events[r]["skip"]["why"] for r in range(world) if "skip" in events[r]))
            if time.monotonic() > deadline or any(p.poll() is not None for p, _ in procs):
                tails = "".join(open(out.name).read()[-1500:] for _, out in procs)
                raise RuntimeError(f"{fault} world did not start: {tails}")
            time.sleep(0.05)
        time.sleep(rnd.uniform(0.05, 0.6))  # somewhere in an op (or between ops)
        vpid = procs[victim][0].pid
        vsc = events[victim]["ready"]["sidecar"]
        t0 = time.time()
        if fault in ("kill_rank", "store", "teardown"):
            os.kill(vpid, signal.SIGKILL)
        elif fault == "kill_sidecar":
            os.kill(vsc, signal.SIGKILL)
        elif fault == "stop_sidecar":
            os.kill(vsc, signal.SIGSTOP)
            stopped |= {vsc, vpid}  # its client waits on it
        elif fault == "hang":
            os.kill(vpid, signal.SIGSTOP)
            stopped |= {vpid, vsc}  # its sidecar serves the stopped client
        elif fault == "unreachable":
            ns.cut()
            stopped |= {vpid, vsc}  # cut off: they wait for the op's timeout
        else:
            raise ValueError(fault)
        survivors = [r for r in range(world) if r != victim]
        exited: dict[int, float] = {}
        wait_until = time.monotonic() + 60
        while time.monotonic() < wait_until and not all("done" in events[r] for r in survivors):
            poll()
            for r in survivors:
                if r not in exited and procs[r][0].poll() is not None:
                    exited[r] = time.time() - t0
            if len(exited) == len(survivors):
                poll()
                break
            time.sleep(0.02)
    finally:
        kill_all(stopped)
        if ns is not None:
            ns.close()
        if store is not None:
            del store
    time.sleep(0.3)
    poll()
    out = {"fault": fault, "bytes": nbytes, "victim": victim, "survivors": {}, "logs": log_dir, "device": device}
    if device == "cuda":
        out["gpu_ready_s"], out["gpu_refusal"] = _gpu_takes_clients(GPU_TIMEOUT_S + 20)
    out["routes"] = events[0].get("ready", {}).get("routes")
    for r in survivors:
        raised = events[r].get("raised")
        s = {"raised": raised is not None}
        if raised:
            s.update(
                elapsed=raised["t"] - t0,
                message=raised["message"],
                error=raised["error"],
                ops=raised["ops"],
                wrong=raised.get("wrong", 0),
                wrong_at=[w - t0 for w in raised.get("wrong_at", [])],
                last_wrong=raised.get("last_wrong", False),
                fds_before=events[r]["ready"]["fds"],
                fds_after=events[r].get("after", {}).get("fds"),
                flight=raised.get("flight"),
            )
        s["exited"], s["returncode"] = exited.get(r), procs[r][0].returncode
        out["survivors"][r] = s
    out["worst"] = max((s.get("elapsed", float("inf")) for s in out["survivors"].values()), default=float("inf"))
    pids = [p.pid for p, _ in procs] + [events[r]["ready"]["sidecar"] for r in range(world)]
    socks = glob.glob(os.path.join(log_dir, "*.sock"))
    rdir = os.environ.get("XDG_RUNTIME_DIR")
    rdir = os.path.join(rdir, "gocomm") if rdir else f"/tmp/gocomm-{os.getuid()}"
    for r in range(world):
        socks.append(os.path.join(rdir, f"pgserver-{procs[r][0].pid}-r{r}.sock"))
    out["leaks"] = _leftovers(pids, socks, shm_before)
    out["traces"] = sorted(glob.glob(os.path.join(log_dir, "trace_rank_*")))
    for s in out["leaks"]["sockets"]:  # a SIGKILLed sidecar's, counted above
        os.unlink(s)
    return out


def _gpu_takes_clients(limit: float) -> tuple[float | None, str]:
    """Seconds until a new process could use the GPU after a trial (under MPS the server
    refuses new clients while it cleans up after one that died with work on the GPU), or
    None and the last refusal when it could not within limit seconds."""
    probe = "import torch; torch.ones(1, device='cuda').sum().item()"
    t0 = time.monotonic()
    while True:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            return time.monotonic() - t0, ""
        if time.monotonic() - t0 > limit:
            return None, (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        time.sleep(1)


def problems(res: dict, limit: float = LIMIT_S) -> list[str]:
    """What is wrong with a trial's outcome: a survivor that did not raise within limit, or
    whose error does not name the dead rank; an op that completed with a wrong result (on
    CUDA but the last one, which was in flight when the peer died, and completed after it:
    a CUDA op returns before it ran, and the next call raises); leftover processes or
    /dev/shm files; a GPU that takes no new process after the trial."""
    bad = []
    v = res["victim"]
    for r, s in res["survivors"].items():
        if not s["raised"]:
            bad.append(f"rank {r} never raised")
            continue
        lost = s.get("wrong", 0)
        if res.get("device") == "cuda" and s.get("last_wrong") and s["wrong_at"] and s["wrong_at"][-1] > 0:
            lost -= 1
        if lost:
            bad.append(
                f"rank {r}: {lost} ops completed with a wrong result (first/last at {s['wrong_at']} s of the fault)"
            )
        if s["elapsed"] > limit:
            bad.append(f"rank {r} raised after {s['elapsed']:.2f}s > {limit}s: {s['message'][:300]}")
        if f"rank {v}" not in s["message"] and (res["fault"] != "store" or "store" not in s["message"].lower()):
            bad.append(f"rank {r}'s error does not name rank {v}: {s['message'][:300]}")
    if res["leaks"]["processes"] or res["leaks"]["shm"]:
        bad.append(f"left behind: {res['leaks']}")
    if res.get("device") == "cuda" and res.get("gpu_ready_s") is None:
        bad.append(f"the GPU took no new process after the trial: {res.get('gpu_refusal')}")
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        sys.path.insert(0, os.path.join(HERE, ".."))
        rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:9])
