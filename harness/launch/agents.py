"""Node agents: multi-node launches where the coordinator cannot start processes on the other nodes
(Kubernetes pods, plain VMs). Each node runs one long-lived ``harness node-agent`` that *pulls* its share
of every launch from the coordinator, runs it supervised, and reports back (issue #45 item 3).

The coordinator (node 0, where ``harness run --nodes N --launcher agents`` runs) serves the *agents
store*, a torch ``TCPStore`` on a fixed port (``HARNESS_AGENTS_PORT``, 29600: the one address a pod
can be told before anything runs), for the whole run: ``ServedStore`` is a process of its own,
started by the run's pytest process (its isolated workers are forked from that process: a listening
socket there would be inherited by every worker and outlive the run). The items' launches are its
clients (``Pool``). Keys:

* ``agent/<K>`` (and ``agents``, one index per line): node K's agent - hostname, the address and
  interface it reaches node 0 from, the address of node 0 it reached, package versions, pid;
* ``beat/<K>``: a counter the agent bumps at every turn of its loop; a launch that sees it stand still
  for ``LOST_S`` takes the agent for lost (counters, not clocks: the nodes' clocks are never compared);
* ``seq``: the launch counter; ``launch/<seq>``: one node's share of one launch, JSON ``{"node",
  "argv", "env", "unset", "run", "log"}`` (``argv`` items ``@python``: the agent's own interpreter;
  ``env``: what the launch sets on top of the node's own environment; ``run``: the node-local run
  folder's name, in the agent's temp folder);
* ``started/<seq>``: pid and tree token of what the agent started; ``log/<seq>``: its log's tail,
  republished as it grows (error messages quote it); ``exit/<seq>/<K>``: how it ended;
* ``kill/<seq>``: the coordinator's group kill (done within a second); ``shutdown``: the run's end
  (the agents exit 0); ``bye/<K>``: an agent's answer to it.

Node 0's share of a launch is started by the coordinator itself, as with the other launchers; nodes
1..N-1 get ``RemoteGroup``s: a ``ProcessGroup``'s ``poll``/``wait``/``kill``/``describe`` over the
store, the agent's log tail mirrored into the coordinator's run folder. An agent runs each share as a
``ProcessGroup`` (own session, whole-tree kill) and removes its folder once reported; when the
coordinator's store goes away (the run was killed) it kills whatever it runs and exits nonzero.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from harness import settings
from harness.files import atomic, paths
from harness.launch import noderun
from harness.launch.channel import LOG_TAIL_BYTES, versions
from harness.launch.group import Ended, ProcessGroup, deadline
from harness.launch.ready import NotReady
from harness.messages import first_line

DEFAULT_PORT = 29600
PYTHON = "@python"
LOST_S = 30.0  # an agent whose beat stands still this long is lost (a group kill takes at most ~10 s)
KILL_WAIT_S = 20.0  # how long a kill waits for the agent's exit record
LOG_EVERY_S = 0.5  # a running share's log tail is republished at most this often
STORE_TIMEOUT_S = 30.0  # one store operation; the agents store answers at once
SHUTDOWN_WAIT_S = 5.0  # how long the served store waits for the agents' goodbyes

# exit codes of `harness node-agent`
UNREACHABLE, STORE_GONE, TERMINATED = 1, 3, 128 + signal.SIGTERM


class AgentError(RuntimeError):
    """An agent, or the agents store, that cannot do its part: one line saying what and where."""


def split_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); a bare IPv6 address is a host."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    if not host or not (port or str(default_port)).isdigit() or not 0 < int(port or default_port) < 65536:
        raise AgentError(f"{text!r}: expected HOST or HOST:PORT")
    return host, int(port or default_port)


def _tcp_store():
    """torch's ``TCPStore``, imported with torch's C++ log at FATAL for this process only: an agent
    waiting for its coordinator would print a stack trace per connection retry; what the agent says
    about the store is its own one line. Its children get the variable as it was."""
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        from torch.distributed import TCPStore
    finally:
        if before is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = before
    return TCPStore


def _store_error() -> type[Exception]:
    """What a store operation raises when the server is gone or does not answer (torch's DistError)."""
    from torch.distributed import DistError

    return DistError


def _client(host: str, port: int, connect_s: float):
    store = _tcp_store()(host, port, is_master=False, timeout=timedelta(seconds=connect_s))
    store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return store


def _route(host: str, port: int) -> tuple[str, str]:
    """(the address ``host`` resolves to, this machine's address that reaches it): a UDP connect
    sends nothing, it only asks the routing table - the interface the collectives must bind."""
    infos = sorted(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), key=lambda i: i[0] != socket.AF_INET)
    family, _t, _p, _c, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return addr[0], s.getsockname()[0]


