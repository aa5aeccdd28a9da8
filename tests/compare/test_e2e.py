"""End to end with XML that real pytest wrote: a clean baseline run, then a run with an injected
precision fault; the issue must name suite, backend, dtype and the first divergent module. The
CLI modules are driven through their own argparse registration (``harness compare``/``report``)
with the file sink, independent of the other subcommands' state."""

from __future__ import annotations

import argparse
import html
import json

import pytest

from harness.cli import compare as compare_cli
from harness.cli import report as report_cli

from .junit_factory import item, run_pytest_suite

LAYERS = [{"module": f"model.layers.{i}.mlp", "max_abs_err": e, "rel_rmse": e / 10, "cosine": 1 - e,
           "tolerance": 1e-3, "ok": e <= 1e-3} for i, e in enumerate([1e-6, 2e-6, 5e-2, 8e-2])]


def _items(fault: bool) -> list[dict]:
    prec = dict(metrics={"max_abs_err": 8e-2 if fault else 1e-6}, tolerances={"max_abs_err": 1e-3})
    if fault:
        prec.update(fail="max_abs_err 0.08 > tolerance 0.001 at model.layers.2.mlp",
                    details={"first_divergent_module": "model.layers.2.mlp", "layer_table": json.dumps(LAYERS)},
                    log="comparing layer by layer (cc @bob)")
    return [item("kimi-k2", "smoke", dtype="bfloat16", metrics={"wall_time_s": 1.0}),
            item("kimi-k2", "precision", dtype="bfloat16", **prec)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("baseline")
    cur = tmp_path_factory.mktemp("current")
    return (run_pytest_suite(base, _items(False), base / "junit.xml"),
            run_pytest_suite(cur, _items(True), cur / "junit.xml"))


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def harness(monkeypatch, capsys):
    def run(*args, cwd, env=None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        monkeypatch.chdir(cwd)
        parser = argparse.ArgumentParser(prog="harness")
        sub = parser.add_subparsers()
        compare_cli.register(sub)
        report_cli.register(sub)
        parsed = parser.parse_args([str(a) for a in args])
        code = parsed.func(parsed)
        out = capsys.readouterr()
        return Result(code, out.out, out.err)
    return run


def test_pytest_wrote_the_harness_shape(runs):
    text = open(runs[1]).read()
    assert 'classname="suites.kimi-k2.toml"' in text and 'name="precision[cpu-bfloat16]"' in text
    assert 'name="harness.detail.first_divergent_module" value="model.layers.2.mlp"' in text


def test_precision_fault_files_one_issue_naming_the_module(runs, tmp_path, harness):
    base, cur = runs
    summary = tmp_path / "step-summary.md"
    r = harness("compare", cur, "--baseline", base, "--history", str(tmp_path / "h.sqlite"), "--sink", "file",
                "--out-dir", str(tmp_path / "issues"), "--commit", "abc123def", "--baseline-commit", "0ld",
                cwd=tmp_path, env={"GITHUB_STEP_SUMMARY": str(summary), "GITHUB_RUN_ID": "42",
                                   "GITHUB_REPOSITORY": "acme/models", "GITHUB_SERVER_URL": "https://github.test"})
    assert r.returncode == 0, r.stderr
    state = json.load(open(tmp_path / "issues" / "issues.json"))
    assert len(state) == 1
    (issue,) = state.values()
    assert issue["title"] == "[harness] precision regression: kimi-k2 on cpu"
    assert issue["labels"] == ["harness", "kind:precision", "suite:kimi-k2", "backend:cpu"]
    body = html.unescape(issue["body"])  # names are entity-escaped in the markdown
    for needle in ("kimi-k2", "**cpu**", "bfloat16", "first divergent module <code>model.layers.2.mlp</code>",
                   "| <code>model.layers.2.mlp</code> | 0.05 |", 'tox -e model-kimi-k2 -- -k "precision[cpu-bfloat16]"',
                   "abc123def", "0ld", "https://github.test/acme/models/actions/runs/42", "<details>",
                   "@\u200dbob"):
        assert needle in body, needle
    assert len(body) < 65536
    md = open(tmp_path / "issues" / "issue-1.md").read()
    assert "model.layers.2.mlp" in md
    log = json.load(open(tmp_path / "issues" / "actions.json"))
    assert [e["op"] for e in log] == ["create"]
    text = html.unescape(summary.read_text())
    assert "## harness compare" in text and "new failure" in text and "precision[cpu-bfloat16]" in text


def test_report_writes_html_with_layer_plot(runs, tmp_path, harness):
    base, cur = runs
    out = tmp_path / "report.html"
    r = harness("report", cur, "--baseline", base, "-o", str(out), "--history", "", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert "model.layers.2.mlp" in page and page.count("data:image/png;base64,") >= 1


def test_cli_without_readable_results_exits_2_with_message(tmp_path, harness):
    r = harness("compare", str(tmp_path / "nope.xml"), "--history", "", cwd=tmp_path)
    assert r.returncode == 2
    assert "shard missing" in r.stderr and "no test case could be read" in r.stderr
