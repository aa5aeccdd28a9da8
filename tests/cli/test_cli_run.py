"""`harness run`, `validate` and `backends` as a user runs them: one end-to-end test per command
through the console script in a subprocess; error paths in-process (harness.cli.main), which is
~50x cheaper than a subprocess that imports torch and transformers again."""

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


def cli(*args, cwd, capsys, monkeypatch) -> tuple[int, str]:
    """The same command line, in this process; returns (exit code, stdout + stderr)."""
    from harness.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("COLUMNS", "200")
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


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


def test_a_reader_that_goes_away_costs_no_item(project):
    """`harness run ... | head -1`: the reader closes the pipe after the first progress line. The next
    write used to end the run (rich's SystemExit(1) on BrokenPipeError: 1 of 18 items of llama-3.1-8b's
    smoke, precision and decode run, exit 1);
    now the rest of the output goes to /dev/null and every item runs and is recorded."""
    (project / "suites" / "tiny.toml").write_text('dtypes = ["float32", "bfloat16"]\n' + TINY)
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    p = subprocess.Popen([str(exe), "run", "tiny", "--check", "smoke"], cwd=project, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = p.stdout.readline()
    p.stdout.close()  # what head does after its line
    err = p.stderr.read()
    assert p.wait(timeout=600) == 0, first + err
    assert first.startswith("[1/"), first
    assert "BrokenPipe" not in err and "INTERNALERROR" not in err and "Traceback" not in err, err
    summary = json.loads((project / "results" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["counts"]["passed"] == 2, summary["counts"]


def test_run_with_a_malformed_suite_reports_it_and_runs_the_rest(project, capsys, monkeypatch):
    (project / "suites" / "tiny.toml").write_text('dtypes = ["float32"]\n' + TINY)
    (project / "suites" / "bad.toml").write_text(TINY.replace("hidden_size = 32", "hidden_size = -3"))
    code, out = cli("run", "--check", "smoke", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 1, out
    assert "prune.hidden_size: must be >= 1, got -3" in out
    assert "1 passed, 0 failed, 1 errors" in out
    assert "<testcase" in (project / "results" / "junit.xml").read_text()


def test_run_unknown_suite_backend_and_check(project, capsys, monkeypatch):
    (project / "suites" / "tiny.toml").write_text(TINY)
    code, out = cli("run", "nope", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 2 and "no such suite 'nope'" in out and "tiny" in out
    code, out = cli("run", "tiny", "--backend", "tpu9", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 2 and "unknown backend(s) tpu9" in out
    # a typo in --check used to select nothing and exit 0
    code, out = cli("run", "tiny", "--check", "smok", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 2 and "unknown check(s) smok (registered: smoke, precision, decode, longctx, compile, training, width, quantization, ops" in out
    assert not (project / "results").exists()


def test_validate_errors_in_process(project, capsys, monkeypatch):
    (project / "suites" / "tiny.toml").write_text(TINY)
    (project / "suites" / "bad.toml").write_text("[model]\nconfig = 'configs/missing.json'\n")
    (project / "suites" / "latin1.toml").write_bytes('[model]\nconfig = "caf\xe9.json"\n'.encode("latin-1"))
    code, out = cli("validate", "--no-build", cwd=project, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 1
    assert "suites/bad.toml: model.config: file not found: suites/configs/missing.json" in out
    assert "suites/latin1.toml: not UTF-8 text (byte 21: invalid continuation byte)" in out
    assert "1 valid, 2 invalid" in out


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
