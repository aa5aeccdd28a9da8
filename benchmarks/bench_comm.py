"""The comm check's false alarms and detection on this machine, in one run.

One baseline launch of the bundled llama-3.1-8b suite's ``comm`` item (gloo on CPU, its sizes and
world size), recorded as ``harness baseline update`` records it; then ``--clean`` clean launches
compared with it (every regression reported is a false alarm) interleaved with ``--slowed``
launches in which one collective is slowed inside the ranks by ``--delay`` of its median time at
each size (every launch that does not name that collective first is a miss). Prints the bus
bandwidth table of the baseline (the figures docs/perf.md quotes) and the counts.

Usage: python benchmarks/bench_comm.py [--clean 10] [--slowed 5] [--collective all_gather] [--delay 1.0]
       [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.backends import get  # noqa: E402
from harness.checks import CheckContext, CheckFailure, registry  # noqa: E402
from harness.cli import main as cli  # noqa: E402
from harness.suite.loader import load_suite  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def launch(ls, tmp: Path, world: int, delay: dict | None = None) -> tuple[CheckContext, CheckFailure | None]:
    ctx = CheckContext(ls, get("cpu"), "float32", f"w{world}", check="comm")
    try:
        registry().get("comm").run(ctx, results_dir=tmp / "results", golden_root=tmp / "golden", delay=delay)
    except CheckFailure as e:
        return ctx, e
    return ctx, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clean", type=int, default=10)
    ap.add_argument("--slowed", type=int, default=5)
    ap.add_argument("--collective", default="all_gather")
    ap.add_argument("--delay", type=float, default=1.0, help="extra time per call, as a fraction of its median")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    ls = load_suite(REPO / "suites" / "llama-3.1-8b.toml")
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as d:
        tmp = Path(d)
        t = time.perf_counter()
        ctx, _ = launch(ls, tmp, args.world)
        print(f"baseline launch: {time.perf_counter() - t:.1f} s")
        table = json.loads(dict(ctx.properties)["harness.detail.comm_table"])
        print(f"{'collective':<15}{'size':>10}{'median':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
        for row in table.values():
            print(f"{row['collective']:<15}{row['size']:>10}{row['median_s'] * 1e6:>10.0f}us"
                  f"{row['algbw'] / 1e9:>12.3f}{row['busbw'] / 1e9:>12.3f}")
        if cli(["baseline", "update", str(tmp / "results"), "--golden-dir", str(tmp / "golden")]) != 0:
            sys.exit("baseline update failed")
        # the per-call delay the slowed collective gets: the largest size's median x --delay (so every
        # size is slowed by at least that fraction: smaller sizes take less time)
        med = max(r["median_s"] for r in table.values() if r["collective"] == args.collective)
        delay = {args.collective: med * args.delay}
        false_alarms = missed = 0
        for i, kind in enumerate(_interleave(args)):  # alternated: noise hits both alike
            _, fail = launch(ls, tmp, args.world, delay if kind == "slowed" else None)
            if kind == "clean":
                false_alarms += fail is not None
                print(f"clean  {i:>3}: {'FALSE ALARM ' + fail.message if fail else 'no regression'}", flush=True)
            else:
                hit = fail is not None and fail.message.startswith(f"collective {args.collective} ")
                missed += not hit
                print(f"slowed {i:>3}: {'named' if hit else 'MISSED'}: {fail.message if fail else 'no failure'}",
                      flush=True)
        print(f"\nfalse alarms: {false_alarms} of {args.clean} clean launches; "
              f"{args.collective} slowed by {delay[args.collective] * 1e3:.2f} ms per call named in "
              f"{args.slowed - missed} of {args.slowed}")
    return 0


def _interleave(args) -> list[str]:
    """clean and slowed launches alternated while both last, the rest at the end."""
    out, c, s = [], args.clean, args.slowed
    while c or s:
        if c:
            out.append("clean")
            c -= 1
        if s:
            out.append("slowed")
            s -= 1
    return out


if __name__ == "__main__":
    sys.exit(main())
