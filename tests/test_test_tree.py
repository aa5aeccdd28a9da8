"""The test tree collects as a whole, and runs as a whole in CI.

No two test modules import under the same name: pytest's default import mode ("prepend") imports a test file outside a package by its basename, so
tests/cli/test_certify.py and tests/testdev/test_certify.py are one module name: the second is an
"import file mismatch" collection error, and CI failed on exactly that (it passes when either folder
runs alone). The rule below is pytest's own: the module name is the file's path from the highest
folder above it that still has an ``__init__.py``.

No test decides from an environment variable whether it runs (issue #44): ``HARNESS_*_FULL``
variables that CI's ``.ci/run`` never set once hid whole matrices (the kernel-fault, decode,
training and Day-0 ones, the test device's long runs), so they were claimed and never run.
"""

from __future__ import annotations

import ast
import re
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


# --- no environment-variable gates (issue #44) -------------------------------------------------------

# An environment variable named like the old gates (HARNESS_<MATRIX>_FULL) read in any form.
FULL_VAR = re.compile(r"""(environ\b[^\n]{0,40}|getenv\s*\(\s*)["'][A-Z0-9_]*_FULL["']""")


def _scan(node: ast.AST) -> tuple[bool, set[str]]:
    """(whether ``node`` reads the environment - ``os.environ``, ``environ``, ``os.getenv(...)``,
    ``getenv(...)`` -, the names and attribute names it uses), in one walk."""
    reads, names = False, set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
            reads = reads or n.id in ("environ", "getenv")
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
            reads = reads or n.attr in ("environ", "environb", "getenv")
    return reads, names


def _module_facts(tree: ast.Module) -> list[tuple[set[str], bool, set[str]]]:
    """(names it binds, reads the environment, names it uses) of each module-level assignment and
    function (a function's own name left out of what it uses)."""
    facts = []
    for st in tree.body:
        if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            facts.append(({n for t in targets for n in _scan(t)[1]}, *_scan(st.value)))
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            reads, uses = _scan(st)
            facts.append(({st.name}, reads, uses - {st.name}))
    return facts


def _own_tainted(tree: ast.Module, facts, imported: set[str]) -> set[str]:
    """Module-level names (variables, functions) whose value depends on the environment: assigned
    from an expression that reads it or names a tainted name, or a function whose body does; names
    in ``imported`` (tainted in another test module) count when this module imports them. (A helper
    that builds a subprocess environment from os.environ is tainted too, harmlessly: it becomes a
    gate only where a skip condition or a parametrization calls it.)"""
    tainted = {a.asname or a.name for st in tree.body if isinstance(st, ast.ImportFrom) for a in st.names
               if a.name in imported}
    while True:
        before = len(tainted)
        for binds, reads, uses in facts:
            if reads or uses & tainted:
                tainted |= binds
        if len(tainted) == before:
            return tainted


def _is_call_to(node: ast.AST, *names: str) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr in names) or (isinstance(f, ast.Name) and f.id in names)


def env_gates(root: Path) -> list[str]:
    """"file:line: why" for every place under ``root`` where the environment decides whether, or on
    what, a test runs: a ``skipif`` condition, an ``if`` around ``pytest.skip`` and a ``parametrize``
    argument that read an environment variable (directly, or through a module-level name or function
    of the test tree that does), and any read of a ``*_FULL`` variable."""
    files = sorted(f for f in root.rglob("*.py") if "__pycache__" not in f.parts)
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
    facts = {f: _module_facts(t) for f, t in trees.items()}
    tainted: dict[Path, set[str]] = {f: set() for f in files}
    while True:  # across modules: ``from testdev_support import FULL`` taints FULL where it is imported
        everywhere = set().union(*tainted.values()) if tainted else set()
        new = {f: _own_tainted(t, facts[f], everywhere) for f, t in trees.items()}
        if new == tainted:
            break
        tainted = new
    out = []
    for f, tree in trees.items():
        rel, bad = f.relative_to(root), tainted[f]

        def depends(node: ast.AST, bad: set[str] = bad) -> bool:
            reads, names = _scan(node)
            return reads or bool(names & bad)

        for node in ast.walk(tree):
            if _is_call_to(node, "skipif") and any(depends(a) for a in node.args):
                out.append(f"{rel}:{node.lineno}: skipif on the environment")
            elif _is_call_to(node, "parametrize") and any(depends(a) for a in node.args[1:]):
                out.append(f"{rel}:{node.lineno}: parametrize on the environment")
            elif isinstance(node, ast.If) and depends(node.test) and any(
                    _is_call_to(n, "skip", "xfail", "importorskip") for b in (node.body, node.orelse)
                    for st in b for n in ast.walk(st)):
                out.append(f"{rel}:{node.lineno}: skip on the environment")
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if FULL_VAR.search(line):
                out.append(f"{rel}:{i}: reads a *_FULL variable")
    return sorted(set(out))


def test_no_test_is_gated_on_an_environment_variable():
    """What .ci/run never sets never runs: a long case belongs in the run, trimmed to what it proves
    (or sharing its set-up), never behind a variable."""
    assert env_gates(TESTS) == [], "run these in .ci/run (issue #44): " + repr(env_gates(TESTS))


GATED = {
    "direct.py": 'import os, pytest\n@pytest.mark.skipif(not os.environ.get("X"), reason="x")\ndef test_a(): pass\n',
    "via_name.py": 'import os, pytest\nFULL = os.getenv("HARNESS_SOME") == "1"\n'
                   'only = pytest.mark.skipif(not FULL, reason="x")\n',
    "imported.py": 'import pytest\nfrom via_name import FULL\n\n\ndef test_b():\n    if not FULL:\n'
                   '        pytest.skip("long")\n',
    "params.py": 'import os, pytest\n\n\ndef cases():\n    return [1, 2] if "BIG" in os.environ else [1]\n\n\n'
                 '@pytest.mark.parametrize("n", cases())\ndef test_c(n): pass\n',
    # split in two so that this file's own text does not read like a gate
    "selects.py": 'import os\nfull = os.environ["HARNESS_DAY0_' 'FULL"]\n',
}
NOT_GATED = (
    'import os, subprocess, sys, pytest\nENV = os.environ | {"HF_HUB_OFFLINE": "1"}\n\n\n'
    'def run(*a):\n    return subprocess.run([sys.executable, *a], env={**os.environ, "A": "1"})\n\n\n'
    '@pytest.mark.skipif(sys.platform == "win32", reason="posix")\n@pytest.mark.parametrize("n", [1, 2])\n'
    'def test_d(n, monkeypatch):\n    monkeypatch.setenv("HARNESS_X_" "FULL_NAME_OK", "1")\n'
    '    assert os.environ.get("HF_HUB_OFFLINE") == "1"\n    if sys.maxsize < 2:\n        pytest.skip("32-bit")\n'
)


def test_the_gate_scan_finds_each_form_and_leaves_ordinary_environment_use(tmp_path):
    for name, text in GATED.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "fine.py").write_text(NOT_GATED)
    found = env_gates(tmp_path)
    assert {g.split(":", 1)[0] for g in found} == set(GATED), found
    assert any(g.startswith("via_name.py:3: skipif") for g in found) and any(
        g.startswith("imported.py:6: skip on") for g in found), found
    assert any(g.startswith("selects.py:2: reads a *_FULL") for g in found), found
