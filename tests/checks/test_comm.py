"""The comm check (issue #30 item 4): gloo's collectives on 2 real ranks, algorithm and bus bandwidth
as nccl-tests defines them, a baseline through `harness baseline update`, and one collective slowed
inside the ranks named in the verdict."""

from __future__ import annotations

import json
import os
import re
import statistics

import pytest

from harness.backends import get
from harness.checks import CheckContext, CheckFailure, NotApplicable, registry
from harness.cli import main
from harness.launch.nodes import netns_available
from harness.perf.comm import bandwidths, bus_factor
from harness.suite.loader import load_suite
from tests_support import TINY_PRUNE

COMM = """
[model]
config = "configs/Llama-3.1-8B.json"
{prune}
[checks.comm]
enabled = true
scope = "commit"
sizes = [4096, 262144]
warmup = 2
repeats = 8
"""


def test_bus_bandwidth_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("broadcast", 4) == bus_factor("send_recv", 2) == 1.0
    assert bandwidths("all_reduce", 1 << 20, 0.001, 2) == pytest.approx(((1 << 20) / 0.001, (1 << 20) / 0.001))


def _run(ls, tmp, variant="w2", delay=None, **options):
    ctx = CheckContext(ls, get("cpu"), "float32", variant, check="comm")
    registry().get("comm").run(ctx, results_dir=tmp / "results", golden_root=tmp / "golden", delay=delay, **options)
    return ctx


@pytest.mark.slow
def test_collectives_measured_baselined_and_a_slowed_one_named(write_suite, tmp_path):
    ls = load_suite(write_suite("commtiny", COMM.format(prune=TINY_PRUNE)))
    assert registry().get("comm").variants(ls, get("cpu")) == ["w2"]
    ctx = _run(ls, tmp_path)
    p = dict(ctx.properties)
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"):
        assert float(p[f"metric.comm_{coll}_busbw"]) > 0 and float(p[f"metric.comm_{coll}_latency_s"]) > 0
    table = json.loads(p["harness.detail.comm_table"])
    row = table["all_reduce/262144"]
    assert row["busbw"] == pytest.approx(row["algbw"] * 1.0)  # 2(n-1)/n = 1 for two ranks
    assert json.loads(p["harness.detail.comm_verdict"])["status"] == "no-baseline"
    assert main(["baseline", "update", str(tmp_path / "results"), "--golden-dir", str(tmp_path / "golden")]) == 0
    # all_gather 20 ms slower per call inside the ranks (a slow collective path): named first, at every
    # size. The other collectives are not asserted clean, nor below all_gather's change: under pytest
    # -n 2 the other worker's load differs between the baseline launch and this one (seen:
    # reduce_scatter, all_reduce; a 4 KiB all_to_all once +3091 % against all_gather's +797 %, in the
    # fresh-clone run of 64d8475); the check is exclusive in a harness run, and its false-alarm rate is
    # measured in benchmarks/.
    with pytest.raises(CheckFailure) as e:
        _run(ls, tmp_path, delay={"all_gather": 0.02})
    assert e.value.message.startswith("collective all_gather regressed"), e.value.message
    assert "all_gather (2 of 2 sizes)" in e.value.message.partition("slower: ")[2]
    assert e.value.metric == "comm_all_gather_busbw" and "busbw now" in e.value.details
    rows = [line.split() for line in e.value.details.splitlines()[1:] if line.strip() and "baseline:" not in line]
    # 20 ms on calls of a few ms at most: at least twice as slow at each size. Not "several times": how
    # many times depends on the baseline launch's own load (CI's run of 68e6724: the 4 KiB baseline took
    # ~7 ms a call beside the other worker, and 20 ms more measured +292 %, against +5103 % at 256 KiB)
    changes = [float(r[-2].rstrip("%")) for r in rows if r[0] == "all_gather"]
    assert len(changes) == 2 and min(changes) > 100.0, rows


