"""Collection time for all bundled suites: how long before the first item can run.

Measured in one process, interpreter start excluded:

* import:   importing harness's plugin and the check modules (pytest, torch, pydantic);
* load:     loading and validating every suite file (TOML + schema + config.json);
* collect:  ``pytest --collect-only suites/`` in-process (all checks, backends, dtypes);
            reported cold (first call, pays lazy imports) and warm (median of the next calls).

Usage: python benchmarks/bench_collect.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


class Count:
    def __init__(self):
        self.n = 0

    def pytest_collection_finish(self, session):
        self.n = len(session.items)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.chdir(REPO)
    t = time.perf_counter()
    import pytest

    import harness.checks
    import harness.run.plugin  # noqa: F401

    harness.checks.registry()
    t_import = time.perf_counter() - t

    from harness.suite.loader import discover, load_suite

    paths = discover("suites")
    t = time.perf_counter()
    for p in paths:
        load_suite(p)
    t_load = time.perf_counter() - t

    times, count = [], Count()
    for _ in range(args.rounds + 1):
        t = time.perf_counter()
        code = pytest.main(["suites", "--collect-only", "-p", "no:terminal", "-p", "no:cacheprovider"],
                           plugins=[count])
        times.append(time.perf_counter() - t)
        assert code == 0, code
    print(f"suites: {len(paths)}   items: {count.n}")
    print(f"import harness plugin + checks : {t_import:8.3f} s")
    print(f"load + validate all suites     : {t_load:8.3f} s  ({t_load / len(paths) * 1e3:.1f} ms per suite)")
    print(f"collect-only, cold             : {times[0]:8.3f} s")
    print(f"collect-only, warm (median)    : {statistics.median(times[1:]):8.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
