"""Multi-rank test harness: a World is a set of rank processes (spawned once, reused by many
tests) that each run torch.distributed with backend "gocomm" plus a gloo group over the same
ranks. A test sends a module-level function to every rank (World.run); each rank calls it with
its Rank context and sends back the result or the traceback.

Nothing here may hang: every wait has a deadline; ranks that do not answer are dumped
(faulthandler, SIGUSR1), killed together with their pgserver sidecars, and the test fails with
what every rank reported and the tails of the rank and pgserver logs.

This module is imported both by pytest (conftest.py) and by the spawned ranks.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing.connection as mpc
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

# The group timeout every world is initialised with (init_process_group(timeout=...)).
GROUP_TIMEOUT_S = 20.0
# How long a world may take to start (Python + torch import on every rank, pgserver, rendezvous).
START_TIMEOUT_S = float(os.environ.get("GOCOMM_TEST_START_TIMEOUT", "150"))
# How long one GPU check may run before the harness dumps its ranks' stacks and kills them
# (GOCOMM_GPU_TEST_LIMIT): a hang costs this much of a device run, not the run.
GPU_RUN_LIMIT_S = float(os.environ.get("GOCOMM_GPU_TEST_LIMIT", "300"))
# Default limit for one World.run: a failing op must be reported by the sidecar within the group
# timeout; the shim gives up 30 s after that; this leaves room for both.
RUN_TIMEOUT_S = 120.0


class HarnessError(AssertionError):
    """A multi-rank command failed; the message holds every rank's report."""


# --------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------


@dataclass
class Group:
    """One gocomm group and the gloo group over the same ranks, seen from one process."""

    pg: object  # gocomm ProcessGroup (None on non-members)
    gloo: object  # gloo ProcessGroup over the same ranks (None on non-members)
    ranks: list[int]  # global ranks, in group-rank order
    rank: int  # this process's rank in the group, -1 if not a member

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def member(self) -> bool:
        return self.rank >= 0

    def glob(self, group_rank: int) -> int:
        """The global rank of a group rank."""
        return self.ranks[group_rank]


class Rank:
    """What a check function gets on each rank."""

    def __init__(self, rank: int, size: int, timeout_s: float):
        import torch.distributed as dist

        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.world = Group(dist.group.WORLD, dist.new_group(backend="gloo"), list(range(size)), rank)
        self._groups: dict[tuple[int, ...], Group] = {}

    def group(self, ranks=None) -> Group:
        """The world (ranks None), or a cached gocomm + gloo subgroup over ranks. Every rank of the
        world must ask for the same subgroups in the same order (new_group is collective)."""
        import torch.distributed as dist

        if ranks is None or list(ranks) == list(range(self.size)):
            return self.world
        key = tuple(ranks)
        if key not in self._groups:
            pg = dist.new_group(list(key), backend="gocomm")
            gloo = dist.new_group(list(key), backend="gloo")
            member = self.rank in key
            self._groups[key] = Group(
                pg if member else None,
                gloo if member else None,
                list(key),
                key.index(self.rank) if member else -1,
            )
        return self._groups[key]


def _sidecar_info() -> dict:
    try:
        import gocomm

        i = gocomm.info()
        return {"sidecar_pid": i.get("pid"), "sidecar_log": i.get("log_file")}
    except Exception as e:  # noqa: BLE001
        return {"sidecar_error": repr(e)}


