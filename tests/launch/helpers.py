"""Helpers for the launch tests: a process tree that tries to outlive its launch, and a look at what of
it is still alive."""

from __future__ import annotations

import time
from pathlib import Path

from harness.launch.tree import alive

# The root starts a child in its session, a grandchild that calls setsid (out of the session: killpg
# misses it), and a daemon that double-forks out of the session and away from its parent (re-parented
# to init: no parent link leads to it; only the launch's marker does). Every process writes its pid to
# PIDS (one file each) and sleeps.
TREE = r"""
import os, subprocess, sys, time
pids = sys.argv[1]
def note(name):
    with open(os.path.join(pids, name), "w") as f:
        f.write(str(os.getpid()))
note("root")
code = "import os, sys, time\nwith open(os.path.join(sys.argv[1], sys.argv[2]), 'w') as f: f.write(str(os.getpid()))\ntime.sleep(600)"
subprocess.Popen([sys.executable, "-c", code, pids, "child"])
subprocess.Popen([sys.executable, "-c", "import os; os.setsid()\n" + code, pids, "setsid_grandchild"])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", code, pids, "daemon"])
    os._exit(0)
print("tree started", flush=True)
time.sleep(600)
"""
NAMES = ("root", "child", "setsid_grandchild", "daemon")


def wait_pids(d: Path, names=NAMES, timeout_s: float = 20.0) -> dict[str, int]:
    """name -> pid, once every process of the tree wrote its file."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = {n: (d / n).read_text() for n in names if (d / n).exists()}
        if len(got) == len(names) and all(got.values()):
            return {n: int(v) for n, v in got.items()}
        time.sleep(0.05)
    raise AssertionError(f"the tree did not start: {sorted(p.name for p in d.iterdir())}")


def still_alive(pids) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if alive(psutil.Process(pid)):
                out.append(pid)
        except psutil.Error:
            pass
    return out
