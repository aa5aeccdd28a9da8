"""The compile check's cost and what compiling buys on CPU, per bundled suite, side by side in one run.

For every suite (and dtype), in one process, with inductor's caches in a fresh temporary folder (a
cold CI runner: every kernel is a C++ build):

* check:     wall time of the commit item (``compile[cpu-<dtype>]``: golden, build, inductor compile,
             eager, numerics, graph breaks, the aot_eager recompile sweep), its ``compile_time_s``
             (the first compiled forward: dynamo + inductor + one run) and its counts;
* speed:     the nightly ``speed`` item on the same (now warm) cache: the median compiled and eager
             forward times on the golden's ids, interleaved (harness.perf.timing), and their ratio.

Usage: python benchmarks/bench_compile.py [--dtype float32 --dtype bfloat16] [--suite llama-3.1-8b ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-compile-inductor-")

from harness.backends import get  # noqa: E402
from harness.checks import CheckContext, CheckFailure, NotApplicable  # noqa: E402
from harness.checks.compile import run_compile  # noqa: E402
from harness.suite.loader import load_suite  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SUITES = ["llama-3.1-8b", "qwen3-8b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2"]


def item(name: str, dtype: str, variant: str | None) -> tuple[float, dict, str]:
    ctx = CheckContext(load_suite(REPO / "suites" / f"{name}.toml"), get("cpu"), dtype, variant)
    t = time.perf_counter()
    try:
        run_compile(ctx)
        verdict = "passed"
    except (CheckFailure, NotApplicable) as f:
        verdict = f"{type(f).__name__}: {str(f).splitlines()[0][:100]}"
    wall = time.perf_counter() - t
    return wall, {k.removeprefix("metric."): float(v) for k, v in ctx.properties if k.startswith("metric.")}, verdict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", action="append", help="suite name (repeatable; default: the six bundled)")
    ap.add_argument("--dtype", action="append", help="dtype (repeatable; default: float32 and bfloat16)")
    args = ap.parse_args(argv)
    dtypes = args.dtype or ["float32", "bfloat16"]
    print(f"inductor cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']} (fresh)", flush=True)
    head = (f"{'suite':<15} {'dtype':<9} {'check s':>8} {'compile s':>9} {'breaks':>6} {'recomp':>6} "
            f"{'budget':>7} {'eager ms':>9} {'compiled ms':>11} {'speedup':>8}  verdict")
    print(head)
    for name in args.suite or SUITES:
        for dtype in dtypes:
            wall, m, verdict = item(name, dtype, None)
            _, s, sv = item(name, dtype, "speed")
            if sv != "passed":
                verdict += f"; speed: {sv}"
            print(f"{name:<15} {dtype:<9} {wall:>8.1f} {m.get('compile_time_s', float('nan')):>9.1f} "
                  f"{m.get('compile_graph_breaks', -1):>6.0f} {m.get('compile_recompiles', -1):>6.0f} "
                  f"{m.get('compile_logits_budget_use', float('nan')):>7.2f} "
                  f"{s.get('compile_eager_forward_s', float('nan')) * 1e3:>9.2f} "
                  f"{s.get('compile_forward_s', float('nan')) * 1e3:>11.2f} "
                  f"{s.get('compile_speedup', float('nan')):>7.2f}x  {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
