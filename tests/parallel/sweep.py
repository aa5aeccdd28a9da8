"""Every bundled suite's default parallel matrix, float32 and bfloat16, N times in a row (by hand:
``python -m tests.parallel.sweep --repeat 5``). Prints one line per item with its errors, and the
worst error per dtype and quantity over everything (what docs/parallel.md derives tolerances from).

``--variants tp2xpp2,pp2xfsdp2-ac`` runs those layouts instead (any layout name, opt-in ones
included; ``--schedule 1F1B`` for their pipeline schedule), all of one world size in one launch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness.checks import parallel as par  # noqa: E402
from harness.parallel.layouts import parse_name  # noqa: E402
from tests.parallel.helpers import metrics_of, run_variant, suite_with  # noqa: E402

SUITES = ("llama-3.1-8b", "qwen3-8b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2")
Q = {"logits": "parallel_logits_error", "loss": "parallel_loss_error", "grads": "parallel_grad_error",
     "weights": "parallel_weight_error", "logits_after": "parallel_logits_after_error",
     "activations": "parallel_activation_error", "router": "parallel_router_error"}


def configs_of(names: list[str], schedule: str | None) -> list[dict]:
    """``[[checks.parallel.configs]]`` entries for layout names (``pp2xtp2``, ``dp2-zero1``, ``-ac``)."""
    out = []
    for name in names:
        lay = parse_name(name)
        entry: dict = {d: getattr(lay, d) for d in ("tp", "pp", "dp", "ep", "fsdp", "cp") if getattr(lay, d) > 1}
        entry.update({"recompute": True} if lay.recompute else {}, **({"zero": lay.zero} if lay.zero else {}))
        if lay.pp > 1 and schedule:
            entry["schedule"] = schedule
        out.append(entry)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="", help="these layouts instead of the default matrix (comma-separated)")
    ap.add_argument("--schedule", default=None, help="pipeline schedule of the --variants layouts with pp")
    ap.add_argument("--max-world", type=int, default=4, help="ranks a layout may use (8 for the 3-D layouts)")
    a = ap.parse_args()
    worst: dict = {}
    fails = 0
    rows = []
    for rep in range(a.repeat):
        for dtype in a.dtypes.split(","):
            for name in a.suites.split(","):
                par.reset_launches()
                # A fresh run root per suite x dtype x repeat: the launcher writes a launch's results
                # under <root>/<hash of spec and layouts>/w<world>-launch<n> and treats results found
                # there as done, so a repeat in the same root would read the previous run's files.
                par._TMP.clear()
                only = [x for x in a.variants.split(",") if x]
                table = {"configs": configs_of(only, a.schedule)} if only else {}
                ls = suite_with(name, max_world=a.max_world, **table)
                for v in par.ParallelCheck().variants(ls, None):
                    t = time.time()
                    out, ctx = run_variant(ls, v, dtype)
                    m = metrics_of(ctx)
                    status = "passed" if out is None else type(out).__name__
                    fails += out is not None and status != "NotApplicable"
                    for q, k in Q.items():
                        if k in m:
                            worst.setdefault(dtype, {})[q] = max(worst.get(dtype, {}).get(q, 0.0), m[k])
                    rows.append({"repeat": rep, "dtype": dtype, "suite": name, "layout": v, "status": status,
                                 **{q: m.get(k) for q, k in Q.items()}, "recompute_peak_ratio": m.get(
                                     "recompute_peak_ratio"), "fsdp_param_fraction": m.get("fsdp_param_fraction"),
                                 "routing_flips_near_tie": m.get("routing_flips_near_tie"),
                                 "peak_bytes": m.get("parallel_peak_bytes"), "seconds": time.time() - t,
                                 "launch_s": m.get("parallel_launch_time_s")})
                    print(f"{rep} {dtype:8} {name:14} {v:9} {status:13} " + " ".join(
                        f"{q}={m[k]:.2e}" for q, k in Q.items() if k in m)
                        + (f" flips={m['routing_flips_near_tie']:g}" if "routing_flips_near_tie" in m else "")
                        + f"  ({time.time() - t:.1f}s)"
                        + ("" if out is None else f"\n    {str(out)[:400]}"), flush=True)
    print("worst:", json.dumps(worst, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "worst": worst}, f, indent=1)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
