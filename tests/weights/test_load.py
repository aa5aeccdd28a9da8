"""Pruned real-weight loads: the pruned model holds exactly the kept layers' and experts' tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.models.build import build_model
from harness.suite.loader import load_suite
from harness.weights.layout import WeightsError
from tests.weights.conftest import make_model, save_checkpoint, small_config, write_suite

PRUNE_2L_4E = "[prune]\nnum_hidden_layers = 2\nnum_experts = 4\n"


def test_pruned_model_equals_the_kept_layers_of_the_full_model(kimi_ckpt, tmp_path):
    root, raw, full = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n{PRUNE_2L_4E}'))
    model, mc = build_model(ls)
    fsd, psd = full.state_dict(), model.state_dict()
    # Kimi-K2 has one dense layer first: the default keeps source layers 0 (dense) and 1 (first MoE).
    assert any("layers [0, 1] of 4, experts [0, 1, 2, 3] of 8" in n for n in mc.notes)
    for k, v in psd.items():
        src = fsd[k]
        if k.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight", "e_score_correction_bias")):
            src = src[:4]  # the kept experts, and the router's rows for them
        assert torch.equal(v, src), k


def test_explicit_layers_and_experts_are_renamed_into_the_pruned_numbering(kimi_ckpt, tmp_path):
    root, raw, full = kimi_ckpt
    body = f'weights = "{root}"\nweights_layers = [0, 3]\nweights_experts = [7, 2, 5, 0]\n{PRUNE_2L_4E}'
    model, _ = build_model(load_suite(write_suite(tmp_path, "k", raw, body)))
    f, p = full.state_dict(), model.state_dict()
    sel = torch.tensor([7, 2, 5, 0])
    assert torch.equal(p["model.layers.1.mlp.experts.gate_up_proj"], f["model.layers.3.mlp.experts.gate_up_proj"][sel])
    assert torch.equal(p["model.layers.1.mlp.experts.down_proj"], f["model.layers.3.mlp.experts.down_proj"][sel])
    assert torch.equal(p["model.layers.1.mlp.gate.weight"], f["model.layers.3.mlp.gate.weight"][sel])
    assert torch.equal(p["model.layers.1.self_attn.q_b_proj.weight"], f["model.layers.3.self_attn.q_b_proj.weight"])
    assert torch.equal(p["model.layers.0.mlp.gate_proj.weight"], f["model.layers.0.mlp.gate_proj.weight"])


def test_unpruned_load_gives_identical_logits(kimi_ckpt, tmp_path):
    root, raw, full = kimi_ckpt
    model, _ = build_model(load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n')))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, full(ids).logits)


def test_mixtral_renamed_experts_and_tied_layout(tmp_path):
    """Mixtral's checkpoints call the MoE block_sparse_moe and the experts w1/w2/w3: transformers'
    renaming is followed both ways."""
    raw = small_config("Mixtral-8x7B-v0.1.json", num_hidden_layers=3, hidden_size=32, intermediate_size=48,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, vocab_size=256)
    full = make_model(raw, seed=3)
    root = save_checkpoint(full, raw, tmp_path / "ckpt", shard="40KB")
    keys = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.block_sparse_moe.experts.3.w3.weight" in keys
    body = f'weights = "{root}"\nweights_layers = [2]\nweights_experts = [3, 1]\n' \
           "[prune]\nnum_hidden_layers = 1\nnum_experts = 2\n"
    model, _ = build_model(load_suite(write_suite(tmp_path, "m", raw, body)))
    f, p = full.state_dict(), model.state_dict()
    sel = torch.tensor([3, 1])
    assert torch.equal(p["model.layers.0.mlp.experts.gate_up_proj"], f["model.layers.2.mlp.experts.gate_up_proj"][sel])
    assert torch.equal(p["model.layers.0.mlp.gate.weight"], f["model.layers.2.mlp.gate.weight"][sel])


def test_bytes_read_are_close_to_bytes_kept(kimi_ckpt, tmp_path):
    from harness.weights.layout import open_checkpoint
    from harness.weights.load import build_plan, fill
    from harness.weights.reader import ShardReader

    root, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n{PRUNE_2L_4E}'))
    from harness.models.build import instantiate, model_config

    mc = model_config(ls)
    model = instantiate(ls, mc, torch.float32)
    ck = open_checkpoint(root)
    reader = ShardReader(ck)
    fill(model, build_plan(model, ls, mc, ck), ck, reader)
    kept = sum(t.numel() for t in model.state_dict().values()) * 4  # float32 checkpoint, float32 model
    assert reader.bytes_read == kept
    assert reader.bytes_read < 0.6 * ck.total_bytes


def test_width_mismatch_names_tensor_and_shard(kimi_ckpt, tmp_path):
    root, raw, _ = kimi_ckpt
    body = f'weights = "{root}"\n[prune]\nnum_hidden_layers = 2\nhidden_size = 32\n'
    # Tensors are read in shard order (each shard unmapped after its last one): the first one read is named.
    with pytest.raises(WeightsError, match=r"(model\.embed_tokens|lm_head)\.weight in model-\d+-of-\d+\.safetensors: "
                                           r"shape \[512, 64\], but the pruned model's \1\.weight "
                                           r"expects \[512, 32\]"):
        build_model(load_suite(write_suite(tmp_path, "k", raw, body)))


def test_missing_tensor_names_tensor_and_shard(kimi_ckpt, tmp_path):
    import shutil

    root, raw, _ = kimi_ckpt
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    victim = "model.layers.1.self_attn.o_proj.weight"
    shard = index["weight_map"].pop(victim)
    sd = load_file(str(bad / shard))
    del sd[victim]
    save_file(sd, str(bad / shard), metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=rf"missing from the checkpoint, first {victim} \(expected in shard "
                                           rf"model-\d+-of-\d+\.safetensors\)"):
        build_model(load_suite(write_suite(tmp_path, "k", raw, f'weights = "{bad}"\n{PRUNE_2L_4E}')))


def test_weights_from_environment_variable(kimi_ckpt, tmp_path, monkeypatch):
    from harness.weights.source import locate

    root, raw, _ = kimi_ckpt
    p = write_suite(tmp_path, "k", raw, f'weights = "$HARNESS_WEIGHTS_TEST"\n{PRUNE_2L_4E}')
    monkeypatch.delenv("HARNESS_WEIGHTS_TEST", raising=False)
    ls = load_suite(p)
    assert ls.weights_path is None
    assert locate(ls).reason == "weights not available: $HARNESS_WEIGHTS_TEST is not set"
    monkeypatch.setenv("HARNESS_WEIGHTS_TEST", str(tmp_path / "nowhere"))
    assert "does not exist" in locate(load_suite(p)).reason
    monkeypatch.setenv("HARNESS_WEIGHTS_TEST", str(root))
    ls = load_suite(p)
    assert ls.weights_path == root.resolve()
    _, mc = build_model(ls)
    assert any(n.startswith("real weights from") for n in mc.notes)


def test_smoke_check_runs_on_the_real_weights(kimi_ckpt, tmp_path):
    """The smoke check's build goes through build_model, so it trains and generates on real numerics."""
    from harness.checks import run_one

    root, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n{PRUNE_2L_4E}'))
    ctx = run_one(ls, "smoke", "cpu", "float32")
    assert any(n.startswith("real weights from") and "layers [0, 1] of 4" in n for n in ctx.notes)
    assert float(dict(ctx.properties)["metric.loss_drop"]) > 0


