"""Recorded durations: `harness durations update` from a results run, and the time limits they give."""

from __future__ import annotations

import json

from harness.cli import main
from harness.run import durations
from harness.run.results import Row, junit_xml


def test_time_limit_from_the_record_the_override_or_the_default():
    # the wall clock is only the backstop (a hang is found by its lack of progress): generous
    rec = {"suites/a.toml::smoke[cpu-float32]": 2.0, "suites/b.toml::smoke[cpu-float32]": 40.0}
    assert durations.timeout_for("suites/a.toml::smoke[cpu-float32]", rec) == 900.0  # at least 15 minutes
    assert durations.timeout_for("suites/b.toml::smoke[cpu-float32]", rec) == 1200.0  # 30x the record
    assert durations.timeout_for("suites/c.toml::smoke[cpu-float32]", rec) == durations.DEFAULT_TIMEOUT_S
    assert durations.timeout_for("suites/a.toml::smoke[cpu-float32]", rec, override=5) == 5.0


def test_update_from_summary_and_junit_keeps_what_did_not_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    durations.save("durations.json", {"suites/old.toml::smoke[cpu-float32]": 7.0,
                                      "suites/x.toml::ops[cpu-float32-aten.mm.default]": 3.0})
    rows = [Row("suites/x.toml::smoke[cpu-float32]", "passed", duration=4.5),
            Row("mysuites/new-model.toml::precision[my-npu-bfloat16]", "failed", duration=1.25),
            Row("suites/x.toml::ops[cpu-float32-aten.mm.default]", "skipped", duration=0.01)]
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "summary.json").write_text(json.dumps({"items": [r.__dict__ for r in rows]}))
    (tmp_path / "j.xml").write_text(junit_xml(rows, ["suites/y.toml::smoke[cpu-float32]"], "interrupted", 6.0))
    for source in ("res", "j.xml"):
        assert main(["durations", "update", source]) == 0
        got = durations.load("durations.json")
        assert got["suites/x.toml::smoke[cpu-float32]"] == 4.5
        assert got["mysuites/new-model.toml::precision[my-npu-bfloat16]"] == 1.25
        assert got["suites/old.toml::smoke[cpu-float32]"] == 7.0  # not in this run: kept
        assert got["suites/x.toml::ops[cpu-float32-aten.mm.default]"] == 3.0  # skipped: record kept
        assert "suites/y.toml::smoke[cpu-float32]" not in got  # not run
    assert "recorded 2 item durations" in capsys.readouterr().out


def test_unreadable_records_are_no_records(tmp_path):
    (tmp_path / "d.json").write_text("{not json")
    assert durations.load(tmp_path / "d.json") == {}
    (tmp_path / "d.json").write_text('{"durations": {"a::b": "slow", "c::d": -1, "e::f": 2}}')
    assert durations.load(tmp_path / "d.json") == {"e::f": 2.0}
