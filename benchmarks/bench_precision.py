"""Benchmark: harness's golden comparison vs a bare loop of torch comparisons.

For a suite, a fresh target run (CPU, --dtype) is captured once; then the full set of layer
goldens is compared with it (a) by harness (``compare_modules``: every captured module with
max_abs_err, max_rel_err, cosine, rel_rmse, within_1e3, tolerance decisions, expert agreement)
and (b) by a bare Python loop computing the same metrics with plain torch calls over the same
tensors. Both are timed over --repeat rounds (median); the ratio harness/bare is printed in one
run (goal: <= 1.2). Loading and sha256-verifying the golden is timed and shown separately.

    .venv/bin/python benchmarks/bench_precision.py --suite mixtral-8x7b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def bare_loop(golden_modules: dict, order: list, outputs: dict) -> list:
    out = []
    for name in order:
        r = golden_modules[name]
        a = outputs[name]
        if not r.is_floating_point():
            out.append((a == r).double().mean().item())
            continue
        a = a.reshape(-1).double()
        r = r.reshape(-1).double()
        d = (a - r).abs()
        rel = d / torch.maximum(r.abs(), r.abs().max() * 1e-6)
        out.append((d.max().item(), rel.max().item(), (torch.dot(a, r) / (a.norm() * r.norm())).item(),
                    ((a - r).norm() / r.norm()).item(), (rel <= 1e-3).double().mean().item()))
    return out


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="mixtral-8x7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--golden-dir", default=str(REPO / "golden"))
    args = ap.parse_args(argv)

    from harness.backends import get
    from harness.golden.store import load_golden
    from harness.precision.compare import compare_modules
    from harness.precision.runner import build_target, run_model, tolerances_for
    from harness.suite.loader import load_suite

    torch.set_num_threads(1)  # stable timings
    ls = load_suite(REPO / "suites" / f"{args.suite}.toml")
    be = get("cpu")
    load_s = timed(lambda: load_golden(ls, args.golden_dir), 20)
    g = load_golden(ls, args.golden_dir)
    tol = tolerances_for(ls, be, args.dtype)[0]
    model, _ = build_target(ls, be, args.dtype)
    outs = run_model(model, g, ls, be.device(), generate=False).outputs
    order = g.order
    n_el = sum(g.modules[n].numel() for n in order)

    for _ in range(10):  # warm-up both paths
        compare_modules(g, outs, tol)
        bare_loop(g.modules, order, outs)
    h, b = [], []
    for _ in range(5):  # interleave rounds so that drift hits both equally
        h.append(timed(lambda: compare_modules(g, outs, tol), args.repeat))
        b.append(timed(lambda: bare_loop(g.modules, order, outs), args.repeat))
    hs, bs = min(h), min(b)
    ratio = hs / bs
    print(f"suite {ls.name} {args.dtype}: {len(order)} golden tensors, {n_el} elements")
    print(f"golden load + sha256 verify : {load_s * 1e3:8.3f} ms")
    print(f"harness compare_modules     : {hs * 1e3:8.3f} ms")
    print(f"bare torch loop             : {bs * 1e3:8.3f} ms")
    print(f"ratio harness / bare        : {ratio:8.3f}  (goal <= 1.2: {'met' if ratio <= 1.2 else 'NOT met'})")
    return 0 if ratio <= 1.2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
