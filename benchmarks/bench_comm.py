"""The comm check's false alarms and detection on this machine, in one run.

``--baseline-runs`` launches of the bundled llama-3.1-8b suite's ``comm`` item (gloo on CPU, its
sizes and world size), pooled as ``harness baseline update DIR1 DIR2 DIR3`` pools them; then
``--clean`` clean launches compared with it (a regression is a false alarm; "too noisy to judge" is
counted apart) interleaved with ``--slowed`` launches per level of ``--shares`` in which the library's
call of ``--collective`` is that much slower inside the ranks (harness/perf/comm.py
``_slow_library``: a sleep of that share of each call's own time; on gloo reduce_scatter slows with
all_reduce); a slowed launch counts as confirmed when the failure's first line names that collective.
Prints the bus bandwidth table of the first baseline launch, one line per launch with the 1-minute
load average, and the counts; ``--out FILE`` keeps them as JSON.

Measured 6 Dec 2026 on this shared 2-core machine under the load other jobs put on it (docs/perf.md
"Communication" has the table), ``--baseline-runs 3 --clean 20 --slowed 20``:

* 09:13-09:37 UTC, load average 7.3-12.6 (median 9.0), ``--shares 50,30``: 0 false alarms in 20
  clean launches; all_reduce 50% slower confirmed in 14 of 20, 30% slower in 10 of 20 (the final
  rule replayed on the saved samples; by the old rule, medians pooled as independent samples: 4
  false alarms, 8 and 6 confirmed);
* 09:41-09:52 UTC, load average 5.3-7.5 (median 6.0), ``--shares 50``: 1 false alarm in 20 (3 more
  "too noisy to judge"); 50% slower confirmed in 13 of 20 (old rule: 0 and 4).

So at most 1 false alarm in 20 holds; at least 19 in 20 confirmed does not, at these loads. 20% is
under the check's 25% threshold and not promised.

7 Dec 2026, with the check's re-measure of a suspected regression (a second launch; ``--load 6``: six
spinners beside the launches, each in a session of its own):

* quiet (load 1.0-1.9): 0 false alarms in 20, 20 of 20 confirmed (the re-measure then asked for a second
  regression);
* ``--load 6`` (load 5.6-8.1), the same: 0 of 20, 12 of 20 (7 more taken back by their re-measures);
* ``--load 6`` (load 6.1-7.9), the re-measure asking for "slower again" (the shipped rule): 0 of 20 (one
  first-launch false alarm, all_reduce +133.6 %, taken back), 16 of 20 (3 too noisy, 1 missed).

7 Dec 2026, later (``--load 6``, ``--out`` keeps every launch's re-measure samples too, so each rule can be
replayed on a run's launches; docs/perf.md "Communication" has both runs with every rule):

* 14:48-15:08 (load 6.0-7.9), too-noisy collectives re-measured and judged on two launches pooled (the shipped
  rule): 1 false alarm in 20 (the lenient "slower again"), 19 of 20 confirmed;
* 15:12-15:38 (load 6.2-7.9), "suspects" re-measured too (tried, taken back): 1 of 20 (filed on two launches
  pooled), 13 of 20; the shipped rule replayed on it: 0 of 20, 12 of 20 - a baseline whose launches waited out
  scheduler ticks at two sizes.

Usage: python benchmarks/bench_comm.py [--baseline-runs 3] [--clean 20] [--slowed 20] [--shares 50]
       [--collective all_reduce] [--world 2] [--out results/bench_comm.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_first_run import _spinners  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def launch(ls, tmp: Path, world: int, delay: dict | None = None, results: str = "results"):
    """One launch of the comm item: (its context, the failure or None, its verdict)."""
    ctx = CheckContext(ls, get("cpu"), "float32", f"w{world}", check="comm")
    fail = None
    try:
        registry().get("comm").run(ctx, results_dir=tmp / results, golden_root=tmp / "golden", delay=delay)
    except CheckFailure as e:
        fail = e
    props = dict(ctx.properties)
    verdict = json.loads(props.get("harness.detail.comm_verdict") or "{}")
    side = json.loads(Path(props["harness.detail.comm_samples"]).read_text())
    verdict["samples"], verdict["remeasure_samples"] = side["samples"], side.get("remeasure_samples")
    verdict["remeasure"] = json.loads(props.get("harness.detail.comm_remeasure") or "null")
    return ctx, fail, verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-runs", type=int, default=3, help="launches pooled into the baseline")
    ap.add_argument("--clean", type=int, default=20)
    ap.add_argument("--slowed", type=int, default=20, help="slowed launches per share")
    ap.add_argument("--shares", default="50", help="comma-separated slowdowns of the library's call, in %%")
    ap.add_argument("--collective", default="all_reduce")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=None, help="write every launch's outcome here (JSON)")
    ap.add_argument("--load", type=int, default=0, help="processes spinning on the CPU meanwhile, each in a "
                    "session of its own (benchmarks/bench_first_run.py): other jobs' load, made on purpose")
    args = ap.parse_args()
    spinners = _spinners(args.load)
    try:
        return _main(args)
    finally:
        for sp in spinners:
            sp.kill()


def _main(args) -> int:
    shares = [s.strip() for s in args.shares.split(",") if s.strip()]
    ls = load_suite(REPO / "suites" / "llama-3.1-8b.toml")
    log: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as d:
        tmp = Path(d)
        t = time.perf_counter()
        for i in range(args.baseline_runs):
            ctx, _, verdict = launch(ls, tmp, args.world, results=f"b{i}")
            log.append({"kind": "baseline", "load": os.getloadavg()[0], "samples": verdict["samples"]})
            if i == 0:
                table = json.loads(dict(ctx.properties)["harness.detail.comm_table"])
        print(f"{args.baseline_runs} baseline launches: {time.perf_counter() - t:.1f} s, load {os.getloadavg()[0]:.1f}")
        print(f"{'collective':<15}{'size':>10}{'median':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}")
        for row in table.values():
            print(f"{row['collective']:<15}{row['size']:>10}{row['median_s'] * 1e6:>10.0f}us"
                  f"{row['algbw'] / 1e9:>12.3f}{row['busbw'] / 1e9:>12.3f}")
        dirs = [str(tmp / f"b{i}") for i in range(args.baseline_runs)]
        if cli(["baseline", "update", *dirs, "--golden-dir", str(tmp / "golden")]) != 0:
            sys.exit("baseline update failed")
        for i, kind in enumerate(_interleave(args.clean, args.slowed, shares)):  # alternated: load hits all alike
            delay = None if kind == "clean" else {args.collective: f"{kind}%"}
            t = time.perf_counter()
            _, fail, verdict = launch(ls, tmp, args.world, delay)
            status = verdict.get("status")
            first = fail.message.splitlines()[0] if fail else ""
            named = first.startswith(f"collective {args.collective} ")
            outcome = ("false alarm" if fail else "noisy" if status == "noisy" else "clean") if kind == "clean" \
                else ("confirmed" if named else "wrong" if fail else "noisy" if status == "noisy" else "missed")
            if not fail and (verdict.get("remeasure") or {}).get("not_repeated"):
                outcome += " (first launch flagged it, the re-measure did not)"
            if fail and (verdict.get("remeasure") or {}).get("pooled"):
                outcome += " (on two launches pooled)"
            log.append({"kind": kind, "outcome": outcome, "status": status, "load": os.getloadavg()[0],
                        "wall_s": time.perf_counter() - t, "message": first[:300], "remeasure": verdict["remeasure"],
                        "remeasure_samples": verdict["remeasure_samples"],
                        "decisions": {k: {f: d.get(f) for f in ("verdict", "change", "ratio", "p_value", "why")}
                                      for k, d in (verdict.get("decisions") or {}).items()
                                      if k.startswith(args.collective + "/")}, "samples": verdict["samples"]})
            print(f"{kind:>5} {i:>3} load {log[-1]['load']:4.1f}: {outcome}{': ' + first[:160] if first else ''}",
                  flush=True)
            if args.out:  # after every launch: a stopped run keeps what it measured
                _save(args, log)
    loads = [r["load"] for r in log if r["kind"] != "baseline"]
    print(f"\nload average (1 min) over the launches: {min(loads):.1f}-{max(loads):.1f}, "
          f"median {sorted(loads)[len(loads) // 2]:.1f}")
    for kind in ["clean", *shares]:
        rows = [r for r in log if r["kind"] == kind]
        counts = {o: sum(r["outcome"] == o for r in rows) for o in dict.fromkeys(r["outcome"] for r in rows)}
        what = "clean" if kind == "clean" else f"{args.collective} {kind}% slower"
        print(f"{what}: {len(rows)} launches: " + ", ".join(f"{o} {n}" for o, n in counts.items()))
    return 0


def _save(args, log: list[dict]) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "launches": log}))


def _interleave(clean: int, slowed: int, shares: list[str]) -> list[str]:
    """clean and slowed launches (each share in turn) alternated while they last, the rest at the end."""
    left = {"clean": clean, **{s: slowed for s in shares}}
    out = []
    while any(left.values()):
        for k in left:
            if left[k]:
                out.append(k)
                left[k] -= 1
    return out


if __name__ == "__main__":
    sys.exit(main())
