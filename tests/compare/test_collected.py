"""`harness compare --collected`: the node ids `pytest --collect-only -q` prints match the keys
pytest's JUnit XML carries, for every id the plugin makes (``<folder>/<file>::<check>[<params>]``),
also when a variant holds ``::`` (an op ``aten::mm``, a named layout). A test still defined but
missing from the run is *vanished* (filed); one the suite no longer defines is *dropped*."""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys

from harness.cli import main as harness_main

from .junit_factory import item, run_pytest_suite


def _op(op: str) -> dict:
    it = item("kimi-k2", "ops")
    it["name"] = f"ops[cpu-float32-{op}]"
    it["props"].append(["harness.variant", op])
    return it


def _collect(folder) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_"))}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "no:harness", "-p", "no:xdist", "-p", "no:hypothesispytest", "suites"],
                       cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert "suites/kimi-k2.toml::ops[cpu-float32-aten::mm]" in r.stdout, r.stdout + r.stderr
    path = os.path.join(folder, "collected.txt")
    with open(path, "w") as f:
        f.write(r.stdout)
    return path


def test_collected_ids_match_pytests_junit_keys_vanished_vs_dropped(tmp_path, monkeypatch, capsys):
    smoke = item("kimi-k2", "smoke")
    base = run_pytest_suite(tmp_path / "main", [smoke, _op("aten::mm"), _op("aten::gone")], tmp_path / "base.xml")
    # what the suites define now: aten::gone was dropped on purpose; aten::mm is still defined
    run_pytest_suite(tmp_path / "now", [smoke, _op("aten::mm")], tmp_path / "defined.xml")
    collected = _collect(tmp_path / "now")
    # this run lost aten::mm (a crashed shard worker, say) while its suite x backend did run
    cur = run_pytest_suite(tmp_path / "run", [smoke], tmp_path / "cur.xml")
    assert 'name="ops[cpu-float32-aten::mm]"' in open(base).read()  # pytest keeps the params whole

    monkeypatch.chdir(tmp_path)
    code = harness_main(["compare", cur, "--baseline", base, "--collected", collected, "--history", "",
                         "--sink", "file", "--out-dir", "issues", "--mute-file", "", "--summary", "s.md"])
    assert code == 0
    summary = html.unescape((tmp_path / "s.md").read_text())
    assert "| vanished | 1 |" in summary and "| dropped | 1 |" in summary
    (issue,) = json.load(open(tmp_path / "issues" / "issues.json")).values()
    body = html.unescape(issue["body"])
    assert issue["title"] == "[harness] vanished regression: kimi-k2 on cpu"
    assert "ops[cpu-float32-aten::mm]" in body and "aten::gone" not in body


def test_junit_key_of_the_plugins_ids():
    from harness.cli.compare import junit_key, junit_keys

    assert junit_key("suites/kimi-k2.toml::smoke[cpu-float32]") == "suites.kimi-k2.toml::smoke[cpu-float32]"
    assert junit_key("mysuites/new.toml::parallel[my-npu-bfloat16-tp2::ep2]\n") == \
        "mysuites.new.toml::parallel[my-npu-bfloat16-tp2::ep2]"
    # harness's own results writer (harness/run/results.py) spells the second one differently today
    assert junit_keys("mysuites/new.toml::parallel[my-npu-bfloat16-tp2::ep2]") == {
        "mysuites.new.toml::parallel[my-npu-bfloat16-tp2::ep2]", "mysuites.new.toml.parallel[my-npu-bfloat16-tp2::ep2]"}
