"""`harness init` on every bundled config, from scratch: the written suite's smoke check passes."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import tomllib

from harness.cli import init as cli_init
from harness.inspect.prune import choose_prune
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
    assert "first_k_dense_replace" not in q and any("(1 kind)" in w for w in why)  # every layer MoE
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
