"""Benchmarks of the precision check (issue #11). Run by hand; nothing here is asserted.

    .venv/bin/python benchmarks/bench_precision.py time [--suite S ...] [--dtype bfloat16] [--repeat 3]
        the check with the isolated comparison vs without it (propagated only, today's check):
        median wall time of each and the ratio, in one run (goal <= 2x); golden size per suite.
    .venv/bin/python benchmarks/bench_precision.py sensitivity [--suite S ...]
        the smallest injected error caught per fault kind in bfloat16, by this check (realistic
        numerics, isolated comparison, measured budgets) and by today's (bare initialisation,
        propagated comparison, per-dtype tolerance), each against its own golden.
    .venv/bin/python benchmarks/bench_precision.py reruns [--reruns 10] [--seed0 1000] [--day0 DIR]
        false alarms over clean reruns: each rerun is a new weight seed (a new golden with its own
        budgets, then the check in float32 and bfloat16), for every bundled suite and every Day-0
        config that `harness init` can turn into a suite and that builds.
    .venv/bin/python benchmarks/bench_precision.py reproduce [--suite S ...]
        budgets regenerated twice (same seeds), and with other input draws: largest relative change.

Set HF_HUB_OFFLINE=1. Each mode prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the fault set lives with the tests (tests/precision/faults.py)
SUITES = ["deepseek-v3", "kimi-k2", "llama-3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-8b"]


def load(name_or_path):
    from harness.suite.loader import load_suite

    p = Path(name_or_path)
    return load_suite(p if p.suffix == ".toml" else REPO / "suites" / f"{name_or_path}.toml")


def variant(ls, **precision):
    """The same suite with other [checks.precision] values (no file written)."""
    s = ls.suite.model_copy(deep=True)
    for k, v in precision.items():
        setattr(s.checks.precision, k, v)
    return type(ls)(ls.path, ls.name, s, ls.config_path, ls.raw_config)


def check(ls, dtype, root, **kw):
    """(failure or None, ctx) of the precision check on CPU."""
    from harness.backends import get
    from harness.checks import CheckContext, CheckFailure, CouldNotRun
    from harness.checks.precision import run_precision

    ctx = CheckContext(ls, get("cpu"), dtype)
    try:
        run_precision(ctx, golden_root=root, results_dir=Path(tempfile.mkdtemp()), **kw)
    except (CheckFailure, CouldNotRun) as f:
        return f, ctx
    return None, ctx


def today(ls):
    """Today's check (before issue #11): bare initialisation, propagated comparison only, the
    per-dtype tolerances alone (budget_k huge: every budget is the ceiling) and the old bf16
    logprob_atol 0.05."""
    from harness.checks.precision import Tolerance

    return variant(ls, numerics="init", isolated=False, budget_k=1e9,
                   tolerances={"bfloat16": Tolerance(logprob_atol=0.05)})


def gen(ls, root):
    from harness.precision.generate import generate

    return generate(ls, root, update=True)


def mode_time(args):
    """Wall time and process CPU time (all threads): on a shared, loaded box the CPU time is the
    fairer figure, wall time is what a user waits."""
    from harness.golden.store import golden_dir

    print(f"{'suite':<16} {'golden KiB':>10} {'propagated s':>13} {'+isolated s':>12} {'ratio':>6} "
          f"{'cpu s':>7} {'+iso cpu s':>10} {'cpu ratio':>9}")
    for name in args.suite or SUITES:
        ls = load(name)
        size = sum(f.stat().st_size for f in golden_dir(ls.name, REPO / "golden").iterdir())
        off, on = variant(ls, isolated=False), ls
        check(on, args.dtype, REPO / "golden")  # warm up (imports, first build)
        t_off, t_on, c_off, c_on = [], [], [], []
        for _ in range(args.repeat):  # interleaved, so drift hits both alike
            for which, t_l, c_l in ((off, t_off, c_off), (on, t_on, c_on)):
                t, c = time.perf_counter(), time.process_time()
                check(which, args.dtype, REPO / "golden")
                t_l.append(time.perf_counter() - t)
                c_l.append(time.process_time() - c)
        a, b = statistics.median(t_off), statistics.median(t_on)
        ca, cb = statistics.median(c_off), statistics.median(c_on)
        print(f"{name:<16} {size / 1024:>10.0f} {a:>13.2f} {b:>12.2f} {b / a:>6.2f} {ca:>7.2f} {cb:>10.2f} "
              f"{cb / ca:>9.2f}", flush=True)


def fault_set(first_mlp: str):
    """kind -> (magnitudes, factory(magnitude) -> check kwargs, module expected first)."""
    from precision import faults

    def kernel(kind, rel=None, block=None):
        def ctx():
            k = faults.KernelFault(kind, rel if rel is not None else 0.03)
            if block is not None:
                k.kernels = lambda: {"mm": faults._k_mm(block, 32)}
            return k
        return ctx

    rels = [0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2]
    return {
        "sdpa_scale": (rels, lambda r: {"context": kernel("sdpa_scale", r)}, "model.layers.0.self_attn"),
        "silu_slope": (rels, lambda r: {"context": kernel("silu_slope", r)}, first_mlp),
        "residual_scale": (rels, lambda r: {"transform": faults.residual_scale(0, r)}, "model.layers.0"),
        # magnitude: K-block of the bf16 accumulation (smaller = more partial sums = larger error)
        "matmul_bf16_acc": ([32, 16, 8, 4, 2, 1], lambda b: {"context": kernel("matmul_bf16_acc", block=b)},
                            "model.layers.0.self_attn"),
        "rmsnorm_bf16_acc": ([1], lambda _r: {"transform": faults.route_rmsnorm,
                                              "context": kernel("rmsnorm_bf16_acc")},
                             "model.layers.0.input_layernorm"),
        "rotary_bf16": ([1], lambda _r: {"transform": faults.rotary_low_precision}, "model.rotary_emb@positions"),
    }


def mode_sensitivity(args):
    from harness.golden.store import load_golden

    tmp = Path(tempfile.mkdtemp())
    rows = []
    for name in args.suite or SUITES:
        new = load(name)
        old = today(new)
        gen(old, tmp / "today")
        g = load_golden(new, REPO / "golden")
        first_mlp = next((n for n in g.order if n.startswith("model.layers.0.mlp.experts")), "model.layers.0.mlp")
        for kind, (mags, make, first) in fault_set(first_mlp).items():
            caught = {}
            for label, ls, root in (("new", new, REPO / "golden"), ("today", old, tmp / "today")):
                hit = None
                for m in mags:  # increasing severity: the first caught is the smallest
                    f, _ = check(ls, "bfloat16", root, **make(m))
                    if f is not None:
                        hit = (m, f.message.split(" diverges")[0] if " diverges" in f.message else f.message[:40])
                        break
                caught[label] = hit
            rows.append((name, kind, caught["new"], caught["today"], first))
            n, t = caught["new"], caught["today"]
            print(f"{name:<15} {kind:<17} new: {fmt(n, first):<48} today: {fmt(t, first)}", flush=True)


def fmt(hit, first):
    if hit is None:
        return "not caught"
    m, where = hit
    return f"{m:g} at {where}" + ("" if where == first else f" (expected {first})")


def day0_suites(day0: Path, out: Path) -> list:
    from harness.cli.init import init_suite

    got = []
    for cfg in sorted(day0.glob("*.json")):
        try:
            p = init_suite(cfg, suites_dir=out, force=True)
            got.append(load(p))
        except Exception as e:  # a config harness cannot turn into a suite is reported, not fatal
            print(f"day0 {cfg.name}: no suite ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    return got


def mode_reruns(args):
    tmp = Path(tempfile.mkdtemp())
    suites = [] if args.day0_only else [load(n) for n in (args.suite or SUITES)]
    if args.day0:
        suites += day0_suites(Path(args.day0), tmp / "suites")
    print(f"{'suite':<34} {'dtype':<9} {'reruns':>6} {'false alarms':>12} {'flips left out':>14} {'worst budget use':>16}")
    total = 0
    for ls in suites:
        res = {d: [0, 0, 0, 0.0, []] for d in ("float32", "bfloat16")}
        for r in range(args.reruns):
            lsr = variant(ls, seed=args.seed0 + r)  # a new weight seed: a new model, a new golden
            try:
                gen(lsr, tmp / f"g{r}")
            except Exception as e:
                print(f"{ls.name}: golden not generated ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                break
            for d in res:
                f, ctx = check(lsr, d, tmp / f"g{r}")
                p = dict(ctx.properties)
                res[d][0] += 1
                if f is not None:
                    res[d][1] += 1
                    res[d][4].append(f"seed {args.seed0 + r}: {f.message[:160]}")
                res[d][2] += int(float(p.get("metric.routing_flips_near_tie", 0)))
                res[d][3] = max(res[d][3], float(p.get("metric.isolated_worst_budget_use", 0)))
        for d, (n, bad, flips, worst, msgs) in res.items():
            total += bad
            print(f"{ls.name:<34} {d:<9} {n:>6} {bad:>12} {flips:>14} {worst:>16.2f}", flush=True)
            for m in msgs:
                print(f"    {m}")
    print(f"false alarms in total: {total}")


def mode_reproduce(args):
    from harness.precision.generate import build_golden

    print(f"{'suite':<16} {'dtype':<9} {'same seeds':>10} {'other draws':>11}  (largest relative budget change)")
    for name in args.suite or SUITES:
        ls = load(name)
        a, _ = build_golden(ls)
        b, _ = build_golden(ls)
        ls2 = variant(ls, budget_draws=ls.suite.checks.precision.budget_draws + 4)  # 4 more, other draws
        c, _ = build_golden(ls2)
        for d in a["budgets"]:
            ma, mb, mc = (x["budgets"][d]["modules"] for x in (a, b, c))
            same = max(abs(mb[n]["budget"] - v["budget"]) / v["budget"] for n, v in ma.items())
            other = max(abs(mc[n]["budget"] - v["budget"]) / v["budget"] for n, v in ma.items())
            print(f"{name:<16} {d:<9} {same:>10.1%} {other:>11.1%}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("time", "sensitivity", "reruns", "reproduce"), nargs="?", default="time")
    ap.add_argument("--suite", action="append")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reruns", type=int, default=10)
    ap.add_argument("--seed0", type=int, default=1000, help="first weight seed of the reruns (a sweep can be continued)")
    ap.add_argument("--day0", default=None, help="directory of Day-0 config.json files")
    ap.add_argument("--day0-only", action="store_true", help="reruns: the Day-0 configs without the bundled suites")
    args = ap.parse_args()
    {"time": mode_time, "sensitivity": mode_sensitivity, "reruns": mode_reruns, "reproduce": mode_reproduce}[args.mode](args)


if __name__ == "__main__":
    main()
