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


def test_what_is_not_a_duration_never_reaches_the_file_and_a_file_of_another_shape_costs_no_item(tmp_path, capsys):
    """Issue #49: `durations update` wrote NaN/Infinity (invalid JSON) and kept 1e308, which switched
    the time limit off; a durations file of another shape failed every item of every run."""
    import math

    inf_json = json.dumps({"items": [
        {"nodeid": "suites/a.toml::smoke[cpu-float32]", "outcome": "passed", "duration": math.nan},
        {"nodeid": "suites/b.toml::smoke[cpu-float32]", "outcome": "passed", "duration": math.inf},
        {"nodeid": "suites/c.toml::smoke[cpu-float32]", "outcome": "passed", "duration": 1e308},
        {"nodeid": "suites/d.toml::smoke[cpu-float32]", "outcome": "passed", "duration": -3},
        {"nodeid": "suites/e.toml::smoke[cpu-float32]", "outcome": "passed", "duration": 2.5}]})
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "summary.json").write_text(inf_json)
    target = tmp_path / "durations.json"
    assert main(["durations", "update", str(tmp_path / "res"), "--file", str(target)]) == 0
    out = capsys.readouterr().out
    for n in "abcd":
        assert f"suites/{n}.toml::smoke[cpu-float32]:" in out and "is not a duration" in out
    # strict JSON (no NaN/Infinity constants) with only the real duration
    strict = json.loads(target.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert strict == {"durations": {"suites/e.toml::smoke[cpu-float32]": 2.5}}
    # a hand-edited 1e308 is no record either: the default limit applies, never none
    target.write_text('{"durations": {"suites/e.toml::smoke[cpu-float32]": 1e308}}')
    assert durations.timeout_for("suites/e.toml::smoke[cpu-float32]", durations.load(target)) \
        == durations.DEFAULT_TIMEOUT_S
    # files of another shape: no record, one line naming the file, no exception
    for i, text in enumerate(('{"durations": [1, 2]}', "[1, 2]", '"x"', '{"durations": null}')):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(text)
        assert durations.load(bad) == {}
        assert f"{bad}:" in capsys.readouterr().err


def test_a_suite_named_with_dots_keeps_its_name_through_junit(tmp_path):
    """pytest's JUnit mangling turns suites/llama-3.1-8b.toml into classname suites.llama-3.1-8b.toml;
    read back by splitting at the last dot it became suites/llama-3/1-8b.toml and lost its record.
    The item's own harness.suite property says where the file name starts."""
    from harness.cli.durations import read

    rows = [Row("suites/llama-3.1-8b.toml::smoke[cpu-float32]", "passed", duration=3.0,
                props={"harness.suite": "llama-3.1-8b"}),
            Row("deep/er/v1.2.toml::smoke[cpu-float32]", "passed", duration=1.0, props={"harness.suite": "v1.2"}),
            Row("plain.toml::smoke[cpu-float32]", "passed", duration=2.0, props={"harness.suite": "plain"})]
    (tmp_path / "j.xml").write_text(junit_xml(rows, [], "complete", 6.0))
    assert read(tmp_path / "j.xml") == {"suites/llama-3.1-8b.toml::smoke[cpu-float32]": 3.0,
                                         "deep/er/v1.2.toml::smoke[cpu-float32]": 1.0,
                                         "plain.toml::smoke[cpu-float32]": 2.0}