def test_one_rank_is_not_a_collective(write_suite, tmp_path):
    ls = load_suite(write_suite("commone", COMM.format(prune=TINY_PRUNE)))
    with pytest.raises(NotApplicable, match="at least 2 ranks"):
        _run(ls, tmp_path, variant="w1")


COMM4 = """
[model]
config = "configs/Llama-3.1-8B.json"
{prune}
[checks.comm]
enabled = true
scope = "commit"
world_sizes = [4]
collectives = ["all_reduce", "send_recv"]
sizes = [4096]
warmup = 2
repeats = 8
pair_bytes = 16384
"""


@pytest.mark.slow
@pytest.mark.skipif(bool(netns_available()), reason=netns_available() or "root")
def test_a_slow_link_between_two_nodes_is_named_by_its_pairs(write_suite, tmp_path, monkeypatch):
    # 4 ranks over two namespaced nodes (harness run --nodes 2 --launcher netns); the baseline on the
    # clean link, then node 1's end of it throttled to 2 Mbit/s (tc tbf; this kernel has no netem): the
    # pairs that cross it are named, with their hosts, and the link between the two hosts
    monkeypatch.setenv("HARNESS_NODES", "2")
    monkeypatch.setenv("HARNESS_NODE_LAUNCHER", "netns")
    ls = load_suite(write_suite("commnodes", COMM4.format(prune=TINY_PRUNE)))
    ctx = _run(ls, tmp_path, variant="w4")
    pairs = json.loads(dict(ctx.properties)["harness.detail.comm_pairs"])
    assert sorted(pairs) == ["pair/0-1", "pair/0-2", "pair/0-3", "pair/1-2", "pair/1-3", "pair/2-3"], pairs
    hosts = {h for p in pairs.values() for h in re.findall(r"\(([^)]+)\)", p["link"])}
    assert hosts == {os.uname().nodename, "node1"}, pairs  # this host and the namespaced node's own hostname
    assert main(["baseline", "update", str(tmp_path / "results"), "--golden-dir", str(tmp_path / "golden")]) == 0
    with pytest.raises(CheckFailure) as e:
        ctx = CheckContext(ls, get("cpu"), "float32", "w4", check="comm")
        registry().get("comm").run(ctx, results_dir=tmp_path / "results", golden_root=tmp_path / "golden",
                                   link_rate={1: 2})
    msg = e.value.message
    assert msg.startswith("slow link: rank") and e.value.metric == "comm_pair_round_trip_s", msg
    assert f"joins {' and '.join(sorted(hosts))}: the link between them" in msg, msg
    assert "; confirmed on re-measure" in msg, msg  # the throttled link measured again, still slow
    slow = [line.split()[0] for line in e.value.details.splitlines()[1:] if line.strip() and "baseline" not in line]
    assert len(slow) >= 4, e.value.details  # the four pairs that cross the link, at least


def test_the_slow_link_is_placed_from_the_pairs_slowed_like_the_worst():
    # What CI saw: the four pairs that cross a throttled link at 100x-290x, and a pair inside one host at
    # 3x on a loaded machine. The link is placed from the pairs at least the geometric midpoint between
    # unchanged and the worst (here 17x): the pair inside vm does not turn "the link between vm and
    # node1" into "the link of vm"; both crossing pairs count though one slowed a third as much.
    from types import SimpleNamespace

    from harness.checks.comm import CommCheck
    from harness.perf.decide import decide

    base = [1e-4 + i * 1e-7 for i in range(10)]
    slowed = {"pair/0-2": 290, "pair/0-3": 250, "pair/1-2": 100, "pair/1-3": 280, "pair/0-1": 3.0}
    decisions = {k: decide(k, [v * f for v in base], base, threshold=0.25) for k, f in slowed.items()}
    st = SimpleNamespace(slow_pairs=decisions, pairs={**{k: 1e-4 * f for k, f in slowed.items()}, "pair/2-3": 1e-4},
                         raw={"hosts": ["vm", "vm", "node1", "node1"]}, regressed={},
                         cfg=SimpleNamespace(threshold=0.25, fail_on_regression=True), baseline_why="b", remeasure="")
    with pytest.raises(CheckFailure) as e:
        CommCheck().verdict(None, st)
    assert "5 of 6 pairs slower; every slow pair joins node1 and vm: the link between them" in e.value.message
    # the same noise at 3x beside pairs of one host slowed: still that host's link
    st.raw["hosts"] = ["vm", "node1", "node2", "node3"]
    st.slow_pairs = {k: d for k, d in decisions.items() if k.startswith("pair/0")}
    with pytest.raises(CheckFailure) as e:
        CommCheck().verdict(None, st)
    assert "every slow pair crosses the link of vm" in e.value.message, e.value.message