def test_golden_records_its_weights_and_refuses_a_run_on_other_ones(kimi_ckpt, tmp_path, monkeypatch):
    """A golden made from the real checkpoint says so; a runner without the checkpoint (random weights)
    or a golden made from random weights under a run that loads real ones is refused in one line,
    instead of every module failing for nothing."""
    from harness.golden.store import GoldenError, load_golden
    from harness.precision.generate import generate

    root, raw, _ = kimi_ckpt
    p = write_suite(tmp_path, "k", raw, f'weights = "$HARNESS_WEIGHTS_TEST"\n{PRUNE_2L_4E}')
    monkeypatch.setenv("HARNESS_WEIGHTS_TEST", str(root))
    ls = load_suite(p)
    generate(ls, tmp_path / "golden")
    rec = load_golden(ls, tmp_path / "golden").manifest["weights"]
    assert rec["weights"] == "real" and rec["checkpoint"] == str(root.resolve()) and rec["layers"] == "default"
    monkeypatch.delenv("HARNESS_WEIGHTS_TEST")
    with pytest.raises(GoldenError, match=r"made from real weights .* but this run has none \(weights not available: "
                                          r"\$HARNESS_WEIGHTS_TEST is not set\)"):
        load_golden(load_suite(p), tmp_path / "golden")
    generate(load_suite(p), tmp_path / "golden", update=True)  # now from random weights
    assert load_golden(load_suite(p), tmp_path / "golden").manifest["weights"] == {"weights": "random", "seed": 0}
    monkeypatch.setenv("HARNESS_WEIGHTS_TEST", str(root))
    with pytest.raises(GoldenError, match="made from random weights but this run loads real ones"):
        load_golden(load_suite(p), tmp_path / "golden")
