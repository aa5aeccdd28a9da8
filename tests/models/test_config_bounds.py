"""`harness init` refuses numbers and names that are wrong in one line naming the key, before any
per-layer list is built (10**12 layers was a hang), from a real bundled config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main as harness_main

CONFIG = next((Path(__file__).resolve().parents[2] / "suites" / "configs").glob("*Llama*.json"))


def _init(tmp_path, capsys, **edit) -> str:
    raw = {**json.loads(CONFIG.read_text()), **edit}
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(raw))
    code = harness_main(["init", str(cfg), "--name", "x", "--suites-dir", str(tmp_path / "suites")])
    out = capsys.readouterr()
    assert code != 0 and not (tmp_path / "suites" / "x.toml").exists()
    return out.out + out.err


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 10**12), ("num_hidden_layers", -3),
                                        ("num_attention_heads", 0), ("num_hidden_layers", True)])
def test_init_refuses_an_out_of_range_config_field_naming_it(tmp_path, capsys, key, value):
    msg = _init(tmp_path, capsys, **{key: value})
    assert f"{key}: must be an integer in [" in msg and "Traceback" not in msg


def test_a_string_architectures_is_refused(tmp_path, capsys):
    msg = _init(tmp_path, capsys, architectures="LlamaForCausalLM")
    assert "architectures: must be a list of class names, got str" in msg


def test_an_attribute_of_transformers_that_is_no_model_class_is_not_an_architecture():
    from harness.models.config import UnknownArchitectureError, architecture_class, model_class

    assert model_class("logging") is None and model_class("AutoConfig") is None
    assert model_class("LlamaForCausalLM") is not None
    with pytest.raises(UnknownArchitectureError, match="not a model class"):
        architecture_class("logging")


def test_validate_refuses_architectures_logging(tmp_path, capsys):
    raw = {**json.loads(CONFIG.read_text()), "architectures": ["logging"], "model_type": "no_such_type"}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    (tmp_path / "s.toml").write_text('[model]\nconfig = "c.json"\n')
    assert harness_main(["validate", str(tmp_path / "s.toml")]) == 1
    assert "'logging'" in capsys.readouterr().out


def test_heads_that_kv_heads_do_not_divide_are_refused_not_pruned_to_1_to_1(tmp_path, capsys):
    # issue #49: a 32:3 head config reported success on a 1:1 layout it chose silently
    msg = _init(tmp_path, capsys, num_attention_heads=32, num_key_value_heads=3)
    assert "32 query heads are not a whole multiple of 3 KV heads" in msg and "Traceback" not in msg, msg
    assert len([ln for ln in msg.strip().splitlines() if ln.strip()]) == 1, msg
