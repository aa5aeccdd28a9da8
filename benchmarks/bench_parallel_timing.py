"""Per parallel layout of a suite's default matrix: step time, time inside collectives and its exposed
part, scaling efficiency against one rank, and ``harness plan``'s calibrated estimate against the
measured step (the parallel check's ``timing`` step, issue #30 item 4), plus what timing costs the
launch: the same matrix with ``timing_repeats = 0`` and with the default, alternated per round.

Usage: .venv/bin/python benchmarks/bench_parallel_timing.py [--suite qwen3-8b] [--rounds 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.backends import get  # noqa: E402
from harness.checks import CheckContext, CheckOutcome, registry  # noqa: E402
from harness.checks import parallel as par  # noqa: E402
from harness.checks.parallel import ParallelConfig  # noqa: E402
from harness.suite.loader import load_suite  # noqa: E402


def matrix(suite: str, repeats: int) -> tuple[float, dict]:
    """Every layout of the suite's default matrix as the check runs them: (wall s, metrics per layout)."""
    ls = load_suite(REPO / "suites" / f"{suite}.toml")
    ls.suite.checks.parallel = ParallelConfig.model_validate({"enabled": True, "timing_repeats": repeats})
    check = registry().get("parallel")
    par.reset_launches()
    out = {}
    t = time.perf_counter()
    for v in check.variants(ls, get("cpu")):
        ctx = CheckContext(ls, get("cpu"), "float32", v, check="parallel")
        try:
            check.run(ctx)
        except CheckOutcome as e:
            out[v] = {"outcome": type(e).__name__ + ": " + str(e).splitlines()[0]}
            continue
        props = dict(ctx.properties)
        out[v] = {k[len("metric."):]: float(x) for k, x in props.items() if k.startswith("metric.")}
        out[v]["timing"] = json.loads(props.get("harness.detail.timing", "{}"))
    return time.perf_counter() - t, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="qwen3-8b")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    walls: dict[int, list[float]] = {0: [], args.repeats: []}
    last = {}
    for r in range(args.rounds):
        for reps in ((0, args.repeats) if r % 2 == 0 else (args.repeats, 0)):
            w, res = matrix(args.suite, reps)
            walls[reps].append(w)
            if reps:
                last = res
            print(f"round {r}: timing_repeats={reps}: {w:.1f} s", flush=True)
    print(f"\n{args.suite}, float32, gloo on {os.cpu_count()} CPU cores, one thread per rank")
    print(f"{'layout':<10}{'step ms':>9}{'1 rank':>8}{'eff':>6}{'comm ms':>9}{'exposed':>9}{'share':>7}"
          f"{'plan ms':>9}{'plan err':>9}{'plan comm':>10}{'of it lat':>10}{'msgs':>6}{'counted':>8}")
    for v, m in last.items():
        if "outcome" in m:
            print(f"{v:<10}{m['outcome']}")
            continue
        t = m["timing"]
        plan = t.get("plan") or {}
        print(f"{v:<10}{m['parallel_step_time_s'] * 1e3:>9.1f}{m['parallel_single_step_s'] * 1e3:>8.1f}"
              f"{m['parallel_scaling_efficiency']:>6.2f}{m['parallel_comm_time_s'] * 1e3:>9.1f}"
              f"{m['parallel_exposed_comm_s'] * 1e3:>9.1f}{m['parallel_exposed_comm_share']:>7.0%}"
              f"{m.get('parallel_plan_step_s', float('nan')) * 1e3:>9.2f}"
              f"{m.get('parallel_plan_step_error', float('nan')):>+9.0%}{plan.get('comm_s', float('nan')) * 1e3:>10.2f}"
              f"{plan.get('comm_latency_s', float('nan')) * 1e3:>10.2f}{plan.get('comm_messages', float('nan')):>6.0f}"
              f"{plan.get('collectives_counted', float('nan')):>8.0f}")
    busbw = {m.get("parallel_world_size"): m.get("parallel_probe_busbw") for m in last.values() if "outcome" not in m}
    print("probe busbw (1 MiB all-reduce): " + ", ".join(f"{int(w)} ranks {b / 1e9:.2f} GB/s"
                                                           for w, b in sorted(busbw.items()) if b))
    lat = {m.get("parallel_world_size"): m.get("parallel_probe_latency_s") for m in last.values() if "outcome" not in m}
    print("probe latency (one-element all-reduce): " + ", ".join(f"{int(w)} ranks {x * 1e3:.3f} ms"
                                                                  for w, x in sorted(lat.items()) if x))
    off, on = statistics.median(walls[0]), statistics.median(walls[args.repeats])
    print(f"matrix wall: timing off {off:.1f} s, on ({args.repeats} repeats) {on:.1f} s -> x{on / off:.2f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
