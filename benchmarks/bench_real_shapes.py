"""Cost and false alarms of the real-shape checks (issue #47): ``shapes`` (the unpruned model's operator
signatures at their published shapes), ``longctx`` (prefill and cached decode at 4096 positions) and
``width`` (one decoder layer of each kind at the published widths), each against float64.

For each bundled suite x dtype x check: ``--reruns`` clean runs on ``--backend`` in this process
(``shapes`` is opt-in: enabled here with the suite's own settings), each timed. A clean run must pass:
every failure is a false alarm, printed with its first line; a check that is not applicable (a suite
already at its published widths) is counted apart. The first run of ``shapes`` traces the unpruned
model on meta into an empty cache (its cold cost); later runs read the trace back. ``identical``
says whether every rerun recorded the same metric values (on the CPU they are bit-identical: same
seeds, same kernels, same thread count; a difference there is itself a finding). ``shapes`` also
reports its coverage (signatures checked / signatures the model runs; forward and all).

Usage: python benchmarks/bench_real_shapes.py [--reruns 10] [--backend cpu] [--dtypes float32,bfloat16]
       [--checks shapes,longctx,width] [-k SUBSTRING] [--minutes 20] [--json out.json]

``--minutes`` starts no run past that wall time (the table says how many ran per row; rows not
started say so).
``--backend testdev`` (harness's PrivateUse1 test device: another arithmetic order through its own
kernels and a CPU fallback) declares the device from testdev/ in a child process, as
tests/testdev/ does, with no install into the environment.
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
CHECKS = ("shapes", "longctx", "width")
DTYPES = ("float32", "bfloat16")
HEADLINE = {"shapes": "shapes_worst_budget_ratio", "longctx": "longctx_worst_budget_use",
            "width": "width_worst_budget_use"}


def one(ls, check: str, backend: str, dtype: str) -> tuple[str, dict, float]:
    """('pass' | 'FAIL: ...' | 'error: ...' | 'n/a: ...', metric properties, seconds) of one run."""
    from harness.checks import CheckFailure, CouldNotRun, run_one
    from harness.checks.outcomes import CheckOutcome

    t = time.perf_counter()
    try:
        props = dict(run_one(ls, check, backend, dtype).properties)
        res = "pass"
    except CheckFailure as e:
        props, res = {}, f"FAIL: {str(e).splitlines()[0][:200]}"
    except CouldNotRun as e:
        props, res = {}, f"error: {str(e).splitlines()[0][:200]}"
    except CheckOutcome as e:  # NotApplicable, KnownGap: no verdict
        props, res = {}, f"n/a: {str(e).splitlines()[0][:120]}"
    metrics = {k.removeprefix("metric."): v for k, v in props.items() if k.startswith("metric.")}
    return res, metrics, time.perf_counter() - t


def bench(args) -> list[dict]:
    from harness.suite.loader import load_suite

    suites = [p for p in sorted((REPO / "suites").glob("*.toml")) if args.k in p.stem]
    checks = [c for c in args.checks.split(",") if c]
    dtypes = [d for d in args.dtypes.split(",") if d]
    deadline = time.monotonic() + args.minutes * 60
    rows = []
    for path in suites:
        ls = load_suite(path)
        ls.suite.checks.shapes.enabled = True  # opt-in in the bundled suites: their own settings otherwise
        for check in checks:
            for dtype in dtypes:
                if dtype not in ls.suite.dtypes:
                    continue
                row = {"suite": path.stem, "check": check, "dtype": dtype, "backend": args.backend,
                       "results": [], "seconds": [], "metrics": []}
                for i in range(args.reruns):
                    if time.monotonic() > deadline:
                        break
                    res, m, s = one(ls, check, args.backend, dtype)
                    row["results"].append(res)
                    row["seconds"].append(round(s, 2))
                    row["metrics"].append(m)
                    if res.startswith(("FAIL", "error")):
                        print(f"{path.stem} {check}[{args.backend}-{dtype}] run {i + 1}: {res}", flush=True)
                    if res.startswith("n/a"):
                        break  # the same reason every time
                if not row["results"]:
                    print(f"| {path.stem} | {check} | {dtype} | 0 | - | - | - | - | - | not run: past --minutes |")
                    continue
                rows.append(row)
                print(line(row), flush=True)
    return rows


def line(row: dict) -> str:
    res, secs, ms = row["results"], row["seconds"], row["metrics"]
    if res and res[0].startswith("n/a"):
        return f"| {row['suite']} | {row['check']} | {row['dtype']} | - | - | - | - | - | {res[0][5:90]} |"
    fails = sum(r.startswith(("FAIL", "error")) for r in res)
    identical = "yes" if all(m == ms[0] for m in ms) else "no"
    warm = statistics.median(secs[1:]) if len(secs) > 1 else secs[0]
    worst = max((float(m.get(HEADLINE[row["check"]], 0)) for m in ms), default=0.0)
    cov = ""
    if row["check"] == "shapes" and ms and ms[0]:
        m = ms[0]
        cov = (f"{float(m['shapes_forward_coverage']):.1%} fw, {float(m['shapes_coverage']):.1%} all "
               f"({int(float(m['shapes_checked']))}/{int(float(m['shapes_signatures']))})")
    return (f"| {row['suite']} | {row['check']} | {row['dtype']} | {len(res)} | {fails} | {secs[0]:.1f} | "
            f"{warm:.1f} | {identical} | {worst:.3g} | {cov} |")


HEADER = ("| suite | check | dtype | runs | false alarms | first s | median s | identical | worst / budget | "
          "coverage (shapes) |\n|---|---|---|---|---|---|---|---|---|---|")


def testdev_env(meta: Path) -> dict[str, str]:
    """This environment plus the test device declared (its dist-info from testdev/pyproject.toml)."""
    sys.path.insert(0, str(REPO / "tests" / "testdev"))
    from testdev_support import declare, device_env

    declare(meta)
    return device_env(meta)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reruns", type=int, default=10, help="clean runs per suite x check x dtype")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("-k", default="", help="only suites whose name contains this")
    ap.add_argument("--minutes", type=float, default=float("inf"), help="start no rerun past this wall time")
    ap.add_argument("--json", type=Path, help="also write every run's result, seconds and metrics here")
    args = ap.parse_args()
    if args.reruns < 1:
        ap.error("--reruns must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.backend == "testdev" and not os.environ.get("BENCH_TESTDEV_DECLARED"):
        with tempfile.TemporaryDirectory(prefix="bench_real_shapes_") as meta:
            env = {**testdev_env(Path(meta)), "BENCH_TESTDEV_DECLARED": "1"}
            return subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env, cwd=REPO).returncode
    # an empty signature cache: the first shapes run pays the meta trace, as a fresh nightly machine does
    os.environ["HARNESS_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_real_shapes_cache_")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; backend {args.backend}, "
          f"up to {args.reruns} reruns\n{HEADER}", flush=True)
    t0 = time.perf_counter()
    rows = bench(args)
    runs = sum(len(r["results"]) for r in rows if not r["results"][0].startswith("n/a"))
    fails = sum(x.startswith(("FAIL", "error")) for r in rows for x in r["results"])
    print(f"\n{runs} clean runs, {fails} false alarms, {time.perf_counter() - t0:.0f} s; "
          f"load average at end: {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
