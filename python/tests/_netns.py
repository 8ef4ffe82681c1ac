"""Simulated hosts for multi-host tests: each host is a set of Linux namespaces of its own
(network, UTS, PID, mount with its own /proc and a fresh tmpfs on /dev/shm), so nothing that
tells one host from another (routes, the same-host probe, /dev/shm, pids) can see across.
Hosts are joined by one veth pair carrying 10.77.0.<host+1>/24; those addresses exist only
inside the namespaces made here. A host's ranks share its namespaces, as ranks on one machine do.

Three roles, one module:
- pytest (Cluster): starts a host agent per host under `unshare`, wires the veth pair from
  inside the namespaces (nothing is added to the machine's own network namespace), tells the
  agents to go, and collects each rank's JSON report from the shared directory. Everything is
  bounded in time; close() kills each agent (its `unshare --kill-child` takes the namespace's
  PID 1 and with it every process of the host: ranks, sidecars) and the namespaces go with them.
- agent (`python _netns.py agent ...`, PID 1 of its host): mounts /dev/shm, brings lo up,
  waits for the go, starts the host's ranks and reaps them.
- rank (`python _netns.py rank ...`): init_process_group over the init method asked for, runs
  a scenario (hosts_scenarios.py style functions, here: SCENARIOS) and writes its report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUBNET = "10.77.0"
PORT = 29577  # the Store's port on host 0 (free: the namespace is the test's own)
AGENT_LIMIT_S = 400.0  # a host ends (and every process in it) this long after it started its ranks


def addr(host: int) -> str:
    return f"{SUBNET}.{host + 1}"


def unavailable() -> str:
    """Why simulated hosts cannot be made here ("" where they can)."""
    if sys.platform != "linux":
        return f"namespaces are Linux's; this is {sys.platform}"
    if os.geteuid() != 0:
        return "making network and mount namespaces needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    for tool in ("unshare", "nsenter", "ip", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        r = subprocess.run(
            [
                "unshare",
                "--net",
                "--uts",
                "--pid",
                "--fork",
                "--mount-proc",
                "sh",
                "-c",
                "mount -t tmpfs t /dev/shm && ip link add gh0 type veth peer name gh1 && ip link set lo up",
            ],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if r.returncode != 0:
        return f"cannot make namespaces here: {r.stderr.decode(errors='replace').strip()}"
    return ""


# Runs unshare with SIGKILL as its parent-death signal: a killed test run cannot leave a host
# behind (unshare's --kill-child takes the rest). setpriv sets it before exec; a preexec_fn
# would run Python in the forked child of a process with gRPC threads, which can hang there
# (seen: the child never reached exec, and the namespace never came).
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"]


def _sh(*cmd: str, timeout: float = 20) -> None:
    r = subprocess.run(list(cmd), capture_output=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.decode(errors='replace').strip()}")


class Cluster:
    """hosts x per_host ranks on simulated hosts, running scenario with init method init
    ("env", "tcp" or "file"). Rank r is on host r // per_host. extra[r] adds environment for
    rank r; dummy[h] gives host h a second, unrouted interface d0 with that address."""

    def __init__(
        self,
        workdir: str,
        hosts: int,
        per_host: int,
        init: str,
        scenario: str,
        args: dict | None = None,
        extra: dict[int, dict[str, str]] | None = None,
        dummy: dict[int, str] | None = None,
    ):
        self.dir = workdir
        self.hosts, self.per_host, self.size = hosts, per_host, hosts * per_host
        self.init, self.scenario, self.args = init, scenario, args or {}
        self.extra, self.dummy = extra or {}, dummy or {}
        self.agents: list[subprocess.Popen] = []
        self.links = [f"gh{h}" for h in range(hosts)]
        os.makedirs(workdir, exist_ok=True)

    # ----- pytest side --------------------------------------------------------------------

    def start(self) -> None:
        spec = {
            "dir": self.dir,
            "size": self.size,
            "per_host": self.per_host,
            "init": self.init,
            "scenario": self.scenario,
            "args": self.args,
            "extra": {str(k): v for k, v in self.extra.items()},
        }
        with open(os.path.join(self.dir, "spec.json"), "w") as f:
            json.dump(spec, f)
        for h in range(self.hosts):
            log = open(os.path.join(self.dir, f"agent{h}.log"), "ab")  # noqa: SIM115
            self.agents.append(
                subprocess.Popen(
                    [
                        *_DIE_WITH_PARENT,
                        "unshare",
                        "--net",
                        "--uts",
                        "--pid",
                        "--kill-child",
                        "--mount-proc",
                        sys.executable,
                        os.path.abspath(__file__),
                        "agent",
                        self.dir,
                        str(h),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            )
            log.close()
        # Wire the hosts from inside their namespaces: unshare's own process is in the new
        # network namespace, so its pid names it.
        if self.hosts != 2:
            raise ValueError("the hosts are joined by one veth pair: 2 hosts")
        pids = [a.pid for a in self.agents]
        self._wait_netns(pids)
        _sh(
            "nsenter",
            "-t",
            str(pids[0]),
            "-n",
            "ip",
            "link",
            "add",
            "gh0",
            "type",
            "veth",
            "peer",
            "name",
            "gh1",
            "netns",
            str(pids[1]),
        )
        for h, pid in enumerate(pids):
            n = ["nsenter", "-t", str(pid), "-n"]
            _sh(*n, "ip", "addr", "add", f"{addr(h)}/24", "dev", f"gh{h}")
            _sh(*n, "ip", "link", "set", f"gh{h}", "up")
            if h in self.dummy:
                # a veth pair with both ends on this host: an interface no other host routes to
                _sh(*n, "ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1")
                _sh(*n, "ip", "addr", "add", f"{self.dummy[h]}/24", "dev", "d0")
                _sh(*n, "ip", "link", "set", "d0", "up")
                _sh(*n, "ip", "link", "set", "d1", "up")
        open(os.path.join(self.dir, "go"), "w").close()

    def _wait_netns(self, pids: list[int]) -> None:
        """unshare has made its namespaces once its network namespace differs from ours."""
        mine = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 20
        for pid in pids:
            while True:
                try:
                    if os.readlink(f"/proc/{pid}/ns/net") != mine:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"unshare (pid {pid}) made no network namespace in 20 s; {self.logs()}")
                time.sleep(0.02)

    def link_down(self, host: int) -> None:
        """Drop host's link: its veth end goes down, so nothing more passes either way (no
        reset is sent: peers see silence, as with a pulled cable)."""
        _sh("nsenter", "-t", str(self.agents[host].pid), "-n", "ip", "link", "set", f"gh{host}", "down")

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def wait_files(self, names: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(os.path.exists(self.path(n)) for n in names):
                return True
            if all(a.poll() is not None for a in self.agents):
                return all(os.path.exists(self.path(n)) for n in names)
            time.sleep(0.05)
        return False

    def reports(self, timeout: float) -> list[dict | None]:
        """Every rank's report (None for a rank that wrote none within timeout)."""
        self.wait_files([f"report{r}.json" for r in range(self.size)], timeout)
        out = []
        for r in range(self.size):
            try:
                with open(self.path(f"report{r}.json")) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                out.append(None)
        return out

    def logs(self, lines: int = 30) -> str:
        """The tails of the agents', ranks' and sidecars' logs, for a failure's message."""
        parts = []
        for root, _, files in os.walk(self.dir):
            for name in sorted(files):
                if name.endswith(".log"):
                    p = os.path.join(root, name)
                    try:
                        with open(p, "rb") as f:
                            text = f.read()[-12000:].decode(errors="replace").splitlines()[-lines:]
                    except OSError:
                        continue
                    parts.append(f"--- {os.path.relpath(p, self.dir)}\n" + "\n".join(text))
        return "\n".join(parts)

    def close(self) -> None:
        """Kill every host: SIGKILL to unshare, whose --kill-child takes the namespace's PID 1,
        and the kernel the rest of its PID namespace; the network namespace (and the veth end
        in it) goes with its last process."""
        for a in self.agents:
            if a.poll() is None:
                try:
                    os.killpg(a.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for a in self.agents:
            try:
                a.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.agents = []

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----- agent: PID 1 of a simulated host ------------------------------------------------------


def agent(workdir: str, host: int) -> None:
    with open(os.path.join(workdir, "spec.json")) as f:
        spec = json.load(f)
    # this host's own shared memory and loopback (the mount namespace's propagation is private)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g,mode=1777", "gocomm-host", "/dev/shm"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(workdir, "go")):
        if time.monotonic() > deadline:
            sys.exit("no go within 60 s")
        time.sleep(0.02)
    rundir = os.path.join(workdir, f"run{host}")  # the sidecars' runtime directory on this host
    os.makedirs(rundir, mode=0o700, exist_ok=True)
    procs = []
    per = spec["per_host"]
    for r in range(host * per, (host + 1) * per):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "GOCOMM_"))}
        env.update(XDG_RUNTIME_DIR=rundir, GOCOMM_LOG_DIR=os.path.join(workdir, f"logs{host}"))
        env.update(spec["extra"].get(str(r), {}))
        log = open(os.path.join(workdir, f"rank{r}.log"), "ab")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "rank", workdir, str(r)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        )
        log.close()
    deadline = time.monotonic() + AGENT_LIMIT_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"rank pid {p.pid} still runs after {AGENT_LIMIT_S} s: ending the host", flush=True)
            break
    # orphans (a sidecar outliving its rank) die with this process, PID 1 of the namespace


