"""A supervised process group: what harness starts and must be able to end whatever happens.

``ProcessGroup.start(cmd, run_dir)`` starts one command (a server, torchrun) with these guarantees:

* its own session: one ``killpg`` reaches the command and whatever it starts in that session;
* death with its parent (PR_SET_PDEATHSIG on the *thread* that started it): an item killed at its time
  limit takes the group with it;
* a marker token in the environment of every process it starts (``harness.launch.tree``);
* ``wait`` kills the group at its time limit (``deadline_s``) or when ``progress()`` has not changed
  for ``stall_s`` (``startup_s`` while it still returns None: start-up is not progress), and when the
  caller raises out of it; the kill is the whole tree (``tree.kill_tree``), and after a normal exit
  whatever still carries the marker is swept too;
* per-rank exit records and log tails for the error message (``harness.launch.status``).

``torchrun(LaunchSpec)`` is the one way harness starts torchrun: nodes x processes per node, the
rendezvous arguments, every rank under the ``harness.launch.rank`` wrapper. Today a launch is one
node (``--standalone``); the spec already names the nodes and a c10d rendezvous (endpoint, run id) so
that one agent per node joining a c10d store (issue #45 item 2) is a new ``Rendezvous``, not a new
launcher.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness import settings
from harness.files import paths
from harness.launch import ready, tree
from harness.launch.status import log_path, log_tail, read_exits
from harness.proc import die_with_parent, signal_name


@dataclass(frozen=True)
class Rendezvous:
    """How a launch's agents find each other. ``standalone``: one node, torchrun's own local store.
    ``c10d``: every node's agent joins the store at ``endpoint`` (host:port, served by node 0) under the
    run id ``run_id``. ``args``: torchrun arguments given verbatim (``HARNESS_TORCHRUN_ARGS``), which
    replace the above."""

    backend: str = "standalone"  # standalone | c10d
    endpoint: str = ""
    run_id: str = ""
    args: tuple[str, ...] = ()

    @classmethod
    def from_text(cls, text: str | None) -> Rendezvous:
        """``HARNESS_TORCHRUN_ARGS``'s value (shell-split), or standalone when unset."""
        return cls(args=tuple(shlex.split(text))) if text else cls()

    def torchrun_args(self, nodes: int) -> list[str]:
        if self.args:
            return list(self.args)
        if self.backend == "standalone":
            if nodes != 1:
                raise ValueError(f"a standalone rendezvous is one node; {nodes} nodes need a c10d endpoint")
            return ["--standalone", "--nnodes", "1"]
        if self.backend == "c10d":
            if not self.endpoint or not self.run_id:
                raise ValueError("a c10d rendezvous needs an endpoint (host:port) and a run id")
            return ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                    "--rdzv-id", self.run_id]
        raise ValueError(f"unknown rendezvous backend {self.backend!r} (standalone, c10d)")


@dataclass
class LaunchSpec:
    """One torchrun launch: ``args`` is what each rank runs after ``python`` (``["-m", "pkg.mod",
    "spec.json"]``); its files (spec, logs, status and exit records) live in ``run_dir``."""

    args: list[str]
    run_dir: Path
    procs_per_node: int = 1
    nodes: int = 1
    rdzv: Rendezvous = field(default_factory=Rendezvous)
    env: dict | None = None  # default: rank_env()
    log_name: str = "torchrun.log"
    stage: tuple[str, ...] = ()  # files of run_dir every node needs (a multi-node launch hands them over)

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    def command(self, run_dir: str | None = None, nodes: int | None = None,
                rdzv: list[str] | None = None) -> list[str]:
        """The agent's command; a multi-node launch (``harness.launch.nodes``) gives each node its
        own run folder and rendezvous arguments."""
        run_dir = run_dir or str(self.run_dir)
        # --log-dir: torchrun's own folder per launch (torchelastic_*) goes in the run folder, not
        # the system temp folder, where one was left behind by every launch (first: a
        # --log-dir in HARNESS_TORCHRUN_ARGS, after it, wins)
        return [sys.executable, "-m", "torch.distributed.run", "--log-dir", run_dir,
                *(rdzv if rdzv is not None else self.rdzv.torchrun_args(nodes or self.nodes)),
                "--nproc-per-node", str(self.procs_per_node), "--max-restarts", "0", "--monitor-interval", "0.1",
                "-m", "harness.launch.rank", run_dir, *self.args]


