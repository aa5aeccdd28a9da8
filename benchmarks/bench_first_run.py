"""The README's first command as a new user meets it (issue #52): `harness run` on the bundled suites
with an empty inductor cache, wall time and exit code, quiet or under an artificial load, and the
configuration before #52 (code generation on commit for every suite, one process) side by side.

Each variant runs in a fresh copy of the repository's suites and durations (so the bundled suite
files are never edited), with its own empty TORCHINDUCTOR_CACHE_DIR, and reports:

* wall seconds of the whole command (the user's figure: process start to exit),
* its exit code, the outcome counts, the items reported "hung", and the slowest items.

Variants:
  now     the bundled suites as they are, `harness run` (its default workers)
  before  the same suites with `codegen_scope = "nightly"` removed (inductor's code generation on
          commit for all six suites) and `-n 0` (one process): the configuration the issue measured

``--load N`` keeps N processes spinning on the CPU for the whole variant (4x the cores is the issue's
test: ``--load 8`` on 2 cores); they stop by themselves after 30 minutes at the latest.

Usage: python benchmarks/bench_first_run.py [--variants now before] [--load 0]

Measured (2 cores, 2026-12-05, empty inductor cache, no engine environment):
  now, quiet:                       169.5 s, exit 0, 216 passed, 38 skipped, 0 hung
  now, --load 8 in one session:     223.8 s, exit 0, 0 hung (the kernel's autogroup gave the spinners
                                    one share between them: a mild load)
  now, --load 8, a session each:    1261.6 s (21 min), exit 0, 216 passed, 38 skipped, 0 failed, 0 hung;
                                    slowest items llama-3.1-8b compile bf16 299 s, fp32 286 s (load
                                    average 12-13: other work on the machine besides the 8 spinners)
  before (issue #52's measurement): 7.7 minutes quiet; 25.5 minutes at load average 7-11, with 2
                                    compile items falsely killed as hung
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = Path(sys.executable).with_name("harness")


def _spinners(n: int, lifetime_s: float = 1800) -> list[subprocess.Popen]:
    code = f"import time\nend = time.monotonic() + {lifetime_s}\nwhile time.monotonic() < end: pass\n"
    # each in a session of its own, as other users' jobs are: with the kernel's autogroup scheduling
    # (on here) spinners sharing one session would share one CPU share and load the machine far less
    return [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(n)]


def _project(variant: str, root: Path) -> Path:
    shutil.copytree(REPO / "suites", root / "suites")
    shutil.copy(REPO / "durations.json", root / "durations.json")
    if (REPO / "golden").exists():
        shutil.copytree(REPO / "golden", root / "golden")
    if variant == "before":
        for f in (root / "suites").glob("*.toml"):
            f.write_text(re.sub(r'(?m)^codegen_scope = "nightly"\n', "", f.read_text()))
    return root


def run_variant(variant: str, load: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-first-{variant}-") as tmp:
        root = _project(variant, Path(tmp))
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "HF_HUB_OFFLINE": "1"}
        cmd = [str(HARNESS), "run", "--results", str(root / "results")]
        if variant == "before":
            cmd += ["-n", "0"]
        spin = _spinners(load)
        try:
            t0 = time.monotonic()
            p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
            wall = time.monotonic() - t0
        finally:
            for s in spin:
                s.kill()
                s.wait()
        summary = json.loads((root / "results" / "summary.json").read_text())
        items = summary["items"]
        hung = [r["nodeid"] for r in items if r.get("message", "").startswith("hung:")]
        slow = sorted(items, key=lambda r: -r.get("duration", 0))[:5]
        return {"variant": variant, "load": load, "wall_s": round(wall, 1), "exit": p.returncode,
                "counts": summary["counts"], "hung": hung,
                "slowest": [(r["nodeid"], round(r.get("duration", 0), 1)) for r in slow],
                "tail": p.stdout.strip().splitlines()[-1:]}


def main() -> int:
    import signal

    # a SIGTERM (`timeout`, a cancelled job) unwinds through run_variant's finally: no spinner outlives us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["now", "before"], choices=["now", "before"])
    ap.add_argument("--load", type=int, default=0, help="processes spinning on the CPU meanwhile")
    args = ap.parse_args()
    out = [run_variant(v, args.load) for v in args.variants]
    for r in out:
        print(json.dumps(r, indent=1))
    if len(out) == 2:
        print(f"before / now wall: {out[1]['wall_s'] / out[0]['wall_s']:.2f}x "
              f"({out[1]['wall_s']:.0f} s -> {out[0]['wall_s']:.0f} s, load {args.load}, {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
