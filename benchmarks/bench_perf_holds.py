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
offline; the check's own final verdict against the pooled baseline is reported beside it). The check's
operator verdicts (issue #51 item 2: every operator and module judged on its own CPU-clock profile
repeats, judge.operator_verdicts) are counted from the same runs: confirmed on the re-profile, suspected
but not confirmed, phases noted too noisy; and the item as a whole (failed: a phase, memory or operator
regression). ``--attn`` more trials slow the CPU attention kernel alone by ``--attn-share`` (busy work
registered at its BackendSelect dispatch key), to be named by its operator verdict.

Usage: python benchmarks/bench_perf_holds.py [--suite llama-3.1-8b] [--clean 20] [--slow 20] [--attn 5]
       [--attn-share 0.4] [--baseline-runs 3] [--per-child 5] [--phases prefill,decode] [--work DIR]
       [--baseline-load N] [--load N]   (N spinners beside the baseline processes / the trials)
       python benchmarks/bench_perf_holds.py --report DIR/trials.json   (a saved, even partial, run)

Since these figures, two retunes (decide.py; docs/perf.md has both nights' tables): the
calibration-spread hold widened to threshold + spread, and a process-spread hold (threshold + half the
range of the baseline processes' levels). A second night, 12:28-12:46 UTC (load 1.4-10.5, baseline
processes at decode 0.87/1.00/1.28 of their median): before the second retune the check filed 2 of 20
clean reruns (decode +21%, +29%, confirmed on re-measure) and caught 20 of 20; both nights replayed with
the final rule, first decision: clean 0 of 20 and 0 of 20, 20% slower 18 of 20 and 18 of 20. The
bench again with the final rule, 12:57-13:15 UTC (load 0.7-3.0): the check's whole item 0 of 20 clean,
16 of 20 slowed (first decision 2 and 18), attention +40% named 2 of 2.

Figures, 2026-12-06 09:32-09:57 UTC, this 2-core machine shared with other engineers' jobs (1-minute
load average 1.3-9.8, mean 5.9: ~9-10 while the 3 baseline processes ran, 2-6 during most trials),
suite llama-3.1-8b, phases prefill + decode, `--clean 20 --slow 20 --attn 2 --baseline-runs 3
--per-child 7`, 24.3 min, op_min_time 1 ms and op_min_call_time 100 us (judged: 11 operators and
modules in prefill, 8 in decode; 1 and 16 left under the floors):

    rule / baseline          false alarms (clean)   detected (20% of every Linear)
    old, one process         0 of 20                20 of 20
    new, one process         0 of 20                 2 of 20   (thin: within the 25% margin)
    old, 3 pooled            0 of 20                19 of 20
    new, 3 pooled            0 of 20                11 of 20
    the check, phases        0 of 20                 9 of 20   (new rule, pooled, confirmed on re-measure)
    the check, operators     0 of 20                 0 of 20   (confirmed on re-profile; none even suspected
                                                                 in the clean trials, no phase noted noisy)
    the check, whole item    0 of 20                 9 of 20
    attention kernel +40%    named 2 of 2 (one in prefill +30%, one in decode +92%; each one's other
                             phase suspected, not confirmed), item failed 2 of 2

**Operators: 0 false alarms in 20 clean reruns** (the goal: at most 1 in 20). **The 20% slowdown: 9 of
20 items, not the 19 the goal asks**, and not for the operators' sake: 10 of the 11 misses are the
phase rule's calibration-spread hold (decide.py: "too noisy to judge", calibration kernel spread 10%
over the 5% threshold with a raw change within it) and one its raw hold. The baseline processes ran at
load ~9-10 and most trials at 2-6: the calibration kernel ran faster in the slowed trials (prefill
kernel ratio median 0.859, 0.82-1.14), so a 20% slower model read a median +3.7% raw (e.g. +2.7% raw,
+21% calibrated at 0.848); clean trials spread from -16.7% to +30.5% raw (kernel ratio 0.82-1.26). The old rule caught 19 of 20
with no false alarm in this run; the holds trade that detection for the issue's 8-in-21 false alarms
of a night when the load moved the other way. The Linear slowdown is not an operator finding: it is
+20% of every Linear, under ``op_threshold`` (25%).

