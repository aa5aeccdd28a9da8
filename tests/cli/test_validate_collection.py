"""`harness validate` refuses what `harness run` refuses at collection (shared in checks/collection.py)."""

from __future__ import annotations

from pathlib import Path

from harness.cli import main as harness_main

CONFIG = next((Path(__file__).resolve().parents[2] / "suites" / "configs").glob("*Llama*.json"))


def test_validate_refuses_an_unknown_backend_name(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(f'backends = ["cdua"]\n[model]\nconfig = "{CONFIG}"\n')
    assert harness_main(["validate", "--no-build", str(tmp_path / "s.toml")]) == 1
    out = capsys.readouterr().out
    assert "backends: unknown backend 'cdua' (registered: " in out and "0 valid, 1 invalid" in out


def test_validate_refuses_a_bool_where_an_integer_belongs(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(f'[model]\nconfig = "{CONFIG}"\n[prune]\nnum_hidden_layers = true\n')
    assert harness_main(["validate", "--no-build", str(tmp_path / "s.toml")]) == 1
    assert "prune.num_hidden_layers: input should be a valid integer, got bool True" in capsys.readouterr().out
