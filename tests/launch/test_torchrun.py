"""torchrun through the launch layer, on real ranks: a rank's crash reported with its signal and log
tail, a launch whose parent is killed takes its ranks with it, and the comm check's ranks hung in a
collective no longer outlive its time limit (they did: the timeout killed torchrun only, and torchrun
puts each rank in a session of its own)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from harness.backends import get
from harness.checks import CheckContext, CouldNotRun, registry
from harness.launch.group import LaunchSpec, torchrun
from harness.suite.loader import load_suite
from tests.launch.helpers import still_alive
from tests_support import TINY_PRUNE

# rank 1 says where it is and aborts; rank 0 waits (as for a collective) until torchrun stops it.
CRASH = ("import os, sys, time\n"
         "if os.environ['RANK'] == '1':\n"
         "    print('rank 1: entering the fused kernel', flush=True); os.abort()\n"
         "print('rank 0: waiting for rank 1', flush=True); time.sleep(600)\n")


def test_a_ranks_crash_is_reported_with_its_signal_and_log_tail(tmp_path):
    g = torchrun(LaunchSpec(["-c", CRASH], tmp_path, procs_per_node=2))
    end = g.wait(deadline_s=120)
    assert end.how == "exited" and end.code != 0, (end, g.describe())
    exits = g.exits()
    assert exits[1]["signal"] == "SIGABRT" and not exits[1]["stopped_by_launcher"], exits
    assert exits[0]["stopped_by_launcher"] == "SIGTERM", exits  # torchrun stopping the survivor
    fails = g.failures()
    assert fails[0] == "rank 1 killed by SIGABRT: rank 1: entering the fused kernel", fails
    assert fails[1].startswith("rank 0 killed by SIGTERM: rank 0: waiting for rank 1 (stopped by the launcher"), fails
    assert g.describe().startswith("exited with code 1: rank 1 killed by SIGABRT"), g.describe()


# An "item": starts a 2-rank launch whose ranks sleep, prints the ranks' pids, waits to be killed.
ITEM = r"""
import json, os, sys, time
from pathlib import Path
from harness.launch.group import LaunchSpec, torchrun
run = Path(sys.argv[1])
g = torchrun(LaunchSpec(["-c", "import time; time.sleep(600)"], run, procs_per_node=2))
import psutil
while True:
    ranks = [p for p in psutil.Process(g.pid).children(recursive=True) if "time.sleep(600)" in " ".join(p.cmdline())]
    if len(ranks) == 4:  # two wrappers, two ranks
        print(json.dumps([g.pid] + [p.pid for p in ranks]), flush=True)
        break
    time.sleep(0.1)
time.sleep(600)
"""


def test_a_launch_dies_with_the_item_that_started_it(tmp_path):
    item = subprocess.Popen([sys.executable, "-c", ITEM, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        pids = json.loads(item.stdout.readline())
        assert len(pids) == 5 and still_alive(pids) == pids
        item.send_signal(signal.SIGKILL)  # what the isolation does to an item at its time limit
        item.wait()
        deadline = time.monotonic() + 15
        while still_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert still_alive(pids) == []  # torchrun, the wrappers and the ranks in their own sessions
    finally:
        item.kill()


COMM = """
[model]
config = "configs/Llama-3.1-8B.json"
{prune}
[checks.comm]
enabled = true
scope = "commit"
collectives = ["all_reduce"]
sizes = [4096]
warmup = 1
repeats = 3
timeout_s = 15
"""


def _comm_ranks(mark: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            # a rank itself, not torchrun or a wrapper (whose command lines name it too)
            if p.environ().get("LAUNCH_TEST_MARK") == mark and p.cmdline()[1:3] == ["-m", "harness.perf.comm"]:
                out.append(p)
        except psutil.Error:
            pass
    return out


def test_the_comm_checks_ranks_do_not_outlive_its_time_limit(write_suite, tmp_path, monkeypatch):
    # The planted hang: every rank sleeps 600 s inside its first all_reduce's timing (the check's delay
    # option); the ranks' environment carries a mark of this test, so only its ranks are counted.
    mark = uuid.uuid4().hex
    monkeypatch.setenv("LAUNCH_TEST_MARK", mark)
    ls = load_suite(write_suite("commhang", COMM.format(prune=TINY_PRUNE)))
    seen: set[int] = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(p.pid for p in _comm_ranks(mark))
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    ctx = CheckContext(ls, get("cpu"), "float32", "w2", check="comm")
    t0 = time.monotonic()
    try:
        with pytest.raises(CouldNotRun) as e:
            registry().get("comm").run(ctx, results_dir=tmp_path / "results", golden_root=tmp_path / "golden",
                                       delay={"all_reduce": 600.0})
    finally:
        stop.set()
        t.join()
    assert time.monotonic() - t0 < 40
    msg = str(e.value)
    assert "did not finish in 15 s" in msg and "killed at its time limit with the" in msg, msg
    assert len(seen) == 2, seen  # both ranks ran (and were seen alive) before the limit
    assert still_alive(seen) == [] and _comm_ranks(mark) == []