def test_reduce_scatter_measured_as_all_reduce_leads_with_all_reduce():
    # issue #51: on gloo reduce_scatter is an all_reduce and a slice, so all_reduce made slower shows
    # as reduce_scatter slower by more (its baseline is cheaper per byte at small sizes): the verdict
    # leads with all_reduce, even when all_reduce crossed the rule at fewer sizes, and says how
    # reduce_scatter was measured.
    from harness.perf import commjudge
    from harness.perf.decide import decide

    base = [1e-3 + i * 1e-6 for i in range(10)]
    decisions = {"all_reduce/4096": decide("comm all_reduce/4096", [v * 1.6 for v in base], base, threshold=0.25),
                 "all_reduce/65536": decide("comm all_reduce/65536", [v * 1.1 for v in base], base, threshold=0.25),
                 "all_reduce/1048576": decide("c", [v * 1.1 for v in base], base, threshold=0.25),
                 "reduce_scatter/4096": decide("c", [v * 9.9 for v in base], base, threshold=0.25),
                 "reduce_scatter/65536": decide("c", [v * 2.0 for v in base], base, threshold=0.25),
                 "all_gather/4096": decide("c", base, base, threshold=0.25)}
    slow = commjudge.regressed(decisions, ["all_reduce", "all_gather", "reduce_scatter"])
    assert list(slow) == ["reduce_scatter"]  # all_reduce at 1 of 3 sizes: not the collective by the rule
    table = {k: {"busbw": 1e9} for k in decisions}
    msg, fields = commjudge.collective_failure(slow, decisions, table, 3, 0.25, "b", "gloo")
    assert msg.startswith("collective all_reduce regressed +60.0% at 4 KiB"), msg
    assert "reduce_scatter (measured on gloo as all_reduce + a slice) slower with it" in msg
    assert fields["metric"] == "comm_all_reduce_busbw"
    assert fields["details"].splitlines()[1].startswith("all_reduce")
    # a collective slower at one size by a scheduler tick (+271%, CI) does not lead over the root of two
    noisy = {**decisions, "all_gather/4096": decide("c", [v * 3.7 for v in base], base, threshold=0.25),
             "reduce_scatter/4096": decide("c", [v * 2.0 for v in base], base, threshold=0.25),
             "all_reduce/65536": decide("c", [v * 1.5 for v in base], base, threshold=0.25)}
    loud = commjudge.regressed(noisy, ["all_reduce", "all_gather", "reduce_scatter"])
    assert set(loud) == {"all_reduce", "all_gather", "reduce_scatter"}, loud
    msg, _ = commjudge.collective_failure(loud, noisy, table, 3, 0.25, "b", "gloo")
    assert msg.startswith("collective all_reduce regressed +60.0% at 4 KiB"), msg
    # on nccl reduce_scatter is its own call: named by itself
    msg, _ = commjudge.collective_failure(slow, decisions, table, 3, 0.25, "b", "nccl")
    assert msg.startswith("collective reduce_scatter regressed +890.0%"), msg
    # all_reduce +40% at one size without the evidence (3 samples: p=0.05), as under load: still the root
    weak = {**decisions, "all_reduce/4096": decide("c", [v * 1.4 for v in base[:3]], base[:3], threshold=0.25)}
    assert weak["all_reduce/4096"].verdict == "unchanged" and weak["all_reduce/4096"].change > 0.25
    weak = {k: d for k, d in weak.items() if k in ("all_reduce/4096", "reduce_scatter/4096", "reduce_scatter/65536")}
    msg, fields = commjudge.collective_failure(commjudge.regressed(weak, ["all_reduce", "reduce_scatter"]), weak,
                                               table, 3, 0.25, "b", "gloo")
    # (not called a regression: on its own its evidence is short; CI's bench saw "all_reduce regressed +271%
    # (p=0.28)" lead a clean launch whose reduce_scatter had regressed)
    assert msg.startswith("collective all_reduce slower, +40.0% at 4 KiB (p=0.05: unchanged on its own; led with as "
                          "what the slower collectives are measured as)"), msg
    # all_reduce clean at every size: reduce_scatter named, with what it measured
    clean = {**decisions, "all_reduce/4096": decide("c", base, base, threshold=0.25)}
    msg, _ = commjudge.collective_failure(slow, clean, table, 3, 0.25, "b", "gloo")
    assert msg.startswith("collective reduce_scatter (measured on gloo as all_reduce + a slice) regressed"), msg


