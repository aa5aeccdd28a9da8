"""Benchmarks of the ``ops`` check with realistic inputs (issue #11, item 5). Run by hand; nothing here
is asserted.

    .venv/bin/python benchmarks/bench_ops.py time [--suite qwen3-30b-a3b] [--dtype float32 bfloat16]
        every ops item of one suite on the CPU, in process, with the bare inputs (``[checks.ops]
        realistic = false``: the bare-initialisation trace and the generic kinds, what the check did
        before) and with the realistic ones (the golden's numerics gains in the trace, the
        statistics-drawn kinds added), interleaved in one run (best of ``--repeat``): wall time of
        each (including the trace and, where there is no golden, the calibration), the ratio, cases
        and outcomes.
    .venv/bin/python benchmarks/bench_ops.py count [--suite S ...]
        the number of ops items (variants: the union of the suite dtypes' traced ops) of every bundled
        suite with the bare and the realistic trace.

Set HF_HUB_OFFLINE=1. A fresh trace cache is used (``HARNESS_CACHE_DIR`` in a temporary directory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITES = ["deepseek-v3", "kimi-k2", "llama-3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-8b"]


def load(name: str, realistic: bool):
    """The bundled suite (same path, so the golden's config hash still matches) with the ops check on
    and ``realistic`` set (no file written)."""
    from harness.suite.loader import load_suite

    ls = load_suite(REPO / "suites" / f"{name}.toml")
    s = ls.suite.model_copy(deep=True)
    s.checks.ops.enabled = True
    s.checks.ops.realistic = realistic
    return type(ls)(ls.path, ls.name, s, ls.config_path, ls.raw_config)


def run_all(ls, dtypes: list[str]) -> dict:
    from harness.checks import CheckFailure, NotApplicable, registry, run_one

    check = registry().get("ops")
    t = time.perf_counter()
    ops = check.variants(ls, None)
    t_variants = time.perf_counter() - t
    out = {"items": 0, "passed": 0, "failed": [], "not_applicable": 0, "cases": 0}
    for dtype in dtypes:
        for op in ops:
            out["items"] += 1
            try:
                ctx = run_one(ls, "ops", "cpu", dtype, op)
            except NotApplicable:
                out["not_applicable"] += 1
                continue
            except CheckFailure as f:
                out["failed"].append(f"{dtype} {op}: {str(f)[:160]}")
                continue
            out["passed"] += 1
            out["cases"] += int(float(dict(ctx.properties)["metric.op_cases"]))
    out["wall_s"] = time.perf_counter() - t
    out["variants_s"] = t_variants
    return out


def cmd_time(args) -> None:
    from harness.inspect import trace

    runs = {False: [], True: []}
    for _ in range(args.repeat):  # interleaved, each with cold in-process traces (the first pays imports)
        for realistic in (False, True):
            trace._REAL.clear()
            trace._CALIBRATED.clear()
            runs[realistic].append(run_all(load(args.suite, realistic), args.dtype))
    rows = {r: min(rs, key=lambda x: x["wall_s"]) for r, rs in runs.items()}
    print(f"ops check, {args.suite}, cpu, {' + '.join(args.dtype)} (in process; best of {args.repeat} "
          f"interleaved rounds, in-process traces cold each round): all rounds bare "
          f"{[round(r['wall_s'], 1) for r in runs[False]]} s, realistic {[round(r['wall_s'], 1) for r in runs[True]]} s")
    print(f"{'inputs':<10} {'items':>5} {'passed':>6} {'failed':>6} {'n/a':>4} {'cases':>6} {'wall s':>7} "
          f"{'of it trace+collect s':>22}")
    for realistic, r in rows.items():
        print(f"{'realistic' if realistic else 'bare':<10} {r['items']:>5} {r['passed']:>6} {len(r['failed']):>6} "
              f"{r['not_applicable']:>4} {r['cases']:>6} {r['wall_s']:>7.1f} {r['variants_s']:>22.1f}")
        for f in r["failed"]:
            print("   FAILED", f)
    paired = sorted(t["wall_s"] / b["wall_s"] for b, t in zip(runs[False], runs[True], strict=True))
    print(f"ratio realistic/bare: {rows[True]['wall_s'] / rows[False]['wall_s']:.2f}x wall (best vs best); "
          f"per round {', '.join(f'{x:.2f}x' for x in paired)} (median {statistics.median(paired):.2f}x); "
          f"{rows[True]['cases'] / max(rows[False]['cases'], 1):.2f}x cases")


def cmd_count(args) -> None:
    from harness.checks import registry

    check = registry().get("ops")
    total = {False: 0, True: 0}
    print(f"{'suite':<15} {'bare':>5} {'realistic':>9}  differing ops")
    for name in args.suite:
        v = {r: set(check.variants(load(name, r), None)) for r in (False, True)}
        for r in v:
            total[r] += len(v[r])
        diff = sorted(v[False] ^ v[True])
        print(f"{name:<15} {len(v[False]):>5} {len(v[True]):>9}  {', '.join(diff) or '-'}")
    print(f"{'total':<15} {total[False]:>5} {total[True]:>9}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time")
    t.add_argument("--suite", default="qwen3-30b-a3b")
    t.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    t.add_argument("--repeat", type=int, default=3)
    c = sub.add_parser("count")
    c.add_argument("--suite", nargs="+", default=SUITES)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        os.environ["HARNESS_CACHE_DIR"] = d
        {"time": cmd_time, "count": cmd_count}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
