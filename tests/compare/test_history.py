"""The SQLite history: round trip, pruning, clean streaks, issue numbers."""

from __future__ import annotations

import sqlite3

import pytest

from harness.compare.history import History
from harness.compare.junit import read_results

from .junit_factory import item, write_junit


def res(tmp_path, name, v, fail=""):
    return read_results([write_junit(tmp_path / f"{name}.xml", [
        item("s", "perf", metrics={"wall_time_s": v, "some_counter": 3.0}, fail=fail)])])


def test_round_trip_prune_and_replace(tmp_path):
    h = History(str(tmp_path / "h.sqlite"))
    for i in range(5):
        h.record(f"r{i}", res(tmp_path, f"r{i}", float(i)), {"fp": i % 2 == 0}, commit=f"c{i}", keep=3)
    runs = h.runs()
    assert [r.run_key for r in runs] == ["r2", "r3", "r4"] and runs[-1].commit == "c4"
    series = h.metric_series([r.id for r in runs])
    assert series.get(("suites.s.toml::perf[cpu-float32]", "wall_time_s")) == [2.0, 3.0, 4.0]
    assert series.get(("suites.s.toml::perf[cpu-float32]", "some_counter")) == []  # no direction: not kept
    assert series.get(("nope", "wall_time_s")) == []
    h.record("r4", res(tmp_path, "again", 9.0), {}, keep=3)  # the same run recorded twice replaces
    assert [r.run_key for r in h.runs()] == ["r2", "r3", "r4"]
    assert h.outcomes(h.runs()[-1].id) == {"suites.s.toml::perf[cpu-float32]": ("passed", "s", "cpu")}
    assert h.runs(exclude_key="r4")[-1].run_key == "r3"


def test_clean_streak_skips_runs_where_the_group_did_not_run(tmp_path):
    h = History(str(tmp_path / "h.sqlite"))
    r = res(tmp_path, "x", 1.0)
    for key, groups in (("a", {"fp": True}), ("b", {"fp": False}), ("c", {}), ("d", {"fp": False})):
        h.record(key, r, groups)
    assert h.clean_streak("fp") == 2 and h.clean_streak("unknown") == 0
    h.set_issue("fp", 12, "closed")
    assert h.issues() == {"fp": (12, "closed")}


def test_foreign_schema_is_refused_clearly(tmp_path):
    path = tmp_path / "h.sqlite"
    History(str(path)).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema'")
    db.commit()
    db.close()
    with pytest.raises(ValueError, match="history schema 99"):
        History(str(path))


def test_baseline_cache_round_trip_and_not_a_run(tmp_path):
    h = History(str(tmp_path / "h.sqlite"))
    base = read_results([write_junit(tmp_path / "b.xml", [
        item("s", "a", metrics={"wall_time_s": 1.5}), item("s", "b", fail="x", backend="npu")])])
    assert h.cached_baseline("d1") is None
    h.record("baseline-d1", base, {}, kind="baseline", inputs="d1", keep=2)
    assert h.runs() == []  # a cached baseline is not part of the run history
    cached = h.cached_baseline("d1")
    assert {k: (c.outcome, c.suite, c.backend, c.metrics) for k, c in cached.cases.items()} == {
        "suites.s.toml::a[cpu-float32]": ("passed", "s", "cpu", {"wall_time_s": 1.5}),
        "suites.s.toml::b[npu-float32]": ("failed", "s", "npu", {})}
    assert cached.cases["suites.s.toml::a[cpu-float32]"].name == "a[cpu-float32]"


def test_reruns_are_recorded_and_a_flake_says_how_often_it_flaked(tmp_path):
    """Issue #31 item 1: each run's confirming reruns (attempts, failed attempts) are kept in the
    history, so a flaky finding says how many of the recent runs it flaked in."""
    import json as _json

    from harness.compare.classify import Config, classify
    from harness.compare.junit import Case, Results

    def run(flaky: bool) -> Results:
        att = [{"outcome": "failed"}, {"outcome": "passed"}, {"outcome": "passed"}] if flaky else []
        c = Case(key="suites.s.toml::smoke[cpu-float32]", name="smoke[cpu-float32]", classname="suites.s.toml",
                 outcome="passed", suite="s", check="smoke", backend="cpu", dtype="float32", device="", variant="",
                 metrics={}, tolerances={}, details={"confirm": "flaky", "confirm_attempts": _json.dumps(att)}
                 if flaky else {}, flaky=flaky, attempts=2 if flaky else 1)
        return Results(cases={c.key: c})

    h = History(str(tmp_path / "h.sqlite"))
    for i, flaky in enumerate([True, False, True]):
        h.record(f"r{i}", run(flaky), {})
    ids = [r.id for r in h.runs(10)]
    assert h.flaky_runs(ids) == {"suites.s.toml::smoke[cpu-float32]": 2}
    (f,) = [f for f in classify(run(True), None, h, Config(), "r3").findings if f.category == "flaky"]
    assert f.note == "flaky: failed 1 of 3 attempts; flaky in 3 of the last 4 runs"
    h.close()
