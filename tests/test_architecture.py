"""The layers of docs/architecture.md hold: import-linter's contracts (pyproject.toml) pass on the
tree, fail on an arrow back up, and no module imports another package's private names."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    if not LINT.exists():
        pytest.fail(f"{LINT} missing: import-linter is in the test extra (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([str(LINT), "--no-cache", "--config", "pyproject.toml"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold():
    r = _lint(ROOT, ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "layers KEPT" in r.stdout and "no cycles between sibling modules of any package KEPT" in r.stdout


def test_an_arrow_back_up_breaks_them(tmp_path):
    """The same contracts on a copy of the tree where anatomy (near the bottom) defers an import of
    the command line (the top), as a function-local import would: both contracts say so."""
    shutil.copytree(ROOT / "harness", tmp_path / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    layers = tmp_path / "harness" / "anatomy" / "layers.py"
    layers.write_text(layers.read_text() + "\n\ndef _upward():\n    from harness.cli import main\n\n    return main\n")
    r = _lint(tmp_path, tmp_path)
    assert r.returncode != 0, r.stdout
    assert "harness.anatomy is not allowed to import harness.cli" in r.stdout
    assert "harness.anatomy.layers -> harness.cli" in r.stdout


def _private_imports_across_packages() -> list[str]:
    out = []
    for p in sorted((ROOT / "harness").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        own = parts[1] if len(parts) > 2 else parts[-1]  # harness/<package>/... or harness/<module>.py
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness."):
                target = node.module.split(".")[1]
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and target != own:
                        out.append(f"{p.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}")
    return out


def test_no_private_names_across_packages():
    assert _private_imports_across_packages() == []


def test_every_package_names_its_modules():
    """Each package's docstring is its map: it names every module in it (the maps had gone stale,
    parallel naming 10 of its 15 modules)."""
    missing = []
    for init in sorted((ROOT / "harness").glob("*/__init__.py")):
        pkg = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        for m in sorted(p.stem for p in pkg.glob("*.py") if p.stem != "__init__"):
            if f"``{m}``" not in doc and f"{m}.py" not in doc and f"harness.{pkg.name}.{m}" not in doc:
                missing.append(f"harness/{pkg.name}/__init__.py does not name {m}")
    assert missing == []

