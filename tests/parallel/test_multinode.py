"""The parallel check over two "nodes" (harness run --nodes 2 --launcher netns): each rank's results
come back through the coordinator's store, the verdicts are those of one host (the same numbers: the
same collectives over a veth link instead of loopback), and a node lost inside a collective is an
infrastructure finding naming the node and its ranks, never the model's failure."""

from __future__ import annotations

import pytest

from harness.checks import CheckFailure, CouldNotRun
from harness.checks import parallel as par
from harness.launch.nodes import netns_available
from tests.parallel.helpers import details_of, metrics_of, run_variant, suite_with

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(netns_available()), reason=netns_available() or "root")]


@pytest.fixture(autouse=True)
def _fresh_launch_cache():
    par.reset_launches()
    yield
    par.reset_launches()


def _matrix(ls, **options):
    out = {v: run_variant(ls, v, "float32", **options) for v in par.ParallelCheck().variants(ls, None)}
    par.reset_launches()
    return out


def test_two_nodes_give_one_hosts_verdicts_and_numbers(monkeypatch):
    ls = suite_with("qwen3-8b", configs=[{"tp": 2}, {"dp": 2}])
    one = _matrix(ls, fault="tests.parallel.faults:skip_rowwise_allreduce")
    monkeypatch.setenv("HARNESS_NODES", "2")
    monkeypatch.setenv("HARNESS_NODE_LAUNCHER", "netns")
    two = _matrix(ls, fault="tests.parallel.faults:skip_rowwise_allreduce")
    for res in (one, two):  # the planted fault caught at its module, the healthy layout passing, on both
        assert isinstance(res["tp2"][0], CheckFailure), res["tp2"][0]
        assert "First diverging module: model.layers.0.self_attn.o_proj" in str(res["tp2"][0])
        assert res["dp2"][0] is None, res["dp2"][0]
    m1, m2 = metrics_of(one["dp2"][1]), metrics_of(two["dp2"][1])
    for k in ("parallel_grad_error", "parallel_logits_after_error", "parallel_loss_error"):
        if k in m1:
            assert m2[k] == m1[k], (k, m1[k], m2[k])  # 2-rank sums: the same bits over any link
    assert "parallel_nodes" not in m1 and m2["parallel_nodes"] == 2
    placement = details_of(two["dp2"][1])["placement"]
    assert "node 0 (" in placement and "node 1 (node1)" in placement, placement


def test_a_node_lost_inside_a_collective_is_infrastructure_naming_the_node(monkeypatch):
    monkeypatch.setenv("HARNESS_NODES", "2")
    monkeypatch.setenv("HARNESS_NODE_LAUNCHER", "netns")
    ls = suite_with("qwen3-8b", configs=[{"dp": 2}, {"tp": 2}])
    res = _matrix(ls, fault="tests.parallel.faults:lose_node1")
    for v in ("dp2", "tp2"):
        out = res[v][0]
        assert isinstance(out, CouldNotRun), (v, out)  # error, not failed: not the model's
        msg = str(out)
        assert "node 1 (node1, " in msg and "was lost with its ranks [" in msg, msg
        assert "none of its ranks wrote an exit record" in msg, msg


def test_harness_run_nodes_2_really_spans_two_nodes(tmp_path):
    # `harness run --nodes 2` once ran every launch on one host: its early worker started before the
    # run's nodes reached the environment. The junit of a real run must place ranks on both nodes.
    import os
    import subprocess
    import sys
    import xml.etree.ElementTree as ET

    res = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "harness", "run", "llama-3.1-8b", "--scope", "nightly", "--check",
                        "parallel", "--backend", "cpu", "--dtype", "float32", "-k", "tp2]", "--nodes", "2",
                        "--launcher", "netns", "--results", str(res)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cases = ET.parse(res / "junit.xml").getroot().iter("testcase")
    props = [{p.get("name"): p.get("value") for p in c.iter("property")} for c in cases]
    props = [p for p in props if "metric.parallel_launch_layouts" in p]
    assert props and all(float(p.get("metric.parallel_nodes", 0)) == 2 for p in props), props
    assert all("node 1 (node1)" in p.get("harness.detail.placement", "") for p in props), props
