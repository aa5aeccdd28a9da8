"""toxfile.py: a model-<suite> env for every suite file, with no hand edits."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests_support import REPO


def tox(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tox", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_dropping_a_suite_in_creates_its_env(tmp_path):
    for f in ("toxfile.py", "tox.ini", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / f, tmp_path / f)
    (tmp_path / "suites").mkdir()
    for p in (REPO / "suites").glob("*.toml"):
        shutil.copy(p, tmp_path / "suites" / p.name)
    before = tox("-l", cwd=tmp_path)
    assert before.returncode == 0, before.stderr
    assert "model-kimi-k2" in before.stdout.split() and "tests" in before.stdout.split()
    assert "model-foo" not in before.stdout.split()

    (tmp_path / "suites" / "foo.toml").write_text("[model]\nconfig = 'configs/x.json'\n")
    after = tox("-l", cwd=tmp_path)
    assert "model-foo" in after.stdout.split()
    cfg = tox("config", "-e", "model-foo", "-k", "commands", "--", "-k", "smoke", cwd=tmp_path)
    assert "suites/foo.toml" in cfg.stdout and "-k smoke" in cfg.stdout, cfg.stdout
