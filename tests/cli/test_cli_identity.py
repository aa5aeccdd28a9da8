"""Item identity end to end: a backend named with hyphens and a suite outside the repository keep
their names through items, JUnit, `harness run`'s table and summary, and `harness compare`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests_support import REPO_SUITES, TINY_PRUNE


def harness(*args, cwd: Path, env: dict):
    exe = Path(sys.executable).with_name("harness")
    e = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "250"} | env
    return subprocess.run([str(exe), *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_hyphenated_backend_and_outside_suite_round_trip(tmp_path):
    # The suite lives outside any repository (as `harness init --suites-dir` writes it); the
    # backend is a vendor's, declared in harness.toml, with hyphens in its name.
    elsewhere = tmp_path / "elsewhere" / "mysuites"
    shutil.copytree(REPO_SUITES / "configs", elsewhere / "configs")
    suite = elsewhere / "new-model.toml"
    body = ('backends = ["my-npu"]\ndtypes = ["float32", "bfloat16"]\n[model]\n'
            'config = "configs/Llama-3.1-8B.json"\n' + TINY_PRUNE)
    suite.write_text(body)
    work = tmp_path / "work"
    work.mkdir()
    (work / "harness.toml").write_text('[[backends]]\nname = "my-npu"\ndevice_type = "cpu"\ncollective = "gloo"\n')
    env = {"HARNESS_CONFIG": str(work / "harness.toml")}

    r1 = harness("run", str(suite), "--check", "smoke", "--results", "r1", cwd=work, env=env)
    assert r1.returncode == 0, r1.stdout + r1.stderr
    assert "passed  mysuites/new-model.toml::smoke[my-npu-bfloat16]" in r1.stdout  # not "::smoke[..."
    rows = [line for line in r1.stdout.splitlines() if "│ new-model" in line]
    assert len(rows) == 2 and all("│ my-npu " in r and "│ passed" in r for r in rows)
    assert any("│ bfloat16 " in r for r in rows) and any("│ float32 " in r for r in rows)
    cases = ET.parse(work / "r1" / "junit.xml").getroot().findall(".//testcase")
    assert {c.get("classname") for c in cases} == {"mysuites.new-model.toml"}
    for c in cases:
        props = {p.get("name"): p.get("value") for p in c.iter("property")}
        assert props["harness.suite"] == "new-model" and props["harness.backend"] == "my-npu"
        assert props["harness.dtype"] in ("float32", "bfloat16") and props["harness.check"] == "smoke"
    summary = json.loads((work / "r1" / "summary.json").read_text())
    assert summary["counts"]["passed"] == 2

    # The model regresses (the optimizer no longer moves it): compare files one issue that names
    # the suite, the hyphenated backend and both dtypes, never a split "my" / "npu-bfloat16".
    suite.write_text(body + "\n[checks.smoke]\nlr = 1e-30\n")
    r2 = harness("run", str(suite), "--check", "smoke", "--results", "r2", cwd=work, env=env)
    assert r2.returncode == 1 and "0 passed, 2 failed" in r2.stdout
    c = harness("compare", "r2/junit.xml", "--baseline", "r1/junit.xml", "--history", "", "--sink", "file",
                "--out-dir", "issues", cwd=work, env=env)
    assert c.returncode == 0, c.stdout + c.stderr
    bodies = [p.read_text() for p in (work / "issues").glob("issue-*.md")]
    assert len(bodies) == 1
    assert "new-model" in bodies[0] and "my-npu" in bodies[0]
    assert "bfloat16" in bodies[0] and "float32" in bodies[0]
