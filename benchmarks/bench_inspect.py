"""``harness inspect`` on the full Kimi-K2 config (61 layers, 384 experts, 1.026T parameters):
wall time and peak RSS of one CLI process, as a vendor engineer runs it on a laptop.

Each round is a fresh process (``python -m harness inspect kimi-k2 --no-table``: imports, the meta
build of the unpruned model, parameter/bytes/FLOPs analysis, the meta trace of one forward +
backward of the *full* model, CPU coverage). Peak RSS is the child's ``ru_maxrss``; the phase
timings are the ones the report prints. Goal: under 60 s and under 4 GiB.

Usage: .venv/bin/python benchmarks/bench_inspect.py [--rounds 1] [--target kimi-k2] [--trace full]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(target: str, trace: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "report.json"
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "harness", "inspect", target, "--trace", trace,
                                 "--json", str(out), "--no-table", "-b", "cpu"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate()
        wall = time.perf_counter() - t
        status = proc.returncode
        if status != 0:
            raise SystemExit(f"harness inspect failed ({status}):\n{err[-2000:]}")
        rep = json.loads(out.read_text())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # max over children so far
    inv = rep["inventory"] or {"ops": {}}
    return {"wall_s": round(wall, 2), "peak_rss_bytes": peak, "timings": rep["timings"],
            "total_params": rep["params"]["total"], "activated": rep["params"]["activated"],
            "ops": len(inv["ops"]), "calls": sum(o["count"] for o in inv["ops"].values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--target", default="kimi-k2")
    ap.add_argument("--trace", default="full", choices=("full", "pruned", "none"))
    args = ap.parse_args()
    rows = [one(args.target, args.trace) for _ in range(args.rounds)]
    for i, r in enumerate(rows):
        print(f"round {i}: wall {r['wall_s']:.1f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
              f"{r['total_params'] / 1e12:.3f}T params ({r['activated'] / 1e9:.1f}B activated), "
              f"{r['ops']} ops / {r['calls']} calls traced; phases {r['timings']}")
    best = min(rows, key=lambda r: r["wall_s"])
    ok = best["wall_s"] < 60 and best["peak_rss_bytes"] < 4 * 2**30
    print(json.dumps({"target": args.target, "trace": args.trace, "cpus": os.cpu_count(), **best,
                      "goal": "< 60 s and < 4 GiB", "meets_goal": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
