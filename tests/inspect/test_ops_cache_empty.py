"""An op-list cache holding ``{"ops": []}`` (``<HARNESS_CACHE_DIR>/ops/<suite>-<dtype>-<key>.json``,
harness.inspect.trace.suite_op_names) is a broken cache, not "this suite has no op items": it is
recomputed with a note, and collection lists the same op items as with a sound cache. (It used to
be read as an empty op list, and every op item of the suite vanished without a word.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = "qwen3-30b-a3b"  # the suite with [checks.ops] enabled


def _collect(cache: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "pytest", f"suites/{SUITE}.toml", "--collect-only", "-q", "-s",
                        "-p", "no:cacheprovider", "--harness-check=ops"], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env=os.environ | {"HARNESS_CACHE_DIR": str(cache),
                                                                 "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


def _op_items(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if f"suites/{SUITE}.toml::ops[cpu-" in line)


@pytest.mark.slow
def test_empty_ops_cache_is_recomputed_and_op_items_stay(tmp_path):
    cache = tmp_path / "cache"
    want = _op_items(_collect(cache).stdout)  # a fresh cache: the trace is run and written
    assert len(want) > 10, want
    files = sorted((cache / "ops").glob("*.json"))
    assert files and all(re.fullmatch(rf"{SUITE}-(float32|bfloat16)-[0-9a-f]{{20}}\.json", f.name) for f in files)
    for f in files:
        f.write_text(json.dumps({"ops": []}))
    r = _collect(cache)
    assert _op_items(r.stdout) == want, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    for f in files:
        assert f"{f}: op-list cache is empty; recomputing it" in out, out[-2000:]
        assert json.loads(f.read_text())["ops"], f  # rewritten with the real op list
