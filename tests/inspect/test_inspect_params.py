"""Parameter totals of the bundled real configs against the official figures
(../shared/model-configs/README.md), counted on the meta device."""

from __future__ import annotations

import pytest
import torch

from harness.inspect.params import count_parameters, load_target, meta_model
from tests_support import REPO_SUITES

B = 1e9
# suite, official total, official activated (None: dense), which activated convention the vendor uses
OFFICIAL = [
    ("deepseek-v3", 671 * B, 37 * B, "activated"),  # DeepSeek excludes the input embedding; MTP layer not built
    ("kimi-k2", 1026 * B, 32 * B, "activated"),  # config gives 1.026T (the tech report 1.04T)
    ("qwen3-30b-a3b", 30.5 * B, 3.3 * B, "activated_with_embedding"),
    ("mixtral-8x7b", 46.7 * B, 12.9 * B, "activated_with_embedding"),
    ("llama-3.1-8b", 8.03 * B, None, None),
    ("qwen3-8b", 8.2 * B, None, None),
]


@pytest.fixture(scope="module")
def reports():
    out = {}
    for name, *_ in OFFICIAL:
        model, mc = meta_model(load_target(REPO_SUITES / f"{name}.toml"), pruned=False)
        out[name] = (count_parameters(model, mc), mc)
    return out


@pytest.mark.parametrize("name,total,activated,convention", OFFICIAL)
def test_totals_match_official_within_2_percent(reports, name, total, activated, convention):
    rep, _ = reports[name]
    assert rep.total == pytest.approx(total, rel=0.02), f"{name}: {rep.total / B:.2f}B vs {total / B}B"
    if activated is None:
        assert rep.activated_with_embedding == rep.total  # dense: every parameter is touched
    else:
        got = getattr(rep, convention)
        assert got == pytest.approx(activated, rel=0.02), f"{name}: {got / B:.2f}B vs {activated / B}B"


def test_non_embedding_qwen3(reports):
    assert reports["qwen3-8b"][0].non_embedding == pytest.approx(6.95 * B, rel=0.02)
    assert reports["qwen3-30b-a3b"][0].non_embedding == pytest.approx(29.9 * B, rel=0.02)


def test_kinds_add_up_and_buffers_are_not_parameters(reports):
    rep, _ = reports["deepseek-v3"]
    assert sum(rep.by_kind.values()) == rep.total
    assert {"embedding", "lm_head", "attention", "dense_mlp", "routed_experts", "shared_experts",
            "router", "norm"} <= set(rep.by_kind)
    # e_score_correction_bias: one fp32 per routed expert per MoE layer (58 of them), a buffer
    assert rep.buffers_persistent == 58 * 256
    assert rep.activated_with_embedding - rep.activated == rep.by_kind["embedding"]


def test_fp8_block_bytes(reports):
    rep, mc = reports["deepseek-v3"]
    fp8 = next(v for k, v in rep.bytes.items() if k.startswith("fp8 block 128x128"))
    # every Linear weight of attention/MLP/experts at 1 byte, embeddings/lm_head/norms/router in bf16
    quantized = sum(rep.by_kind[k] for k in ("attention", "dense_mlp", "routed_experts", "shared_experts"))
    norms_in_attention = 61 * (1536 + 512)  # q_a_layernorm, kv_a_layernorm are norms, not quantized
    assert fp8["float8_e4m3fn (weights)"] == quantized
    assert fp8["bfloat16 (embeddings, lm_head, norms, router)"] == 2 * (rep.total - quantized)
    assert norms_in_attention < rep.by_kind["norm"]
    # scales: one fp32 per 128x128 block; ~1/16384 of the weights, rounded up per matrix
    scales = fp8["float32 (weight_scale_inv)"]
    assert quantized / 16384 * 4 < scales < quantized / 16384 * 4 * 1.05
    # one routed expert's down_proj [7168, 2048]: 56 x 16 blocks; check the formula on it
    assert (7168 // 128) * (2048 // 128) * 4 == 3584
    assert fp8["total"] == pytest.approx(673e9, rel=0.01)  # ~ the published 671B-parameter FP8 checkpoint
    assert mc.quantization["weight_block_size"] == [128, 128]
    assert "fp8 block 128x128 (checkpoint)" not in reports["llama-3.1-8b"][0].bytes


def test_meta_build_allocates_nothing(reports):
    model, _ = meta_model(load_target(REPO_SUITES / "kimi-k2.toml"), pruned=False)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert next(model.parameters()).dtype == torch.bfloat16


def test_bare_config_json_target():
    t = load_target(REPO_SUITES / "configs" / "Mixtral-8x7B-v0.1.json")
    assert t.suite is None and t.name == "Mixtral-8x7B-v0.1"
    model, mc = meta_model(t)
    assert count_parameters(model, mc).total == pytest.approx(46.7 * B, rel=0.02)
