"""Issue #30 item 1, the two other places perf baselines are made: the golden-update workflow's perf
step (its own `run:` script, read from .github/workflows/golden-update.yml and run by bash) and
`harness ci-local --scope nightly --check perf` followed by `harness baseline update` of its results
folder (shard folders inside). Each is followed by a later run that must be compared with the baseline
it made, through the command line in a project of its own."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests_support import REPO, REPO_SUITES, TINY_PRUNE

RUN = ("run", "tiny", "--scope", "nightly", "--check", "perf", "--backend", "cpu", "--dtype", "float32")


def _project(root: Path, head: str = "") -> tuple[Path, dict]:
    from checks.test_perf import PERF

    (root / "suites" / "configs").mkdir(parents=True)
    (root / "suites" / "configs" / "Llama-3.1-8B.json").write_bytes(
        (REPO_SUITES / "configs" / "Llama-3.1-8B.json").read_bytes())
    (root / "suites" / "tiny.toml").write_text(head + PERF.format(prune=TINY_PRUNE))
    (root / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\nresults_dir = "results"\n')
    return root, {**os.environ, "HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(root / "harness.toml")}


def _harness(project: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=300)


def _compared_with_baseline(junit: Path, items: int) -> None:
    verdicts = [p for p in junit.read_text().split("<property ") if "perf_verdict" in p]
    assert len(verdicts) == items, junit.read_text()[:2000]
    for v in verdicts:
        assert "golden/perf/tiny/" in v and "no baseline" not in v, v[:600]


@pytest.mark.slow
def test_golden_update_workflows_perf_step_makes_the_baseline_a_later_run_uses(tmp_path):
    wf = yaml.safe_load((REPO / ".github" / "workflows" / "golden-update.yml").read_text())
    steps = [s for job in wf["jobs"].values() for s in job["steps"]]
    step = next(s for s in steps if "harness baseline update" in s.get("run", ""))
    # float32 only: the step's three pooled runs and the update are what is tested, not the dtypes (the
    # ci-local test below does both); two dtypes made this test three minutes in CI
    project, env = _project(tmp_path / "proj", head='dtypes = ["float32"]\n')
    # the workflow's `.venv/bin/harness`: this interpreter's harness, in the project
    (project / ".venv" / "bin").mkdir(parents=True)
    exe = project / ".venv" / "bin" / "harness"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m harness \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    r = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=project, capture_output=True, text=True, timeout=600,
                       env={**env, **step.get("env", {}), "SUITES": "tiny", "PERF_BACKEND": "cpu"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "1 item(s)" in (project / "baseline-update.txt").read_text()  # float32
    assert list((project / "golden" / "perf" / "tiny").glob("*.json"))
    r = _harness(project, env, *RUN)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    _compared_with_baseline(project / "results" / "junit.xml", 1)


@pytest.mark.slow
def test_ci_local_nightly_perf_then_baseline_update_then_compared(tmp_path):
    project, env = _project(tmp_path / "proj")
    ci = ("ci-local", "tiny", "--scope", "nightly", "--check", "perf", "--shards", "1", "-n", "0",
          "--out", "ci")
    r = _harness(project, env, *ci)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = _harness(project, env, "baseline", "update", "ci/results")  # shard-1/perf/... inside
    assert r.returncode == 0 and "2 item(s)" in r.stdout, r.stdout + r.stderr  # float32 and bfloat16
    r = _harness(project, env, *ci)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    _compared_with_baseline(project / "ci" / "results" / "shard-1" / "junit.xml", 2)
