"""The streamed run's full-size target: built straight onto its device (harness.weights.place) vs the
former build (the whole model in float32 on the host, then cast to the run dtype), on a synthetic bf16
checkpoint (bench_weights' writer). Each build runs in a fresh process; reported: the peak resident
memory over the process's baseline (VmHWM - VmRSS before the build), the model's own bytes in the run
dtype, and the build time, with the ratios new / former, side by side in one run.

Usage: python benchmarks/bench_stream_build.py [--layers 12] [--hidden 2048] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, sys, time, torch
from pathlib import Path
torch.set_num_threads(2)
from harness.models.build import build_model, instantiate, model_config, torch_dtype
from harness.suite.loader import load_suite
from harness.weights.layout import open_checkpoint
from harness.weights.place import build_placed, plan_placement

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024

how, suite, dtype = sys.argv[1], sys.argv[2], torch_dtype(sys.argv[3])
ls = load_suite(suite)
mc = model_config(ls, pruned=False)
with torch.device("meta"):
    meta = instantiate(ls, mc, torch.float32)   # imports and a meta build, outside the measure
ck = open_checkpoint(ls.weights_path)
Path("/proc/self/clear_refs").write_text("5")
base = status("VmRSS:")
t = time.perf_counter()
if how == "placed":
    model, _ = build_placed(ls, mc, dtype, plan_placement(meta, dtype, [("cpu", 1 << 40)]), ck)
else:
    model, _ = build_model(ls, dtype, "cpu", mc=mc)
dt = time.perf_counter() - t
own = sum(v.numel() * v.element_size() for v in model.state_dict().values())
print(json.dumps({"peak_growth": status("VmHWM:") - base, "model_bytes": own, "seconds": dt}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from benchmarks.bench_weights import write_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-stream-build-"))
    try:
        info = write_checkpoint(tmp / "ckpt", args.layers, args.hidden, args.shard_mb)
        suite = tmp / "bench.toml"
        suite.write_text('[model]\nconfig = "ckpt/config.json"\nweights = "ckpt"\n')
        print(f"checkpoint: {info['bytes'] / 2**30:.2f} GiB in {info['shards']} shards, {args.layers} layers; "
              f"target dtype {args.dtype}")
        out = {}
        for how in ("former", "placed"):
            r = subprocess.run([sys.executable, "-c", CHILD, how, str(suite), args.dtype], capture_output=True,
                               text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
            out[how] = json.loads(r.stdout.strip().splitlines()[-1])
            o = out[how]
            print(f"{how:>7}: peak RSS growth {o['peak_growth'] / 2**30:.2f} GiB = {o['peak_growth'] / o['model_bytes']:.2f} "
                  f"x the model's {o['model_bytes'] / 2**30:.2f} GiB; {o['seconds']:.2f} s")
        a, b = out["former"], out["placed"]
        print(f"ratio placed / former: peak {b['peak_growth'] / a['peak_growth']:.3f}, time {b['seconds'] / a['seconds']:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
