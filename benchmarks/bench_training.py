"""Benchmarks of the training check (issue #25). Run by hand; nothing here is asserted.

    .venv/bin/python benchmarks/bench_training.py sizes [--suite S ...]
        per suite: golden size and `golden generate` time without and with the training section,
        the section's size, and the training check's wall time per dtype beside the smoke check's
        (the issue's goal: the training check adds at most 2x to a suite's commit-scope run time).
    .venv/bin/python benchmarks/bench_training.py reruns [--reruns 10] [--seed0 1000] [--day0 DIR]
        false alarms over clean reruns: each rerun is a new weight seed (a new golden with its own
        training section and budgets, then the check in float32 and bfloat16), for every bundled
        suite and, with --day0, every Day-0 config `harness init` turns into a suite that builds.

Set HF_HUB_OFFLINE=1. Each mode prints one table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_precision import SUITES, day0_suites, load, variant  # noqa: E402


def _gen(ls, root: Path, training: bool = True) -> float:
    """Seconds of `golden generate` into ``root`` (training=False: without the training section)."""
    from harness.precision import backward, generate

    spec = backward.spec
    if not training:
        backward.spec = lambda ls: None
    try:
        t = time.perf_counter()
        generate.generate(ls, root=root)
        return time.perf_counter() - t
    finally:
        backward.spec = spec


def _run(ls, check: str, dtype: str, root: Path):
    """(failure or None, ctx, seconds) of one check on CPU."""
    from harness.backends import get
    from harness.checks import CheckContext, CheckFailure, CouldNotRun, registry

    ctx = CheckContext(ls, get("cpu"), dtype, check=check)
    t = time.perf_counter()
    try:
        if check == "training":
            from harness.checks.training import run_training

            run_training(ctx, golden_root=root)
        else:
            registry().get(check).run(ctx)
    except (CheckFailure, CouldNotRun) as f:
        return f, ctx, time.perf_counter() - t
    return None, ctx, time.perf_counter() - t


def _size(root: Path, name: str) -> tuple[int, int]:
    from harness.golden.store import current_dir

    d = current_dir(root / name)
    sec = d / "training.safetensors"
    return sum(f.stat().st_size for f in d.iterdir()) // 1024, (sec.stat().st_size // 1024 if sec.exists() else 0)


def mode_sizes(args):
    tmp = Path(tempfile.mkdtemp())
    print(f"{'suite':<16} {'golden KiB':>10} {'+training':>10} {'section':>8} {'gen s':>7} {'+training':>9} "
          f"{'dtype':<9} {'smoke s':>8} {'training s':>10}")
    for name in args.suite or SUITES:
        ls = load(name)
        g0 = _gen(ls, tmp / "without", training=False)
        g1 = _gen(ls, tmp / "with")
        s0, _ = _size(tmp / "without", name)
        s1, sec = _size(tmp / "with", name)
        for d in ("float32", "bfloat16"):
            _, _, ts = _run(ls, "smoke", d, tmp / "with")
            f, _, tt = _run(ls, "training", d, tmp / "with")
            print(f"{name:<16} {s0:>10} {s1:>10} {sec:>8} {g0:>7.1f} {g1:>9.1f} {d:<9} {ts:>8.2f} {tt:>10.2f}"
                  + (f"  FAILED: {f}" if f else ""), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


def mode_reruns(args):
    tmp = Path(tempfile.mkdtemp())
    suites = [] if args.day0_only else [load(n) for n in (args.suite or SUITES)]
    if args.day0:
        suites += day0_suites(Path(args.day0), tmp / "suites")
    print(f"{'suite':<34} {'dtype':<9} {'reruns':>6} {'false alarms':>12} {'worst backward use':>18} "
          f"{'worst trajectory use':>20}")
    total = 0
    for ls in suites:
        res = {d: [0, 0, 0.0, 0.0, []] for d in ("float32", "bfloat16")}
        for r in range(args.reruns):
            lsr = variant(ls, seed=args.seed0 + r)  # a new weight seed: a new model, a new golden
            root = tmp / f"{ls.name}-{r}"
            try:
                _gen(lsr, root)
            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                print(f"{ls.name}: golden not generated ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                break
            for d, acc in res.items():
                f, ctx, _ = _run(lsr, "training", d, root)
                p = dict(ctx.properties)
                acc[0] += 1
                if f is not None:
                    acc[1] += 1
                    acc[4].append(f"seed {args.seed0 + r}: {str(f).splitlines()[0][:200]}")
                acc[2] = max(acc[2], float(p.get("metric.training_backward_worst_budget_use", 0)))
                acc[3] = max(acc[3], float(p.get("metric.training_trajectory_worst_envelope_use", 0)))
            shutil.rmtree(root, ignore_errors=True)
        for d, (n, bad, wb, wt, msgs) in res.items():
            total += bad
            print(f"{ls.name:<34} {d:<9} {n:>6} {bad:>12} {wb:>18.2f} {wt:>20.2f}", flush=True)
            for m in msgs:
                print(f"    {m}")
    print(f"false alarms in total: {total}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["sizes", "reruns"])
    ap.add_argument("--suite", nargs="*", help="bundled suites (default: all six)")
    ap.add_argument("--reruns", type=int, default=10)
    ap.add_argument("--seed0", type=int, default=1000, help="first weight seed of the reruns")
    ap.add_argument("--day0", help="also the Day-0 corpus (tests/data/day0)")
    ap.add_argument("--day0-only", action="store_true", help="only the Day-0 corpus")
    args = ap.parse_args()
    {"sizes": mode_sizes, "reruns": mode_reruns}[args.mode](args)


if __name__ == "__main__":
    main()
