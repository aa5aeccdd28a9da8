"""The roofline arithmetic against figures computed by hand for one Llama layer."""

from __future__ import annotations

import math

import pytest

from harness.perf import roofline
from harness.perf.workload import perf_model_config, perf_prune
from harness.suite.loader import load_suite

# One Llama-3.1 layer: hidden 64, MLP 128, 4 query heads and 2 KV heads of head_dim 16, vocab 512.
SUITE = """
[model]
config = "configs/Llama-3.1-8B.json"

[prune]
num_hidden_layers = 1
hidden_size = 64
intermediate_size = 128
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 512
"""

# By hand, in parameters:
ATTN = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v (2 KV heads x 16), o = 12288
MLP = 3 * 64 * 128  # gate, up, down = 24576
LM_HEAD = 64 * 512  # untied in Llama-3.1 = 32768
NORMS = 3 * 64  # input, post-attention, final RMSNorm weights
MATMUL_FLOPS = 2 * (ATTN + MLP + LM_HEAD)  # per token = 139264
ATTN_PER_CTX = 2 * 1 * 4 * (16 + 16)  # QK^T and AV, per token of context = 256


@pytest.fixture
def one_layer(write_suite):
    ls = load_suite(write_suite("one-layer", SUITE))
    return ls, perf_model_config(ls, 0, 1, {})


def test_one_layer_work_by_hand(one_layer):
    ls, mc = one_layer
    b, s, t = 2, 8, 4
    w = roofline.work_for_model(ls, mc, b, s, t, "float32")
    assert MATMUL_FLOPS == 139264
    # prefill: causal attention sees (S + 1) / 2 tokens of context on average
    assert w.prefill_flops == b * s * (MATMUL_FLOPS + ATTN_PER_CTX * (s + 1) / 2) == 2246656
    # decode steps run at contexts 8, 9, 10, 11: on average 9.5
    assert w.decode_context == 9.5
    assert w.decode_flops_per_step == b * (MATMUL_FLOPS + ATTN_PER_CTX * 9.5) == 283392
    # bytes: every weight but the embedding once, float32; plus the KV cache read
    assert w.weight_bytes == (ATTN + MLP + LM_HEAD + NORMS) * 4 == 279296
    kv_per_token = 1 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x 4 bytes = 256
    assert w.kv_bytes_per_step == b * 9.5 * kv_per_token == 4864
    assert w.decode_bytes_per_step == 279296 + 4864
    assert w.train_flops == 3 * w.prefill_flops


def test_bfloat16_halves_the_bytes_not_the_flops(one_layer):
    ls, mc = one_layer
    f32 = roofline.work_for_model(ls, mc, 1, 8, 4, "float32")
    bf16 = roofline.work_for_model(ls, mc, 1, 8, 4, "bfloat16")
    assert bf16.prefill_flops == f32.prefill_flops and bf16.decode_bytes_per_step * 2 == f32.decode_bytes_per_step


def test_fractions():
    # 2246656 FLOPs in 1 ms against a 10 GFLOP/s peak: 22.46656% of the roof.
    assert math.isclose(roofline.fraction(2246656, 1e-3, 1e10), 0.2246656)
    assert roofline.fraction(1.0, 1.0, None) is None and roofline.fraction(1.0, 0.0, 1.0) is None


def test_perf_model_scales_the_suites_ratios(write_suite):
    ls = load_suite(write_suite("one-layer", SUITE))
    p = perf_prune(ls, 1024, 2, {})
    # 64 -> 1024: x16 on every width; heads, KV heads and vocab kept
    assert (p.hidden_size, p.intermediate_size, p.num_hidden_layers) == (1024, 2048, 2)
    assert (p.num_attention_heads, p.num_key_value_heads, p.vocab_size) == (4, 2, 512)
    assert perf_prune(ls, 1024, 2, {"num_key_value_heads": 4}).num_key_value_heads == 4
    pub = perf_prune(ls, "published", 1, {})
    assert pub.hidden_size is None and pub.num_hidden_layers == 1  # the published width stays
