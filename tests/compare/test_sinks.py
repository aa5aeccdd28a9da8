"""File and stdout sinks: no token needed; the file sink keeps state like GitHub would."""

from __future__ import annotations

import io
import json

from harness.compare.pipeline import Options, run_compare
from harness.compare.sinks import FileSink

from .junit_factory import item, write_junit


def run(tmp_path, items, n, sink="file", **kw):
    cur = write_junit(tmp_path / f"cur{n}.xml", items)
    base = tmp_path / "base.xml"
    if not base.exists():
        write_junit(base, [item("s", "a"), item("s", "b")])
    out = io.StringIO()
    o = run_compare(Options(results=[cur], baseline=[str(base)], history=str(tmp_path / "h.sqlite"), sink=sink,
                            out_dir=str(tmp_path / "issues"), run_key=f"r{n}", **kw), out=out)
    return o, out.getvalue()


def test_file_sink_lifecycle_and_action_log(tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    bad = [item("s", "a", fail="x"), item("s", "b")]
    good = [item("s", "a"), item("s", "b")]
    for n, items in enumerate([bad, bad, bad, good, good, bad]):
        run(tmp_path, items, n)
    state = json.loads((tmp_path / "issues" / "issues.json").read_text())
    assert list(state) == ["1"] and state["1"]["state"] == "open"
    log = json.loads((tmp_path / "issues" / "actions.json").read_text())
    # create; close: the state change, then its comment; reopen: the same
    assert [e["op"] for e in log] == ["create", "edit", "comment", "edit", "comment"]
    assert (tmp_path / "issues" / "issue-1.md").read_text().startswith("# [harness] failure regression: s on cpu")
    assert FileSink(str(tmp_path / "issues")).list_issues("harness")[0].fingerprint


def test_stdout_sink_prints_issue_and_dry_run_prints_plan(tmp_path):
    bad = [item("s", "a", fail="x"), item("s", "b")]
    o, printed = run(tmp_path, bad, 0, sink="stdout")
    assert "=== new issue: [harness] failure regression: s on cpu" in printed and o.api_calls == 0
    o, printed = run(tmp_path, bad, 1, sink="file", dry_run=True)
    assert "[dry-run] would create issue" in printed and not (tmp_path / "issues" / "issues.json").exists()


def test_group_by_dtype_splits_issues(tmp_path):
    items = [item("s", "a", dtype="float32", fail="x"), item("s", "a", dtype="bfloat16", fail="y")]
    base = write_junit(tmp_path / "b.xml", [item("s", "a", dtype="float32"), item("s", "a", dtype="bfloat16")])
    cur = write_junit(tmp_path / "c.xml", items)
    o = run_compare(Options(results=[cur], baseline=[base], history=None, sink="file",
                            out_dir=str(tmp_path / "i"), group_by=("suite", "backend", "dtype", "kind")),
                    out=io.StringIO())
    assert sorted(a.title for a in o.actions) == [
        "[harness] failure regression: s on cpu (bfloat16)", "[harness] failure regression: s on cpu (float32)"]
    one = run_compare(Options(results=[cur], baseline=[base], history=None, sink="stdout"), out=io.StringIO())
    assert len(one.actions) == 1  # default grouping: one issue, never one per test case


def test_baseline_is_parsed_once_then_cached_in_the_history(tmp_path):
    bad = [item("s", "a", fail="x"), item("s", "b")]
    first, _ = run(tmp_path, bad, 0)
    second, _ = run(tmp_path, bad, 1)
    assert first.baseline.files[0].endswith("base.xml")
    assert second.baseline.files[0].startswith("(cached baseline")
    assert [(f.category, f.key) for f in second.classification.findings] == \
        [("still_failing", "suites.s.toml::a[cpu-float32]")]
    (tmp_path / "base.xml").write_text((tmp_path / "base.xml").read_text().replace('name="b[', 'name="c['))
    third, _ = run(tmp_path, bad, 2)  # new content, new digest: parsed again
    assert third.baseline.files[0].endswith("base.xml")


def test_a_history_file_that_is_not_a_database_is_moved_aside_in_one_line(tmp_path):
    (tmp_path / "h.sqlite").write_text("not a database, just text " * 100)
    o, _ = run(tmp_path, [item("s", "a", fail="x"), item("s", "b")], 0)
    (line,) = [w for w in o.warnings if "moved aside" in w]
    (aside,) = tmp_path.glob("h.sqlite.damaged-*")
    assert "not a readable history database" in line and str(aside) in line and not o.problems
    assert aside.read_text().startswith("not a database")  # kept for a person to look at
    assert [f.category for f in o.classification.findings] == ["new_failure"]


def test_flaky_is_filed_only_when_asked(tmp_path):
    base = write_junit(tmp_path / "b.xml", [item("s", "a")])
    a1 = write_junit(tmp_path / "attempt1.xml", [item("s", "a", fail="timeout")])
    a2 = write_junit(tmp_path / "attempt2.xml", [item("s", "a")])
    default = run_compare(Options(results=[a1, a2], baseline=[base], history=None), out=io.StringIO())
    assert [f.category for f in default.classification.findings] == ["flaky"] and default.actions == []
    asked = run_compare(Options(results=[a1, a2], baseline=[base], history=None,
                                filed_kinds=("failure", "flaky")), out=io.StringIO())
    assert [a.title for a in asked.actions] == ["[harness] flaky tests: s on cpu"]


def test_infrastructure_is_one_issue_per_backend_and_closes_when_clean(tmp_path):
    """Runner and device failures (harness.run.confirm's ``infrastructure``) of several suites are one
    issue for the backend, not one per suite, and never a failure issue of a model; it closes after
    clean runs like any other."""
    infra = {"confirm": "infrastructure"}
    bad = write_junit(tmp_path / "bad.xml", [item("s", "a", error="crashed with SIGKILL", details=infra),
                                             item("t", "a", error="crashed with SIGKILL", details=infra)])
    hist = str(tmp_path / "h.sqlite")
    first = run_compare(Options(results=[bad], history=hist, sink="file", out_dir=str(tmp_path / "i"),
                                run_key="r1"), out=io.StringIO())
    assert [f.category for f in first.classification.findings] == ["infrastructure"] * 2
    assert [a.title for a in first.actions] == ["[harness] infrastructure (runner or device): * on cpu"]
    for i, key in enumerate(("r2", "r3")):  # two different clean runs (the same files again are one run)
        good = write_junit(tmp_path / f"good{i}.xml", [item("s", "a", metrics={"x": i}), item("t", "a")])
        last = run_compare(Options(results=[good], history=hist, sink="file", out_dir=str(tmp_path / "i"),
                                   run_key=key), out=io.StringIO())
    assert [a.op for a in last.actions] == ["close"]


def test_baseline_parsed_by_a_child_process_into_the_cache(tmp_path, monkeypatch):
    from harness.compare import prefetch
    monkeypatch.setattr(prefetch, "MIN_BYTES", 0)  # force the second process even for a tiny file
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    bad = [item("s", "a", fail="x"), item("s", "b")]
    first, _ = run(tmp_path, bad, 0)
    assert first.baseline.files[0].startswith("(cached baseline")  # written by the child
    assert [f.category for f in first.classification.findings] == ["new_failure"]
    (tmp_path / "base.xml").write_text("<testsuites><testsuite><testcase name='cut")  # child refuses
    second, _ = run(tmp_path, bad, 1)
    assert second.baseline.files[0].endswith("base.xml")
    assert any("baseline:" in p and "truncated" in p for p in second.problems)


def test_a_cut_off_run_is_one_infrastructure_finding_per_backend(tmp_path):
    """A shard whose run was interrupted (the job's time limit, a cancelled runner: harness writes
    ``harness.run.status = interrupted`` and lists the items it never ran) is the runner's problem:
    one infrastructure issue for the backend, and it closes once runs finish again."""
    from harness.run.results import junit_xml
    from harness.run.rows import Row

    rows = [Row("suites/s.toml::smoke[cpu-float32]", "passed", {"harness.suite": "s", "harness.backend": "cpu",
                                                                 "harness.check": "smoke", "harness.dtype": "float32"})]
    cut = tmp_path / "cut.xml"
    cut.write_text(junit_xml(rows, ["suites/s.toml::ops[cpu-float32-aten.mm.default]"], "interrupted", 3.0,
                             "SIGTERM"))
    hist = str(tmp_path / "h.sqlite")
    first = run_compare(Options(results=[str(cut)], history=hist, sink="file", out_dir=str(tmp_path / "i"),
                                run_key="r1"), out=io.StringIO())
    (f,) = [f for f in first.classification.findings if f.category == "infrastructure"]
    assert f.backend == "cpu" and f.note == f"the run was interrupted (SIGTERM): 1 item(s) not run ({cut})"
    assert [a.title for a in first.actions] == ["[harness] infrastructure (runner or device): * on cpu"]
    for i, key in enumerate(("r2", "r3")):
        whole = tmp_path / f"whole{i}.xml"
        whole.write_text(junit_xml(rows, [], "complete", 3.0 + i))
        last = run_compare(Options(results=[str(whole)], history=hist, sink="file", out_dir=str(tmp_path / "i"),
                                   run_key=key), out=io.StringIO())
    assert [a.op for a in last.actions] == ["close"]
