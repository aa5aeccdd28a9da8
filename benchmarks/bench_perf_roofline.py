"""The CPU roofline fraction of every bundled suite's perf shape (the table in docs/perf.md).

Runs the perf check (its defaults: hidden 1024, 2 layers, batch 1 x 128 tokens, 8 decoded tokens,
one thread, CPU clock) for every suite and dtype on the cpu backend and prints a markdown table of
the medians and MFU / MBU against the calibration kernels measured in the same run.

Usage: python benchmarks/bench_perf_roofline.py [--dtype float32 --dtype bfloat16] [--suite NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from harness.backends import get  # noqa: E402
from harness.checks import CheckContext, registry  # noqa: E402
from harness.suite.loader import discover, load_suite  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", action="append", default=[])
    ap.add_argument("--dtype", action="append", default=[])
    ap.add_argument("--out", default=str(REPO / "results" / "bench_perf_roofline.json"))
    a = ap.parse_args()
    suites = [REPO / "suites" / f"{s}.toml" for s in a.suite] or discover(REPO / "suites")
    rows = []
    print("| suite | dtype | params | prefill | MFU | decode / token | MFU | MBU | train step | MFU | peak FLOP/s | copy B/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in suites:
        ls = load_suite(path)
        ls.suite.checks.perf = ls.suite.checks.perf.model_copy(update={"enabled": True})
        for dtype in a.dtype or ["float32", "bfloat16"]:
            ctx = CheckContext(ls, get("cpu"), dtype, None, check="perf")
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    registry().get("perf").run(ctx, results_dir=tmp, golden_root=tmp)
                except Exception as e:  # one suite's failure is a row, not the end of the table
                    print(f"| {ls.name} | {dtype} | {type(e).__name__}: {e} |")
                    continue
            m = {k[7:]: float(v) for k, v in ctx.properties if k.startswith("metric.")}
            rows.append({"suite": ls.name, "dtype": dtype, **m})

            def ms(k, m=m):
                return f"{m[k] * 1e3:.1f} ms" if k in m else "-"

            def pc(k, m=m):
                return f"{m[k]:.0%}" if k in m else "-"

            print(f"| {ls.name} | {dtype} | {m['perf_parameters'] / 1e6:.1f} M | {ms('prefill_cpu_s')} | "
                  f"{pc('prefill_mfu')} | {ms('decode_token_cpu_s')} | {pc('decode_mfu')} | {pc('decode_mbu')} | "
                  f"{ms('train_step_cpu_s')} | {pc('train_mfu')} | {m['calib_matmul_flops_per_s'] / 1e9:.0f} G | "
                  f"{m['calib_copy_bytes_per_s'] / 1e9:.1f} G |", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
