"""A launch over several nodes: one torchrun agent per node, joined by a c10d rendezvous, the ranks'
files brought back over the coordinator's store (``harness.launch.channel``), never a shared folder.

How the agents are started on their nodes is the ``NodeSet``'s business:

* ``netns``: the rehearsal on one machine (root). Node 0 is this host (the coordinator runs there, as
  on a cluster); node k >= 1 is a network namespace of its own joined to node 0 by a veth pair on a
  bridge, with its own hostname (``unshare --uts``), temp folder and run folder. Its hostname resolves
  nowhere and no folder of node 0 is handed to it, so a single-host assumption (a rank addressed by
  hostname, a result read from a local path) fails here as it fails on a cluster.
* ``srun``: inside a Slurm allocation (the body of ``harness plan --emit slurm``'s script): one ``srun``
  step starts the same agent command on every node of the allocation.
* ``agents``: where nothing on node 0 can start a process on another node (Kubernetes, plain VMs): each
  node k >= 1 runs a long-lived ``harness node-agent`` that pulls its share of every launch from node 0
  (``harness.launch.agents``); its share is a ``RemoteGroup``, node 0's is started here as always.

Per launch: a fresh rendezvous port and run id, the coordinator's store, and per node the environment
a cluster needs said explicitly - the interface the collective library binds (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``: the one that reaches the other nodes, not whatever the hostname resolves to)
and the address the agent announces (torchrun ``--local-addr``).

A node that does not join within ``join_timeout_s``, a node whose agent dies (its ranks wrote no exit
record), and a node whose packages differ from node 0's are *infrastructure*: ``NodeLaunch.infrastructure()``
names the node, its host and its ranks, and the caller reports it as such, never as the model's failure.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness import settings
from harness.files import atomic, scratch
from harness.launch import agents, channel, noderun, ready
from harness.launch.group import (
    Ended,
    LaunchSpec,
    ProcessGroup,
    Progress,
    Rendezvous,
    deadline,
    rank_env,
    torchrun,
)
from harness.launch.status import log_tail, read_exits

LAUNCHERS = ("netns", "srun", "agents")


@dataclass(frozen=True)
class Node:
    index: int
    addr: str  # what its agent announces and its peers reach it at
    ifname: str  # the interface the collective library binds
    hostname: str
    prefix: tuple[str, ...] = ()  # what runs a command there (netns: ip netns exec ... unshare --uts)
    tmp: str = ""  # its temp folder
    env: tuple[tuple[str, str], ...] = ()  # what differs in its environment (a test plants a fault here)
    announce: bool = True  # rendezvous arguments name its address and whether it hosts (netns); srun: found


@dataclass
class NodeSet:
    """``count`` nodes reached by ``kind``; ``coordinator``: the address nodes reach node 0 at."""

    kind: str
    count: int
    coordinator: str
    nodes: list[Node] = field(default_factory=list)
    _down: Callable[[], None] | None = None
    # (node, cmd, run_dir, env, log_name) -> a group: how nodes k >= 1 are started where this process
    # cannot start them itself (agents: an ``agents.RemoteGroup``); None: ``ProcessGroup.start`` here
    remote: Callable | None = None

    def close(self) -> None:
        if self._down is not None:
            self._down()
            self._down = None

    def __enter__(self) -> NodeSet:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


# --- netns: the rehearsal ------------------------------------------------------------------------


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")


def netns_available() -> str:
    """'' when network namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "network namespaces need root (the multi-node rehearsal creates them)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"the multi-node rehearsal needs `{tool}` (iproute2 / util-linux)")
    return ""


