"""The test tree collects as a whole: no two test modules import under the same name.

pytest's default import mode ("prepend") imports a test file outside a package by its basename, so
tests/cli/test_certify.py and tests/testdev/test_certify.py are one module name: the second is an
"import file mismatch" collection error, and CI failed on exactly that (it passes when either folder
runs alone). The rule below is pytest's own: the module name is the file's path from the highest
folder above it that still has an ``__init__.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def module_name(path: Path) -> str:
    """The name pytest's prepend import mode gives the test module ``path``."""
    parts = [path.stem]
    d = path.parent
    while (d / "__init__.py").exists():
        parts.insert(0, d.name)
        d = d.parent
    return ".".join(parts)


def clashes(root: Path) -> dict[str, list[str]]:
    """Module name -> the test files under ``root`` that share it (only names with two or more)."""
    seen: dict[str, list[str]] = {}
    for f in sorted(root.rglob("test_*.py")):
        if "__pycache__" not in f.parts:
            seen.setdefault(module_name(f), []).append(str(f.relative_to(root)))
    return {n: fs for n, fs in seen.items() if len(fs) > 1}


def test_no_two_test_modules_share_an_import_name():
    assert clashes(TESTS) == {}, "rename one of each (or make its folder a package): " + repr(clashes(TESTS))


def test_the_rule_is_pytests(tmp_path):
    """Two folders without __init__.py, one basename: the rule reports it and pytest fails to
    collect; a package on one side resolves both."""
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "test_same.py").write_text("def test_it():\n    pass\n")
    assert clashes(tmp_path) == {"test_same": ["a/test_same.py", "b/test_same.py"]}
    run = lambda: subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",  # noqa: E731
                                  str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    r = run()
    assert r.returncode != 0 and "import file mismatch" in r.stdout, r.stdout
    (tmp_path / "b" / "__init__.py").write_text("")
    assert clashes(tmp_path) == {}
    r = run()
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout
