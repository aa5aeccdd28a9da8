"""False alarms of the checks judged against the float64 golden, over clean reruns with new weights.

For each suite (the bundled ones, and with ``--day0`` every config of tests/data/day0/ that
``harness init`` accepts) and each weight seed: the suite's ``checks.precision.seed`` set to the
seed (the golden, its budgets and every check build the same new weights), ``golden generate`` into
a scratch folder, then the clean checks ``precision``, ``training`` and ``decode`` (those installed
and enabled) on the CPU in float32 and bfloat16, in this process. A clean run must pass: every
failure printed is a false alarm (with its first line); "could not run" and skips are counted apart.

Usage: python benchmarks/bench_false_alarms.py [--seeds 10] [--day0 | --day0-only] [-k SUBSTRING] [--checks a,b]

Prints one row per suite x seed and the totals per check x dtype. Slow by design (a golden per
suite and seed): 6 suites x 10 seeds is about 20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DAY0 = REPO / "tests" / "data" / "day0"
CHECKS = ("precision", "training", "decode")
DTYPES = ("float32", "bfloat16")


def day0_suites(root: Path, k: str) -> list[Path]:
    """Suites ``harness init`` writes for the Day-0 configs (those it refuses are left out, as it says)."""
    out = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for cfg in sorted(DAY0.glob("*.json")):
        if k not in cfg.stem:
            continue
        name = cfg.stem.lower().replace("_", "-").replace(".", "-")
        r = subprocess.run([sys.executable, "-m", "harness", "init", str(cfg), "--suites-dir", str(root),
                            "--name", name], capture_output=True, text=True, env=env, cwd=REPO)
        if r.returncode == 0:
            out.append(root / f"{name}.toml")
        else:
            print(f"# {cfg.stem}: init refuses it: {(r.stderr or r.stdout).strip().splitlines()[-1][:120]}")
    return out


def run_seed(path: Path, seed: int, checks: tuple[str, ...], scratch: Path) -> dict[tuple[str, str], str]:
    """{(check, dtype): 'pass' | 'FAIL: ...' | 'error: ...' | 'skip'} for one suite and weight seed."""
    from harness.checks import CheckFailure, CouldNotRun, registry, run_one
    from harness.checks.outcomes import CheckOutcome
    from harness.precision.generate import generate
    from harness.suite.loader import load_suite

    ls = load_suite(path)
    ls.suite.checks.precision.seed = seed  # new weights: the golden and every check build them
    for other in ("training", "decode"):  # a section no asked-for check reads is not made (time)
        cfg = getattr(ls.suite.checks, other, None)
        if cfg is not None and other not in checks:
            cfg.enabled = False
    root = scratch / f"seed{seed}"
    generate(ls, root)
    os.environ["HARNESS_GOLDEN_DIR"] = str(root)
    known = set(registry().names())
    res = {}
    for check in checks:
        for dtype in DTYPES:
            if check not in known or not getattr(ls.suite.checks, check).enabled or dtype not in ls.suite.dtypes:
                res[(check, dtype)] = "skip"
                continue
            try:
                run_one(ls, check, "cpu", dtype)
                res[(check, dtype)] = "pass"
            except CheckFailure as e:
                res[(check, dtype)] = f"FAIL: {str(e).splitlines()[0][:160]}"
            except CouldNotRun as e:
                res[(check, dtype)] = f"error: {str(e).splitlines()[0][:160]}"
            except CheckOutcome as e:  # NotApplicable, KnownGap: no verdict
                res[(check, dtype)] = f"skip: {type(e).__name__}"
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10, help="weight seeds per suite (1..N; 0 is the committed golden's)")
    ap.add_argument("--day0", action="store_true", help="also the Day-0 corpus (tests/data/day0/) through harness init")
    ap.add_argument("--day0-only", action="store_true", help="only the Day-0 corpus, not the bundled suites")
    ap.add_argument("-k", default="", help="only suites whose name contains this")
    ap.add_argument("--checks", default=",".join(CHECKS), help="comma-separated checks")
    ap.add_argument("--shard", default="1/1", help="K/N: only every N-th suite from the K-th (run N processes)")
    args = ap.parse_args()
    k_shard, n_shard = (int(x) for x in args.shard.split("/"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    checks = tuple(c for c in args.checks.split(",") if c)
    scratch = Path(tempfile.mkdtemp(prefix="bench_false_alarms_"))
    suites = [p for p in sorted((REPO / "suites").glob("*.toml")) if args.k in p.stem]
    if args.day0_only:
        suites, args.day0 = [], True
    if args.day0:
        (scratch / "day0").mkdir()
        suites += day0_suites(scratch / "day0", args.k)
    suites = suites[k_shard - 1 :: n_shard]
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {len(suites)} suites, "
          f"seeds 1..{args.seeds}, checks {', '.join(checks)}")
    totals: Counter = Counter()
    t0 = time.perf_counter()
    for path in suites:
        for seed in range(1, args.seeds + 1):
            try:
                res = run_seed(path, seed, checks, scratch / path.stem)
            except Exception as e:  # noqa: BLE001 - a golden that cannot be made is reported, the rest go on
                print(f"{path.stem} seed {seed}: golden generate failed: {type(e).__name__}: {str(e)[:160]}")
                totals["golden_error"] += 1
                continue
            for (check, dtype), r in res.items():
                totals[(check, dtype, r.split(":")[0])] += 1
                if r != "pass" and r != "skip":
                    print(f"{path.stem} seed {seed} {check}[{dtype}]: {r}")
            print(f"{path.stem} seed {seed}: " + " ".join(f"{c}[{d}]={r.split(':')[0]}" for (c, d), r in res.items()),
                  flush=True)
    print(f"\ntotals ({time.perf_counter() - t0:.0f} s):")
    for key, n in sorted(totals.items(), key=str):
        print(f"  {key}: {n}")
    fails = sum(n for k, n in totals.items() if isinstance(k, tuple) and k[2] == "FAIL")
    print(f"false alarms: {fails}")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
