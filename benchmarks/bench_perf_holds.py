"""Perf false alarms on a shared machine: the rule before and after issue #51's holds, side by side.

Baseline processes (``--baseline-runs``, each a child process running the perf check clean) are taken
twice with `harness baseline update`'s code: the first process alone (a *thin* baseline, as one
nightly run gives) and all of them pooled. Then ``--clean`` clean trials and ``--slow`` trials with
every Linear 20% slower (bench_perf_detection.py's injection: busy work for 20% of each layer's own
CPU time) run in child processes (``--per-child`` trials each), and every trial's samples are judged
against both baselines by both rules, from the same samples:

* **old**: threshold + one-sided Mann-Whitney on the calibrated samples (decide() without holds);
* **new**: the same, then held as ``noisy`` when the raw samples disagree (raw median not slower, or
  raw p >= 0.5) or the calibration kernel's spread exceeds the threshold with a raw change within it,
  and as ``thin-baseline`` against a one-process baseline for a change within ``thin_margin`` (25%).

A trial counts as an alarm when any timed metric is a regression by the rule (its first decision:
the check re-measures a suspected regression once more before failing, which cannot be replayed
offline; the check's own final verdict against the pooled baseline is reported beside it).

Usage: python benchmarks/bench_perf_holds.py [--suite llama-3.1-8b] [--clean 20] [--slow 20]
       [--baseline-runs 3] [--per-child 5] [--phases prefill,decode]

Figures (this 2-core machine shared with other engineers' jobs, load 10-13; 2026-12-05, suite
llama-3.1-8b, phases prefill + decode; `--clean 6 --slow 4 --baseline-runs 2 --per-child 2`, 10.7 min:
a short run, the >= 20 reruns the issue asks for are still to be measured). Trials with an alarm on
any timed metric (first decision, before the check's re-measurement):

    rule / baseline        false alarms (clean)   detected (20% of every Linear)
    old, one process       1 of 6                 4 of 4
    new, one process       0 of 6                 2 of 4   (thin: prefill +19-21% held, within 25%)
    old, 2 pooled          1 of 6                 4 of 4
    new, 2 pooled          1 of 6                 4 of 4   (the clean alarm: decode, raw slower too)
    the check, 2 pooled    0 of 6                 4 of 4   (new rule, confirmed on re-measure)

In this run no clean trial had a raw time faster than the baseline with a slower calibrated one (the
issue's 7 of 8), so the raw hold did not fire; the thin hold removed the one-process false alarm and,
by design, 20% slowdowns that a one-process baseline cannot separate from another process's level.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _detection():
    """bench_perf_detection.py's child side (its injection, its check run), loaded by path."""
    spec = importlib.util.spec_from_file_location("bench_perf_detection", REPO / "benchmarks" /
                                                  "bench_perf_detection.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    det = _detection()
    ls = det._suite(spec)
    out = []
    for i, share in enumerate(spec["levels"]):
        res = Path(spec["results"]) / f"t{i}"
        r = det._run_check(ls, {}, res, Path(spec["golden"]), share)
        out.append({"share": share, "results": str(res), "outcome": r["outcome"],
                    "confirmed": sorted(m for m, d in r["verdict"].get("metrics", {}).items()
                                        if d.get("verdict") == "regression")})
    Path(spec["out"]).write_text(json.dumps(out))


def spawn(spec: dict, work: Path, name: str) -> list[dict]:
    spec = dict(spec, out=str(work / f"{name}.out.json"))
    p = work / f"{name}.spec.json"
    p.write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, __file__, "--child", str(p)], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"child {name} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(Path(spec["out"]).read_text())


