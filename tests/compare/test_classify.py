"""Classification against baseline and history."""

from __future__ import annotations

import pytest

from harness.compare.classify import Config, classify
from harness.compare.history import History
from harness.compare.junit import read_results

from .junit_factory import item, write_junit


def results(tmp_path, name, items):
    return read_results([write_junit(tmp_path / f"{name}.xml", items)])


def cats(cls):
    return sorted((f.category, f.key.split("::")[-1]) for f in cls.findings)


def test_outcome_categories_against_baseline(tmp_path):
    base = results(tmp_path, "base", [
        item("s", "a"), item("s", "b", fail="x"), item("s", "c", fail="x"), item("s", "gone"),
        item("s", "d"), item("s", "x", backend="npu"), item("other", "y")])
    cur = results(tmp_path, "cur", [
        item("s", "a", fail="new"), item("s", "b", fail="x"), item("s", "c"), item("s", "d", error="setup"),
        item("s", "fresh")])
    cls = classify(cur, base, None, Config())
    assert cats(cls) == [
        ("fixed", "c[cpu-float32]"), ("new_failure", "a[cpu-float32]"), ("new_failure", "d[cpu-float32]"),
        ("new_test", "fresh[cpu-float32]"), ("not_run", "s/npu"), ("still_failing", "b[cpu-float32]"),
        ("vanished", "gone[cpu-float32]")]
    by_key = {(f.category, f.key.split("::")[-1]): f for f in cls.findings}
    assert by_key[("new_failure", "a[cpu-float32]")].kind == "failure"
    assert by_key[("new_failure", "d[cpu-float32]")].kind == "error"
    assert by_key[("vanished", "gone[cpu-float32]")].regression
    assert any("s on npu: no results" in n and "shard may be missing" in n for n in cls.notes)
    assert any("['other']" in n for n in cls.notes)  # baseline suites not in this run


def test_dropped_when_no_longer_collected(tmp_path):
    base = results(tmp_path, "base", [item("s", "a"), item("s", "gone")])
    cur = results(tmp_path, "cur", [item("s", "a")])
    cls = classify(cur, base, None, Config(collected={"suites.s.toml::a[cpu-float32]"}))
    assert [f.category for f in cls.findings] == ["dropped"] and not cls.findings[0].regression


def test_baseline_from_another_suite_set_is_a_note_not_a_crash(tmp_path):
    base = results(tmp_path, "base", [item("llama", "smoke")])
    cur = results(tmp_path, "cur", [item("kimi-k2", "smoke", fail="x")])
    cls = classify(cur, base, None, Config())
    assert any("different suite sets" in n and "llama" in n and "kimi-k2" in n for n in cls.notes)
    assert [f.category for f in cls.findings] == ["new_failure"]  # still classified on its own


@pytest.mark.parametrize("metric,base_v,cur_v,expected", [
    ("wall_time_s", 1.0, 1.2, "metric_regression"),
    ("wall_time_s", 1.0, 1.05, None),
    ("wall_time_s", 1.0, 0.7, "improvement"),
    ("logit_cosine", 0.99, 0.80, "metric_regression"),  # higher is better
    ("logit_cosine", 0.50, 0.99, "improvement"),
    ("some_counter", 1.0, 9.0, None),  # no direction: informational
])
def test_metric_direction_and_threshold(tmp_path, metric, base_v, cur_v, expected):
    base = results(tmp_path, "base", [item("s", "perf", metrics={metric: base_v})])
    cur = results(tmp_path, "cur", [item("s", "perf", metrics={metric: cur_v})])
    found = [f for f in classify(cur, base, None, Config()).findings if f.metric]
    assert [f.category for f in found] == ([expected] if expected else [])
    if found:
        assert not found[0].confirmed and found[0].bad_runs == 1  # one run never confirms


def test_timing_changes_below_the_floor_are_noise(tmp_path):
    base = results(tmp_path, "base", [item("s", "perf", metrics={"wall_time_s": 0.03, "peak_memory_bytes": 1e6})])
    cur = results(tmp_path, "cur", [item("s", "perf", metrics={"wall_time_s": 0.045, "peak_memory_bytes": 2e6})])
    found = [f.metric for f in classify(cur, base, None, Config()).findings]
    assert found == ["peak_memory_bytes"]  # +50% of 30 ms is noise; +100% memory is not
    assert "wall_time_s" in [f.metric for f in classify(cur, base, None, Config(time_floor_s=0)).findings]


def test_suite_threshold_overrides_default(tmp_path):
    base = results(tmp_path, "base", [item("s", "perf", metrics={"wall_time_s": 1.0})])
    cur = results(tmp_path, "cur", [item("s", "perf", metrics={"wall_time_s": 1.2})])
    assert not [f for f in classify(cur, base, None, Config(thresholds={"s:wall_time_s": 0.5})).findings]
    assert [f for f in classify(cur, base, None, Config(thresholds={"t:wall_time_s": 0.5})).findings]


def test_precision_drift_uses_the_tolerance_headroom(tmp_path):
    def run(v):
        return [item("s", "precision", metrics={"max_abs_err": v}, tolerances={"max_abs_err": 1e-3})]
    base = results(tmp_path, "base", run(1e-4))
    small = classify(results(tmp_path, "a", run(4e-4)), base, None, Config()).findings
    assert small == []  # used a third of the 9e-4 headroom
    big = classify(results(tmp_path, "b", run(7e-4)), base, None, Config()).findings
    assert [(f.category, f.kind) for f in big] == [("precision_drift", "precision")]
    assert "headroom" in big[0].threshold


def test_consecutive_bad_runs_from_history_confirm(tmp_path):
    h = History(str(tmp_path / "h.sqlite"))
    base = results(tmp_path, "base", [item("s", "perf", metrics={"wall_time_s": 1.0})])
    slow = results(tmp_path, "slow", [item("s", "perf", metrics={"wall_time_s": 1.3})])
    first = classify(slow, base, h, Config())
    assert [f.confirmed for f in first.findings] == [False]
    h.record("r1", slow, {})
    second = classify(slow, base, h, Config())
    assert [(f.confirmed, f.bad_runs) for f in second.findings] == [(True, 2)]
    assert [(f.confirmed, f.bad_runs) for f in classify(slow, base, h, Config(min_bad_runs=3)).findings] \
        == [(False, 2)]


def test_previous_run_is_the_reference_without_baseline(tmp_path):
    h = History(str(tmp_path / "h.sqlite"))
    h.record("r1", results(tmp_path, "r1", [item("s", "a", fail="x"), item("s", "b"), item("s", "c")]), {})
    cur = results(tmp_path, "cur", [item("s", "a", fail="x"), item("s", "b", fail="y")])
    assert cats(classify(cur, None, h, Config())) == [
        ("new_failure", "b[cpu-float32]"), ("still_failing", "a[cpu-float32]"), ("vanished", "c[cpu-float32]")]


def test_collected_node_ids_map_to_junit_keys():
    from harness.cli.compare import junit_key
    assert junit_key("suites/kimi-k2.toml::smoke[cpu-float32]") == "suites.kimi-k2.toml::smoke[cpu-float32]"
    assert junit_key("tests/test_x.py::TestA::test_b[1]") == "tests.test_x.TestA::test_b[1]"
