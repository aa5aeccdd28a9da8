"""The cost of process isolation: the full default run (`harness run`, every bundled suite and
check on CPU) with items in the isolated worker against the same run in-process (`--no-isolate`),
side by side in one invocation.

Rounds alternate (isolated, in-process, isolated, ...) so that machine noise hits both alike; each
round is a fresh `harness run` subprocess, as a user runs it, timed from start to exit. Reports
every round, the medians and the ratio isolated / in-process (goal: at most 1.15x), and the
summed per-item wall times (which exclude collection and worker start-up) for the same ratio, and
the session's fixed cost: wall / item time of each mode (issue #30 item 5; goal: at most 1.3x with
``--check smoke``).

``--server`` adds two modes, the same runs through a warm ``harness server`` (harness/cli/server.py)
started for the benchmark's environment: every mode then alternates in each round, and the fixed
cost of each is printed the same way.

Usage: python benchmarks/bench_isolation.py [--rounds 2] [--check smoke] [--server] [SUITE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


ENV = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
HARNESS = str(Path(sys.executable).with_name("harness"))


def one(isolated: bool, args: argparse.Namespace, out: Path, server: bool = False) -> tuple[float, float, dict]:
    cmd = [HARNESS, "run", *args.suites, "--results", str(out)]
    cmd += [f"--check={c}" for c in args.check]
    if not isolated:
        cmd.append("--no-isolate")
    # Without the server: a variable it was not started with makes another key (no server used).
    env = ENV if server else ENV | {"HARNESS_BENCH_NO_SERVER": "1"}
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    summary = json.loads((out / "summary.json").read_text())
    items = sum(float(i["props"].get("metric.wall_time_s", 0.0)) for i in summary["items"])
    if r.returncode not in (0, 1):
        sys.exit(f"harness run failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return wall, items, summary["counts"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suites", nargs="*")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--check", action="append", default=[])
    p.add_argument("--server", action="store_true", help="also through a warm `harness server`")
    args = p.parse_args()
    modes = [(True, False), (False, False)] + ([(True, True), (False, True)] if args.server else [])
    res = {m: [] for m in modes}
    if args.server:
        subprocess.run([HARNESS, "server", "start"], cwd=REPO, env=ENV, check=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for isolated, server in modes if r % 2 == 0 else modes[::-1]:
                    wall, items, c = one(isolated, args, Path(tmp) / f"r{r}-{isolated}-{server}", server)
                    res[(isolated, server)].append((wall, items))
                    print(f"round {r} {'isolated  ' if isolated else 'in-process'}{' (server)' if server else ''}: "
                          f"{wall:7.2f} s wall, {items:7.2f} s in items, {c}", flush=True)
    finally:
        if args.server:
            subprocess.run([HARNESS, "server", "stop"], cwd=REPO, env=ENV)
    iw, ii = (statistics.median(x[k] for x in res[(True, False)]) for k in (0, 1))
    pw, pi = (statistics.median(x[k] for x in res[(False, False)]) for k in (0, 1))
    print(f"\nmedian wall: isolated {iw:.1f} s, in-process {pw:.1f} s -> ratio {iw / pw:.3f} (goal <= 1.15)")
    print(f"median item time: isolated {ii:.1f} s, in-process {pi:.1f} s -> ratio {ii / pi:.3f}")
    # The session's fixed cost (issue #30 item 5): the whole run against the items' own wall time
    # (each item's build, model work and first-use imports of its model code; goal: at most 1.3x).
    print(f"session / item time: isolated {iw / ii:.2f}x ({iw - ii:.1f} s fixed), "
          f"in-process {pw / pi:.2f}x ({pw - pi:.1f} s fixed)")
    for isolated in (True, False) if args.server else ():
        sw, si = (statistics.median(x[k] for x in res[(isolated, True)]) for k in (0, 1))
        print(f"through the server, {'isolated' if isolated else 'in-process'}: {sw:.2f} s wall, {si:.2f} s in "
              f"items -> {sw / si:.2f}x ({sw - si:.2f} s fixed); without it {(iw if isolated else pw):.2f} s")
    print(f"cpus: {os.cpu_count()}, load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
