"""A metric (or tolerance) property that is not a number is a named input warning, through
`harness compare`: which file, which test, which metric, the bad value; the shard is not partial,
nothing false is filed, and the rest of that test case and of the run is compared as usual."""

from __future__ import annotations

import html
import json

from harness.cli import main as harness_main

from .junit_factory import item, write_junit


def _raw(it: dict, name: str, value: str) -> dict:
    """The item with property ``name`` set to the raw text ``value`` (not a number)."""
    it["props"] = [p for p in it["props"] if p[0] != name] + [[name, value]]
    return it


def _baseline():
    return [item("kimi-k2", "smoke", metrics={"loss_final": 2.0, "step_time_s": 1.0, "peak_memory_bytes": 1e9}),
            item("kimi-k2", "precision", metrics={"max_abs_err": 1e-6}, tolerances={"max_abs_err": 1e-3}),
            item("kimi-k2", "ops", fail="aten.mm missing"),
            item("kimi-k2", "parallel")]


def _current():
    return [
        # two bad metric values; its memory regressed for real (+50%) and must still be found
        _raw(_raw(item("kimi-k2", "smoke", metrics={"step_time_s": 1.0, "peak_memory_bytes": 1.5e9}),
                  "metric.loss_final", "abc"), "metric.wall_time_s", ""),
        # a tolerance that is not a number: its metric cannot be judged (never by a generic threshold)
        _raw(item("kimi-k2", "precision", metrics={"max_abs_err": 5e-6}), "tolerance.max_abs_err", "n/a @bob"),
        # failed before and fails now, with a bad metric: still failing, never "fixed"
        _raw(item("kimi-k2", "ops", fail="aten.mm missing"), "metric.coverage", "NaN%"),
        # "parallel" vanished: counted as vanished only because the input is not partial
    ]


def test_non_numeric_metrics_are_named_warnings_and_nothing_else_is_lost(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = write_junit(tmp_path / "base.xml", _baseline())
    history = tmp_path / "h.sqlite"
    for n in range(2):  # two runs: the memory regression is confirmed on the second
        cur = write_junit(tmp_path / f"shard-{n}.xml", _current())
        code = harness_main(["compare", cur, "--baseline", base, "--history", str(history), "--sink", "file",
                             "--out-dir", "issues", "--run-id", f"r{n}", "--mute-file", "", "--summary", "s.md"])
        assert code == 0
    err = capsys.readouterr().err
    summary = html.unescape((tmp_path / "s.md").read_text())
    warnings = summary.split("### Input warnings", 1)[1].split("\n\n", 2)[1]
    for needle in (f"{cur}: suites.kimi-k2.toml::smoke[cpu-float32]: metric 'loss_final' is not a number ('abc')",
                   f"{cur}: suites.kimi-k2.toml::smoke[cpu-float32]: metric 'wall_time_s' is not a number ('')",
                   f"{cur}: suites.kimi-k2.toml::precision[cpu-float32]: tolerance 'max_abs_err' is not a number "
                   "('n/a @\u200dbob')",
                   f"{cur}: suites.kimi-k2.toml::ops[cpu-float32]: metric 'coverage' is not a number ('NaN%')"):
        assert needle in warnings, needle
        assert f"harness compare: warning: {needle}" in err
    assert "partial" not in summary and "Input problems" not in summary
    assert "@bob" not in summary  # neutralised like every text from a run
    # the rest: the smoke case's memory regression, the vanished test, the still-failing one
    state = json.load(open(tmp_path / "issues" / "issues.json"))
    titles = sorted(i["title"] for i in state.values())
    assert titles == ["[harness] failure regression: kimi-k2 on cpu", "[harness] performance regression: kimi-k2 on cpu",
                      "[harness] vanished regression: kimi-k2 on cpu"]
    perf = next(html.unescape(i["body"]) for i in state.values() if "performance" in i["title"])
    assert "peak_memory_bytes" in perf and "+50.0%" in perf
    for absent in ("loss_final", "wall_time_s", "max_abs_err", "coverage", "nan"):
        assert absent not in perf, absent
    assert "still failing" in summary and "fixed" not in summary and "precision drift" not in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ")]  # the findings tables
    assert rows and not any(w in line.lower() for line in rows for w in ("nan", "loss_final", "wall_time_s"))


def test_a_baseline_with_a_bad_value_is_named_as_the_baseline(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = write_junit(tmp_path / "base.xml", [_raw(item("kimi-k2", "smoke"), "metric.step_time_s", "fast")])
    cur = write_junit(tmp_path / "cur.xml", [item("kimi-k2", "smoke", metrics={"step_time_s": 9.0})])
    for _ in range(2):  # the cached baseline (second run) keeps saying so
        assert harness_main(["compare", cur, "--baseline", base, "--history", "h.sqlite", "--sink", "stdout",
                             "--mute-file", ""]) == 0
        err = capsys.readouterr().err
        assert (f"harness compare: warning: baseline: {base}: suites.kimi-k2.toml::smoke[cpu-float32]: metric "
                "'step_time_s' is not a number ('fast')") in err