def _ifname(addr: str) -> str:
    """The local interface holding ``addr`` ('' if none: the user's GLOO/NCCL_SOCKET_IFNAME then)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    return ""


# --- the coordinator's side ----------------------------------------------------------------------


class AgentsServer:
    """The agents store itself (``ServedStore`` runs it in a process of its own)."""

    def __init__(self, port: int = DEFAULT_PORT, host: str = "0.0.0.0"):
        TCPStore = _tcp_store()
        try:
            self.store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=STORE_TIMEOUT_S))
        except RuntimeError as e:
            raise AgentError(f"the agents store cannot listen on port {port}: {first_line(e)}") from None
        self.port = self.store.port

    def registered(self) -> list[int]:
        if not self.store.check(["agents"]):
            return []
        return sorted({int(k) for k in self.store.get("agents").decode().split()})

    def shutdown(self, wait_s: float = SHUTDOWN_WAIT_S) -> list[int]:
        """Tell every agent the run is over; the nodes whose agents answered within ``wait_s``."""
        self.store.set("shutdown", "1")
        deadline = time.monotonic() + wait_s
        while True:
            nodes = self.registered()
            said = [k for k in nodes if self.store.check([f"bye/{k}"])]
            if len(said) == len(nodes) or time.monotonic() > deadline:
                return said
            time.sleep(0.05)

    def close(self) -> None:
        del self.store


def serve(port: int) -> int:
    """``python -m harness.launch.agents serve PORT``: the store until SIGTERM (the run's end: the agents
    are told and exit 0) or its parent's death (the run was killed: the store goes away, and the agents
    end their launches and exit nonzero)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = AgentsServer(port)
    except AgentError as e:
        print(e, flush=True)
        return 2
    print(f"agents store ready on port {server.port}", flush=True)
    while not stop.wait(1.0):
        pass
    said = server.shutdown()
    print(f"agents store: shutdown; agents that answered: {said}", flush=True)
    server.close()
    return 0


class ServedStore:
    """The run's agents store in its own process (``serve``), dying with this one; ``close()`` says
    shutdown to the agents and ends it."""

    def __init__(self, port: int, ready_s: float = 120.0):
        self.port = port
        self.folder = Path(tempfile.mkdtemp(prefix="harness-agents-"))
        self.group = ProcessGroup.start([sys.executable, "-m", "harness.launch.agents", "serve", str(port)],
                                        self.folder, log_name="agents-store.log")
        try:
            self.group.wait_ready(timeout_s=ready_s, line=r"^agents store ready", name=f"the agents store (port {port})")
        except NotReady as e:
            self.close()
            raise AgentError(str(e)) from None

    def close(self) -> None:
        if self.group.poll() is None:
            self.group.proc.send_signal(signal.SIGTERM)
            try:
                self.group.proc.wait(timeout=SHUTDOWN_WAIT_S + 10)
            except Exception:
                pass
        self.group.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