@pytest.mark.slow
def test_all_reduce_made_slower_in_the_library_is_named_as_all_reduce(write_suite, tmp_path):
    # The library's all_reduce 10 ms slower a call inside the ranks: reduce_scatter, measured on gloo with
    # all_reduce, slows with it; the failure's first line names all_reduce (the report: all_reduce
    # 50 % slower named "reduce_scatter regressed +888.7 %"). A fixed delay, not the 50 %: how often a
    # 50 % slower all_reduce is caught under load is benchmarks/bench_comm.py's figure (16 of 20 at load 7.6),
    # and a fresh clone's run (2 workers) missed it in both tries, p=0.15 and 0.19 at ratios 2.4 and 2.6 (the
    # fastest half of 12 samples in launches the other worker loaded). The baseline pools two launches, each
    # calibrated by its own other collectives (all_gather, broadcast: harness/perf/commjudge.py). A second
    # try is left for a launch that caught only reduce_scatter, said as measured with all_reduce (a miss of
    # all_reduce's own, not a wrong name); any other collective named fails at once.
    ls = load_suite(write_suite("commar", COMM.format(prune=TINY_PRUNE).replace(
        '"commit"', '"commit"\ncollectives = ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]')
        .replace("repeats = 8", "repeats = 12")))
    for i in range(2):
        _run(ls, tmp_path / f"b{i}")
    dirs = [str(tmp_path / f"b{i}" / "results") for i in range(2)]
    assert main(["baseline", "update", *dirs, "--golden-dir", str(tmp_path / "golden")]) == 0
    (golden,) = (tmp_path / "golden" / "perf" / "commar").glob("*.json")
    item = json.loads(golden.read_text())["items"]["cpu-float32-w2"]
    assert item["runs"] == 2 and item["splits"]["all_reduce/4096"] == [12, 12]  # the launches kept apart
    failure, held = None, []
    for _ in range(2):
        try:
            ctx = _run(ls, tmp_path, delay={"all_reduce": "0.01s"})
        except CheckFailure as e:
            failure = e
            if not e.message.startswith("collective reduce_scatter (measured on gloo as all_reduce"):
                break
            held.append(e.message.splitlines()[0])
            failure = None
            continue
        held.append(json.loads(dict(ctx.properties)["harness.detail.comm_verdict"]))
    assert failure is not None, f"all_reduce 10 ms slower was not caught in two launches: {held}"
    first = failure.message.splitlines()[0]
    # all_reduce leads either confirmed on its own ("regressed") or as the root of reduce_scatter's confirmed
    # regression, its own change past the threshold but its p-value short under the other worker's load (a
    # fresh clone: "slower, +32.2 % at 4 KiB (p=0.021: unchanged on its own ...)"): both name the collective
    # that was slowed first, which is what this test is for; any other lead fails
    assert first.startswith(("collective all_reduce regressed", "collective all_reduce slower, +")), failure.message
    assert "confirmed on re-measure" in first, first  # slower in a second launch too
    if " slower, +" in first:
        assert "reduce_scatter (measured on gloo as all_reduce + a slice) slower with it" in first, first
    assert failure.metric == "comm_all_reduce_busbw"