def judge(results: str, golden: Path, new: bool) -> set[str]:
    """Timed metrics of one trial that are regressions by the old or the new rule (first decision)."""
    from harness import metrics
    from harness.checks.perf import PerfConfig  # declares the perf metrics (their directions)
    from harness.perf import baseline as store
    from harness.perf import calibrate as calib
    from harness.perf.decide import decide
    from harness.perf.measure import PHASE_OF, samples_key

    cfg = PerfConfig()
    ((_, rec),) = store.read_sidecars(results)
    base, why = store.find_baseline(rec["suite"], rec["key"], rec["fingerprint"], golden)
    assert base is not None, why
    cal, bcal = rec["calibration"], base["calibration"]
    clock = cal.get("clock", "wall")
    bad = set()
    for m in PHASE_OF:
        k = samples_key(clock, m)
        if k not in rec["samples"]:
            continue
        args = (m, cal, bcal, rec.get("reference"), base.get("reference"), clock)
        kw = dict(kernel_spread=calib.kernel_spread(*args), baseline_runs=store.runs(base),
                  thin_margin=cfg.thin_margin) if new else {}
        d = decide(m, rec["samples"][k], base["samples"][k], direction=metrics.direction(m),
                   threshold=cfg.thresholds.get(m, cfg.threshold), alpha=cfg.alpha,
                   kernel_ratio=calib.kernel_ratio(*args), **kw)
        if d.verdict == "regression":
            bad.add(m)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--suite", default="llama-3.1-8b")
    ap.add_argument("--clean", type=int, default=20)
    ap.add_argument("--slow", type=int, default=20, help="trials with every Linear 20%% slower")
    ap.add_argument("--baseline-runs", type=int, default=3)
    ap.add_argument("--per-child", type=int, default=5)
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return 0
    from harness.perf import baseline as store

    t0 = time.perf_counter()
    work = REPO / "results" / "bench-perf-holds"
    work.mkdir(parents=True, exist_ok=True)
    base = {"suite": a.suite, "phases": a.phases.split(",")}
    dirs = []
    for b in range(a.baseline_runs):  # one process each: the check's own run writes the sidecar
        spawn({**base, "levels": [0.0], "results": str(work / f"base-{b}"), "golden": str(work / "none")},
              work, f"base-{b}")
        dirs.append(str(work / f"base-{b}" / "t0"))
    thin, pooled = work / "golden-thin", work / "golden-pooled"
    store.update(dirs[:1], thin)
    store.update(dirs, pooled)
    plan = [0.0] * a.clean + [0.2] * a.slow
    random.Random(a.seed).shuffle(plan)
    trials = []
    for ci in range(0, len(plan), a.per_child):
        got = spawn({**base, "levels": plan[ci:ci + a.per_child], "results": str(work / f"trials-{ci}"),
                     "golden": str(pooled)}, work, f"trials-{ci}")
        for t in got:
            t["judged"] = {f"{rule} {name}": sorted(judge(t["results"], g, rule == "new"))
                           for rule in ("old", "new") for name, g in (("thin", thin), ("pooled", pooled))}
        trials += got
        print(f"[{time.perf_counter() - t0:5.0f} s] {len(trials)}/{len(plan)}", flush=True)
    (work / "trials.json").write_text(json.dumps(trials, indent=1))
    report(trials, time.perf_counter() - t0)
    return 0


def report(trials: list[dict], seconds: float) -> None:
    clean = [t for t in trials if t["share"] == 0]
    slow = [t for t in trials if t["share"] > 0]
    print(f"\n{len(clean)} clean, {len(slow)} at 20%, {seconds / 60:.1f} min")
    print(f"{'rule / baseline':<16} {'false alarms (clean)':>22} {'detected (20%)':>16}")
    for col in ("old thin", "new thin", "old pooled", "new pooled"):
        fa = sum(bool(t["judged"][col]) for t in clean)
        det = sum(bool(t["judged"][col]) for t in slow)
        print(f"{col:<16} {fa:>14} of {len(clean):<5} {det:>8} of {len(slow):<5}")
    fa = sum(bool(t["confirmed"]) for t in clean)
    det = sum(bool(t["confirmed"]) for t in slow)
    print(f"{'check (pooled)':<16} {fa:>14} of {len(clean):<5} {det:>8} of {len(slow):<5}  "
          "(new rule, confirmed on re-measure)")


if __name__ == "__main__":
    sys.exit(main())
