"""ruff holds the repository (issue #44 item 3: rules hold because CI holds them): `ruff check .` with
pyproject.toml's rules passes, so .ci/run (pytest only) fails where the lint job would; and the
complexity and statement rules it selects do fail an oversized function."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    if not RUFF.exists():
        pytest.fail(f"{RUFF} missing: ruff is in the test extra (pip install -e '.[test]')")
    return subprocess.run([str(RUFF), "check", "--no-cache", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_ruff_passes_on_the_repository():
    r = _ruff(".")
    assert r.returncode == 0, f"`ruff check .` fails (run it for the fixes):\n{r.stdout}{r.stderr}"


def test_an_oversized_function_fails_complexity_and_statements(tmp_path):
    """A function with more branches and statements than pyproject.toml allows, in a copy of the
    project's configuration: ruff names both rules."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    body = "".join(f"    if x == {i}:\n        y = {i}\n        x += y\n" for i in range(40))
    (tmp_path / "big.py").write_text(f"def big(x):\n    y = 0\n{body}    return x\n")
    r = _ruff("big.py", "--output-format", "concise", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "C901 `big` is too complex" in r.stdout and "PLR0915 Too many statements" in r.stdout, r.stdout
