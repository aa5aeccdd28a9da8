"""Shards (harness/run/shard.py and --harness-shard): disjoint, complete, the same in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.run import shard
from tests_support import REPO

ids = st.text(alphabet="abcdefgh/.:[]-", min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(ids, st.tuples(st.sampled_from(["smoke", "ops", "perf", "x"]),
                                      st.floats(0.01, 50), st.one_of(st.none(), st.floats(0, 500))),
                       max_size=60),
       st.integers(1, 9))
def test_shards_are_disjoint_complete_and_deterministic(spec, n):
    items = [(i, check, size) for i, (check, size, _) in spec.items()]
    recorded = {i: rec for i, (_, _, rec) in spec.items() if rec is not None}
    expected = shard.expected(items, recorded)
    a = shard.assign(expected, n)
    # every item in exactly one shard, numbered 1..n
    assert set(a) == set(spec) and all(1 <= k <= n for k in a.values())
    # the same whatever order the items were collected in (another process, another worker)
    b = shard.assign(shard.expected(list(reversed(items)), dict(reversed(list(recorded.items())))), n)
    assert a == b
    # longest-first greedy: no shard exceeds the mean by more than the longest item
    if spec:
        totals = shard.loads(expected, a, n)
        assert max(totals) <= sum(totals) / n + max(expected.values()) + 1e-9


def test_records_win_and_estimates_follow_the_records_of_their_check():
    items = [("a", "smoke", 1.0), ("b", "smoke", 2.0), ("c", "ops", 1.0)]
    e = shard.expected(items, {"a": 10.0})
    assert e["a"] == 10.0
    assert e["b"] == pytest.approx(20.0)  # twice a's size, calibrated on a's record
    assert e["c"] == pytest.approx(shard.CHECK_SECONDS["ops"] * 10.0 / shard.CHECK_SECONDS["smoke"])


@pytest.mark.parametrize("spec", ["0/4", "5/4", "x", "1/0"])
def test_bad_shard_spec(spec):
    with pytest.raises(ValueError, match="--shard"):
        shard.parse(spec)


@pytest.mark.slow
def test_bundled_suites_shard_across_processes(tmp_path):
    """Four processes, as four CI jobs: disjoint shards whose union is the unsharded collection."""
    env = os.environ | {"HF_HUB_OFFLINE": "1"}

    def start(*extra):
        return subprocess.Popen([sys.executable, "-m", "pytest", "suites", "--collect-only", "-q", "-p",
                                 "no:cacheprovider", "--harness-backend=cpu", *extra], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def collected(p):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, out + err
        return [line for line in out.splitlines() if "::" in line]

    # the five collections at once, as five CI jobs would run (one after another took 50 s)
    procs = [start()] + [start(f"--harness-shard={k}/4") for k in range(1, 5)]
    whole, *parts = [collected(p) for p in procs]
    assert sum(len(p) for p in parts) == len(whole)
    assert set().union(*map(set, parts)) == set(whole)
    assert all(p for p in parts)
    # the committed records make the commit-scope shards even (issue: slowest / mean <= 1.15)
    recorded = json.loads((REPO / "durations.json").read_text())["durations"]
    totals = [sum(recorded.get(i, 0.0) for i in p) for p in parts]
    assert max(totals) / (sum(totals) / 4) <= 1.15, totals
