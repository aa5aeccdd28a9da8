from __future__ import annotations

import pytest

from harness.inspect.flops import compute_flops, head_dims
from harness.inspect.params import count_parameters, load_target, meta_model
from tests_support import REPO_SUITES


def _flops(name, **kw):
    model, mc = meta_model(load_target(REPO_SUITES / f"{name}.toml"), pruned=False)
    return compute_flops(mc.config, count_parameters(model, mc), **kw), mc


def test_gqa_kv_cache_and_flops_llama():
    f, mc = _flops("llama-3.1-8b", prefill_len=1, decode_context=0)
    assert head_dims(mc.config) == (32, 8, 128, 128)
    assert f.kv_cache_bytes_per_token == {"k and v per kv head": 32 * 2 * 8 * 128 * 2}  # 128 KiB
    # ~2 FLOPs per non-embedding parameter per token (lm_head included)
    assert f.matmul_flops_per_token == pytest.approx(2 * (8.03e9 - 0.525e9), rel=0.01)
    assert f.decode_flops_per_token == f.matmul_flops_per_token
    assert any("GQA" in n for n in f.notes)


def test_mla_compressed_vs_decompressed_cache():
    f, mc = _flops("kimi-k2", prefill_len=4096, decode_context=4096)
    kv = f.kv_cache_bytes_per_token
    compressed = next(v for k, v in kv.items() if k.startswith("mla_compressed"))
    full = next(v for k, v in kv.items() if k.startswith("decompressed"))
    assert compressed == 61 * (512 + 64) * 2
    assert full == 61 * 64 * (192 + 128) * 2
    assert f.decode_flops_per_token_hf > f.decode_flops_per_token > f.matmul_flops_per_token
    assert f.prefill_flops_per_token < f.decode_flops_per_token  # average context (S+1)/2 < S


DAY0 = REPO_SUITES.parent / "tests" / "data" / "day0"


def _day0(name):
    model, mc = meta_model(load_target(DAY0 / f"{name}.json"), pruned=False)
    return compute_flops(mc.config, count_parameters(model, mc), prefill_len=1, decode_context=0), mc


def test_wrapper_uses_its_text_config():
    f, mc = _day0("Llama-4-Scout-17B-16E-Instruct")  # Llama4Config has no num_attention_heads of its own
    assert f.kv_cache_bytes_per_token == {"k and v per kv head": 48 * 2 * 8 * 128 * 2}


def test_hybrid_counts_attention_layers_only():
    f, _ = _day0("Nemotron-3-Nano-30B-A3B-BF16")  # 6 '*' layers in hybrid_override_pattern, 2 KV heads x 128
    assert f.kv_cache_bytes_per_token == {"k and v per kv head": 6 * 2 * 2 * 128 * 2}
    assert any("6 of 52 layers have softmax attention" in n for n in f.notes)
    f, _ = _day0("Qwen3.5-35B-A3B")  # full attention every 4th layer; the rest gated delta-net
    assert f.kv_cache_bytes_per_token == {"k and v per kv head": 10 * 2 * 2 * 256 * 2}


def test_per_layer_head_dims():
    f, _ = _day0("gemma-4-26B-A4B")  # 25 sliding layers (8 KV x 256), 5 full (2 KV x 512)
    assert f.kv_cache_bytes_per_token["k and v per kv head"] == (25 * 8 * 256 * 2 + 5 * 2 * 512 * 2) * 2
