"""The allocator regime of a measurement (timing.steady_allocator), in fresh processes: mallopt's
thresholds stay fixed for the rest of a process, so each case gets an interpreter of its own."""

import json
import subprocess
import sys

import pytest

from harness.perf.timing import _glibc

# A 16 MiB tensor allocated, freed and allocated again. glibc's dynamic rule serves the first from a
# fresh mmap (16 MiB > its 128 KiB starting threshold), unmaps it on free and raises the threshold,
# so the second comes from newly grown heap: every page faults again (4096 pages of 4 KiB). With
# the thresholds fixed both come from the heap, the freed block is kept, and the second faults none.
CHILD = """
import json, sys, torch
from harness.perf.timing import minor_faults, steady_allocator
with steady_allocator(sys.argv[1]) as what:
    a = torch.empty(4 << 20).fill_(1.0); del a
    f0 = minor_faults(); b = torch.empty(4 << 20).fill_(1.0); del b
    print(json.dumps({"faults": minor_faults() - f0, "what": what}))
"""


def _child(mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc()[0] is None, reason="glibc malloc only")
def test_fixed_thresholds_keep_a_freed_block_warm():
    fixed, as_is = _child("fixed"), _child("as-is")
    assert fixed["what"].startswith("glibc ") and "mmap threshold 32 MiB" in fixed["what"]
    assert as_is["what"].startswith("as-is")
    assert fixed["faults"] < 64, fixed  # the second allocation reuses the freed heap
    assert as_is["faults"] > 1000, as_is  # what the fix is for: the same pages faulted in again
