"""The launch layer's group kill on real process trees: at the time limit, on no progress, and when the
caller raises; the whole tree goes, a grandchild that escaped the session with setsid and a daemon
that double-forked away from its parent included."""

from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

from harness.launch import tree
from harness.launch.group import LaunchSpec, ProcessGroup, Rendezvous
from tests.launch.helpers import NAMES, TREE, still_alive, wait_pids


def _tree(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    return pids, [sys.executable, "-c", TREE, str(pids)]


def test_a_wait_long_after_the_start_gives_the_group_its_time_from_now(tmp_path):
    # an agent waited for at a run's end: its start was long ago, so a limit counted from the start is past
    # already and the first poll that finds it alive kills it (CI saw an agent that exited 0 a moment later
    # read as a timeout); ``within_s`` counts from the wait
    def late():
        g = ProcessGroup.start([sys.executable, "-c", "import time; time.sleep(1.5)"], tmp_path / f"run{time.monotonic_ns()}")
        time.sleep(1.0)
        return g
    assert late().wait(deadline_s=0.5).how == "timeout"
    end = late().wait(within_s=20)
    assert end.how == "exited" and end.ok, end
    assert late().wait(deadline_s=60, within_s=0.1).how == "timeout"  # the sooner of the two


def test_a_launch_killed_at_its_time_limit_leaves_no_process_behind(tmp_path):
    pids, cmd = _tree(tmp_path)
    g = ProcessGroup.start(cmd, tmp_path / "run")
    got = wait_pids(pids)
    assert got["root"] == g.pid
    # the escapes really escaped: the grandchild left the session, the daemon its parent
    assert os.getsid(got["setsid_grandchild"]) != os.getsid(g.pid) == g.pid
    assert psutil.Process(got["daemon"]).ppid() != got["root"]
    end = g.wait(within_s=1.0)
    assert end.how == "timeout" and end.code == -9, end
    assert still_alive(got.values()) == [], got
    assert {got[n] for n in NAMES if n != "root"} <= set(end.killed), (got, end.killed)
    assert tree.marked(g.token) == []
    assert "killed at its time limit with the" in g.describe() and "tree started" in g.describe()


def test_no_progress_kills_and_progress_keeps_it_running(tmp_path):
    pids, cmd = _tree(tmp_path)
    g = ProcessGroup.start(cmd, tmp_path / "run")
    got = wait_pids(pids)
    ticks = []

    def progress():  # moves for 1.5 s, then stops moving
        ticks.append(time.monotonic())
        return int((ticks[-1] - ticks[0]) * 10) if ticks[-1] - ticks[0] < 1.5 else "stuck"

    end = g.wait(stall_s=1.0, progress=progress)
    assert end.how == "stalled" and 2.3 < ticks[-1] - ticks[0] < 10, ticks[-1] - ticks[0]
    assert still_alive(got.values()) == []


def test_an_exception_in_the_caller_kills_the_tree_and_propagates(tmp_path):
    pids, cmd = _tree(tmp_path)
    g = ProcessGroup.start(cmd, tmp_path / "run")
    got = wait_pids(pids)

    def cancelled():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        g.wait(stall_s=60, progress=cancelled)
    assert g.ended.how == "cancelled" and still_alive(got.values()) == []


def test_a_group_that_ends_on_its_own_has_its_strays_swept(tmp_path):
    """The root exits 0 and leaves a setsid'd grandchild behind: the group's end takes it."""
    pids = tmp_path / "pids"
    pids.mkdir()
    code = ("import os, subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', \"import os, sys, time; os.setsid(); "
            "open(os.path.join(sys.argv[1], 'stray'), 'w').write(str(os.getpid())); time.sleep(600)\", sys.argv[1]])\n"
            "while not os.path.exists(os.path.join(sys.argv[1], 'stray')): time.sleep(0.02)\n")
    g = ProcessGroup.start([sys.executable, "-c", code, str(pids)], tmp_path / "run")
    end = g.wait(deadline_s=30)
    stray = int((pids / "stray").read_text())
    assert end.how == "exited" and end.code == 0 and end.killed == [stray]
    assert still_alive([stray]) == []


def test_rendezvous_arguments_one_node_now_c10d_nodes_later(tmp_path):
    spec = LaunchSpec(["-m", "x"], tmp_path, procs_per_node=4)
    cmd = spec.command()
    # torchrun's own log folder in the run folder (it left a torchelastic_* in /tmp per launch)
    assert cmd[cmd.index("torch.distributed.run") + 1:][:7] == ["--log-dir", str(tmp_path), "--standalone", "--nnodes",
                                                               "1", "--nproc-per-node", "4"]
    assert cmd[-4:] == ["harness.launch.rank", str(tmp_path), "-m", "x"] and spec.world == 4
    c10d = LaunchSpec(["-m", "x"], tmp_path, procs_per_node=8, nodes=2,
                      rdzv=Rendezvous("c10d", endpoint="node0:29400", run_id="nightly-7"))
    assert c10d.world == 16 and c10d.command()[5:13] == [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "nightly-7"]
    with pytest.raises(ValueError, match="standalone rendezvous is one node"):
        LaunchSpec(["x"], tmp_path, nodes=2).command()
    with pytest.raises(ValueError, match="needs an endpoint"):
        LaunchSpec(["x"], tmp_path, nodes=2, rdzv=Rendezvous("c10d")).command()
    raw = Rendezvous.from_text("--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 'h:1' --log-dir /var/log/t")
    assert LaunchSpec(["x"], tmp_path, nodes=2, rdzv=raw).command()[3:13] == [
        "--log-dir", str(tmp_path), "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
        "--log-dir", "/var/log/t"]  # the user's verbatim arguments come after harness's: theirs wins
