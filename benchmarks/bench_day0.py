"""Day-0 corpus (tests/data/day0/): wall time and peak memory of each step a new user runs, per model.

For every config: ``harness init`` (into a scratch project's --suites-dir), ``harness golden generate``
and ``harness run --backend cpu --dtype float32 --dtype bfloat16``, each in its own process, as from
a shell; then the same ``run`` again ("run (warm)"). Each config gets its own, empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` in its scratch folder), so ``run`` is what a new user's first run costs
(cold: inductor's code generation and C++ builds of every compiled graph) and "run (warm)" what every
later run costs where the cache is kept (a workstation; ci.yml's actions/cache entry).
``--shared-cache`` uses the machine's default cache instead (figures before 2026-12-04 were taken
that way: warm wherever the test suite had compiled the same config before). Time is wall clock including interpreter start; memory is the process's peak RSS
(``wait4``'s ``ru_maxrss``). Goal: each step under 60 s and 2 GiB. A config that init refuses shows
its one-line reason instead.

Usage: python benchmarks/bench_day0.py [-k SUBSTRING] [--keep DIR] [--steps init,golden,run,warm]
       [--shared-cache] [--workers N|auto]

Also prints the machine's load average at start and end: on a shared machine the times scale with it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DAY0 = REPO / "tests" / "data" / "day0"
GOAL_S, GOAL_BYTES = 60.0, 2 * 1024**3


def step(args: list[str], cwd: Path, extra_env: dict[str, str], log_name: str) -> tuple[int, float, float, int, str]:
    """(exit status, wall seconds, CPU seconds, peak RSS bytes, last output line) of one harness
    command. CPU seconds (user + system, the command and the workers it reaped) are the fairer figure
    on a shared machine, where wall time scales with the load."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(cwd / "harness.toml"), **extra_env}
    log = cwd / f"{log_name}.log"
    t = time.perf_counter()
    with log.open("w") as f:
        p = subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, stdout=f,
                             stderr=subprocess.STDOUT)
        # wait4 (not p.wait) to get this child's own rusage: ru_maxrss is its peak RSS in KiB
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    rc = os.waitstatus_to_exitcode(status)
    lines = [x for x in log.read_text().splitlines() if x.strip() and not x.startswith("[transformers]")]
    cpu = usage.ru_utime + usage.ru_stime
    return rc, wall, cpu, usage.ru_maxrss * 1024, (lines[-1] if lines else "")


def run_one(config: Path, root: Path, steps: tuple[str, ...] = ("init", "golden", "run", "warm"),
            shared_cache: bool = False, workers: str | None = None) -> list[str]:
    work = root / config.stem
    work.mkdir(parents=True)
    (work / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\nresults_dir = "results"\n')
    name = config.stem.lower()
    rows = []
    env = {} if shared_cache else {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache")}
    run = ["run", name, "--backend", "cpu", "--dtype", "float32", "--dtype", "bfloat16"]
    run += ["--workers", workers] if workers else []
    for label, args in (("init", ["init", str(config), "--suites-dir", "new", "--name", name]),
                        ("golden", ["golden", "generate", name]),
                        ("run", run), ("warm", [*run, "--results", "results-warm"])):
        if label not in steps:
            break
        rc, wall, cpu, rss, last = step(args, work, env, label)
        label = "run (warm)" if label == "warm" else label
        ok = "ok" if rc == 0 else ("refused" if label == "init" and rc == 2 else f"rc={rc}")
        goal = "" if wall < GOAL_S and rss < GOAL_BYTES else " OVER GOAL"
        rows.append(f"| {config.stem} | {label} | {wall:6.1f} | {cpu:6.1f} | {rss / 2**20:6.0f} | {ok}{goal} | "
                    f"{last[:110] if rc else ''} |")
        if rc != 0:
            break
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only configs whose file name contains this")
    ap.add_argument("--keep", help="scratch directory to keep (default: a temporary one, removed)")
    ap.add_argument("--steps", default="init,golden,run,warm", help="comma-separated prefix of init,golden,run,warm")
    ap.add_argument("--shared-cache", action="store_true", help="the machine's inductor cache, not an empty one "
                    "per config")
    ap.add_argument("--workers", "-n", help="pass --workers to run (a number or 'auto'): the items spread over the "
                    "cores; default: one isolated worker, as `harness run` does")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_day0_"))
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| model | step | wall s | CPU s | peak RSS MiB | outcome | detail |")
    print("|---|---|---:|---:|---:|---|---|")
    try:
        for config in sorted(DAY0.glob("*.json")):
            if args.k in config.name:
                for row in run_one(config, root, tuple(args.steps.split(",")), args.shared_cache,
                                   args.workers):
                    print(row, flush=True)
    finally:
        print(f"load average at end: {os.getloadavg()[0]:.1f}")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
