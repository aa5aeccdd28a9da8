"""Step summary and the static HTML report."""

from __future__ import annotations

import html
import io
import json

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


# --- the run at a glance (issue #52 item 4) -----------------------------------------------------

_LAYERS = json.dumps([{"module": "model.layers.0.mlp", "rel_rmse": 1e-6, "tolerance": 1e-5, "ok": True},
                      {"module": "model.layers.1.mlp", "rel_rmse": 0.02, "tolerance": 1e-5, "ok": False},
                      {"module": "logits", "rel_rmse": 0.0, "tolerance": 1e-5, "ok": True}])
_HEADLINES = {"precision": ("isolated_worst_budget_use", "logits_rel_rmse"),
              "training": ("training_backward_worst_budget_use",), "perf": ("prefill_s",)}
_HOSTILE = "<script>alert(1)</script> token ghp_" + "A" * 36


def _glance_results(tmp_path):
    """A failing precision item (message, module, layer table), a passing training item (budget use,
    trajectory), a decode item per step, two variants of one ops row, and captured warnings."""
    items = [
        item("s", "precision", metrics={"isolated_worst_budget_use": 2000.0, "logits_rel_rmse": 1.4e-3,
                                        "wall_time_s": 1.5},
             details={"first_divergent_module": "model.layers.1.mlp", "layer_table": _LAYERS, "phase": "verdict"},
             fail=f"model.layers.1.mlp diverges from the golden {_HOSTILE}"),
        item("s", "training", metrics={"training_backward_worst_budget_use": 0.49, "wall_time_s": 0.25},
             details={"module_budget_use": '[["lm_head",0.26],["model.layers.0.mlp",0.49],["model.embed_tokens",0]]',
                      "trajectory": '{"loss":[[0.0,2e-6],[4e-7,3e-6]],"grad_norm":[[1e-8,7e-7],[1e-7,8e-7]]}'}),
        item("s", "decode", metrics={"decode_worst_budget_use": 0.67},
             details={"step_budget_use": '[["step 0",0.37],["step 1",0.67]]'}),
        item("s", "ops", metrics={"op_max_rel_error": 1e-7}),
        {**item("s", "ops", metrics={"op_max_rel_error": 2e-7}), "name": "ops[cpu-float32-aten.mm]"},
        item("t", "precision", details={"module_budget_use": "{not json", "trajectory": "[1,2"}),
    ]
    path = write_junit(tmp_path / "junit.xml", items)
    # what the runner writes now: each item's captured library warnings in its <system-err>
    xml = open(path).read().replace(
        '</properties></testcase><testcase classname="suites.s.toml" name="decode',
        "</properties><system-err>3 x UserWarning: TypedStorage is deprecated [torch/_utils.py:831]\n"
        "1 x FutureWarning: " + _HOSTILE.replace("<", "&lt;") + " [transformers/x.py:1]\n</system-err>"
        '</testcase><testcase classname="suites.s.toml" name="decode', 1)
    open(path, "w").write(xml)
    return run_compare(Options(results=[path], history=None, dry_run=True), out=io.StringIO())


def test_summary_has_the_matrix_and_every_failure_with_its_module(tmp_path):
    o = _glance_results(tmp_path)
    md = summary_markdown(o, _HEADLINES)
    assert "| s | precision | cpu | float32 | FAILED | isolated&#95;worst&#95;budget&#95;use=2000 " in md, md
    assert "| s | ops | cpu | float32 | passed | 2 items: 2 passed" in md  # variants folded into one row
    assert "| s | training | cpu | float32 | passed | training&#95;backward&#95;worst&#95;budget&#95;use=0.49 | 0.25 s |" in md
    assert "### Failures and errors (1)" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("- **suites.s.toml::precision"))
    assert "model.layers.1.mlp diverges" in line and "first divergent module <code>model.layers.1.mlp</code>" in line
    assert "<script>" not in md and "ghp_AAAA" not in md  # escaped and scrubbed
    # without the registry's headlines (another caller): the budget-use metrics
    assert "| decode&#95;worst&#95;budget&#95;use=0.67 |" in summary_markdown(o).replace(" | 0.50 s", " |")


def test_html_shows_failure_module_plots_and_collapsed_warnings(tmp_path):
    o = _glance_results(tmp_path)
    page = html_report(o, None, "glance", headlines=_HEADLINES)
    text = html.unescape(page)
    assert "1 failed, 0 errors" in page and "Matrix: suite x check x backend x dtype (5 rows)" in page
    assert "first divergent module: <code>model.layers.1.mlp</code>" in page
    for alt in ("rel RMSE per layer vs its tolerance", "budget use per module", "training trajectory inside its envelope",
                "decode budget use per step"):
        assert page.count(f"alt='{alt}'") == 1, alt  # the malformed details of t's item draw nothing, and no crash
    assert page.count("data:image/png;base64,") == 4
    # the warnings: parsed from <system-err>, collapsed (<details> without open), counted in the matrix
    assert "<details><summary>suites.s.toml::training[cpu-float32]: 2 warning(s)</summary>" in page
    assert "3 x UserWarning: TypedStorage is deprecated [torch/_utils.py:831]" in text
    assert "<details open" not in page
    # untrusted text escaped (and the token cut) everywhere: message, warnings, findings
    assert "<script>" not in page and "&lt;script&gt;" in page and "ghp_AAAA" not in page
    # the findings row of a failure says what failed (it had empty cells)
    assert "<td>new failure</td>" in page and "model.layers.1.mlp diverges from the golden" in page
    assert "No perf items in these results" in page


def test_html_perf_items_against_baseline_and_history(tmp_path):
    hist = str(tmp_path / "h.sqlite")
    for n, v in enumerate([1.0, 1.02, 0.99]):
        p = write_junit(tmp_path / f"r{n}.xml", [item("s", "perf", metrics={"prefill_s": v})])
        run_compare(Options(results=[p], history=hist, run_key=f"r{n}"), out=io.StringIO())
    base = write_junit(tmp_path / "base.xml", [item("s", "perf", metrics={"prefill_s": 1.0})])
    cur = write_junit(tmp_path / "cur.xml", [item("s", "perf", metrics={"prefill_s": 1.01})])
    o = run_compare(Options(results=[cur], baseline=[base], history=hist, dry_run=True), out=io.StringIO())
    h = History(hist)
    page = html_report(o, h.metric_series([r.id for r in h.runs()]), headlines=_HEADLINES)
    assert "<td>prefill_s</td><td>1.01</td><td>1</td><td>+1.0%</td>" in page
    assert "<h3>prefill_s of suites.s.toml::perf[cpu-float32]</h3><img" in page  # its history, this run last


def test_junit_keeps_system_err_for_the_report(tmp_path):
    o = _glance_results(tmp_path)
    case = o.current.cases["suites.s.toml::training[cpu-float32]"]
    assert case.outcome == "passed" and case.stderr.startswith("3 x UserWarning")
    assert "ghp_AAAA" not in case.stderr  # scrubbed when read