def rank_env() -> dict:
    """The environment of a launch's processes: this one's, one thread per rank (the machine is
    shared), this working directory importable (fault hooks and vendor modules, as under pytest),
    offline hub, and none of the isolated worker's own variables."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    settings.unset_env("HARNESS_ISOLATION_FDS", env)
    settings.unset_env("HARNESS_ISOLATION_STATUS", env)
    return env


@dataclass
class Ended:
    """How a group ended: ``exited`` (on its own, ``code``), ``timeout`` (killed at ``deadline_s``),
    ``stalled`` (killed: no progress within ``stall_s`` / ``startup_s``)."""

    how: str
    code: int | None
    wall_s: float
    killed: list[int] = field(default_factory=list)  # pids of the tree killed with it, or swept after it

    @property
    def ok(self) -> bool:
        return self.how == "exited" and self.code == 0


def deadline(t0: float, deadline_s: float | None, within_s: float | None) -> float | None:
    """A wait's limit in seconds after ``t0`` (its group's start): ``deadline_s``, or ``within_s`` from
    now if sooner. A group waited for long after its start (an agent at a run's end) is given
    ``within_s``: a ``deadline_s`` already past would kill it at the first poll that finds it alive."""
    if within_s is None:
        return deadline_s
    from_now = time.monotonic() - t0 + within_s
    return from_now if deadline_s is None else min(deadline_s, from_now)


class Progress:
    """The no-progress rule of a wait: ``progress()``'s value unchanged for ``stall_s`` (``startup_s``,
    default ``stall_s``, while it returns None: start-up is not progress) is a stall."""

    def __init__(self, progress: Callable[[], object] | None, stall_s: float | None, startup_s: float | None):
        self.progress, self.stall_s, self.startup_s = progress, stall_s, startup_s
        self.last, self.since = object(), time.monotonic()

    def stalled(self, now: float) -> bool:
        if self.progress is None:
            return False
        key = self.progress()
        if key != self.last:
            self.last, self.since = key, now
        limit = (self.startup_s or self.stall_s) if key is None else self.stall_s
        return limit is not None and now - self.since > limit


class ProcessGroup:
    def __init__(self, proc: subprocess.Popen, run_dir: Path, token: str, log: Path, world: int, t0: float):
        self.proc, self.run_dir, self.token, self.log, self.world, self.t0 = proc, run_dir, token, log, world, t0
        self.ended: Ended | None = None

    @classmethod
    def start(cls, cmd: list[str], run_dir: Path, env: dict | None = None, log_name: str = "launch.log",
              world: int = 0, cwd: str | Path | None = None) -> ProcessGroup:
        """Start ``cmd`` supervised (see the module's docstring); its output goes to ``run_dir/log_name``.
        ``world``: how many ranks write exit records and logs in ``run_dir`` (0: none, a plain process)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if env is None else env)
        token = tree.new_token()
        tree.mark(env, token)
        log = paths.join(run_dir, log_name, source="launch", field="log_name")  # a caller's constant, checked
        with open(log, "ab") as out:
            # Own session (one killpg) and death with this thread: a killed item must not leave the
            # group running.
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, preexec_fn=die_with_parent, cwd=cwd)
        return cls(proc, run_dir, token, log, world, time.monotonic())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, deadline_s: float | None = None, stall_s: float | None = None, startup_s: float | None = None,
             progress: Callable[[], object] | None = None, interval_s: float = 0.1,
             within_s: float | None = None) -> Ended:
        """Wait for the group to end, killing it (the whole tree) at ``deadline_s`` after its start, at
        ``within_s`` after this call (for a group started long before: its ``deadline_s`` may be past
        already, and the first poll that finds it alive would kill it), or when ``progress()``'s value has
        not changed for ``stall_s`` (``startup_s``, default ``stall_s``, while it returns None).
        ``progress`` is called at every poll; what it raises kills the group and propagates (a cancelled
        launch), as does anything else raised meanwhile."""
        deadline_s = deadline(self.t0, deadline_s, within_s)
        watch = Progress(progress, stall_s, startup_s)
        try:
            while self.proc.poll() is None:
                time.sleep(interval_s)
                now = time.monotonic()
                if deadline_s is not None and now - self.t0 > deadline_s:
                    return self.kill("timeout")
                if watch.stalled(now):
                    return self.kill("stalled")
        except BaseException:
            self.kill("cancelled")
            raise
        # Ended on its own: whatever of it is still alive (a rank's stray grandchild) goes too.
        self.ended = Ended("exited", self.proc.returncode, time.monotonic() - self.t0, tree.sweep(self.token))
        return self.ended

    def kill(self, how: str = "killed") -> Ended:
        """Kill the whole tree now (idempotent: a second call returns the first ending)."""
        if self.ended is not None:
            return self.ended
        killed = tree.kill_tree(self.proc.pid, self.token)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.ended = Ended(how, self.proc.returncode, time.monotonic() - self.t0, killed)
        return self.ended

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *_exc) -> None:
        self.kill()

    # --- what the ranks left ---------------------------------------------------------------------

    def exits(self) -> dict[int, dict]:
        return read_exits(self.run_dir, self.world)

    def rank_tail(self, rank: int, lines: int = 3) -> list[str]:
        return log_tail(log_path(self.run_dir, rank), lines)

    def failures(self, lines: int = 2) -> list[str]:
        """One phrase per rank that failed - its signal or exit code, the tail of its log - first the
        ranks that failed on their own, then the ones the launcher stopped; ranks without an exit
        record (killed with the group) are said as such when no rank said more."""
        out, stopped = [], []
        exits = self.exits()
        for r, x in sorted(exits.items()):
            if not x.get("code"):
                continue
            how = f"killed by {x['signal']}" if x.get("signal") else f"exit code {x['code']}"
            tail = " / ".join(self.rank_tail(r, lines))
            phrase = f"rank {r} {how}" + (f": {tail}" if tail else "")
            (stopped if x.get("stopped_by_launcher") else out).append(phrase + (
                f" (stopped by the launcher with {x['stopped_by_launcher']})" if x.get("stopped_by_launcher") else ""))
        if not out:  # ranks killed with the group wrote no exit record: where their logs stopped
            for r in (r for r in range(self.world) if r not in exits):
                tail = " / ".join(self.rank_tail(r, lines))
                out.append(f"rank {r} killed with the group" + (f", its log ended: {tail}" if tail else ""))
        return out + stopped

    def describe(self, lines: int = 2) -> str:
        """The ending in one line: how, the ranks' failures, else the group log's tail."""
        e = self.ended
        if e is None:
            return "still running"
        tree_ = f" with the {len(e.killed)} processes of its tree" if e.killed else ""
        how = {"exited": f"exited with {signal_name(-e.code) if e.code and e.code < 0 else f'code {e.code}'}",
               "timeout": f"killed at its time limit{tree_}", "stalled": f"killed on no progress{tree_}"
               }.get(e.how, f"{e.how}{tree_}")
        parts = self.failures(lines)
        if not parts:
            tail = " / ".join(log_tail(self.log, lines))
            parts = [f"{self.log.name}: {tail}"] if tail else []
        return how + (": " + "; ".join(parts) if parts else "")

    def wait_ready(self, timeout_s: float, port: int | None = None, line: str | None = None, name: str = "server") -> float:
        """``ready.wait_ready`` on this group's log and liveness; a group that is not ready is killed."""
        try:
            return ready.wait_ready(timeout_s=timeout_s, port=port, line=line, log=self.log, poll=self.poll, name=name)
        except BaseException:
            self.kill()
            raise


def torchrun(spec: LaunchSpec) -> ProcessGroup:
    """Start ``spec``'s torchrun (this node's agent) supervised."""
    return ProcessGroup.start(spec.command(), spec.run_dir, env=spec.env if spec.env is not None else rank_env(),
                              log_name=spec.log_name, world=spec.world)
