"""The pull-model launcher (`--launcher agents`): node 1 is a network namespace whose long-lived
`harness node-agent` was started from outside, as Kubernetes starts a pod - nothing on node 0 starts a
process there. Real processes throughout: a gloo launch over the link through the agent, a kill at the
time limit that leaves nothing of the launch on node 1 (the agent serves the next launch, then exits on
shutdown), and an agent whose coordinator disappears, killing an escaping process tree on its way out."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.launch import agents, ready, tree
from harness.launch.group import LaunchSpec, ProcessGroup
from harness.launch.nodes import NodeLaunch, netns_available, netns_nodes, open_nodes
from tests.launch.helpers import NAMES, TREE, still_alive, wait_pids
from tests.launch.test_nodes import LOOP, SUM

HARNESS = str(Path(sys.executable).with_name("harness"))  # the console script, as a pod runs it
root = pytest.mark.skipif(bool(netns_available()), reason=netns_available() or "root")

# Every rank writes where it ran; no torch import in the ranks (the agents' torchrun has its own).
HELLO = r"""
import json, os, socket, sys
run = os.path.dirname(sys.argv[1])
os.makedirs(os.path.join(run, "out"), exist_ok=True)
with open(os.path.join(run, "out", f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"host": socket.gethostname()}, f)
"""


def _spec(run: Path, prog: str) -> LaunchSpec:
    run.mkdir(parents=True, exist_ok=True)
    (run / "spec.json").write_text(json.dumps({"layouts": ["tp2"]}))
    return LaunchSpec(["-c", prog, "@run/spec.json"], run, procs_per_node=2, nodes=2, stage=("spec.json",))


def _ns_pids(node) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", node.prefix[3]], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        time.sleep(0.1)


@contextlib.contextmanager
def _rehearsal(tmp_path: Path, monkeypatch):
    """Two namespaced nodes, the run's agents store (as `harness run --launcher agents` serves it), and
    node 1's agent started inside its namespace with its own temp folder. Yields (nodes, store, agent)."""
    port = ready.free_port()  # not 29600: the machine is shared
    monkeypatch.setenv("HARNESS_AGENTS_PORT", str(port))
    with netns_nodes(2) as nodes:
        served = agents.ServedStore(port)
        n1 = nodes.nodes[1]
        env = dict(os.environ, TMPDIR=n1.tmp)
        agent = ProcessGroup.start([*n1.prefix, HARNESS, "node-agent", "--coordinator",
                                    f"{nodes.coordinator}:{port}", "--node", "1", "--connect-timeout", "60"],
                                   tmp_path / "agent", env=env, log_name="agent.log")
        try:
            yield nodes, served, agent
        finally:
            agent.kill()
            served.close()


@root
def test_a_launch_over_two_nodes_through_the_agent_returns_every_ranks_files(tmp_path, monkeypatch):
    run = tmp_path / "coordinator"
    with _rehearsal(tmp_path, monkeypatch) as (nodes, served, agent):
        n1 = nodes.nodes[1]
        with open_nodes("agents", 2) as node_set:
            # what the agent registered: node 1's own address and interface, node 0 as node 1 reached it
            assert [(n.addr, n.ifname, n.hostname) for n in node_set.nodes] == [
                (nodes.nodes[0].addr, nodes.nodes[0].ifname, nodes.nodes[0].hostname), (n1.addr, n1.ifname, "node1")]
            with NodeLaunch(_spec(run, SUM), node_set, join_timeout_s=120) as launch:
                end = launch.wait(deadline_s=300)
                assert end.ok, (end, launch.describe(), (tmp_path / "agent" / "agent.log").read_text()[-2000:])
                remote = launch.groups[1]
                tokens = [g.token for g in launch.groups]
        outs = {r: json.loads((run / "out" / f"rank{r}.json").read_text()) for r in range(4)}
        assert all(o["sum"] == 10.0 for o in outs.values()), outs  # 1+2+3+4 over the link
        on1 = [r for r, o in outs.items() if o["host"] == "node1"]
        assert len(on1) == 2 and all(outs[r]["run"].startswith(n1.tmp) for r in on1), outs
        assert all(o["spec"] == {"layouts": ["tp2"]} for o in outs.values())
        # node 1's agent log tail reached the coordinator: torchrun's own lines, from node 1
        assert isinstance(remote, agents.RemoteGroup) and (run / "torchrun-node1.log").stat().st_size > 0
        assert all(tree.marked(t) == [] for t in tokens) and _ns_pids(n1) == {agent.pid}
        assert not list(Path(n1.tmp).glob("harness-*"))  # the agent removed its node-local run folder
        # node 0 (this host) runs its share itself: its folder in this host's temp folder went with it
        assert not (Path(tempfile.gettempdir()) / launch.run_id).exists() and not Path("@tmp").exists()
        served.close()  # the run's end: the agent says goodbye and exits 0
        assert agent.wait(within_s=15).ok, (tmp_path / "agent" / "agent.log").read_text()
    assert "the run ended; exiting" in (tmp_path / "agent" / "agent.log").read_text()


