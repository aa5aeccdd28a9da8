"""Does the perf check catch real slowdowns without crying wolf, on this noisy machine?

A slowdown is injected into a bundled model in a child process: every ``nn.Linear`` gets a
forward pre-hook and hook that time the layer and then do extra (busy) work for ``share`` of the
CPU time the layer itself just took, so the injected cost scales with the layer as the machine speeds
up or slows down, the way a slower kernel would. The perf check then runs exactly as in CI
(calibration, interleaved reference kernels, threshold + Mann-Whitney, one interleaved
re-measurement of a suspected regression) against a baseline stored by *another* child process
earlier, as a CI run compares with a reviewed run of another day.

Trials (default): 20 at each of 5%, 10%, 20% and 40 clean (0%), in a seeded random order spread
over child processes (several trials per child, so interpreter start and model build are paid
once per child); a fresh baseline process every ``--block`` trial children so that the rates do not
hang on one lucky or unlucky baseline. Each child also measures the *effective* end-to-end
slowdown of each share with a/b interleaved prefill timings (on the check's clock) (the share is of each linear layer's
time; attention core, norms and Python overhead are not slowed).

Reports per level: detection rate (a confirmed regression verdict on any timed metric, and per
metric) and, for clean trials, the false-alarm rate. Writes results/bench_perf_detection.json.

Usage: python benchmarks/bench_perf_detection.py [--suite llama-3.1-8b] [--trials 20] [--clean 40]
       [--levels 0.05,0.10,0.20] [--per-child 10] [--block 2] [--phases prefill,decode] [--baseline-runs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
TIMED = ("prefill_s", "ttft_s", "decode_token_s", "train_step_s")


# --- child side -------------------------------------------------------------------------------
def inject(model, share: float):
    """Extra busy work after every Linear, ``share`` x the (CPU) time that Linear just took."""
    import torch

    if share <= 0:
        return []
    t0: dict[int, float] = {}

    # On the thread's CPU clock: the extra work is share x the CPU time the layer took, whatever
    # the neighbours do (a wall-clock spin would shrink whenever this process is descheduled).
    def pre(mod, _args):
        t0[id(mod)] = time.thread_time()

    def post(mod, _args, _out):
        now = time.thread_time()
        end = now + share * (now - t0[id(mod)])
        while time.thread_time() < end:
            pass

    handles = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


def _run_check(ls, cfg_over: dict, results: Path, golden: Path, share: float) -> dict:
    from harness.backends import get
    from harness.checks import CheckContext, CheckFailure, registry

    check = registry().get("perf")
    ctx = CheckContext(ls, get("cpu"), "float32", None, check="perf")
    outcome = "passed"
    try:
        check.run(ctx, results_dir=str(results), golden_root=str(golden),
                  transform=(lambda m: inject(m, share)) if share > 0 else None)
    except CheckFailure as e:
        outcome = f"failed: {e.message}"
    props = dict(ctx.properties)
    verdict = json.loads(props.get("harness.detail.perf_verdict", "{}"))
    return {"outcome": outcome, "verdict": verdict,
            "metrics": {k[7:]: float(v) for k, v in ctx.properties if k.startswith("metric.")}}


def _suite(spec: dict):
    from harness.suite.loader import load_suite

    ls = load_suite(REPO / "suites" / f"{spec['suite']}.toml")
    # The benchmark's own [checks.perf] settings: same defaults as the check, phases narrowed.
    cfg = ls.suite.checks.perf.model_copy(update={"phases": spec["phases"], "enabled": True})
    ls.suite.checks.perf = cfg
    return ls


def _effective(ls, shares: list[float], pairs: int) -> dict[str, float]:
    """End-to-end prefill slowdown of each share: a/b interleaved, same process, same model."""
    from harness.backends import get
    from harness.perf.timing import pinned
    from harness.perf.workload import Workload, perf_model_config

    cfg = ls.suite.checks.perf
    be = get("cpu")
    out = {}
    with pinned(cfg.threads, cfg.cpus):
        wl = Workload(ls, perf_model_config(ls, cfg.width, cfg.layers, cfg.prune), "float32", be,
                      cfg.batch_sizes[0], cfg.seq_lens[0], cfg.decode_tokens, cfg.seed, cpu_clock=True)
        key = "prefill_cpu_s" if cfg.threads == 1 else "prefill_s"  # the check's clock (checks/perf.py)
        wl.prefill_sample()
        for share in shares:
            ratios = []
            for _ in range(pairs):
                a = wl.prefill_sample()[key]
                hs = inject(wl.model, share)
                b = wl.prefill_sample()[key]
                for h in hs:
                    h.remove()
                ratios.append(b / a)
            out[str(share)] = statistics.median(ratios) - 1
    return out


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    ls = _suite(spec)
    res = {"role": spec["role"], "trials": []}
    if spec["role"] == "baseline":
        r = _run_check(ls, {}, Path(spec["results"]), Path(spec["golden"]), 0.0)
        from harness.perf.baseline import update

        update(spec["results"], spec["golden"], append=spec.get("append", False))
        res["baseline"] = r["metrics"]
    else:
        for i, share in enumerate(spec["levels"]):
            t = time.perf_counter()
            r = _run_check(ls, {}, Path(spec["results"]) / f"t{i}", Path(spec["golden"]), share)
            r.update(share=share, seconds=time.perf_counter() - t)
            res["trials"].append(r)
        if spec.get("effective"):
            res["effective"] = _effective(ls, sorted({s for s in spec["levels"] if s > 0}), spec["effective"])
    Path(spec["out"]).write_text(json.dumps(res))


# --- parent side ------------------------------------------------------------------------------
def spawn(spec: dict, work: Path, name: str) -> dict:
    spec = dict(spec, out=str(work / f"{name}.out.json"))
    p = work / f"{name}.spec.json"
    p.write_text(json.dumps(spec))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--child", str(p)], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"child {name} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    out = json.loads(Path(spec["out"]).read_text())
    out["wall_s"] = time.perf_counter() - t
    return out


def regressed(trial: dict) -> set[str]:
    ms = trial["verdict"].get("metrics", {})
    return {m for m, d in ms.items() if d.get("verdict") == "regression"}


def suspected(trial: dict) -> set[str]:
    ms = trial["verdict"].get("metrics", {})
    return {m for m, d in ms.items() if d.get("first", {}).get("verdict") == "regression"
            or d.get("verdict") == "regression"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--suite", default="llama-3.1-8b")
    ap.add_argument("--trials", type=int, default=20, help="trials per slowdown level")
    ap.add_argument("--clean", type=int, default=40, help="clean trials (false alarms)")
    ap.add_argument("--levels", default="0.05,0.10,0.20")
    ap.add_argument("--per-child", type=int, default=10, help="trials per child process")
    ap.add_argument("--block", type=int, default=2, help="trial children per baseline process")
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--baseline-runs", type=int, default=1,
                    help="baseline processes per block, pooled with `harness baseline update --append`")
    ap.add_argument("--effective-pairs", type=int, default=5, help="a/b pairs per share for the effective slowdown")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_perf_detection.json"))
    ap.add_argument("--report", help="print the table of a saved (possibly partial) run and exit")
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return 0
    levels = [float(x) for x in a.levels.split(",") if x]
    if a.report:
        d = json.loads(Path(a.report).read_text())
        a.out = a.report
        report(d["trials"], d["effective"], d["baselines"], levels, a, 0.0, 0)
        return 0
    plan = [0.0] * a.clean + [lv for lv in levels for _ in range(a.trials)]
    random.Random(a.seed).shuffle(plan)
    chunks = [plan[i:i + a.per_child] for i in range(0, len(plan), a.per_child)]
    work = REPO / "results" / "bench-perf-detection"
    work.mkdir(parents=True, exist_ok=True)
    base = {"suite": a.suite, "phases": a.phases.split(",")}
    trials, effective, baselines = [], [], []
    started = time.perf_counter()
    golden = None
    for ci, chunk in enumerate(chunks):
        if ci % a.block == 0:
            golden = work / f"golden-{ci}"
            for bi in range(a.baseline_runs):
                b = spawn({**base, "role": "baseline", "results": str(work / f"base-{ci}-{bi}"),
                           "golden": str(golden), "append": bi > 0}, work, f"base-{ci}-{bi}")
                baselines.append(b["baseline"])
        r = spawn({**base, "role": "trials", "levels": chunk, "results": str(work / f"trials-{ci}"),
                   "golden": str(golden), "effective": a.effective_pairs if ci % a.block == 0 else 0},
                  work, f"trials-{ci}")
        trials += r["trials"]
        if r.get("effective"):
            effective.append(r["effective"])
        print(f"[{time.perf_counter() - started:6.0f} s] child {ci + 1}/{len(chunks)}: "
              + " ".join(f"{t['share']:.2f}:{'R' if regressed(t) else '.'}" for t in r["trials"]), flush=True)
        # Saved after every child: a run cut short still has its trials (--report prints them).
        Path(a.out).write_text(json.dumps({"trials": trials, "effective": effective, "baselines": baselines,
                                           "args": vars(a), "partial": True}))
    report(trials, effective, baselines, levels, a, time.perf_counter() - started, len(chunks))
    return 0


def report(trials, effective, baselines, levels, a, seconds, children) -> None:
    rows = []
    print(f"\n{a.suite}, phases {a.phases}; threshold 5%, Mann-Whitney p < 0.01, re-measure on suspicion")
    print(f"{'injected':>9} {'effective':>9} {'trials':>6} {'detected':>9} {'suspected':>9}  per metric")
    for lv in [0.0] + levels:
        ts = [t for t in trials if t["share"] == lv]
        det = sum(bool(regressed(t)) for t in ts)
        sus = sum(bool(suspected(t)) for t in ts)
        per = {m: sum(m in regressed(t) for t in ts) for m in TIMED if any(m in t["verdict"].get("metrics", {})
                                                                         for t in ts)}
        eff = statistics.median([e[str(lv)] for e in effective if str(lv) in e]) if lv and effective else 0.0
        rows.append({"share": lv, "effective": eff, "trials": len(ts), "detected": det, "suspected": sus,
                     "rate": det / len(ts) if ts else None, "per_metric": per,
                     "changes": {m: [t["verdict"]["metrics"].get(m, {}).get("change") for t in ts] for m in per}})
        label = "clean" if lv == 0 else f"{lv:.0%}"
        print(f"{label:>9} {eff:>+9.1%} {len(ts):>6} {det / max(len(ts), 1):>9.0%} {sus / max(len(ts), 1):>9.0%}  "
              + ", ".join(f"{m} {n}/{len(ts)}" for m, n in per.items()))
    reliable = [r["share"] for r in rows if r["share"] and r["rate"] is not None and r["rate"] >= 0.95]
    print(f"\nfalse alarms: {rows[0]['detected']}/{rows[0]['trials']}; smallest share detected in >= 95% of "
          f"trials: {min(reliable):.0%}" if reliable else "\nno share detected in >= 95% of trials")
    print(f"total {seconds:.0f} s, {children} trial children, {len(baselines)} baselines")
    Path(a.out).write_text(json.dumps({"rows": rows, "trials": trials, "effective": effective,
                                       "baselines": baselines, "args": vars(a)}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