Before the per-call floor (same command, stopped after 8 trials, 09:12-09:28, load 8-10; only
op_min_time 1 ms): 1 of 4 clean items failed on an operator, decode's ``aten::mean`` +43% (40 calls of
37 us per decode, over 1 ms per phase call) with the decoder layer's own time +33% (126 us a call);
replayed offline on the first profile with a 100 us per-call floor, 0 of 4. Before the CPU clock (the
profiler's wall-clock times) the tiny perf suite gave 2 operator false alarms in ~60 clean reruns,
both a ~17 us decode attention kernel; on the llama-3.1-8b perf model at load 10, consecutive profiles
in one process moved judged operators by a median 16-39% (90th percentile over 100%) on the
profiler's clock, 5-6.5% (at most 25%) on the CPU clock.

The earlier short run (2026-12-05, load 10-13, `--clean 6 --slow 4 --baseline-runs 2 --per-child 2`,
phases only, before the operator verdicts): old / new with one process 1 / 0 of 6 false alarms, 4 / 2
of 4 detected; pooled 1 / 1 of 6, 4 / 4; the check 0 of 6, 4 of 4.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_first_run import _spinners  # noqa: E402  (other jobs' load: each spinner in a session of its own)


def _detection():
    """bench_perf_detection.py's child side (its injection, its check run), loaded by path."""
    spec = importlib.util.spec_from_file_location("bench_perf_detection", REPO / "benchmarks" /
                                                  "bench_perf_detection.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SDPA = "_scaled_dot_product_flash_attention_for_cpu"


def slow_attention(share: float):
    """The CPU attention kernel ``share`` slower, every other operator as it was (the issue's case:
    attention 3% of the prefill, so its phase moves ~1%, under any phase threshold): busy work for
    ``share`` of the CPU time the kernel itself just took, registered at the dispatcher's BackendSelect
    key (right above the CPU kernel it redispatches to), so the check's profile and its CPU-clock
    operator timing see it inside the operator, as they would a slower kernel."""
    import time as _t

    import torch

    op = getattr(torch.ops.aten, SDPA).default

    def slow(keyset, *args, **kwargs):
        t0 = _t.thread_time()
        out = op.redispatch(keyset.remove(torch._C.DispatchKey.BackendSelect), *args, **kwargs)
        now = _t.thread_time()
        end = now + share * (now - t0)
        while _t.thread_time() < end:
            pass
        return out

    lib = torch.library.Library("aten", "IMPL")
    lib.impl(SDPA, slow, "BackendSelect", with_keyset=True)
    return lib


def _operators(verdict: dict) -> dict:
    """What the check's operator verdicts did: confirmed (filed), suspected on the first profile but not
    confirmed on the re-profile, held (too noisy / thin), and phases noted too noisy to judge."""
    ops = verdict.get("operators") or {}
    return {"confirmed": [f"{ph} {x['kind']} {x['name']} {x['change']:+.0%}" for ph, r in ops.items()
                          for x in r.get("regressions", [])],
            "unconfirmed": [f"{ph} {k}" for ph, r in ops.items() for k, why in r.get("held", {}).items()
                            if why.startswith("suspected")],
            "held": [f"{ph} {k}" for ph, r in ops.items() for k, why in r.get("held", {}).items()
                     if not why.startswith("suspected")],
            "noisy_phases": [ph for ph, r in ops.items() if (r.get("note") or "").startswith("too noisy")],
            "judged": {ph: r.get("judged", 0) for ph, r in ops.items()},
            "under_floor": {ph: len(r.get("under_floor", [])) for ph, r in ops.items()}}


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    det = _detection()
    ls = det._suite(spec)
    out = []
    for i, level in enumerate(spec["levels"]):
        res = Path(spec["results"]) / f"t{i}"
        attn = isinstance(level, str)  # "attn:<share>": the attention operator slowed, not the Linears
        lib = slow_attention(float(level.split(":")[1])) if attn else None
        try:
            r = det._run_check(ls, {}, res, Path(spec["golden"]), 0.0 if attn else level)
        finally:
            if lib is not None:
                lib._destroy()
        out.append({"share": level, "results": str(res), "outcome": r["outcome"],
                    "confirmed": sorted(m for m, d in r["verdict"].get("metrics", {}).items()
                                        if d.get("verdict") == "regression"),
                    "operators": _operators(r["verdict"])})
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
    """Timed metrics of one trial that are regressions by the old or the new rule (first decision).
    The new rule is the check's own (harness.perf.judge.first_decisions, on the trial's sidecar); the
    old one is the rule before the holds: the calibrated change and the test alone."""
    from harness import metrics
    from harness.checks.perf import PerfConfig  # declares the perf metrics (their directions)
    from harness.perf import baseline as store
    from harness.perf import calibrate as calib
    from harness.perf import judge as perf_judge
    from harness.perf.decide import decide
    from harness.perf.measure import PHASE_OF, samples_key

    cfg = PerfConfig()
    ((_, rec),) = store.read_sidecars(results)
    cal, clock = rec["calibration"], rec["calibration"].get("clock", "wall")
    if new:
        c, base = perf_judge.first_decisions(rec["suite"], rec["key"], rec["fingerprint"], golden, rec["shape"],
                                             clock, cfg, rec["samples"], rec.get("reference"), cal)
        if base is None:  # not comparable (a calibration kernel past max_kernel_ratio): the check judges nothing
            return set()
        return {m for m, d in c.decisions.items() if d.verdict == "regression"}
    base, why = store.find_baseline(rec["suite"], rec["key"], rec["fingerprint"], golden)
    assert base is not None, why
    bad = set()
    for m in PHASE_OF:
        k = samples_key(clock, m)
        if k not in rec["samples"]:
            continue
        ratio = calib.kernel_ratio(m, cal, base["calibration"], rec.get("reference"), base.get("reference"), clock)
        d = decide(m, rec["samples"][k], base["samples"][k], direction=metrics.direction(m),
                   threshold=cfg.thresholds.get(m, cfg.threshold), alpha=cfg.alpha, kernel_ratio=ratio)
        if d.verdict == "regression":
            bad.add(m)
    return bad


def replay(results: str, golden: Path) -> dict[str, list[str]]:
    """The check's decisions after its re-measure, replayed from one trial's sidecar (its first samples,
    its re-measured samples and their reference kernel's) by two rules on the same samples: ``before``,
    a first regression confirmed by the re-measure alone; ``now``, the check's (judge.confirm: a first
    "too noisy to judge" re-measured too, and confirmed by a re-measure that is a regression by itself)."""
    from harness.checks.perf import PerfConfig
    from harness.perf import baseline as store
    from harness.perf import judge as perf_judge
    from harness.perf.measure import PHASE_OF, samples_key

    cfg = PerfConfig()
    ((_, rec),) = store.read_sidecars(results)
    cal, clock = rec["calibration"], rec["calibration"].get("clock", "wall")
    c, base = perf_judge.first_decisions(rec["suite"], rec["key"], rec["fingerprint"], golden, rec["shape"], clock,
                                         cfg, rec["samples"], rec.get("reference"), cal)
    if base is None:
        return {"before": [], "now": [], "incomparable": [c.note or "not comparable"]}
    again, kern = rec.get("remeasured") or {}, rec.get("reference_remeasured") or {}
    out: dict[str, list[str]] = {"before": [], "now": []}
    for m, first in list(c.decisions.items()):
        k = samples_key(clock, m)
        if not perf_judge.remeasured(first) or f"{k}_remeasured" not in again:
            continue
        d = perf_judge.decide_again(c, m, base, clock, cfg, cal, again[f"{k}_remeasured"],
                                    kern[f"{PHASE_OF[m]}_remeasured"])
        if d.verdict == "regression":
            out["now"].append(m)
            if first.verdict == "regression":
                out["before"].append(m)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--suite", default="llama-3.1-8b")
    ap.add_argument("--clean", type=int, default=20)
    ap.add_argument("--slow", type=int, default=20, help="trials with every Linear 20%% slower")
    ap.add_argument("--attn", type=int, default=5, help="trials with the attention operator slowed alone")
    ap.add_argument("--attn-share", type=float, default=0.4, help="how much slower the attention operator is")
    ap.add_argument("--baseline-runs", type=int, default=3)
    ap.add_argument("--per-child", type=int, default=5)
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=str(REPO / "results" / "bench-perf-holds"), help="scratch folder (emptied)")
    ap.add_argument("--report", help="print the table of a saved trials.json")
    ap.add_argument("--baseline-load", type=int, default=0, help="processes spinning on the CPU while the baseline "
                    "processes run (each in a session of its own, as other users' jobs): other jobs' load, on purpose")
    ap.add_argument("--load", type=int, default=0, help="the same, while the trials run")
    a = ap.parse_args()
    if a.report:
        report(json.loads(Path(a.report).read_text()), math.nan)
        return 0
    if a.child:
        child(a.child)
        return 0
    from harness.perf import baseline as store

    t0 = time.perf_counter()
    work = Path(a.work)
    if work.exists():  # a fresh baseline each run: update() would pool an earlier run's samples in
        shutil.rmtree(work)
    work.mkdir(parents=True)
    base = {"suite": a.suite, "phases": a.phases.split(",")}
    dirs = _baselines(a, base, work, t0)
    spin = _spinners(a.load, lifetime_s=7200)
    thin, pooled = work / "golden-thin", work / "golden-pooled"
    store.update(dirs[:1], thin)
    store.update(dirs, pooled)
    plan = [0.0] * a.clean + [0.2] * a.slow + [f"attn:{a.attn_share}"] * a.attn
    random.Random(a.seed).shuffle(plan)
    trials = []
    try:
        _trials(a, plan, base, work, pooled, thin, trials, t0)
    finally:
        _stop(spin)
    (work / "trials.json").write_text(json.dumps(trials, indent=1))
    report(trials, time.perf_counter() - t0)
    return 0


def _baselines(a, base: dict, work: Path, t0: float) -> list[str]:
    dirs = []
    spin = _spinners(a.baseline_load, lifetime_s=7200)
    try:
        for b in range(a.baseline_runs):  # one process each: the check's own run writes the sidecar
            spawn({**base, "levels": [0.0], "results": str(work / f"base-{b}"), "golden": str(work / "none")},
                  work, f"base-{b}")
            dirs.append(str(work / f"base-{b}" / "t0"))
            print(f"[{time.perf_counter() - t0:5.0f} s] baseline {b + 1}/{a.baseline_runs}, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    finally:
        _stop(spin)
    return dirs


def _stop(spin: list[subprocess.Popen]) -> None:
    for p in spin:
        p.kill()
        p.wait()


def _trials(a, plan: list, base: dict, work: Path, pooled: Path, thin: Path, trials: list, t0: float) -> None:
    for ci in range(0, len(plan), a.per_child):
        got = spawn({**base, "levels": plan[ci:ci + a.per_child], "results": str(work / f"trials-{ci}"),
                     "golden": str(pooled)}, work, f"trials-{ci}")
        for t in got:
            if isinstance(t["share"], str):
                continue  # the phases' rules are not what the attention trials test
            t["judged"] = {f"{rule} {name}": sorted(judge(t["results"], g, rule == "new"))
                           for rule in ("old", "new") for name, g in (("thin", thin), ("pooled", pooled))}
            t["remeasure"] = replay(t["results"], pooled)
        for t in got:
            t["load"] = os.getloadavg()[0]
        trials += got
        (work / "trials.json").write_text(json.dumps(trials, indent=1))  # a partial run reports too
        print(f"[{time.perf_counter() - t0:5.0f} s] {len(trials)}/{len(plan)}, load {os.getloadavg()[0]:.1f}",
              flush=True)


def report(trials: list[dict], seconds: float) -> None:
    clean = [t for t in trials if t["share"] == 0]
    slow = [t for t in trials if not isinstance(t["share"], str) and t["share"] > 0]
    attn = [t for t in trials if isinstance(t["share"], str)]
    print(f"\n{len(clean)} clean, {len(slow)} at 20%, {len(attn)} attention slowed, {seconds / 60:.1f} min")
    print(f"{'rule / baseline':<16} {'false alarms (clean)':>22} {'detected (20%)':>16}")
    for col in ("old thin", "new thin", "old pooled", "new pooled"):
        fa = sum(bool(t["judged"][col]) for t in clean)
        det = sum(bool(t["judged"][col]) for t in slow)
        print(f"{col:<16} {fa:>14} of {len(clean):<5} {det:>8} of {len(slow):<5}")
    fa = sum(bool(t["confirmed"]) for t in clean)
    det = sum(bool(t["confirmed"]) for t in slow)
    print(f"{'check phases':<16} {fa:>14} of {len(clean):<5} {det:>8} of {len(slow):<5}  "
          "(new rule, pooled, confirmed on re-measure)")
    for rule, what in (("before", "a first regression the re-measure confirms"),
                       ("now", "the check's: a first 'too noisy to judge' re-measured and confirmed too")):
        have = [t for t in clean + slow if "remeasure" in t]
        fa = sum(bool(t["remeasure"][rule]) for t in have if t["share"] == 0)
        det = sum(bool(t["remeasure"][rule]) for t in have if t["share"] != 0)
        print(f"{'re-measure ' + rule:<16} {fa:>14} of {len(clean):<5} {det:>8} of {len(slow):<5}  ({what}, replayed)")
    odd = [t for t in clean + slow if (t.get("remeasure") or {}).get("incomparable")]
    if odd:
        print(f"not comparable (the check judges nothing: a calibration kernel past max_kernel_ratio): {len(odd)} "
              f"trial(s), {sum(t['share'] == 0 for t in odd)} clean; first: {odd[0]['remeasure']['incomparable'][0][:120]}")
    fa = sum(bool(t["operators"]["confirmed"]) for t in clean)
    det = sum(bool(t["operators"]["confirmed"]) for t in slow)
    print(f"{'check operators':<16} {fa:>14} of {len(clean):<5} {det:>8} of {len(slow):<5}  (confirmed on re-profile)")
    fa = sum(t["outcome"] != "passed" for t in clean)
    det = sum(t["outcome"] != "passed" for t in slow)
    print(f"{'check item':<16} {fa:>14} of {len(clean):<5} {det:>8} of {len(slow):<5}  (failed: phase, memory or operator)")
    named = sum(any(SDPA in x for x in t["operators"]["confirmed"]) for t in attn)
    print(f"attention slowed ({attn[0]['share'] if attn else '-'}): named {named} of {len(attn)}; item failed "
          f"{sum(t['outcome'] != 'passed' for t in attn)} of {len(attn)}")
    for t in clean + slow + attn:
        o = t["operators"]
        if o["confirmed"] or o["unconfirmed"] or o["noisy_phases"]:
            print(f"  {t['share']!s:>8}: confirmed {o['confirmed']} unconfirmed {o['unconfirmed']} "
                  f"noisy {o['noisy_phases']}")
    print("judged per phase (first trial):", clean[0]["operators"]["judged"] if clean else "-",
          "under the floor:", clean[0]["operators"]["under_floor"] if clean else "-")


if __name__ == "__main__":
    sys.exit(main())
