"""Confirm before filing (issue #31 item 1): `harness run --confirm N` reruns a failed item in fresh
workers and says what it is, with real processes and real models: a NaN kernel in every run is
deterministic, one that fails one process in three is flaky (reported passed, its failed attempt
recorded), a worker the OOM killer takes is infrastructure. A quarantined item's failure is reported
but does not fail the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.run.confirm import confirm, infrastructure_cause
from harness.run.rows import ItemResult
from tests_support import REPO_SUITES, smoke_suite

TESTS = Path(__file__).resolve().parent.parent  # tests/: faulty_models.py


def suite(adapter: str | None) -> str:
    return smoke_suite(f"faulty_models:{adapter}" if adapter else None)


@pytest.fixture
def project(tmp_path) -> Path:
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\n')
    return tmp_path


def harness(project: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "250", "HARNESS_CONFIG": str(project / "harness.toml"),
                        "HARNESS_TEST_FLAKY_COUNTER": str(project / "flaky.count"),
                        "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([str(exe), *args], cwd=project, env=env, capture_output=True, text=True, timeout=600)


def cases(results: Path) -> dict[str, ET.Element]:
    root = ET.parse(results / "junit.xml").getroot()
    return {tc.get("classname").split(".")[1]: tc for tc in root.iter("testcase")}


def props(tc: ET.Element) -> dict[str, str]:
    return {p.get("name"): p.get("value") for p in tc.iter("property")}


@pytest.mark.slow
def test_deterministic_flaky_and_infrastructure_failures_are_told_apart(project):
    s = project / "suites"
    # the healthy item first and the OOM-killed one last: no fresh worker is started only to run the
    # healthy item after the last kill (that the item after a killed worker still runs is
    # tests/run/test_isolation.py's hang/abort/leak test)
    (s / "a-healthy.toml").write_text(suite(None))
    (s / "b-nan.toml").write_text(suite("nan"))
    (s / "c-flaky.toml").write_text(suite("flaky"))
    (s / "d-oom.toml").write_text(suite("oom_killed"))
    r = harness(project, "run", "--check", "smoke", "--confirm", "2", "--results", "res")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out  # the deterministic failure and the infrastructure error fail the run
    tc = cases(project / "res")

    nan = tc["b-nan"]
    p = props(nan)
    assert nan.find("failure") is not None and p["harness.detail.confirm"] == "deterministic"
    attempts = json.loads(p["harness.detail.confirm_attempts"])
    assert [a["outcome"] for a in attempts] == ["failed"] * 3
    assert len(nan.findall("rerunFailure")) == 2  # the reruns, beside the case's own <failure>
    assert "non-finite" in nan.find("failure").get("message")

    flaky = tc["c-flaky"]
    p = props(flaky)
    assert flaky.find("failure") is None and flaky.find("error") is None  # passed
    assert p["harness.detail.confirm"] == "flaky" and p["harness.detail.confirm_rate"] == "0.333"
    assert [a["outcome"] for a in json.loads(p["harness.detail.confirm_attempts"])] == ["failed", "passed", "passed"]
    assert len(flaky.findall("rerunFailure")) == 1 and "non-finite" in p["harness.detail.confirm_failure"]
    assert "metric.loss_final" in p  # the passing attempt's metrics are the item's
    assert (project / "flaky.count").read_text() == "3"  # three processes built it: one per attempt

    oom = tc["d-oom"]
    p = props(oom)
    assert oom.find("error") is not None and p["harness.detail.confirm"] == "infrastructure"
    assert oom.find("error").get("message").startswith("infrastructure: crashed with SIGKILL")

    assert props(tc["a-healthy"]).get("harness.detail.confirm") is None  # passed at once: never rerun
    # the stack it ran with, for the upstream canary's comparison (installed versions, nothing imported)
    from importlib.metadata import version

    suite_props = {p.get("name"): p.get("value")
                   for p in ET.parse(project / "res" / "junit.xml").getroot().find("testsuite/properties")}
    assert suite_props["harness.stack.torch"] == version("torch")
    assert suite_props["harness.stack.transformers"] == version("transformers")
    assert "2 passed, 1 failed, 1 errors, 0 skipped, 1 flaky (passed on a rerun)" in out, out

    # the comparator reads the classification: one failure, one infrastructure finding, one flake
    from harness.compare.classify import Config, classify
    from harness.compare.junit import read_results

    found = {(f.category, f.suite, f.note) for f in classify(read_results([str(project / "res")]), None, None,
                                                               Config()).findings}
    assert ("new_failure", "b-nan", "deterministic: failed 3 of 3 attempts") in found
    assert ("flaky", "c-flaky", "flaky: failed 1 of 3 attempts") in found
    assert ("infrastructure", "d-oom", "infrastructure: failed 3 of 3 attempts") in found


@pytest.mark.slow
def test_a_quarantined_failure_is_reported_and_does_not_fail_the_run(project):
    (project / "suites" / "a-nan.toml").write_text(suite("nan"))
    r = harness(project, "quarantine", "add", "suites/a-nan.toml::smoke[cpu-float32]", "--reason", "known race")
    assert r.returncode == 0 and "quarantined suites.a-nan.toml::smoke[cpu-float32]" in r.stdout, r.stderr
    r = harness(project, "run", "--check", "smoke", "--results", "res")  # quarantine.json from harness.toml
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "1 quarantined (not failing the run)" in out and "quarantined" in out.split("harness results")[1]
    nan = cases(project / "res")["a-nan"]
    f = nan.find("failure")  # still a failure for every reader of the XML
    assert f is not None and f.get("type") == "harness.quarantined" and "non-finite" in f.get("message")
    assert "known race" in props(nan)["harness.detail.quarantined"] and "non-finite" in (f.text or "")
    # given back: the same failure fails the run again
    assert harness(project, "quarantine", "remove", "suites.a-nan.toml::smoke[cpu-float32]").returncode == 0
    r = harness(project, "run", "--check", "smoke", "--results", "res")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout


def test_an_unreadable_quarantine_file_stops_the_run_in_one_line(project):
    (project / "suites" / "a.toml").write_text(suite(None))
    (project / "quarantine.json").write_text('{"format": 1, "items": [')
    r = harness(project, "run", "--check", "smoke", "--results", "res")
    assert r.returncode != 0 and "quarantine.json: cannot read the quarantine file" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def _result(outcome: str, message: str = "") -> ItemResult:
    return ItemResult(outcome, message, message)


def test_classification_rules():
    """The rules on their own: what each class needs, and that a hang is rerun once only."""
    seq = iter([_result("passed"), _result("failed", "x 0.5 > 0.1")])
    r = confirm(_result("failed", "x 0.7 > 0.1"), 1.0, lambda: next(seq), 2)
    assert r.outcome == "passed" and dict(r.properties)["harness.detail.confirm"] == "flaky"
    calls = []
    r = confirm(_result("error", "hung: no result within the 60 s time limit, killed in forward"), 60.0,
                lambda: calls.append(1) or _result("error", "hung: again"), 2)
    assert len(calls) == 1 and dict(r.properties)["harness.detail.confirm"] == "deterministic"
    r = confirm(_result("failed", "logits 0.31 > 0.04"), 1.0, lambda: _result("failed", "logits 0.29 > 0.04"), 2)
    assert dict(r.properties)["harness.detail.confirm"] == "deterministic"
    assert r.notes[-1] == "deterministic: failed 3 of 3 attempts in fresh workers"
    # a device gone after the failure, or the kernel's OOM killer: the runner's, not the model's
    gone = confirm(_result("failed", "RuntimeError: bad"), 1.0, lambda: _result("failed", "RuntimeError: bad"), 1,
                   device_available=lambda: False)
    assert gone.outcome == "error" and dict(gone.properties)["harness.detail.confirm"] == "infrastructure"
    assert infrastructure_cause(_result("error", "crashed with SIGKILL in forward"))
    assert not infrastructure_cause(_result("error", "crashed with SIGSEGV in forward"))  # a kernel's own crash
    assert not infrastructure_cause(_result("error", "exceeded the memory limit (3.1 GiB > 3 GiB) and was killed"))
    assert infrastructure_cause(_result("failed", "RuntimeError: CUDA error: uncorrectable ECC error encountered"))
    passed = _result("passed")
    assert confirm(passed, 1.0, lambda: pytest.fail("never rerun"), 2) is passed


def test_a_measured_verdict_is_not_rerun_but_its_crash_is():
    """A perf or comm regression is decided by the check's own statistics (perf re-measures a
    suspected one in the item): rerunning it would report a real regression as a flaky pass
    whenever one attempt misses it, and quarantine it. Only those checks say so; their errors
    (crashes, hangs) are confirmed like any other item's."""
    from harness.checks import registry

    checks = registry()
    assert {n for n in checks.names() if checks.get(n).statistical_verdict} == {"perf", "comm"}
    slower = _result("failed", "prefill_s regressed +12.0% (calibrated, p=0.003, confirmed on re-measure)")
    r = confirm(slower, 30.0, lambda: pytest.fail("never rerun"), 2, statistical=True)
    assert r is slower and r.outcome == "failed" and dict(r.properties)["harness.detail.confirm"] == "statistical"
    assert r.notes[-1].startswith("not rerun by --confirm: a measured verdict")
    calls = []
    r = confirm(_result("error", "crashed with SIGSEGV in timing"), 30.0,
                lambda: calls.append(1) or _result("passed"), 2, statistical=True)
    assert calls == [1, 1] and dict(r.properties)["harness.detail.confirm"] == "flaky"
    # the same failure of a numerics check is rerun
    calls.clear()
    confirm(_result("failed", "logits 0.31 > 0.04"), 1.0, lambda: calls.append(1) or _result("passed"), 2)
    assert calls == [1, 1]