@root
def test_a_kill_at_the_time_limit_leaves_nothing_on_node_1_and_the_agent_serves_the_next_launch(tmp_path, monkeypatch):
    run = tmp_path / "loop"
    with _rehearsal(tmp_path, monkeypatch) as (nodes, served, agent), open_nodes("agents", 2) as node_set:
        n1 = nodes.nodes[1]
        with NodeLaunch(_spec(run, LOOP), node_set, join_timeout_s=120) as launch:
            def looping():
                launch.coord.sync()
                return len(list((run / "in").glob("rank*.json"))) == 4 or launch.poll() is not None
            _until(looping, 240, "every rank looping in collectives")
            assert launch.poll() is None, launch.describe()
            remote = launch.groups[1]
            on1 = _ns_pids(n1) - {agent.pid}
            assert len(on1) >= 5, on1  # torchrun, 2 wrappers, 2 ranks
            t0 = time.monotonic()
            end = launch.wait(within_s=0.5)  # the limit is now
            took = time.monotonic() - t0
        assert end.how == "timeout" and remote.ended.how == "timeout", (end, remote.ended)
        assert took < 15, took
        # the agent killed the tree; what it did not signal itself had died with its parent first (ranks are
        # killed on their parent's death: CI saw the two ranks gone before the kill listed them). Nothing of
        # the launch is left on node 1, its only process the agent:
        assert set(remote.ended.killed) <= on1 and remote.ended.killed, (remote.ended, on1)
        assert tree.marked(remote.token) == [] and _ns_pids(n1) == {agent.pid}
        assert "killed at its time limit" in remote.describe()
        # the same agent serves the next launch
        nxt = tmp_path / "next"
        with NodeLaunch(_spec(nxt, HELLO), node_set, join_timeout_s=120) as launch:
            end = launch.wait(deadline_s=300)
            assert end.ok, launch.describe()
        hosts = sorted(json.loads((nxt / "out" / f"rank{r}.json").read_text())["host"] for r in range(4))
        assert hosts.count("node1") == 2, hosts
        served.close()
        assert agent.wait(within_s=15).ok, (tmp_path / "agent" / "agent.log").read_text()


@root
def test_an_agent_whose_coordinator_disappears_exits_and_leaves_nothing_behind(tmp_path, monkeypatch):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    with _rehearsal(tmp_path, monkeypatch) as (nodes, served, agent):
        n1 = nodes.nodes[1]
        pool = agents.Pool(2)
        # a share that tries to outlive its launch: setsid grandchild, double-forked daemon
        share = pool.start(n1, [sys.executable, "-c", TREE, str(pids_dir), "@tmp/harness-tree"], tmp_path / "run",
                           dict(os.environ), "tree.log")
        pids = wait_pids(pids_dir, timeout_s=60)
        assert set(pids.values()) <= _ns_pids(n1)
        served.group.kill()  # the coordinator's store goes away (the run was killed outright)
        t0 = time.monotonic()
        ended = agent.wait(within_s=20)
        log = (tmp_path / "agent" / "agent.log").read_text()
        assert ended.how == "exited" and ended.code == agents.STORE_GONE, (ended, log)
        assert time.monotonic() - t0 < 10, log
        assert still_alive(pids.values()) == [] and _ns_pids(n1) == set(), (pids, log)
        assert "went away" in log and "killed 1 launch(es)" in log, log
        # the coordinator's side: the share reads as lost, in one line, without hanging
        assert share.poll() == -9 and "is unreachable" in share.log.read_text()
        pool.close()
    assert sorted(pids) == sorted(NAMES)


def test_node_agent_bad_input_and_an_unreachable_coordinator_are_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    cmd = [HARNESS, "node-agent"]
    r = subprocess.run([*cmd, "--coordinator", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--node is required" in r.stderr, r.stderr
    r = subprocess.run([*cmd, "--coordinator", "127.0.0.1:1", "--node", "0"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "node 0 is the coordinator's own" in r.stderr, r.stderr
    # nothing listens there: retried for the timeout, then one line naming the address
    port = ready.free_port()
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")  # a JobSet pod's index
    t0 = time.monotonic()
    r = subprocess.run([*cmd, "--coordinator", "127.0.0.1", "--agents-port", str(port), "--connect-timeout", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == agents.UNREACHABLE and r.stderr.count("\n") == 1, r.stderr
    assert f"node 3: the coordinator's agents store at 127.0.0.1:{port} was not reachable within 2 s" in r.stderr
    assert time.monotonic() - t0 < 60


def test_endpoints_and_node_index():
    assert agents.split_endpoint("leader.js:1234", 29600) == ("leader.js", 1234)
    assert agents.split_endpoint("leader.js", 29600) == ("leader.js", 29600)
    assert agents.split_endpoint("[fd00::1]:7", 29600) == ("fd00::1", 7)
    for bad in ("", ":80", "h:port", "h:70000"):
        with pytest.raises(agents.AgentError):
            agents.split_endpoint(bad, 29600)
    assert agents.node_index(2) == 2
