"""Multi-node launches rehearsed on this machine: two "nodes" in separate network namespaces (own
hostname, own temp and run folders) joined by a veth pair, one torchrun agent each, a c10d rendezvous,
real gloo collectives across the link, and the ranks' files brought back over the coordinator's store.
And the faults a cluster has and one host never shows: a node that joins late, a node lost inside a
collective, a node running another package version - each named as the infrastructure's, by node."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from harness.launch import tree
from harness.launch.group import LaunchSpec
from harness.launch.nodes import NodeLaunch, netns_available, netns_nodes

pytestmark = pytest.mark.skipif(bool(netns_available()), reason=netns_available() or "root")

# Every rank: a sum over all ranks (gloo, across the link), then where it ran, into its run folder.
SUM = r"""
import json, os, socket, sys
from datetime import timedelta
import torch, torch.distributed as dist
run = os.path.dirname(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
r = dist.get_rank()
t = torch.tensor([float(r + 1)])
dist.all_reduce(t)
os.makedirs(os.path.join(run, "out"), exist_ok=True)
with open(os.path.join(run, "out", f"rank{r}.json"), "w") as f:
    json.dump({"sum": t.item(), "host": socket.gethostname(), "run": run, "spec": json.load(open(sys.argv[1]))}, f)
dist.destroy_process_group()
"""

# Collectives in a loop until killed; each rank marks that it got into the loop.
LOOP = r"""
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
run = os.path.dirname(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
r = dist.get_rank()
os.makedirs(os.path.join(run, "in"), exist_ok=True)
open(os.path.join(run, "in", f"rank{r}.json"), "w").write("{}")
while True:
    dist.all_reduce(torch.ones(1024)); time.sleep(0.05)
"""


def _spec(run: Path, prog: str) -> LaunchSpec:
    run.mkdir(parents=True, exist_ok=True)
    (run / "spec.json").write_text(json.dumps({"layouts": ["tp2"]}))
    return LaunchSpec(["-c", prog, "@run/spec.json"], run, procs_per_node=2, nodes=2, stage=("spec.json",))


def test_two_namespaced_nodes_run_one_job_and_results_come_back_through_the_store(tmp_path, monkeypatch):
    run = tmp_path / "coordinator"
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # torchrun once made ./@tmp/<run id>/ here, from its --log-dir
    with netns_nodes(2) as nodes, NodeLaunch(_spec(run, SUM), nodes, join_timeout_s=120) as launch:
        end = launch.wait(deadline_s=300)
        # each node's own run folder went with its share (harness.launch.noderun); nothing in the working folder
        assert [list(Path(n.tmp).iterdir()) for n in nodes.nodes] == [[], []]
        assert list((tmp_path / "cwd").iterdir()) == []
        assert end.ok, (end, launch.infrastructure(), (run / "torchrun-node1.log").read_text()[-2000:])
        outs = {r: json.loads((run / "out" / f"rank{r}.json").read_text()) for r in range(4)}
        hosts = {r: o["host"] for r, o in outs.items()}
        node1 = nodes.nodes[1]
        assert all(o["sum"] == 10.0 for o in outs.values()), outs  # 1+2+3+4 over the link
        assert sorted(hosts.values()).count(node1.hostname) == 2 and node1.hostname != os.uname().nodename
        # every rank wrote into its node's own folder, never the coordinator's; the spec was handed over
        assert all(not o["run"].startswith(str(run)) for o in outs.values()), outs
        assert {o["run"].startswith(node1.tmp) for r, o in outs.items() if hosts[r] == node1.hostname} == {True}
        assert all(o["spec"] == {"layouts": ["tp2"]} for o in outs.values())
        assert sorted(launch.exits()) == [0, 1, 2, 3] and launch.infrastructure() == ""
        assert {p.split(" (")[0] for p in launch.placement().values()} == {"node 0", "node 1"}
        tokens = [g.token for g in launch.groups]
    assert all(tree.marked(t) == [] for t in tokens)  # nothing of the launch survives it
    assert not any(ns.startswith(node1.prefix[3].rsplit("-", 1)[0] + "-") for ns in _namespaces())


def test_a_node_that_joins_late_is_named_by_the_rendezvous_timeout(tmp_path):
    run = tmp_path / "coordinator"
    # The join timeout is waited out whole (node 1 never comes): 2 s, as nothing else has to happen in it
    # (node 0's agent joins at once; it was 5 s)
    with netns_nodes(2) as nodes, NodeLaunch(_spec(run, SUM), nodes, join_timeout_s=2,
                                             start_delay_s={1: 600}) as launch:
        end = launch.wait(deadline_s=180)
        why = launch.infrastructure()
    assert not end.ok and end.wall_s < 120, end
    assert "rendezvous" in why and "timed out after 2 s" in why and "node 1" in why, why
    assert "its agent had not started" in why, why


def test_a_node_lost_inside_a_collective_is_named_with_its_ranks(tmp_path):
    run = tmp_path / "coordinator"
    with netns_nodes(2) as nodes, NodeLaunch(_spec(run, LOOP), nodes, join_timeout_s=120) as launch:
        progress_seen = []

        def progress():
            got = sorted((run / "in").glob("rank*.json")) if (run / "in").exists() else []
            if len(got) == 4 and not progress_seen:  # every rank is looping in collectives: pull node 1's plug
                progress_seen.append(time.monotonic())
                tree.kill_tree(launch.groups[1].pid, launch.groups[1].token)
            return len(got) or None

        end = launch.wait(deadline_s=300, stall_s=120, progress=progress)
        why = launch.infrastructure()
    assert progress_seen and not end.ok, end
    assert "node 1" in why and "lost with its ranks" in why, why
    ranks1 = [r for r, p in launch.placement().items() if p.startswith("node 1")]
    assert len(ranks1) == 2 and f"ranks {ranks1}" in why, (why, launch.placement())
    assert "node 0" not in why.split("node 1")[0], why  # the survivors are not blamed


def test_a_node_running_another_package_version_is_refused_before_any_result(tmp_path):
    # node 1's environment shadows transformers' installed metadata with another version (as a node
    # whose image was built a day later would): what `import` would report there differs.
    fake = tmp_path / "shadow" / "transformers-9.9.9.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 9.9.9\n")
    run = tmp_path / "coordinator"
    with netns_nodes(2) as nodes:
        n1 = nodes.nodes[1]
        path = os.pathsep.join([str(tmp_path / "shadow"), os.getcwd(), os.environ.get("PYTHONPATH", "")])
        nodes.nodes[1] = dataclasses.replace(n1, env=(("PYTHONPATH", path),))
        with NodeLaunch(_spec(run, SUM), nodes, join_timeout_s=120) as launch:
            end = launch.wait(deadline_s=300)
            why = launch.infrastructure()
    assert end.how == "refused", (end, why)
    assert why.startswith("refused before any comparison") and "node 1" in why and "transformers 9.9.9" in why, why
    assert not (run / "out").exists() or len(list((run / "out").glob("*.json"))) < 4


# SUM, and rank 3 (node 1) sends two files straight to the launch store as a buggy or hostile rank
# program could: a name that leaves the run folder, and a chunked file whose chunks never come.
SENDS_BAD_FILES = SUM + r"""
if r == 3:
    host, port = os.environ["HARNESS_LAUNCH_STORE"].rsplit(":", 1)
    s = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    for name, data in (("../../escape.json", b"{}"),
                       ("out/rank3.safetensors", b"\0harness-chunked\0" + b'{"gen": 7, "n": 2, "size": 5}')):
        s.set("f/" + name, data)
        s.append("idx/3", name + "\n")
    s.check(["idx/3"])
"""


def test_files_a_rank_sent_that_never_reached_the_run_folder_are_named_as_the_launchs(tmp_path):
    run = tmp_path / "coordinator"
    with netns_nodes(2) as nodes, NodeLaunch(_spec(run, SENDS_BAD_FILES), nodes, join_timeout_s=120) as launch:
        end = launch.wait(deadline_s=300)
        why = launch.infrastructure()
    assert end.ok, (end, why)
    assert sorted(p.name for p in (run / "out").glob("rank*.json")) == [f"rank{r}.json" for r in range(4)]
    assert not (tmp_path / "escape.json").exists() and not (run / "out" / "rank3.safetensors").exists()
    assert why.startswith("the launch store could not bring back 2 file(s): "), why
    assert "rank 3's out/rank3.safetensors: " in why and "escape.json" in why, why


def _namespaces() -> list[str]:
    import subprocess

    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def test_a_rendezvous_port_taken_meanwhile_is_retried_on_a_fresh_one(tmp_path, monkeypatch):
    # The port picked for the rendezvous was free when picked and taken before node 0's agent bound it
    # (another launch's socket, under pytest -n 2): the agents are restarted on a fresh port, not
    # reported as a hang of the model's. Here the first port is held by a bound, non-listening socket.
    # Driven by poll() alone, as a caller with its own loop does (CI saw such a caller get the first
    # attempt's failure while only wait() retried); wait() polls the same way.
    import socket
    import time

    from harness.launch import nodes as nodes_mod

    blocker = socket.socket()
    real = nodes_mod.ready.free_port
    picks = []

    def free_port(host="127.0.0.1"):
        if not picks:
            blocker.bind((host, 0))
            picks.append(blocker.getsockname()[1])
            return picks[-1]
        picks.append(real(host))
        return picks[-1]

    monkeypatch.setattr(nodes_mod.ready, "free_port", free_port)
    run = tmp_path / "coordinator"
    try:
        with netns_nodes(2) as nodes, NodeLaunch(_spec(run, SUM), nodes, join_timeout_s=60) as launch:
            t0 = time.monotonic()
            while launch.poll() is None and time.monotonic() - t0 < 300:
                time.sleep(0.2)
            assert launch.poll() == 0, (launch.infrastructure(), (run / "torchrun.log").read_text()[-1500:])
            assert launch._retries == 1 and len(picks) == 2, (launch._retries, picks)
            assert launch.endpoint.endswith(f":{picks[1]}")
    finally:
        blocker.close()


def test_a_multi_node_launch_killed_at_its_limit_leaves_nothing_on_any_node(tmp_path):
    # every rank loops in collectives; the launch is killed at its time limit: no process of it is left,
    # on this host or in node 1's namespace (whose processes are listed by `ip netns pids`)
    import subprocess

    run = tmp_path / "coordinator"
    with netns_nodes(2) as nodes, NodeLaunch(_spec(run, LOOP), nodes, join_timeout_s=120) as launch:
        t0 = time.monotonic()

        def progress():
            got = list((run / "in").glob("rank*.json")) if (run / "in").exists() else []
            return None if len(got) < 4 else "looping"  # then no change: killed on no progress after 3 s

        end = launch.wait(deadline_s=240, stall_s=3, startup_s=200, progress=progress)
        ns = nodes.nodes[1].prefix[3]
        left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        tokens = [g.token for g in launch.groups]
    assert end.how == "stalled" and time.monotonic() - t0 < 240, end
    assert left == [] and all(tree.marked(t) == [] for t in tokens), (left, tokens)


def test_a_node_set_whose_owner_was_killed_outright_is_swept_by_the_next(tmp_path):
    # SIGKILL runs no `finally`: the namespaces and bridge of a killed run used to stay forever
    import signal
    import subprocess
    import sys

    code = ("import sys, time\nfrom harness.launch.nodes import netns_nodes\n"
            "n = netns_nodes(2, tmp_root=sys.argv[1])\nprint(n.nodes[1].prefix[3], flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    ns = p.stdout.readline().strip()
    assert ns in _namespaces()
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert ns in _namespaces()  # left behind by the kill
    with netns_nodes(2, tmp_root=str(tmp_path)) as nodes:
        assert ns not in _namespaces() and nodes.nodes[1].prefix[3] in _namespaces()
    assert not list(tmp_path.glob("harness-nodes-*"))