def _second_launch(monkeypatch, live, then):
    """The comm check's launches replaced: each item's first launch ``live``, its second ``then``."""
    from harness.checks import comm as commcheck

    seen = []  # the items' states, held: an id freed by one item could be another's

    def launch(ctx, st):
        if any(s is st for s in seen):
            return then(ctx, st)
        seen.append(st)
        return live(ctx, st)
    monkeypatch.setattr(commcheck, "_launch", launch)


def _died(ctx, st):
    from harness.checks.outcomes import CouldNotRun

    raise CouldNotRun("the 2-rank launch failed: rank 1 exited 1 (SIGKILL)", step="launch")


@pytest.mark.slow
def test_a_finding_a_second_launch_does_not_repeat_is_noted_and_one_it_could_not_measure_is_filed(
        write_suite, tmp_path, monkeypatch):
    # CI: "collective broadcast regressed +271.5% at 4 KiB (p=0.001)" with broadcast untouched: one launch's
    # samples share one load level. A suspected regression is measured again by a second launch. The first here
    # is live, 20 ms added to every all_reduce (a 3x slower call went unflagged in both tries of 4 tests of 12
    # beside two busy loops). The second replays the real clean launch the baseline was made of: a live one is at
    # the mercy of the other pytest worker (stop 61's CI: a clean re-measure +3108 % at 4 KiB, confirmed, both
    # tries). One baseline launch: of two at different loads, either can itself read "slower again" at one size.
    from harness.checks import comm as commcheck

    ls = load_suite(write_suite("commblip", COMM.format(prune=TINY_PRUNE).replace(
        '"commit"', '"commit"\ncollectives = ["all_reduce", "all_gather", "broadcast"]')))
    live, clean = commcheck._launch, []
    monkeypatch.setattr(commcheck, "_launch", lambda ctx, st: clean.append(live(ctx, st)) or clean[-1])
    _run(ls, tmp_path / "b0")
    assert main(["baseline", "update", str(tmp_path / "b0" / "results"), "--golden-dir", str(tmp_path / "golden")]) == 0

    _second_launch(monkeypatch, live, lambda ctx, st: clean[0])
    # a second try only when the first launch, under the other worker's load, flagged nothing at all
    for _ in range(2):
        ctx = _run(ls, tmp_path, delay={"all_reduce": 0.02})
        p = dict(ctx.properties)
        if "harness.detail.comm_remeasure" in p:
            break
    else:
        raise AssertionError(f"all_reduce 20 ms slower flagged nothing in two launches: {ctx.notes}")
    again = json.loads(p["harness.detail.comm_remeasure"])
    assert again["confirmed"] == [] and any(g.startswith("all_reduce +") for g in again["not_repeated"]), again
    assert any(n.startswith("comm: slower in one launch, not on re-measure (not filed): ") and "all_reduce +" in n
               for n in ctx.notes), ctx.notes
    side = json.loads(open(p["harness.detail.comm_samples"]).read())
    assert side["remeasure_samples"] == clean[0][0]["samples"]  # the re-measure's samples beside the first's
    slow = statistics.median(side["samples"]["all_reduce/4096"])
    assert slow > 2 * statistics.median(side["remeasure_samples"]["all_reduce/4096"])

    # a second launch that died is no evidence either way: the first launch's finding is filed, said unconfirmed
    _second_launch(monkeypatch, live, _died)
    for _ in range(2):
        ctx = CheckContext(ls, get("cpu"), "float32", "w2", check="comm")
        try:
            registry().get("comm").run(ctx, results_dir=tmp_path / "results", golden_root=tmp_path / "golden",
                                       delay={"all_reduce": 0.02})
        except CheckFailure as e:
            failure = e.message
            break
    else:
        raise AssertionError(f"all_reduce 20 ms slower flagged nothing in two launches: {ctx.notes}")
    assert "; not re-measured: the second launch failed (the 2-rank launch failed: rank 1 exited 1" in failure, failure
    assert any(n.endswith("; filed on the first launch alone") for n in ctx.notes), ctx.notes


