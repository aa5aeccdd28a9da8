"""A 4-layout parallel matrix on one suite: one torchrun launch for all four layouts (what the
parallel check does: layouts of one world size share a launch) against four launches of one layout
each (one launch per item). Same code path as the check (``harness.parallel.launcher.launch``),
2 gloo ranks on CPU, one thread per rank. Goal: ratio (one launch / four launches) under 0.5.

Each round runs both, alternating which goes first so that machine load drifts hit both alike.

Usage: .venv/bin/python benchmarks/bench_parallel.py [--suite qwen3-8b] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.chdir(REPO)

from harness.parallel.launcher import launch  # noqa: E402
from harness.parallel.layouts import parse_name  # noqa: E402

LAYOUTS = ("tp2", "pp2", "dp2", "fsdp2")


def spec(suite: str) -> dict:
    return {"suite": str(REPO / "suites" / f"{suite}.toml"), "collective": "gloo", "dtype": "float32", "seed": 0,
            "batch_size": 4, "seq_len": 8, "lr": 0.5, "memory_seq_len": 128, "pg_timeout_s": 600,
            "capacity_factor": 0.0, "tp_plan": {}, "fault": None}


def together(suite: str, root: Path) -> float:
    t = time.perf_counter()
    rep = launch(spec(suite), [parse_name(n) for n in LAYOUTS], 2, root / "together", timeout_s=300)
    assert all(o.status == "ok" for o in rep.outcomes.values()), {k: o.message for k, o in rep.outcomes.items()}
    return time.perf_counter() - t


def apart(suite: str, root: Path) -> float:
    t = time.perf_counter()
    for n in LAYOUTS:
        rep = launch(spec(suite), [parse_name(n)], 2, root / f"apart-{n}", timeout_s=300)
        assert rep.outcomes[n].status == "ok", rep.outcomes[n].message
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="qwen3-8b")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    rows = []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-parallel-") as d:
            root = Path(d)
            if r % 2 == 0:
                one, four = together(a.suite, root), apart(a.suite, root)
            else:
                four, one = apart(a.suite, root), together(a.suite, root)
        rows.append({"round": r, "one_launch_s": round(one, 1), "four_launches_s": round(four, 1),
                     "ratio": round(one / four, 3)})
        print(json.dumps(rows[-1]), flush=True)
    ratio = sum(x["ratio"] for x in rows) / len(rows)
    print(f"{len(LAYOUTS)} layouts of {a.suite} (world 2): one launch / four launches = {ratio:.3f} "
          f"(goal < 0.5) over {len(rows)} round(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
