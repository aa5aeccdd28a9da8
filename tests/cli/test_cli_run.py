"""`harness run`, `validate` and `backends` as a user runs them: the console script, in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import REPO_SUITES, TINY_PRUNE

TINY = '[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + TINY_PRUNE


def harness(*args, cwd):
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    return subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def project(tmp_path):
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    return tmp_path


def test_run_writes_results_and_prints_a_table(project):
    (project / "suites" / "tiny.toml").write_text('dtypes = ["float32", "bfloat16"]\n' + TINY)
    r = harness("run", "tiny", "--check", "smoke", cwd=project)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "harness results" in r.stdout and "tiny" in r.stdout
    # no terminal (as in CI): one progress line per finished item
    assert "[2/2] passed  suites/tiny.toml::smoke[cpu-" in r.stdout
    assert "2 passed, 0 failed, 0 errors, 0 skipped" in r.stdout
    summary = json.loads((project / "results" / "summary.json").read_text())
    assert summary["counts"]["passed"] == 2
    assert (project / "results" / "junit.xml").read_text().count("<testcase") == 2
    assert (project / "results" / "summary.txt").exists()


def test_run_with_a_malformed_suite_reports_it_and_runs_the_rest(project):
    (project / "suites" / "tiny.toml").write_text('dtypes = ["float32"]\n' + TINY)
    (project / "suites" / "bad.toml").write_text(TINY.replace("hidden_size = 32", "hidden_size = -3"))
    r = harness("run", "--check", "smoke", cwd=project)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "prune.hidden_size: must be >= 1, got -3" in r.stdout
    assert "1 passed, 0 failed, 1 errors" in r.stdout
    assert "<testcase" in (project / "results" / "junit.xml").read_text()


def test_run_unknown_suite_and_backend(project):
    (project / "suites" / "tiny.toml").write_text(TINY)
    r = harness("run", "nope", cwd=project)
    assert r.returncode == 2 and "no such suite 'nope' (known: tiny)" in r.stdout
    r = harness("run", "tiny", "--backend", "tpu9", cwd=project)
    assert r.returncode == 2 and "unknown backend(s) tpu9" in r.stdout


def test_validate(project):
    (project / "suites" / "tiny.toml").write_text(TINY)
    (project / "suites" / "bad.toml").write_text("[model]\nconfig = 'configs/missing.json'\n")
    r = harness("validate", cwd=project)
    assert r.returncode == 1
    assert "ok    suites/tiny.toml" in r.stdout
    assert "suites/bad.toml: model.config: file not found: suites/configs/missing.json" in r.stdout
    assert "1 valid, 1 invalid" in r.stdout


def test_backends_json(project):
    r = harness("backends", "--json", cwd=project)
    rows = {b["name"]: b for b in json.loads(r.stdout)}
    assert rows["cpu"]["available"] and "float32" in rows["cpu"]["dtypes"]
    assert set(rows) >= {"cpu", "cuda", "xpu", "mps", "npu", "musa", "mlu"}
