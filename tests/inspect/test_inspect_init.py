"""`harness init` on every bundled config, from scratch: the written suite's smoke check passes."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import tomllib

from harness.cli import init as cli_init
from harness.models.prune import choose_prune
from harness.suite.loader import load_suite
from tests_support import REPO_SUITES

CONFIGS = sorted((REPO_SUITES / "configs").glob("*.json"))


def _run(argv):
    p = argparse.ArgumentParser()
    cli_init.register(p.add_subparsers())
    args = p.parse_args(["init", *argv])
    return args.func(args)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_init_from_scratch_passes_smoke(config, tmp_path, capsys):
    cfg = tmp_path / "configs" / config.name
    cfg.parent.mkdir()
    shutil.copy(config, cfg)
    assert _run([str(cfg), "--suites-dir", str(tmp_path / "suites"), "--name", "new-model"]) == 0
    out = capsys.readouterr().out
    assert "ok: smoke[cpu-float32] passed" in out
    ls = load_suite(tmp_path / "suites" / "new-model.toml")
    assert ls.config_path == cfg.resolve()
    # the file is plain TOML with its reasons in comments
    assert tomllib.loads((tmp_path / "suites" / "new-model.toml").read_text())["prune"]["vocab_size"] == 512


def test_prune_choices_respect_the_architecture():
    raw = {p.stem: json.loads(p.read_text()) for p in CONFIGS}
    ds, _ = choose_prune(raw["DeepSeek-V3"])
    assert ds["first_k_dense_replace"] == 1 and ds["num_hidden_layers"] == 2
    assert (ds["n_group"], ds["topk_group"]) == (4, 2) and ds["num_experts"] % 4 == 0
    assert ds["kv_lora_rank"] and ds["qk_rope_head_dim"] and ds["n_shared_experts"] == 1
    q, why = choose_prune(raw["Qwen3-30B-A3B"])
    assert q["num_attention_heads"] // q["num_key_value_heads"] == 8  # 32:4
    assert q["head_dim"] * q["num_attention_heads"] != q["hidden_size"]  # stays explicit
    assert "first_k_dense_replace" not in q and any("(1 kind" in w for w in why)  # every layer MoE
    ll, _ = choose_prune(raw["Llama-3.1-8B"])
    assert ll["num_attention_heads"] // ll["num_key_value_heads"] == 4 and "num_experts" not in ll
    assert ll["hidden_size"] % ll["num_attention_heads"] == 0


def test_init_refuses_to_overwrite_and_unknown_architecture(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"}))
    assert _run([str(cfg), "--suites-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "NoSuchModelForCausalLM" in err and "model.adapter" in err
    shutil.copy(CONFIGS[0], cfg)
    (tmp_path / "c.toml").write_text("")
    assert _run([str(cfg), "--suites-dir", str(tmp_path), "--no-validate"]) == 2
    assert "exists" in capsys.readouterr().err


def test_suites_written_elsewhere_are_found_by_name(tmp_path, monkeypatch):
    """`init --suites-dir DIR` records DIR; resolve_names (golden generate, run) then finds NAME there."""
    from harness.suite.loader import SUITE_DIRS_FILE, SuiteError, resolve_names

    monkeypatch.chdir(tmp_path)
    (tmp_path / "suites").mkdir()
    cfg = tmp_path / "c.json"
    shutil.copy(REPO_SUITES / "configs" / "Llama-3.1-8B.json", cfg)
    with pytest.raises(SuiteError, match="no such suite 'mine'"):
        resolve_names(["mine"], "suites")
    assert _run([str(cfg), "--suites-dir", "elsewhere", "--name", "mine", "--no-validate"]) == 0
    assert (tmp_path / SUITE_DIRS_FILE).read_text().strip() == str(tmp_path / "elsewhere")
    assert resolve_names(["mine"], "suites") == [tmp_path / "elsewhere" / "mine.toml"]
    (tmp_path / "third").mkdir()
    (tmp_path / "third" / "other.toml").write_text("")
    monkeypatch.setenv("HARNESS_SUITES_PATH", str(tmp_path / "third"))
    assert resolve_names(["other"], "suites") == [tmp_path / "third" / "other.toml"]
    with pytest.raises(SuiteError) as e:
        resolve_names(["nope"], "suites")
    assert "elsewhere" in str(e.value) and "third" in str(e.value)