# ----- rank -----------------------------------------------------------------------------------


def rank_main(workdir: str, rank: int) -> None:
    import datetime
    import traceback

    import torch.distributed as dist

    sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the scenarios; gocomm from this checkout
    import hosts_scenarios

    with open(os.path.join(workdir, "spec.json")) as f:
        spec = json.load(f)
    size = spec["size"]
    report: dict = {"rank": rank, "host": rank // spec["per_host"]}
    t0 = time.monotonic()
    try:
        init = spec["init"]
        if init == "env":  # as torchrun sets it for a multi-node job
            os.environ.update(MASTER_ADDR=addr(0), MASTER_PORT=str(PORT), RANK=str(rank), WORLD_SIZE=str(size))
            method = "env://"
        elif init == "tcp":
            method = f"tcp://{addr(0)}:{PORT}"
        elif init == "file":  # a file on a file system every host shares
            method = f"file://{os.path.join(workdir, 'filestore')}"
        else:
            raise ValueError(f"init method {init!r}")
        import gocomm  # noqa: F401  (registers the backend)

        dist.init_process_group(
            "gocomm",
            init_method=method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=spec["args"].get("timeout", 30)),
        )
        report["init_s"] = time.monotonic() - t0
        fn = getattr(hosts_scenarios, spec["scenario"])
        report.update(fn(workdir, rank, size, spec["per_host"], **spec["args"]))
    except BaseException:  # noqa: BLE001
        report["error"] = traceback.format_exc()
    report["total_s"] = time.monotonic() - t0
    tmp = os.path.join(workdir, f"report{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.rename(tmp, os.path.join(workdir, f"report{rank}.json"))
    sys.stdout.flush()
    sys.stderr.flush()
    # no orderly teardown: after a fault the Store and peers are out of reach
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "agent":
        agent(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "rank":
        rank_main(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} agent|rank DIR N")
