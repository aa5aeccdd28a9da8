"""harness/settings.py owns every HARNESS_* environment variable: declared once (name, type, default,
description), read through ``env``, written for child processes through ``set_env``, listed by
``harness validate --schema``; no other module of harness names one."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from harness import settings
from harness.settings import ENV, SettingsError, env, set_env, unset_env

ROOT = Path(__file__).resolve().parents[1] / "harness"


ACCESSORS = {"env", "set_env", "unset_env"}  # harness.settings' (imported as is, or `env as setting`)


def _accessor(func: ast.expr, aliases: set[str]) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ACCESSORS or name in aliases


def _named_variables(path: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """(places that name a HARNESS_* variable in code outside the settings accessors, the names passed
    to the accessors). Outside: a string that is exactly such a name (os.environ["HARNESS_X"],
    .get("HARNESS_X"), {"HARNESS_X": ...}), a keyword (dict(os.environ, HARNESS_X=...)), an f-string
    starting with one. Docstrings and comments that mention one are prose, not reads."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases = {a.asname for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "harness.settings"
               for a in n.names if a.name in ACCESSORS and a.asname}
    through, used = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _accessor(node.func, aliases) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            through.add(id(node.args[0]))
            used.append(node.args[0].value)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("HARNESS_") \
                and node.value.replace("_", "").isalnum() and id(node) not in through:
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg and node.arg.startswith("HARNESS_"):
            out.append((node.value.lineno, node.arg))
        elif isinstance(node, ast.JoinedStr):  # f"HARNESS_{x}"
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and str(first.value).startswith("HARNESS_") and len(node.values) > 1:
                out.append((node.lineno, str(first.value) + "..."))
    return out, used


def _modules():
    return [p for p in sorted(ROOT.rglob("*.py")) if p != ROOT / "settings.py"]


def test_no_module_but_settings_reads_or_writes_a_harness_variable():
    offenders = [f"{p.relative_to(ROOT.parent)}:{line}: {name}" for p in _modules()
                 for line, name in _named_variables(p)[0]]
    assert offenders == [], ("read and write HARNESS_* variables through harness.settings.env / set_env "
                             "(declared in harness.settings.ENV):\n" + "\n".join(offenders))


def test_every_variable_a_module_uses_is_declared():
    used = {n for p in _modules() for n in _named_variables(p)[1] if n.startswith("HARNESS_")}
    assert used and used <= set(ENV), used - set(ENV)