def netns_nodes(count: int, tmp_root: str | None = None) -> NodeSet:
    """``count`` rehearsal nodes (see the module's docstring); ``close()`` removes them all."""
    why = netns_available()
    if why:
        raise RuntimeError(why)
    tag = secrets.token_hex(2)  # interface names: at most 15 characters
    subnet = _free_subnet(int(tag, 16))  # 10.77.<subnet>.0/24, one per node set
    bridge = f"hb{tag}"
    made: list[str] = []
    _sweep_orphans(tmp_root)
    tmp = Path(tempfile.mkdtemp(prefix="harness-nodes-", dir=tmp_root))
    atomic.write_text(tmp / NODE_SET, f"{tag} {count}\n")
    atomic.write_text(tmp / scratch.OWNER, scratch.owner_record())  # last: a set with an owner is a whole one

    def down() -> None:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)

    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"10.77.{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        nodes = [Node(0, f"10.77.{subnet}.1", bridge, os.uname().nodename, (), _node_tmp(tmp, 0))]
        for k in range(1, count):
            ns, host, peer = f"hn{tag}-{k}", f"hv{tag}{k}", f"hp{tag}{k}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", host, "type", "veth", "peer", "name", peer)
            _ip("link", "set", host, "master", bridge, "up")
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "addr", "add", f"10.77.{subnet}.{k + 1}/24", "dev", peer)
            _ip("-n", ns, "link", "set", peer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            name = f"node{k}"  # its own UTS namespace: the same name in two node sets collides nowhere
            prefix = ("ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c",
                      'hostname "$0" && exec "$@"', name)
            nodes.append(Node(k, f"10.77.{subnet}.{k + 1}", peer, name, prefix, _node_tmp(tmp, k)))
    except BaseException:
        down()
        raise
    return NodeSet("netns", count, nodes[0].addr, nodes, down)


NODE_SET = "node-set"  # "<tag> <count>" of a node set, in its temp folder (its owner: harness.files.scratch)


def _sweep_orphans(tmp_root: str | None) -> list[str]:
    """Remove the node sets whose owning process is gone (it was SIGKILLed: no `finally` ran), with
    their namespaces, bridge and folders; their names, for the record."""
    gone = []
    for owner in Path(tmp_root or tempfile.gettempdir()).glob(f"harness-nodes-*/{scratch.OWNER}"):
        try:
            if not scratch.owner_gone(owner.read_text()):
                continue
            tag, count = (owner.parent / NODE_SET).read_text().split()
        except (OSError, ValueError):
            continue
        for k in range(1, int(count)):
            subprocess.run(["ip", "netns", "del", f"hn{tag}-{k}"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"hb{tag}"], capture_output=True)
        shutil.rmtree(owner.parent, ignore_errors=True)
        gone.append(tag)
    return gone


def _free_subnet(seed: int) -> int:
    """A 10.77.<n>.0/24 no interface of this host uses: two node sets at once (pytest -n 2) must not
    share a subnet, or their routes collide."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for i in range(240):
        n = 10 + (seed + i) % 240
        if f" 10.77.{n}." not in used:
            return n
    raise RuntimeError("no free 10.77.x.0/24 subnet for the rehearsal's nodes (240 node sets exist?)")


def _node_tmp(root: Path, k: int) -> str:
    p = root / f"node{k}"
    p.mkdir()
    return str(p)


def slow_link(node: Node, rate_mbit: float) -> None:
    """Limit what leaves ``node`` (its end of the link) to ``rate_mbit``: a slow link (a token-bucket
    filter: ``tc netem``'s delay is not in every kernel, this machine's included)."""
    if not node.prefix:
        raise ValueError("a slow link applies to a namespaced node (k >= 1)")
    ns = node.prefix[3]
    _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", node.ifname, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
        "burst", "32kbit", "latency", "10s")


# --- srun: inside a Slurm allocation ------------------------------------------------------------


def srun_nodes(count: int | None = None) -> NodeSet:
    """The nodes of the Slurm allocation this process runs in (``SLURM_JOB_ID``): one ``srun`` step per
    launch starts the agent on each (``--kill-on-bad-exit``: one failed node ends the step). The
    collective library's interface is the user's (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``
    as exported); node 0 is this batch host, where the coordinator's store listens."""
    import socket

    if not os.environ.get("SLURM_JOB_ID") or shutil.which("srun") is None:
        raise RuntimeError("--launcher srun runs inside a Slurm allocation (sbatch/salloc: SLURM_JOB_ID unset or no "
                           "srun here); `harness run --launcher slurm` submits one")
    have = int(os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES") or 1)
    count = count or have
    if count > have:
        raise RuntimeError(f"--nodes {count}: the Slurm allocation has {have} node(s)")
    host = socket.getfqdn()
    # --cpus-per-task said again: since Slurm 22.05 a step no longer inherits the batch job's, and each
    # agent (all of one node's ranks) would get one CPU
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    prefix = ("srun", "--nodes", str(count), "--ntasks", str(count), "--ntasks-per-node", "1",
              "--kill-on-bad-exit=1", "--export=ALL", "--cpu-bind=none", *((f"--cpus-per-task={cpus}",) if cpus else ()))
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    return NodeSet("srun", count, host, [Node(0, host, ifname, host, prefix, "", announce=False)])


def open_nodes(kind: str, count: int) -> NodeSet:
    if kind == "netns":
        return netns_nodes(count)
    if kind == "srun":
        return srun_nodes(count)
    if kind == "agents":
        pool = agents.Pool(count)
        return NodeSet("agents", count, pool.coordinator, [Node(**f) for f in pool.node_fields()], pool.close,
                       pool.start)
    raise ValueError(f"unknown node launcher {kind!r} ({', '.join(LAUNCHERS)})")


# --- the launch ----------------------------------------------------------------------------------


def agent_env(spec: LaunchSpec, node: Node, store: str) -> dict:
    env = dict(spec.env if spec.env is not None else rank_env())
    settings.set_env("HARNESS_LAUNCH_STORE", store, env)
    if node.announce:  # srun: each task's SLURM_NODEID says it
        settings.set_env("HARNESS_LAUNCH_NODE", node.index, env)
    if node.tmp:
        env["TMPDIR"] = node.tmp
    if node.ifname:
        env.update(GLOO_SOCKET_IFNAME=node.ifname, NCCL_SOCKET_IFNAME=node.ifname)
    env.update(dict(node.env))
    return env


class NodeLaunch:
    """One launch over a ``NodeSet``: the agents (a ``ProcessGroup`` each), the store, the mirror.
    Waits and kills like one ``ProcessGroup``; its files appear in ``run_dir`` as on one host."""

    def __init__(self, spec: LaunchSpec, nodes: NodeSet, join_timeout_s: float = 120.0,
                 start_delay_s: dict[int, float] | None = None):
        self.spec, self.nodes, self.run_dir, self.world = spec, nodes, Path(spec.run_dir), spec.world
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.coord = channel.Coordinator(self.run_dir, self.world)
        for name in spec.stage:
            self.coord.stage(name, (self.run_dir / name).read_bytes())
        self.join_timeout_s = join_timeout_s
        port = ready.free_port(nodes.coordinator)
        self.endpoint = f"{nodes.coordinator}:{port}"
        self.run_id = f"{noderun.PREFIX}{secrets.token_hex(4)}"
        self.groups: list[ProcessGroup] = []
        self.t0 = time.monotonic()
        self.ended: Ended | None = None
        self._delays = dict(start_delay_s or {})
        self._started: set[int] = set()
        self._retries = 0  # rendezvous restarts (_retry_rendezvous)
        self._alone: dict[int, int | None] = {}  # node -> its agent's exit code before any kill
        self.refused = ""  # the nodes' versions differ: the launch was stopped before any comparison
        store = f"{nodes.coordinator}:{self.coord.port}"
        self._envs = {n.index: agent_env(spec, n, store) for n in nodes.nodes}
        self._start_due()

    def _command(self, node: Node) -> list[str]:
        # each node's own run folder, in its own temp folder: made, named to torchrun and removed on the
        # node by the node wrapper (harness.launch.noderun), the one that knows that folder
        local = f"{noderun.TMP}{self.run_id}"
        return [*node.prefix, sys.executable, "-m", "harness.launch.noderun", local, "--",
                *self.spec.command(run_dir=local, nodes=self.nodes.count, rdzv=self._rdzv(node))]

    def _rdzv(self, node: Node) -> list[str]:
        args = ["--nnodes", str(self.nodes.count), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.run_id]
        if not node.announce:
            return [*args, "--rdzv-conf", f"join_timeout={self.join_timeout_s:g}"]
        host = "1" if node.index == 0 else "0"
        return [*args, "--local-addr", node.addr, "--rdzv-conf", f"is_host={host},join_timeout={self.join_timeout_s:g}"]

    def _start_due(self) -> None:
        now = time.monotonic() - self.t0
        for n in self.nodes.nodes:
            if n.index in self._started or self._delays.get(n.index, 0.0) > now:
                continue
            self._started.add(n.index)
            log = "torchrun.log" if n.index == 0 else f"torchrun-node{n.index}.log"
            if self.nodes.remote is not None and n.index:
                self.groups.append(self.nodes.remote(n, self._command(n), self.run_dir, self._envs[n.index], log))
                continue
            self.groups.append(ProcessGroup.start(self._command(n), self.run_dir, env=self._envs[n.index],
                                                  log_name=log))

    def poll(self) -> int | None:
        """None while any agent runs, or while the launch starts again on a fresh rendezvous port
        (``_retry_rendezvous``: a caller that polls by itself gets the retry ``wait`` gets); else the
        first nonzero exit code (0 when all succeeded)."""
        if self.ended is None:
            self._start_due()
            self._retry_rendezvous()
        return self._code()

    def _code(self) -> int | None:
        codes = [g.poll() for g in self.groups]
        if len(self.groups) < len(self.nodes.nodes) or any(c is None for c in codes):
            return None
        return next((c for c in codes if c), 0)

    def wait(self, deadline_s: float | None = None, stall_s: float | None = None, startup_s: float | None = None,
             progress: Callable[[], object] | None = None, interval_s: float = 0.1, grace_s: float = 10.0,
             within_s: float | None = None) -> Ended:
        """``ProcessGroup.wait`` over every node's agent; the store is mirrored at every poll. One
        agent that failed ends the launch ``grace_s`` later (its peers would wait in a collective
        until the process group's timeout)."""
        deadline_s = deadline(self.t0, deadline_s, within_s)
        watch, failed_at = Progress(progress, stall_s, startup_s), None
        try:
            while True:
                self._start_due()
                self.coord.sync()
                self.refused = self.coord.version_mismatch()
                if self.refused:
                    return self.kill("refused")
                tries = self._retries
                code = self.poll()
                if code is not None:
                    break
                now = time.monotonic()
                if self._retries != tries:  # started again on a fresh port: its failure is forgotten
                    failed_at = None
                    continue
                if failed_at is None and any(g.poll() not in (None, 0) for g in self.groups):
                    failed_at = now
                if failed_at is not None and now - failed_at > grace_s:
                    return self.kill("node failed")
                if deadline_s is not None and now - self.t0 > deadline_s:
                    return self.kill("timeout")
                if watch.stalled(now):
                    return self.kill("stalled")
                time.sleep(interval_s)
        except BaseException:
            self.kill("cancelled")
            raise
        killed = [p for g in self.groups for p in g.wait(deadline_s=0).killed]
        self.coord.sync()
        self.ended = Ended("exited", code, time.monotonic() - self.t0, killed)
        return self.ended

    RDZV_RETRIES = 2
    _RDZV_STORE_ERRORS = ("RendezvousConnectionError", "Address already in use", "EADDRINUSE")

    def _retry_rendezvous(self) -> bool:
        """Node 0's agent could not host the rendezvous store before any rank started (its port, free
        when picked, was taken meanwhile by another launch's socket: seen once under pytest -n 2):
        every agent is killed and the launch starts again on a fresh port, twice at most. Anything
        else is the launch's outcome."""
        if self._retries >= self.RDZV_RETRIES or not self.groups or self.groups[0].poll() in (None, 0):
            return False
        g0 = self.groups[0]
        self.coord.sync()  # a rank that started (and registered its node) makes it the launch's outcome
        if self.coord.nodes or not any(e in "\n".join(log_tail(g0.log, 60)) for e in self._RDZV_STORE_ERRORS):
            return False
        for g in self.groups:
            g.kill("rendezvous retry")
        self._retries += 1
        self.endpoint = f"{self.nodes.coordinator}:{ready.free_port(self.nodes.coordinator)}"
        self.run_id = f"{noderun.PREFIX}{secrets.token_hex(4)}"
        self.groups, self._started = [], set()
        self._start_due()
        return True

    def kill(self, how: str = "killed") -> Ended:
        if self.ended is not None:
            return self.ended
        self._alone = {n: g.poll() for n, g in zip(sorted(self._started), self.groups, strict=False)}
        killed = [p for g in self.groups for p in g.kill(how).killed]
        try:
            self.coord.sync()
        except Exception:
            pass
        self.ended = Ended(how, self._code(), time.monotonic() - self.t0, killed)
        return self.ended

    def close(self) -> None:
        self.kill()
        self.coord.close()

    def __enter__(self) -> NodeLaunch:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def exits(self) -> dict[int, dict]:
        return read_exits(self.run_dir, self.world)

    def describe(self, lines: int = 2) -> str:
        """The ending in one line, like ``ProcessGroup.describe``, the nodes' failures first."""
        infra = self.infrastructure()
        parts = [g.describe(lines) for g in self.groups if g.ended is not None and not g.ended.ok]
        return "; ".join(filter(None, [infra, *parts])) or (self.ended.how if self.ended else "still running")

    def placement(self) -> dict[int, str]:
        """Where each rank ran: ``{rank: "node <i> (<host>)"}`` (the ranks that reported)."""
        return {r: f"node {i} ({h})" for r, (i, h) in sorted(self.coord.nodes.items())}

    def infrastructure(self) -> str:
        """'' when every node took part to the end (a rank's own error or a hang is the caller's to
        judge); else what went wrong with which node: versions differ, the rendezvous timed out, a
        node was lost (its agent ended before the launch's end and its ranks left no exit record)."""
        if self.refused:
            return f"refused before any comparison: the nodes run different packages: {self.refused}"
        why = []
        exits = self.exits()
        for g, n in zip(self.groups, [x for x in self.nodes.nodes if x.index in self._started], strict=False):
            code = self._alone.get(n.index, g.poll()) if self._alone else g.poll()
            if code in (None, 0):
                continue
            text = "\n".join(log_tail(g.log, 40))
            ranks = self.coord.ranks_of(n.index)
            who = f"node {n.index} ({n.hostname}, {n.addr})"
            err = next((e for e in ("RendezvousTimeoutError", "RendezvousClosedError", "RendezvousConnectionError")
                        if e in text), None)
            if err:
                joined = sorted({i for i, _h in self.coord.nodes.values()})
                what = (f"timed out after {self.join_timeout_s:g} s" if err == "RendezvousTimeoutError" else
                        f"failed ({err}{', after ' + str(self._retries) + ' fresh ports' if self._retries else ''})")
                why.append(f"{who}: the rendezvous at {self.endpoint} {what}; "
                           f"nodes whose ranks started: {joined or 'none'} of {list(range(self.nodes.count))}")
            elif ranks and not any(r in exits for r in ranks):
                how = f"killed by signal {-code}" if code < 0 else f"ended with code {code}"
                why.append(f"{who} was lost with its ranks {ranks}: its agent was {how} and none of its ranks "
                           "wrote an exit record")
        late = [n for n in self.nodes.nodes if n.index not in self._started]
        why += [f"node {n.index} ({n.hostname}): its agent had not started" for n in late if why]
        if lost := self.coord.problems():  # files a rank sent that never reached the run folder
            why.append(f"the launch store could not bring back {len(lost)} file(s): " + "; ".join(lost[:3])
                       + (f"; and {len(lost) - 3} more" if len(lost) > 3 else ""))
        return "; ".join(why)


# --- what the checks call ------------------------------------------------------------------------


def spans(world: int) -> int:
    """How many nodes a launch of ``world`` ranks spans: ``HARNESS_NODES`` (``harness run --nodes``)
    when it divides the world; else one (a layout of 2 ranks on 4 nodes, a 1-rank reference)."""
    nodes = settings.env("HARNESS_NODES") or 1
    return nodes if nodes > 1 and world % nodes == 0 else 1


@contextlib.contextmanager
def launched(module: str, spec_path: Path, world: int, rdzv: Rendezvous | None = None, env: dict | None = None,
             join_timeout_s: float = 300.0, link_rate_mbit: dict[int, float] | None = None):
    """``python -m module SPEC`` on ``world`` ranks, as the run asks: torchrun on this host, or one
    agent per node (``HARNESS_NODES`` x ``HARNESS_NODE_LAUNCHER``) whose ranks get the spec staged into
    their node's own folder and send their files back (they appear beside the spec, as on one host).
    Yields the group (``ProcessGroup`` or ``NodeLaunch``: the same ``wait``/``kill``/``describe``);
    whatever ends the block, nothing of the launch is left running. ``link_rate_mbit`` ({node:
    Mbit/s}): those nodes' links throttled (a rehearsal's slow link, for tests)."""
    spec_path = Path(spec_path)
    nodes = spans(world)
    if nodes == 1:
        with torchrun(LaunchSpec(["-m", module, str(spec_path)], spec_path.parent, procs_per_node=world,
                                 rdzv=rdzv or Rendezvous(), env=env if env is not None else rank_env())) as group:
            yield group
        return
    kind = settings.env("HARNESS_NODE_LAUNCHER")
    if not kind:
        raise ValueError(f"{nodes} nodes need a node launcher (harness run --launcher netns, srun or agents)")
    spec = LaunchSpec(["-m", module, f"@run/{spec_path.name}"], spec_path.parent, procs_per_node=world // nodes,
                      nodes=nodes, env=env if env is not None else rank_env(), stage=(spec_path.name,))
    with open_nodes(kind, nodes) as node_set:
        for k, rate in (link_rate_mbit or {}).items():
            slow_link(node_set.nodes[k], rate)
        with NodeLaunch(spec, node_set, join_timeout_s=join_timeout_s) as group:
            yield group
