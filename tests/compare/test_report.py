"""Step summary and the static HTML report."""

from __future__ import annotations

import io

from harness.compare.history import History
from harness.compare.pipeline import Options, run_compare
from harness.compare.report import html_report, summary_markdown, write_step_summary

from .junit_factory import item, write_junit


def test_summary_lists_problems_counts_and_actions(tmp_path, monkeypatch):
    cur = write_junit(tmp_path / "c.xml", [item("s", "a", fail="x @dev"), item("s", "b", metrics={"wall_time_s": 2})])
    base = write_junit(tmp_path / "b.xml", [item("s", "a"), item("s", "b", metrics={"wall_time_s": 1})])
    o = run_compare(Options(results=[cur, str(tmp_path / "missing.xml")], baseline=[base], history=None),
                    out=io.StringIO())
    md = summary_markdown(o)
    assert "Input problems (this report is partial)" in md and "missing.xml: shard missing" in md
    assert "new failure" in md and "suspected (1 bad run)" in md and "### Issue actions" in md
    target = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(target))
    assert write_step_summary(md) == str(target) and target.read_text() == md
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    assert write_step_summary(md) is None


def test_html_has_history_plot_with_change_point(tmp_path):
    hist = str(tmp_path / "h.sqlite")
    for n, v in enumerate([1.0, 1.01, 0.99, 1.0, 1.5]):
        p = write_junit(tmp_path / f"r{n}.xml", [item("s", "perf", metrics={"wall_time_s": v})])
        run_compare(Options(results=[p], history=hist, run_key=f"r{n}"), out=io.StringIO())
    p = write_junit(tmp_path / "now.xml", [item("s", "perf", metrics={"wall_time_s": 1.52})])
    o = run_compare(Options(results=[p], history=hist, dry_run=True), out=io.StringIO())
    h = History(hist)
    series = h.metric_series([r.id for r in h.runs()])
    page = html_report(o, series, "nightly")
    assert "<h1>nightly</h1>" in page and "Performance history" in page and "wall_time_s" in page
    assert page.count("data:image/png;base64,") == 2  # the test's history + the suite's total
    assert "Wall time per suite" in page and "s on cpu: change point 2 runs ago: 1 s -> 1.51 s (+51%)" in page
    assert series.run_totals(["suites.s.toml::perf[cpu-float32]"], "wall_time_s") == [1.0, 1.01, 0.99, 1.0, 1.5]


def test_partial_inputs_give_a_partial_report_not_a_crash(tmp_path):
    good = write_junit(tmp_path / "shard-0.xml", [item("kimi-k2", "smoke", fail="x"), item("kimi-k2", "ops")])
    cut = tmp_path / "shard-1.xml"
    full = open(write_junit(tmp_path / "full.xml", [item("kimi-k2", f"op{i}") for i in range(5)])).read()
    cut.write_text(full[: full.index('name="op3[')])
    base = write_junit(tmp_path / "base.xml", [item("llama-3.1-8b", "smoke")])
    o = run_compare(Options(results=[good, str(cut), str(tmp_path / "shard-2.xml")], baseline=[base],
                            history=None, expect_shards=3), out=io.StringIO())
    md = summary_markdown(o)
    assert len(o.current.cases) == 5  # 2 + the 3 complete cases before the cut
    for needle in ("shard-1.xml: malformed or truncated XML", "shard-2.xml: shard missing",
                   "different suite sets", "this report is partial", "new failure"):
        assert needle in md, needle
    assert "<li>" in html_report(o)
