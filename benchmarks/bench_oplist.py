"""The coverage matrix of every bundled suite x every backend with an op list, in one command:
wall time and peak RSS of one CLI process, as a CI job or a vendor engineer runs it.

Each round is a fresh process (``python -m harness inspect --backends all --json ... --markdown ...``:
imports, for each suite the pruned model built and traced on the meta device, then each op
classified for cpu (dispatcher) and cuda, rocm, xpu, npu, musa, mlu (the shipped op lists, parsed
once per backend per suite)). Peak RSS is the child's ``ru_maxrss``. Goal: under 60 s and 2 GiB.
The same run with ``--backends cpu`` separates the cost of the op lists from that of the traces.

Usage: .venv/bin/python benchmarks/bench_oplist.py [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(backends: str) -> dict:
    """One fresh process; its own peak RSS read through a wrapper so rounds do not mask each other."""
    with tempfile.TemporaryDirectory() as d:
        out, md = Path(d) / "matrix.json", Path(d) / "matrix.md"
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        env.pop("GITHUB_STEP_SUMMARY", None)
        code = ("import resource, runpy, sys; sys.argv = ['harness'] + sys.argv[1:]\n"
                "try:\n    runpy.run_module('harness', run_name='__main__')\n"
                "except SystemExit as e:\n    rc = e.code\nelse:\n    rc = 0\n"
                "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
                "sys.exit(rc or 0)\n")
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code, "inspect", "--backends", backends, "--json", str(out),
                               "--markdown", str(md)], cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"harness inspect --backends failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        rss = int(next(x for x in proc.stderr.splitlines() if x.startswith("RSS ")).split()[1]) * 1024
        mat, md_bytes = json.loads(out.read_text()), len(md.read_text())
    return {"wall_s": round(wall, 2), "peak_rss_bytes": rss, "models": len(mat["models"]),
            "backends": [b["backend"] for b in mat["backends"]], "needs": len(mat["needs"]),
            "in_process_s": mat["timings"]["total_s"], "markdown_bytes": md_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    rows = {spec: [one(spec) for _ in range(args.rounds)] for spec in ("all", "cpu")}
    for spec, rs in rows.items():
        for i, r in enumerate(rs):
            print(f"--backends {spec:<3} round {i}: wall {r['wall_s']:.1f} s (matrix {r['in_process_s']:.1f} s "
                  f"in process), peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, {r['models']} models x "
                  f"{len(r['backends'])} backends ({', '.join(r['backends'])}), {r['needs']} missing/fallback rows")
    best = min(rows["all"], key=lambda r: r["wall_s"])
    cpu = min(rows["cpu"], key=lambda r: r["wall_s"])
    print(f"op lists add {best['wall_s'] - cpu['wall_s']:+.1f} s and "
          f"{(best['peak_rss_bytes'] - cpu['peak_rss_bytes']) / 2**20:+.0f} MiB over the cpu-only matrix")
    ok = best["wall_s"] < 60 and best["peak_rss_bytes"] < 2 * 2**30
    print(f"goal (< 60 s, < 2 GiB): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