class Pool:
    """This run's agents as a launch on node 0 reaches them: a client of the agents store, waiting until
    nodes 1..count-1 have an agent; ``start`` hands one node its share of a launch."""

    def __init__(self, count: int, endpoint: str | None = None, join_timeout_s: float = 300.0,
                 interval_s: float = 0.2):
        if count < 2:
            raise ValueError(f"--launcher agents: {count} node(s); agents serve nodes 1..N-1 of N >= 2")
        port = settings.env("HARNESS_AGENTS_PORT")
        self.endpoint = endpoint or f"127.0.0.1:{port}"
        host, port = split_endpoint(self.endpoint, port)
        try:
            self.store = _client(host, port, 10.0)
        except RuntimeError as e:
            raise AgentError(f"--launcher agents: no agents store at {self.endpoint} ({first_line(e)}): "
                             "`harness run --nodes N --launcher agents` serves it (HARNESS_AGENTS_PORT)") from None
        self.count, self.port = count, port
        self.agents = self._join(join_timeout_s, interval_s)

    def _join(self, timeout_s: float, interval_s: float) -> dict[int, dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            got = {k: json.loads(self.store.get(f"agent/{k}")) for k in range(1, self.count)
                   if self.store.check([f"agent/{k}"])}
            if len(got) == self.count - 1:
                return got
            if time.monotonic() > deadline:
                missing = [k for k in range(1, self.count) if k not in got]
                have = ", ".join(f"node {k} ({a['hostname']}, {a['addr']})" for k, a in sorted(got.items()))
                raise AgentError(f"--launcher agents: no agent joined for node(s) {missing} within {timeout_s:g} s "
                                 f"(joined: {have or 'none'}); each node runs `harness node-agent --coordinator "
                                 f"<this host>:{self.port} --node K`")
            time.sleep(interval_s)

    @property
    def coordinator(self) -> str:
        """Node 0's address as the agents reached it (their rendezvous and launch stores are there)."""
        return self.agents[1]["coordinator"]

    def node_fields(self) -> list[dict]:
        """``harness.launch.nodes.Node``'s fields for node 0 (this host) and every agent's node."""
        out = [dict(index=0, addr=self.coordinator, ifname=_ifname(self.coordinator), hostname=socket.gethostname())]
        return out + [dict(index=k, addr=a["addr"], ifname=a["ifname"], hostname=a["hostname"])
                      for k, a in sorted(self.agents.items())]

    def start(self, node, cmd: list[str], run_dir: Path, env: dict, log_name: str) -> RemoteGroup:
        """Post ``node``'s share: ``cmd`` with what ``env`` sets on top of this process's environment
        (the node keeps its own PATH, TMPDIR, ...; the run's declared settings go along)."""
        here = os.environ
        send = {k: v for k, v in env.items() if here.get(k) != v}
        send.update({k: env[k] for k, var in settings.ENV.items() if k in env and not var.internal})
        gone = {k: "" for k in here if k not in env}
        # The coordinator's tree markers stay behind: a node's processes carry their agent's, and on a
        # rehearsal host the coordinator's group kill must not reach into the other "nodes".
        for names in (send, gone):
            settings.unset_env("HARNESS_LAUNCH_GROUP", names)
        req = {"node": node.index, "argv": [PYTHON if a == sys.executable else a for a in cmd], "env": send,
               "unset": sorted(gone),
               "run": next((a[len(noderun.TMP):] for a in cmd if a.startswith(noderun.TMP)), ""), "log": log_name}
        seq = self.store.add("seq", 1)
        self.store.set(f"launch/{seq}", json.dumps(req))
        return RemoteGroup(self.store, node.index, seq, Path(run_dir), log_name, self.agents[node.index])

    def close(self) -> None:
        del self.store


class RemoteGroup(ProcessGroup):
    """One node's share of a launch, run by its agent: what ``NodeLaunch`` uses of a ``ProcessGroup``
    (``poll``, ``wait``, ``kill``, ``describe``, ``log``: the agent's log tail, mirrored here), over the
    agents store. ``pid``/``token``: the agent's group on its node, once started."""

    def __init__(self, store, node: int, seq: int, run_dir: Path, log_name: str, agent: dict):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(None, run_dir, "", paths.join(run_dir, log_name, source="launch", field="log_name"), 0,
                         time.monotonic())
        self.store, self.node, self.seq, self.agent = store, node, seq, agent
        self.remote_pid: int | None = None
        self._exit: dict | None = None
        self._beat: tuple[int | None, float] = (None, time.monotonic())
        self._log: bytes | None = None
        self._log_at = 0.0

    @property
    def pid(self) -> int | None:
        return self.remote_pid

    def _lose(self, why: str) -> None:
        """The agent is gone: the share ends as killed, and the log says why (the error quotes it)."""
        line = f"harness: node {self.node}'s agent ({self.agent.get('hostname')}, {self.agent.get('addr')}) {why}\n"
        with open(self.log, "ab") as f:
            f.write(line.encode())
        self._exit = {"code": -signal.SIGKILL, "how": "lost", "killed": []}

    def _mirror_log(self) -> None:
        key = f"log/{self.seq}"
        if self.store.check([key]):
            data = self.store.get(key)
            if data != self._log:
                self._log = data
                atomic.write_bytes(self.log, data)
        self._log_at = time.monotonic()

    def _look(self) -> None:
        now = time.monotonic()
        if self.remote_pid is None and self.store.check([f"started/{self.seq}"]):
            info = json.loads(self.store.get(f"started/{self.seq}"))
            self.remote_pid, self.token = info["pid"], info["token"]
        done = f"exit/{self.seq}/{self.node}"
        if self.store.check([done]):
            self._mirror_log()  # the agent published its last tail before the exit record
            self._exit = json.loads(self.store.get(done))
            return
        if now - self._log_at >= LOG_EVERY_S:
            self._mirror_log()
        beat = self.store.add(f"beat/{self.node}", 0)
        if beat != self._beat[0]:
            self._beat = (beat, now)
        elif now - self._beat[1] > LOST_S:
            self._lose(f"stopped answering: its heartbeat stood still for {LOST_S:g} s")

    def poll(self) -> int | None:
        if self._exit is None:
            try:
                self._look()
            except _store_error() as e:  # the store is gone with the coordinator
                self._lose(f"is unreachable: the agents store did not answer ({first_line(e)})")
        return None if self._exit is None else self._exit.get("code")

    def wait(self, deadline_s: float | None = None, interval_s: float = 0.1, within_s: float | None = None,
             **_progress) -> Ended:
        """Until the agent reports the end (``NodeLaunch`` watches progress itself), killed at ``deadline_s``
        (or ``within_s`` from now, as ``ProcessGroup.wait``)."""
        deadline_s = deadline(self.t0, deadline_s, within_s)
        try:
            while self.poll() is None and self._exit is None:
                if deadline_s is not None and time.monotonic() - self.t0 > deadline_s:
                    return self.kill("timeout")
                time.sleep(interval_s)
        except BaseException:
            self.kill("cancelled")
            raise
        if self.ended is None:
            self.ended = Ended("exited", self._exit.get("code"), time.monotonic() - self.t0,
                               list(self._exit.get("killed") or []))
        return self.ended

    def kill(self, how: str = "killed") -> Ended:
        """The agent kills the group (its whole tree, on its node) and says so; idempotent."""
        if self.ended is not None:
            return self.ended
        if self._exit is None:
            try:
                self.store.set(f"kill/{self.seq}", how)
            except _store_error():
                pass
            deadline = time.monotonic() + KILL_WAIT_S
            while self.poll() is None and self._exit is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._exit is None:
                self._lose(f"did not confirm the kill within {KILL_WAIT_S:g} s")
        self.ended = Ended(how, self._exit.get("code"), time.monotonic() - self.t0, list(self._exit.get("killed") or []))
        return self.ended


# --- the node's side: `harness node-agent` -------------------------------------------------------


class _Stop(Exception):
    """SIGTERM (a pod being deleted): end the launches, then exit."""


@dataclass
class _Share:
    group: ProcessGroup
    run_dir: Path
    log_key: tuple[int, int] = (0, -1)
    log_at: float = 0.0


class Agent:
    """``harness node-agent``: node ``node``'s agent of the coordinator at ``host:port``."""

    def __init__(self, host: str, port: int, node: int, connect_timeout_s: float = 600.0, poll_s: float = 0.1):
        self.host, self.port, self.node = host, port, node
        self.connect_timeout_s, self.poll_s = connect_timeout_s, poll_s
        self.running: dict[int, _Share] = {}
        self.low, self.seen = 1, set()
        self.hostname = socket.gethostname()

    def say(self, text: str, err: bool = False) -> None:
        print(f"harness node-agent: node {self.node}: {text}", file=sys.stderr if err else sys.stdout, flush=True)

    def connect(self):
        """The store, retried until ``connect_timeout_s`` (a pod may start before node 0's name resolves
        or its store listens); registers this node."""
        deadline, last = time.monotonic() + self.connect_timeout_s, ""
        while True:
            try:
                ip, local = _route(self.host, self.port)
                store = _client(ip, self.port, max(1.0, min(10.0, deadline - time.monotonic())))
                break
            except (OSError, RuntimeError) as e:
                last = first_line(e)
            if time.monotonic() >= deadline:
                raise AgentError(f"node {self.node}: the coordinator's agents store at {self.host}:{self.port} was "
                                 f"not reachable within {self.connect_timeout_s:g} s ({last})")
            time.sleep(1.0)
        me = {"hostname": self.hostname, "addr": local, "ifname": _ifname(local), "coordinator": ip,
              "pid": os.getpid(), "versions": versions()}
        # Only launches posted from now on are this agent's (posted once it registered): an agent that
        # replaces a lost one must not run the old one's launches again.
        self.low = int(store.add("seq", 0)) + 1
        store.set(f"agent/{self.node}", json.dumps(me))
        store.append("agents", f"{self.node}\n")
        self.say(f"joined the coordinator at {self.host}:{self.port} as {self.hostname} ({local}"
                 f"{' on ' + me['ifname'] if me['ifname'] else ''})")
        return store

    def run(self) -> int:
        try:
            store = self.connect()
        except AgentError as e:
            print(f"harness node-agent: {e}", file=sys.stderr, flush=True)
            return UNREACHABLE
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._terminate)
        try:
            return self._loop(store)
        except _store_error() as e:  # the coordinator's store went away
            n = self.kill_all(None, "coordinator gone")
            self.say(f"the coordinator's agents store at {self.host}:{self.port} went away ({first_line(e)}); "
                     f"killed {n} launch(es); exiting", err=True)
            return STORE_GONE
        except _Stop:
            n = self.kill_all(store, "agent terminated")
            self.say(f"terminated (SIGTERM); killed {n} launch(es)", err=True)
            return TERMINATED
        finally:
            self.kill_all(None, "agent exiting")  # whatever ended the loop, nothing is left running

    def _terminate(self, *_):
        raise _Stop()

    def _loop(self, store) -> int:
        while True:
            if store.check(["shutdown"]):
                n = self.kill_all(store, "shutdown")
                store.set(f"bye/{self.node}", "1")
                self.say("the run ended; exiting" + (f" (killed {n} launch(es) still running)" if n else ""))
                return 0
            self.take(store)
            self.tend(store)
            store.add(f"beat/{self.node}", 1)
            time.sleep(self.poll_s)

    def take(self, store) -> None:
        """Start this node's shares of the launches posted since the last look (a sequence number taken
        but not yet posted is looked at again next time)."""
        top = int(store.add("seq", 0))
        for s in range(self.low, top + 1):
            if s in self.seen or not store.check([f"launch/{s}"]):
                continue
            self.seen.add(s)
            req = json.loads(store.get(f"launch/{s}"))
            if req.get("node") == self.node:
                self.start(store, s, req)
        while self.low in self.seen:
            self.seen.discard(self.low)
            self.low += 1

    def start(self, store, s: int, req: dict) -> None:
        """One share: a bad request is refused with its reason as its log - it costs that launch only."""
        try:
            run_dir = paths.join(tempfile.gettempdir(), req.get("run") or f"harness-agent-{s}", source=f"launch {s}",
                                 field="run")
            log_name = paths.name(req.get("log") or "launch.log", source=f"launch {s}", field="log")
            argv = [sys.executable if a == PYTHON else str(a) for a in req["argv"]]
            env = dict(os.environ)
            env.update({str(k): str(v) for k, v in dict(req.get("env") or {}).items()})
            for k in req.get("unset") or []:
                env.pop(k, None)
            if store.check([f"kill/{s}"]):  # killed before it was picked up: never started
                return self.report(store, s, {"code": None, "how": "killed", "killed": []})
            group = ProcessGroup.start(argv, run_dir, env=env, log_name=log_name)
        except (KeyError, TypeError, ValueError, OSError) as e:
            store.set(f"log/{s}", f"node {self.node}'s agent refused launch {s}: {first_line(e)}\n")
            self.say(f"launch {s} refused: {first_line(e)}", err=True)
            return self.report(store, s, {"code": 2, "how": "refused", "killed": []})
        store.set(f"started/{s}", json.dumps({"pid": group.pid, "token": group.token, "host": self.hostname}))
        self.running[s] = _Share(group, run_dir)
        self.say(f"launch {s} started (pid {group.pid})")

    def tend(self, store) -> None:
        for s, share in list(self.running.items()):
            if store.check([f"kill/{s}"]):
                end = share.group.kill(store.get(f"kill/{s}").decode() or "killed")
            elif share.group.poll() is not None:
                end = share.group.wait(deadline_s=0)  # whatever of it still lives is swept
            else:
                if time.monotonic() - share.log_at >= LOG_EVERY_S:
                    self.publish_log(store, s, share)
                continue
            self.finish(store, s, share, end)

    def publish_log(self, store, s: int, share: _Share) -> None:
        share.log_at = time.monotonic()
        try:
            st = share.group.log.stat()
            if (st.st_mtime_ns, st.st_size) == share.log_key:
                return
            with open(share.group.log, "rb") as f:
                f.seek(max(0, st.st_size - LOG_TAIL_BYTES))
                data = f.read()
        except OSError:
            return
        store.set(f"log/{s}", data)
        share.log_key = (st.st_mtime_ns, st.st_size)

    def finish(self, store, s: int, share: _Share, end: Ended) -> None:
        """Log tail first, then the exit record (the coordinator reads the tail once it sees the record),
        then the node-local folder goes: a long-lived node must not fill its disk run after run."""
        self.running.pop(s, None)
        try:
            if store is not None:
                self.publish_log(store, s, share)
                self.report(store, s, {"code": end.code, "how": end.how, "killed": end.killed,
                                       "wall_s": round(end.wall_s, 3)})
        finally:
            shutil.rmtree(share.run_dir, ignore_errors=True)
        self.say(f"launch {s} {end.how}" + (f" with code {end.code}" if end.code is not None else "")
                 + f" after {end.wall_s:.1f} s" + (f" ({len(end.killed)} processes killed)" if end.killed else ""))

    def report(self, store, s: int, rec: dict) -> None:
        store.set(f"exit/{s}/{self.node}", json.dumps(rec))

    def kill_all(self, store, how: str) -> int:
        """Kill every running share (its whole tree); report it where the store still answers."""
        n = 0
        for s, share in list(self.running.items()):
            end = share.group.kill(how)
            n += 1
            try:
                self.finish(store, s, share, end)
            except _store_error():  # the store is gone: nobody to tell
                self.running.pop(s, None)
        return n


def node_index(node: int | None) -> int:
    """``--node``, else ``JOB_COMPLETION_INDEX`` (what Kubernetes sets in each pod of an Indexed Job)."""
    if node is None:
        raw = os.environ.get("JOB_COMPLETION_INDEX", "")
        if not raw.strip().isdigit():
            raise AgentError("--node is required (JOB_COMPLETION_INDEX, a JobSet pod's index, is "
                             f"{'unset' if not raw else repr(raw)})")
        node = int(raw)
    if node < 1:
        raise AgentError(f"--node {node}: node 0 is the coordinator's own (`harness run` starts its share); "
                         "agents serve nodes 1..N-1")
    return node


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"] and len(sys.argv) == 3 and sys.argv[2].isdigit():
        from harness.proc import exit_now

        exit_now(serve(int(sys.argv[2])))
    sys.exit("usage: python -m harness.launch.agents serve PORT")