def rank_main(
    rank: int,
    size: int,
    port: int,
    conn,
    log_path: str,
    timeout_s: float,
    sys_path: list[str],
) -> None:
    """Entry point of a spawned rank: init, then run commands until told to stop."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    print(f"rank {rank}/{size} pid {os.getpid()} port {port}", flush=True)
    try:
        import torch.distributed as dist

        import gocomm  # noqa: F401  (registers the backend)

        # the store's server is the World's, in the pytest process (see World._start)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gocomm", rank=rank, world_size=size, timeout=timeout, store=store)
        rk = Rank(rank, size, timeout_s)
        conn.send(("ready", {"pid": os.getpid(), **_sidecar_info()}))
    except BaseException:  # noqa: BLE001
        conn.send(("err", traceback.format_exc()))
        conn.close()
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        _, fn, kwargs = msg
        name = getattr(fn, "__qualname__", repr(fn))
        print(f"--- {name} {kwargs}", flush=True)
        t0 = time.monotonic()
        try:
            result = fn(rk, **kwargs)
            reply = ("ok", result)
        except BaseException:  # noqa: BLE001
            reply = ("err", traceback.format_exc())
        print(f"--- {name}: {reply[0]} in {time.monotonic() - t0:.2f}s", flush=True)
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001  (e.g. an unpicklable result)
            conn.send(("err", "could not send the result back:\n" + traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def health(rk: Rank) -> None:
    """Is the gocomm world group still usable? (run after a failed command)"""
    import torch
    import torch.distributed as dist

    t = torch.ones(3)
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((3,), float(rk.size))):
        raise AssertionError(f"health all_reduce gave {t.tolist()}")
    dist.barrier(group=rk.world.gloo)


# --------------------------------------------------------------------------------------------
# pytest side
# --------------------------------------------------------------------------------------------


def _tail(path: str | None, lines: int = 25) -> str:
    if not path:
        return "    (no log)"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16000))
            text = f.read().decode("utf-8", "replace").splitlines()[-lines:]
        return "\n".join("    " + t for t in text) or "    (empty)"
    except OSError as e:
        return f"    (cannot read {path}: {e})"


def _is_pgserver(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"pgserver" in f.read().split(b"\0")[0]
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(d))
    return out


_counter = 0


class World:
    """size rank processes running gocomm, started on construction."""

    def __init__(
        self,
        size: int,
        log_dir: str,
        timeout_s: float = GROUP_TIMEOUT_S,
        label: str = "",
    ):
        global _counter
        _counter += 1
        self.size = size
        self.timeout_s = timeout_s
        self.name = f"w{size}{label}-{_counter}"
        self.log_dir = log_dir
        self.procs: list = []
        self._store = None
        self.conns: list = []
        self.info: list[dict] = [{} for _ in range(size)]
        self.logs = [os.path.join(log_dir, f"{self.name}-rank{r}.log") for r in range(size)]
        self.alive = False
        self.started_s = 0.0
        self._start()

    # ----- lifetime ---------------------------------------------------------------------------

    def _start(self) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        t0 = time.monotonic()
        # The world's store server lives here, bound to a port the OS picks, for as long as
        # the world: a port picked, freed and handed to rank 0 could be taken in between (an
        # x4 run lost 35 s to that when NCCL's sockets were about).
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for r in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=rank_main,
                args=(
                    r,
                    self.size,
                    self._store.port,
                    child,
                    self.logs[r],
                    self.timeout_s,
                    list(sys.path),
                ),
                name=f"{self.name}-rank{r}",
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.alive = True
        try:
            replies = self._collect(START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        if all(rep[0] == "ready" for rep in replies):
            for r, rep in enumerate(replies):
                self.info[r] = rep[1]
            self.started_s = time.monotonic() - t0
            return
        report = self._report("start", replies, seed=None)
        self.kill()
        raise HarnessError(report)

    def kill(self) -> None:
        """Kill every rank and its sidecar (by pid, checked to be a pgserver)."""
        self._store = None
        if not self.procs:
            return
        sidecars = {i.get("sidecar_pid") for i in self.info if i.get("sidecar_pid")}
        for p in self.procs:
            if p.pid:
                sidecars.update(c for c in _children(p.pid) if _is_pgserver(c))
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in sidecars:
            if _is_pgserver(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.join(5)
        for c in self.conns:
            c.close()
        self.alive = False
        self.procs, self.conns = [], []

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the ranks cleanly (they destroy their groups), killing whatever lingers."""
        if not self.alive:
            return
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 20
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()

    # ----- commands ---------------------------------------------------------------------------

    def _collect(self, timeout: float) -> list[tuple]:
        replies: list[tuple | None] = [None] * self.size
        pending = set(range(self.size))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waitables = {}
            for r in pending:
                waitables[self.conns[r]] = r
                waitables[self.procs[r].sentinel] = r
            for obj in mpc.wait(list(waitables), timeout=left):
                r = waitables[obj]
                if r not in pending:
                    continue
                conn = self.conns[r]
                try:
                    if conn.poll():
                        replies[r] = conn.recv()
                        pending.discard(r)
                        continue
                except (EOFError, OSError):
                    pass
                if not self.procs[r].is_alive():
                    self.procs[r].join(1)
                    code = self.procs[r].exitcode
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
                    replies[r] = (
                        "died",
                        f"the rank process ended ({how}) without answering",
                    )
                    pending.discard(r)
        if pending:
            # Dump the stacks of the ranks that hang, and of every goroutine of their
            # pgservers (SIGUSR1 makes pgserver log them), into their logs before they die.
            for r in pending:
                try:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except (ProcessLookupError, TypeError):
                    pass
                spid = self.info[r].get("sidecar_pid")
                if spid:
                    try:
                        os.kill(spid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
            time.sleep(0.5)
            for r in pending:
                replies[r] = ("hung", f"no answer within {timeout:.0f}s (killed)")
        return replies  # type: ignore[return-value]

    def _report(self, what: str, replies: list[tuple], seed) -> str:
        head = f"{what} on world {self.name} (size {self.size}, group timeout {self.timeout_s:.0f}s)"
        if seed is not None:
            head += f", seed {seed} (rerun with GOCOMM_TEST_SEED={seed})"
        parts = [head + " failed:"]
        for r, rep in enumerate(replies):
            status = rep[0] if rep else "none"
            body = rep[1] if rep and len(rep) > 1 else ""
            if status in ("ok", "ready"):
                parts.append(f"--- rank {r}: {status}")
                continue
            parts.append(f"--- rank {r}: {status}\n{str(body).rstrip()}")
            parts.append(f"  rank {r} log {self.logs[r]} ends with:\n{_tail(self.logs[r])}")
            side = self.info[r].get("sidecar_log") if r < len(self.info) else None
            if side:
                parts.append(f"  rank {r} pgserver log {side} ends with:\n{_tail(side, 15)}")
        return "\n".join(parts)

    def run(self, fn, *, timeout: float = RUN_TIMEOUT_S, seed=None, **kwargs) -> list:
        """Call fn(rank_ctx, seed=seed, **kwargs) on every rank; return the per-rank results, or
        raise HarnessError with every rank's report. A world whose ranks hung or died is killed;
        one whose gocomm group no longer works is closed (a later test starts a fresh one)."""
        if not self.alive:
            raise HarnessError(f"world {self.name} is not running")
        if seed is not None:
            kwargs["seed"] = seed
        for c in self.conns:
            try:
                c.send(("run", fn, kwargs))
            except (OSError, ValueError) as e:
                self.kill()
                raise HarnessError(f"world {self.name}: cannot reach a rank: {e}") from None
        try:
            replies = self._collect(timeout)
        except BaseException:  # e.g. pytest-timeout: replies would come out of step later
            self.kill()
            raise
        if all(rep[0] == "ok" for rep in replies):
            return [rep[1] for rep in replies]
        report = self._report(getattr(fn, "__qualname__", repr(fn)), replies, seed)
        if any(rep[0] in ("hung", "died") for rep in replies):
            self.kill()
        else:
            self._check_health()
        raise HarnessError(report)

    def _check_health(self) -> None:
        """After a failed command: keep the world only if its gocomm group still works."""
        try:
            for c in self.conns:
                c.send(("run", health, {}))
        except (OSError, ValueError):
            self.kill()
            return
        replies = self._collect(self.timeout_s + 40)
        if not all(rep[0] == "ok" for rep in replies):
            self.kill()


class Worlds:
    """The session's worlds, one per size, started on first use and reused."""

    def __init__(self):
        # GOCOMM_TEST_LOG_DIR keeps the rank logs somewhere known (device runs fetch them)
        self.log_dir = os.environ.get("GOCOMM_TEST_LOG_DIR") or tempfile.mkdtemp(prefix="gocomm-tests-")
        os.makedirs(self.log_dir, exist_ok=True)
        self._worlds: dict[int, World] = {}

    def get(self, size: int) -> World:
        w = self._worlds.get(size)
        if w is None or not w.alive:
            w = World(size, self.log_dir)
            self._worlds[size] = w
        return w

    def fresh(self, size: int, label: str = "", env: dict[str, str] | None = None) -> World:
        """A world of its own (the caller closes it: `with worlds.fresh(...) as w:`), for tests that wreck their world or
        need env set in its ranks and sidecars (set while they start, then restored)."""
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})  # inherited by the ranks and, through them, the sidecars
        try:
            return World(size, self.log_dir, label=label)
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    def close(self) -> None:
        for w in self._worlds.values():
            w.close()
        self._worlds.clear()
