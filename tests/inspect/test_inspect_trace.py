"""The op inventory: a meta trace agrees with what really executes on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from harness.inspect.params import load_target, meta_model
from harness.inspect.trace import Inventory, general_module, signature, trace_model
from harness.models.build import build_model
from tests_support import REPO_SUITES

# aten.lift_fresh: the identity op torch.tensor(data) runs for a *CPU* tensor built from Python data
# (transformers' KV-cache init); building on meta skips it.
HOST_ONLY = {"aten.lift_fresh.default"}
# transformers feeds histc floats on cpu/mps and ints on any other device type (meta included): same
# overloads, other dtypes, so these signatures differ by design.
DEVICE_BRANCH = {"aten.histc.default", "aten.cumsum.default", "aten._to_copy.default"}


@pytest.mark.parametrize("suite,dtype", [("deepseek-v3", "float32"), ("mixtral-8x7b", "bfloat16"),
                                         ("qwen3-8b", "float32")])
def test_meta_trace_equals_real_cpu_trace(suite, dtype):
    target = load_target(REPO_SUITES / f"{suite}.toml")
    real_model, mc = build_model(target.suite, dtype, "cpu")
    real = trace_model(real_model, mc.config.vocab_size, batch=2, seq=16)
    meta_m, _ = meta_model(target, pruned=True, dtype=getattr(torch, dtype))
    meta = trace_model(meta_m, mc.config.vocab_size, batch=2, seq=16)
    assert meta.meta["device"] == "meta" and real.meta["device"] == "cpu"
    assert set(real.ops) - HOST_ONLY == set(meta.ops)
    for op, r in meta.ops.items():
        c = real.ops[op]
        assert (r.forward, r.backward) == (c.forward, c.backward), op
        assert r.modules == c.modules, op
        if op not in DEVICE_BRANCH:
            assert r.signatures == c.signatures, op
    # the fused attention kernel the CPU picks is what the meta trace reports, not the math fallback
    if suite != "deepseek-v3":  # MLA has d_qk != d_v: the CPU takes the math path there too
        assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in meta.ops


def test_inventory_modules_forward_and_backward():
    target = load_target(REPO_SUITES / "deepseek-v3.toml")
    model, mc = meta_model(target, pruned=True)
    inv = trace_model(model, mc.config.vocab_size)
    gm = inv.ops["aten._grouped_mm.default"]
    assert gm.modules == {"model.layers.*.mlp.experts [DeepseekV3Experts]"}
    assert gm.forward == 2 and gm.backward == 4  # one MoE layer: gate_up + down, and both grads of each
    assert inv.modules_of("aten.embedding_dense_backward.default") == ["model.embed_tokens [Embedding]"]
    assert "model.layers.*.mlp.gate [DeepseekV3TopkRouter]" in inv.ops["aten.sigmoid_backward.default"].modules
    assert any("bf16[" in s for s in gm.signatures)
    # JSON round trip
    back = Inventory.from_dict(json.loads(inv.to_json()))
    assert back.names() == inv.names() and back.ops["aten.mm.default"].count == inv.ops["aten.mm.default"].count


def test_real_trace_keeps_samples_with_values():
    target = load_target(REPO_SUITES / "llama-3.1-8b.toml")
    model, mc = build_model(target.suite, "float32", "cpu")
    inv = trace_model(model, mc.config.vocab_size, keep_samples=True)
    s = inv.samples["aten.embedding.default"][0]
    assert s.args[1].dtype == torch.int64 and s.args[1].max() < 512  # real token ids
    assert s.module == "model.embed_tokens [Embedding]"


def test_helpers():
    assert general_module("model.layers.12.mlp.experts") == "model.layers.*.mlp.experts"
    assert signature((torch.zeros(2, 3), 1, [4, 5]), {"dtype": torch.bfloat16}) == "(f32[2,3], 1, [4,5], dtype=bf16)"