def test_the_scanner_sees_reads_and_writes(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""HARNESS_PERF in prose is fine."""\nimport os\n# HARNESS_PERF in a comment too\n'
                 'a = os.environ.get("HARNESS_PERF")\nb = os.environ["HARNESS_X"]\n'
                 'c = dict(os.environ, HARNESS_Y="1")\nd = {"HARNESS_Z": 1}\n')
    assert [n for _, n in _named_variables(p)[0]] == ["HARNESS_PERF", "HARNESS_X", "HARNESS_Y", "HARNESS_Z"]
    p.write_text('from harness.settings import env as setting\nfrom harness import settings\n'
                 'a = setting("HARNESS_PERF")\nb = settings.set_env("HARNESS_X", 1, {})\n')
    assert _named_variables(p) == ([], ["HARNESS_PERF", "HARNESS_X"])


def test_every_declared_variable_has_type_default_description():
    for v in ENV.values():
        assert v.name.startswith("HARNESS_") and v.type in ("str", "path", "paths", "int", "bool")
        assert v.description.endswith(".") and len(v.description) > 20, v


def test_typed_reads_defaults_and_errors_name_the_variable(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    assert env("HARNESS_PERF") is False and env("HARNESS_SUITES_PATH") == [] and env("HARNESS_CONFIG") is None
    monkeypatch.setenv("HARNESS_PERF", "1")
    monkeypatch.setenv("HARNESS_LEAK_BYTES", "1024")
    monkeypatch.setenv("HARNESS_SUITES_PATH", f"a{__import__('os').pathsep}b")
    monkeypatch.setenv("HARNESS_GOLDEN_DIR", "g")
    assert env("HARNESS_PERF") is True and env("HARNESS_LEAK_BYTES") == 1024
    assert env("HARNESS_SUITES_PATH") == [Path("a"), Path("b")] and env("HARNESS_GOLDEN_DIR") == Path("g")
    monkeypatch.setenv("HARNESS_PERF", "0")
    assert env("HARNESS_PERF") is False
    monkeypatch.setenv("HARNESS_PERF", "maybe")
    with pytest.raises(SettingsError, match=r"\$HARNESS_PERF: expected a boolean .*got 'maybe'"):
        env("HARNESS_PERF")
    monkeypatch.setenv("HARNESS_LEAK_BYTES", "1e9")
    with pytest.raises(SettingsError, match=r"\$HARNESS_LEAK_BYTES: expected an integer, got '1e9'"):
        env("HARNESS_LEAK_BYTES")
    with pytest.raises(KeyError, match="undeclared environment variable 'HARNESS_NOPE'"):
        env("HARNESS_NOPE")


def test_set_env_writes_what_reads_back_into_a_child_environment():
    child: dict[str, str] = {}
    set_env("HARNESS_NUM_THREADS", 3, child)
    set_env("HARNESS_PERF", True, child)
    set_env("HARNESS_SUITES_PATH", [Path("x"), Path("y")], child)
    assert env("HARNESS_NUM_THREADS", child) == 3 and child["HARNESS_PERF"] == "1"
    assert env("HARNESS_SUITES_PATH", child) == [Path("x"), Path("y")]
    with pytest.raises(ValueError, match="expected an integer"):
        set_env("HARNESS_NUM_THREADS", "three", child)
    unset_env("HARNESS_NUM_THREADS", child)
    assert "HARNESS_NUM_THREADS" not in child
    with pytest.raises(KeyError):
        set_env("HARNESS_NOPE", 1, child)


def test_a_malformed_variable_is_one_line_from_the_cli(tmp_path, capsys, monkeypatch):
    from harness.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HARNESS_SUITES_PATH", str(tmp_path))
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "c"))
    (tmp_path / "suites").mkdir()
    monkeypatch.setenv("HARNESS_PERF", "maybe")
    from harness.checks.perf import _forced

    with pytest.raises(SettingsError):
        _forced()
    assert settings.env("HARNESS_CACHE_DIR") == tmp_path / "c"
    assert main(["validate", "--schema"]) == 0


def test_validate_schema_lists_every_variable(capsys):
    from harness.cli.validate import schema_markdown

    text = schema_markdown()
    assert "## Environment variables" in text
    for v in ENV.values():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{v.name}` |"))
        assert f"`{v.type}`" in row and v.description.split(" (")[0][:30].replace("|", "/") in row, row


def test_every_int_variable_has_bounds_and_a_bad_value_is_the_runs_usage_error(tmp_path):
    # issue #49: HARNESS_CPU_THREADS=-5 failed every item "in forward", 100000 gave a SIGSEGV there
    import subprocess
    import sys

    from harness.settings import ENV, check_environment

    assert [v.name for v in ENV.values() if v.type == "int" and v.range is None] == []
    assert check_environment({"HARNESS_CPU_THREADS": "-5"}) == ["$HARNESS_CPU_THREADS: -5 is outside 0 .. 1024"]
    assert check_environment({"HARNESS_CPU_THREADS": "100000", "HARNESS_NODES": "0"}) == [
        "$HARNESS_NODES: 0 is outside 1 .. 4096", "$HARNESS_CPU_THREADS: 100000 is outside 0 .. 1024"]
    assert check_environment({"HARNESS_CPU_THREADS": "4"}) == []
    import os

    r = subprocess.run([sys.executable, "-m", "harness", "run", "llama-3.1-8b", "--check", "smoke", "--no-isolate",
                        "--results", str(tmp_path / "r")], capture_output=True, text=True,
                       env=dict(os.environ, HARNESS_CPU_THREADS="-5"), timeout=300)
    assert r.returncode != 0 and "$HARNESS_CPU_THREADS: -5 is outside 0 .. 1024" in r.stdout + r.stderr, r.stderr[-2000:]
    assert "error: the run did not start" in r.stdout and "harness results" not in r.stdout, r.stdout[-2000:]
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["status"] == "not started", run  # never left "running" (issue #49)
