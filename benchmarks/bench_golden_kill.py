"""kill -9 at random moments during golden replacement, N times; after each kill the golden must
load whole (sha256, every tensor against its manifest), and `harness golden verify` must pass at
the end. Usage: .venv/bin/python benchmarks/bench_golden_kill.py [--kills 50] [--suite llama-3.1-8b]

Writes only under a fresh temporary folder (removed at the end)."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from golden.test_golden_atomic import ENV, HARNESS, REPO, WRITER  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--suite", default="llama-3.1-8b")
    ap.add_argument("--seed", type=int, default=2024)
    a = ap.parse_args()
    from harness.golden import store

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "g"
        t0 = time.perf_counter()
        subprocess.run([HARNESS, "golden", "generate", a.suite, "--golden-dir", str(root)], cwd=REPO, env=ENV,
                       check=True, capture_output=True)
        gen_s = time.perf_counter() - t0
        rng, intact, versions = random.Random(a.seed), 0, set()
        t1 = time.perf_counter()
        for _ in range(a.kills):
            p = subprocess.Popen([sys.executable, "-c", WRITER, str(root), a.suite], cwd=REPO, env=ENV,
                                 stdout=subprocess.PIPE, text=True)
            p.stdout.readline()
            time.sleep(rng.uniform(0.0, 0.25))
            p.kill()
            p.wait()
            p.stdout.close()
            g = store.load_golden_dir(root / a.suite)
            intact += bool(g.order)
            versions.add(store.current_dir(root / a.suite).name)
        loop_s = time.perf_counter() - t1
        r = subprocess.run([HARNESS, "golden", "verify", a.suite, "--golden-dir", str(root)], cwd=REPO, env=ENV,
                           capture_output=True, text=True)
        print(f"generate {gen_s:.1f} s; {a.kills} kills in {loop_s:.1f} s; intact after {intact}/{a.kills}; "
              f"{len(versions)} distinct current versions seen; verify rc={r.returncode}: {r.stdout.strip()}")
        return 0 if intact == a.kills and r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
