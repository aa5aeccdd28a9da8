"""The test device's fixtures (issue #28): the built device, declared to harness through its entry point.

The device is built (C++, JIT, cached in testdev/.build) and used only in subprocesses: importing it
renames PrivateUse1 for the whole process and registers kernels that cannot be unregistered, which
the rest of the suite's process must not inherit (an xdist worker runs other tests after these). It
is declared to harness the way a vendor package is, through its ``harness.backends`` entry point:
the fixture puts the source folder on PYTHONPATH (a stable path, so the build cache holds across
sessions; pip would copy the sources and force a rebuild) beside a ``.dist-info`` whose
``entry_points.txt`` is generated from testdev/pyproject.toml itself, so the shared venv is not
changed. ``pip install -e testdev --no-deps --no-build-isolation`` declares it the same way.

Skipped, with the reason, where there is no C++ compiler or the build fails. Every test here runs in
.ci/run, the long device runs included (issue #44: they once ran only under an environment variable that
only CI's ``testdev`` job set); that job adds what is no test: every bundled suite's items and the nightly
perf items on the device, and ``harness certify`` on it (.ci/testdev).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from testdev_support import BUILD_TIMEOUT_S, declare, device_env, py


@pytest.fixture(scope="session")
def meta(tmp_path_factory) -> Path:
    m = tmp_path_factory.mktemp("testdev-declared")
    declare(m)
    return m


@pytest.fixture(scope="session")
def env(meta):
    """The environment whose Python sees the built test device (built here on first use)."""
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler (c++ or g++) on PATH: the test device cannot be built")
    e = device_env(meta)
    t0 = time.monotonic()
    r = py(e, "import harness_testdev, torch; assert torch.hdev.device_count() >= 1", timeout=BUILD_TIMEOUT_S)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"the test device did not build: {last[:300]}")
    print(f"test device build/load {time.monotonic() - t0:.1f} s")
    return e
