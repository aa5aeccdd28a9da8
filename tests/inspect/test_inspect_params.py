"""Parameter totals of the bundled real configs against the official figures
(../shared/model-configs/README.md), counted on the meta device."""

from __future__ import annotations

from pathlib import Path

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


# --- Day-0 corpus (tests/data/day0/SOURCES.md): official figures where the vendor gives one ----------
DAY0 = REPO_SUITES.parent / "tests" / "data" / "day0"
OFFICIAL_DAY0 = [
    ("gpt-oss-120b", 117 * B, 5.1 * B, "activated"),  # gpt-oss README / model card
    ("DeepSeek-V3.2", 671 * B, 37 * B, "activated"),  # MTP layer not built, as for V3
    ("MiniMax-M2.5", 230 * B, 10 * B, "activated"),  # MiniMax-M2 README (M2.5 states none)
    ("Llama-4-Scout-17B-16E-Instruct", 109 * B, 17 * B, "activated"),  # whole wrapper; 17B active
    # NVIDIA's model card: 31.6B total, 3.2B active (3.6B with embeddings); "30B" is the rounded name
    ("Nemotron-3-Nano-30B-A3B-BF16", 31.6 * B, 3.2 * B, "activated"),
]


@pytest.fixture(scope="module")
def day0():
    out = {}
    for name in ("gpt-oss-120b", "gpt-oss-20b", "DeepSeek-V3.2", "MiniMax-M2.5", "MiniMax-M2.5-NVFP4", "Kimi-K2.5",
                 "Llama-4-Scout-17B-16E-Instruct", "Nemotron-3-Nano-30B-A3B-BF16",
                 "Qwen3-32B-FP8-Static-PerTensor", "Qwen3.5-35B-A3B"):
        model, mc = meta_model(load_target(DAY0 / f"{name}.json"), pruned=False)
        out[name] = (count_parameters(model, mc), mc)
    return out


@pytest.mark.parametrize("name,total,activated,convention", OFFICIAL_DAY0)
def test_day0_totals_match_official(day0, name, total, activated, convention):
    rep, _ = day0[name]
    assert rep.total == pytest.approx(total, rel=0.02), f"{name}: {rep.total / B:.2f}B vs {total / B}B"
    got = getattr(rep, convention)
    assert got == pytest.approx(activated, rel=0.05), f"{name}: {got / B:.2f}B vs {activated / B}B"


def test_wrapper_totals_per_part(day0):
    rep, _ = day0["Llama-4-Scout-17B-16E-Instruct"]
    assert set(rep.by_part) == {"text", "vision", "projector", "overall"}
    assert rep.by_part["text"] + rep.by_part["vision"] + rep.by_part["projector"] == rep.by_part["overall"] == rep.total
    assert 0.3 * B < rep.by_part["vision"] < 0.6 * B < rep.by_part["text"]
    assert any(n.startswith("parts: text") for n in rep.notes)
    assert day0["gpt-oss-20b"][0].by_part == {}  # a plain causal LM has no parts


def _scenario(rep, prefix):
    return next(v for k, v in rep.bytes.items() if k.startswith(prefix))


def test_mxfp4_experts_only(day0):
    rep, mc = day0["gpt-oss-120b"]
    mx = _scenario(rep, "mxfp4")
    experts = rep.by_kind["routed_experts"]
    biases = 36 * 128 * (2 * 2880 + 2880)  # gate_up_proj_bias + down_proj_bias per expert stay bf16
    # 4-bit values two per byte and one e8m0 scale per 32: attention, router, embeddings stay bf16
    assert mx["float4_e2m1 (packed, 2 per byte) (weights)"] == (experts - biases) // 2
    assert mx["float8_e8m0 (one per 32) (scales)"] == (experts - biases) // 32
    assert mx["bfloat16 (embeddings, lm_head, norms, router)"] == 2 * (rep.total - experts + biases)
    assert mx["total"] == pytest.approx(65e9, rel=0.05)  # the published checkpoint is ~65 GB


def test_int4_group_compressed_tensors_honours_ignore(day0):
    rep, mc = day0["Kimi-K2.5"]
    q = _scenario(rep, "int4 group 32")
    experts = rep.by_kind["routed_experts"]
    # ignore: lm_head, every self_attn, shared_experts and dense MLPs -> only routed experts are int4
    assert q["int4 (packed) (weights)"] == experts // 2
    assert q["bfloat16 (weight_scale)"] == experts // 32 * 2
    assert "kept unquantized: lm_head, re:.*self_attn.*" in " ".join(rep.notes)


def test_nvfp4_and_fp8_per_tensor(day0):
    rep, _ = day0["MiniMax-M2.5-NVFP4"]
    q = _scenario(rep, "nvfp4 group 16")
    experts = rep.by_kind["routed_experts"]
    # every self_attn and router is in the ignore list: only the experts are fp4, one fp8 scale per 16
    assert q["float4_e2m1 (packed, 2 per byte) (weights)"] == experts // 2
    assert q["float8_e4m3fn (one per 16) + fp32 global (weight_scale)"] == pytest.approx(experts / 16, rel=0.01)
    rep, mc = day0["Qwen3-32B-FP8-Static-PerTensor"]
    t = _scenario(rep, "fp8 per-tensor")
    quantized = rep.by_kind["attention"] + rep.by_kind["dense_mlp"]
    assert t["float8_e4m3fn (weights)"] == quantized
    # 7 Linear per layer x 64 layers, each one fp32 weight_scale + one static fp32 input_scale
    assert t["float32 (+ static input_scale) (weight_scale)"] == 64 * 7 * 8


def test_fp8_block_size_null_is_not_assumed_128():
    from harness.anatomy.quant import quant_scheme

    s = quant_scheme({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": None})
    assert s.granularity == "tensor" and s.bytes_of(256, 256) == (256 * 256, 4)
    s = quant_scheme({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}})
    assert s.granularity == "channel" and s.bytes_of(256, 512) == (256 * 512, 256 * 4)
    s = quant_scheme({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert s.bytes_of(7168, 2048) == (7168 * 2048, 56 * 16 * 4)
    assert quant_scheme({"quant_method": "bitsandbytes"}) is None


def test_a_wrapper_decoder_suite_names_the_whole_wrapper_too(write_suite):
    """A suite that tests a multimodal wrapper's language decoder (gemma-4: Gemma4ForCausalLM from
    text_config) is inspected as the decoder; a note gives the whole wrapper's parts, so the
    official total (vision tower included) is on the same page."""
    from harness.inspect.params import load_target
    from harness.inspect.report import inspect as run_inspect

    day0 = Path(__file__).resolve().parents[1] / "data" / "day0" / "gemma-4-26B-A4B.json"
    path = write_suite("gemma-decoder", f'[model]\nconfig = "{day0}"\narchitecture = "Gemma4ForCausalLM"\n')
    rep = run_inspect(load_target(path), trace="none")
    whole = run_inspect(load_target(day0), trace="none")
    assert rep.architecture == "Gemma4ForCausalLM" and rep.params.total == whole.params.by_part["text"]
    (note,) = [n for n in rep.params.notes if "tests the language decoder only" in n]
    assert "Gemma4ForConditionalGeneration" in note and f"overall {whole.params.total / 1e9:.3f}B" in note
    assert f"vision {whole.params.by_part['vision'] / 1e9:.3f}B" in note and str(day0) in note
    # a config.json target is the whole wrapper already: no such note
    assert not any("tests the language decoder only" in n for n in whole.params.notes)
