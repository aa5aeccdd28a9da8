"""Benchmark of ``harness compare``; prints its figures to stdout.

1. Scale: 100,000 test cases in 16 shard files (and a baseline of the same size) merged and
   compared, three runs in a row sharing one history file. Each run is a fresh process, so its
   wall time and peak RSS are those of one CI step. Goal: under 10 s and 1 GiB.
2. API calls per run against the local GitHub server (tests/compare/github_server.py), as a
   function of the number of regressed groups, for each phase of an issue's life. Goal: one call
   (the listing) when nothing changed; otherwise one listing plus at most three calls per changed
   group (a reopen: fetch, edit, comment), plus, when it creates, the listing again right before
   creating and one repository lookup.

Run: ``.venv/bin/python benchmarks/bench_compare.py [--cases N] [--shards K]``
"""

from __future__ import annotations

import argparse
import io
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.compare.pipeline import Options, run_compare  # noqa: E402
from tests.compare.github_server import TOKEN, GitHubServer  # noqa: E402
from tests.compare.junit_factory import item, write_junit  # noqa: E402

SUITES = ["kimi-k2", "deepseek-v3", "qwen3-8b", "qwen3-30b-a3b", "llama-3.1-8b", "mixtral-8x7b"]
BACKENDS = ["cpu", "cuda", "npu"]