def test_a_collective_too_noisy_to_judge_on_one_launch_is_judged_on_two_pooled(write_suite, tmp_path, monkeypatch):
    # The launches' samples are the synthetic ones of tests/perf/test_commjudge.py (its ``launch``: each
    # collective's time x the load, one slowed), so that which launch is "too noisy" is exact; what runs is the
    # check itself: its baseline through `harness baseline update`, its re-measure, record and verdict. At load
    # 7.6 three of twenty launches with all_reduce 50 % slower were held as too noisy on one launch
    # (benchmarks/bench_comm.py): the baseline's own launches differ, and one launch's level is one draw.
    from harness.checks import comm as commcheck
    from tests.perf.test_commjudge import COLLS, launch

    ls = load_suite(write_suite("commnoisy", COMM.format(prune=TINY_PRUNE).replace("sizes = [4096, 262144]", (
        f"sizes = [4096]\ncollectives = {json.dumps(COLLS)}\npair_bytes = 0"))))
    queue = []

    def replay(ctx, st):
        return {"world": 2, "backend": "gloo", "dtype": "float32", "samples": queue.pop(0), "hosts": ["h", "h"]}, 1.0, ""
    monkeypatch.setattr(commcheck, "_launch", replay)
    for i, s in enumerate((launch(1.0), launch(1.0, slower={"all_reduce": 1.2}), launch(1.0))):
        queue.append(s)
        _run(ls, tmp_path / f"b{i}")
    assert main(["baseline", "update", *(str(tmp_path / f"b{i}" / "results") for i in range(3)),
                 "--golden-dir", str(tmp_path / "golden")]) == 0

    # +50 % read low in the first launch (too noisy alone), high in the second: filed, said how it was judged
    queue[:] = [launch(1.0, slower={"all_reduce": 1.4}), launch(3.0, slower={"all_reduce": 1.7})]
    with pytest.raises(CheckFailure) as e:
        _run(ls, tmp_path)
    first = e.value.message.splitlines()[0]
    assert first.startswith("collective all_reduce regressed +"), first
    assert "regressed on two launches pooled (one alone too noisy to judge), slower in the second too" in first, first
    assert not queue  # both launches used

    # a clean second launch: not filed, said too noisy on both
    queue[:] = [launch(1.0, slower={"all_reduce": 1.4}), launch(3.0)]
    ctx = _run(ls, tmp_path)
    p = dict(ctx.properties)
    assert json.loads(p["harness.detail.comm_verdict"])["status"] == "noisy"
    assert json.loads(p["harness.detail.comm_remeasure"])["pooled"] == []
    assert any(n.startswith("comm: too noisy to judge on one launch and on two pooled: all_reduce") for n in ctx.notes)
    # what one launch judges alone is not re-measured for nothing: a clean launch is one launch
    queue[:] = [launch(1.0), launch(1.0)]
    _run(ls, tmp_path)
    assert len(queue) == 1