def write_shards(folder: str, n: int, shards: int, seed: int, fail_rate: float) -> None:
    """pytest-shaped shards: harness properties, two metrics with a direction, one tolerance."""
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    per = -(-n // shards)
    for s in range(shards):
        rows = []
        for i in range(s * per, min(n, (s + 1) * per)):
            suite, backend = SUITES[i % len(SUITES)], BACKENDS[(i // len(SUITES)) % len(BACKENDS)]
            name = f"op_{i:06d}[{backend}-bfloat16]"
            err = 1e-4 * (1 + rng.random() * 0.05)
            props = (f'<property name="harness.suite" value="{suite}"/>'
                     '<property name="harness.check" value="ops"/>'
                     f'<property name="harness.backend" value="{backend}"/>'
                     '<property name="harness.dtype" value="bfloat16"/>'
                     '<property name="harness.device" value="cpu"/>'
                     f'<property name="metric.wall_time_s" value="{0.05 * (1 + rng.random() * 0.05)!r}"/>'
                     f'<property name="metric.max_abs_err" value="{err!r}"/>'
                     '<property name="tolerance.max_abs_err" value="0.01"/>')
            result = ""
            if rng.random() < fail_rate:
                result = ('<failure message="AssertionError: mismatch">Traceback (most recent call last):\n'
                          + "  frame\n" * 20 + "AssertionError: mismatch</failure>")
            rows.append(f'<testcase classname="suites.{suite}.toml" name="{name}" time="0.05">'
                        f"<properties>{props}</properties>{result}</testcase>")
        with open(os.path.join(folder, f"shard-{s:02d}.xml"), "w") as f:
            f.write('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
                    f'<testsuite name="pytest" tests="{len(rows)}">' + "\n".join(rows)
                    + "</testsuite></testsuites>")


_CHILD = """
import io, json, resource, sys, time
sys.path.insert(0, {root!r})
t = time.perf_counter()
from harness.compare.pipeline import Options, run_compare
o = run_compare(Options(results=[{cur!r}], baseline=[{base!r}], history={hist!r}, sink="file",
                        out_dir={out!r}, run_key={key!r}), out=io.StringIO())
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_SELF)
ch = resource.getrusage(resource.RUSAGE_CHILDREN)  # the baseline prefetch process, when used
print(json.dumps({{"wall": wall, "rss_mib": ru.ru_maxrss / 1024, "child_rss_mib": ch.ru_maxrss / 1024,
                  "cpu": ru.ru_utime + ru.ru_stime + ch.ru_utime + ch.ru_stime,
                  "cases": len(o.current.cases), "findings": len(o.classification.findings),
                  "groups": len(o.groups), "timings": o.timings}}))
"""


def scale(n: int, shards: int) -> None:
    import json
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        write_shards(f"{tmp}/base", n, shards, seed=1, fail_rate=0.0)
        write_shards(f"{tmp}/cur", n, shards, seed=2, fail_rate=0.001)
        size = sum(os.path.getsize(os.path.join(f"{tmp}/cur", f)) for f in os.listdir(f"{tmp}/cur"))
        print(f"generated {n:,} cases in {shards} shards ({size / 2**20:.0f} MiB per run) "
              f"in {time.perf_counter() - t:.1f} s")
        print(f"\n{'run':>4} {'wall s':>7} {'cpu s':>6} {'peak RSS MiB':>13} {'prefetch RSS':>13} {'read':>6} {'classify':>9} {'history':>8} "
              f"{'issues':>7} {'findings':>9} {'groups':>7}")
        for run in range(1, 4):
            code = _CHILD.format(root=ROOT, cur=f"{tmp}/cur", base=f"{tmp}/base", hist=f"{tmp}/h.sqlite",
                                 out=f"{tmp}/issues", key=f"run-{run}")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            d = json.loads(r.stdout.strip().splitlines()[-1])
            tm = d["timings"]
            print(f"{run:>4} {d['wall']:>7.2f} {d['cpu']:>6.2f} {d['rss_mib']:>13.0f} {d['child_rss_mib']:>13.0f} {tm['read']:>6.2f} "
                  f"{tm['classify'] - tm['read']:>9.2f} {tm['history'] - tm['classify']:>8.2f} "
                  f"{tm['issues'] - tm['history']:>7.2f} {d['findings']:>9} {d['groups']:>7}")
        print(f"history file after 3 runs: {os.path.getsize(f'{tmp}/h.sqlite') / 2**20:.0f} MiB "
              "(run 1 parses the baseline XML in a second process; runs 2-3 read it from the history's cache)")
        print(f"load average during the runs: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus "
              "(wall time includes waiting for other processes; cpu s does not)")


def api_calls(group_counts: list[int]) -> None:
    print(f"\n{'groups':>6} {'open':>5} {'steady':>7} {'update':>7} {'close':>6} {'reopen':>7} "
          f"{'bound 1+3G':>11}")
    for g in group_counts:
        with GitHubServer() as server, tempfile.TemporaryDirectory() as tmp:
            os.environ["GITHUB_TOKEN"], os.environ["GITHUB_REPOSITORY"] = TOKEN, "acme/models"
            suites = [f"suite-{i:03d}" for i in range(max(g, 1) + 3)]
            # "update": a second failing check of the same kind joins each regressed group
            clean = [item(s, c) for s in suites for c in ("smoke", "parallel")]
            bad = [item(s, "smoke", fail="x") if i < g else item(s, "smoke") for i, s in enumerate(suites)]
            bad += [item(s, "parallel") for s in suites]
            worse = [item(s, c, fail="x") if i < g else item(s, c) for i, s in enumerate(suites)
                     for c in ("smoke", "parallel")]
            base = write_junit(f"{tmp}/base.xml", clean)
            calls = {}
            for n, (phase, items) in enumerate([("open", bad), ("steady", bad), ("update", worse),
                                                ("clean1", clean), ("close", clean), ("reopen", bad)]):
                cur = write_junit(f"{tmp}/cur{n}.xml", items)
                o = run_compare(Options(results=[cur], baseline=[base], history=f"{tmp}/h.sqlite",
                                        sink="github", enterprise_url=server.url, run_key=f"r{n}",
                                        max_api_calls=10_000), out=io.StringIO())
                calls[phase] = o.api_calls
            print(f"{g:>6} {calls['open']:>5} {calls['steady']:>7} {calls['update']:>7} {calls['close']:>6} "
                  f"{calls['reopen']:>7} {1 + 3 * g:>11}")
    print("(open: the listing, the listing again right before creating, one repository lookup, one "
          "create per group; steady: the listing only)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=100_000)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--groups", default="0,1,5,20,50")
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    scale(args.cases, args.shards)
    api_calls([int(x) for x in args.groups.split(",")])


if __name__ == "__main__":
    main()
