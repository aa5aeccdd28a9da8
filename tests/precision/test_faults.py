"""Injected faults are caught, with the module where the error is born named first; the clean
model passes the same checks. Each fault is tested in a dtype where it is meaningful (a float16
softmax in one layer is below bf16 noise, so that one is a float32 test)."""

from __future__ import annotations

import pytest

from precision import faults
from precision.helpers import layer_table, props, run_check

TABLE_KEYS = {"module", "max_abs_err", "max_rel_err", "cosine", "rel_rmse", "tolerance", "ok"}

CASES = [
    # (suite, dtype, fault, module expected first)
    ("llama-3.1-8b", "float32", faults.rmsnorm_eps(1), "model.layers.1.input_layernorm"),
    ("qwen3-8b", "float32", faults.rmsnorm_eps(0), "model.layers.0.input_layernorm"),
    ("llama-3.1-8b", "float32", faults.half_softmax(1), "model.layers.1.self_attn"),
    ("qwen3-8b", "float32", faults.half_softmax(0), "model.layers.0.self_attn"),
    ("mixtral-8x7b", "bfloat16", faults.perturbed_expert(1, 2), "model.layers.1.mlp.experts"),
    ("qwen3-30b-a3b", "float32", faults.perturbed_expert(1, 3), "model.layers.1.mlp.experts"),
    ("deepseek-v3", "bfloat16", faults.rotary_base(factor=2.0), "model.rotary_emb"),
    ("llama-3.1-8b", "bfloat16", faults.rotary_base(10000.0), "model.rotary_emb"),
]


@pytest.mark.parametrize("suite_name,dtype,fault,first", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2].__qualname__.split('.')[0]}" for c in CASES])
def test_fault_caught_and_localized(suite_name, dtype, fault, first, tmp_path):
    ctx, failure = run_check(suite_name, dtype, tmp_path, transform=fault)
    assert failure is not None, "fault not caught"
    assert failure.message.startswith(first + " diverges")
    p = props(ctx)
    assert p["harness.detail.first_divergent_module"] == first
    table = layer_table(ctx)
    assert all(set(row) == TABLE_KEYS for row in table)
    rows = {r["module"]: r for r in table}
    assert not rows[first]["ok"]
    # every module before the first divergent one is within tolerance
    before = [r for r in table[: [r["module"] for r in table].index(first)]]
    assert all(r["ok"] for r in before)
    assert (tmp_path / "results" / "precision" / f"{suite_name}-cpu-{dtype}.png").stat().st_size > 1000
    assert "first divergent" in failure.details and "growth" in failure.details


@pytest.mark.parametrize("suite_name,dtype", sorted({(c[0], c[1]) for c in CASES}))
def test_clean_model_passes_same_checks(suite_name, dtype, tmp_path):
    ctx, failure = run_check(suite_name, dtype, tmp_path)
    assert failure is None, failure and failure.report("clean")
    # on success no table unless asked
    assert "harness.detail.layer_table" not in props(ctx)


def test_report_on_request(tmp_path):
    ctx, failure = run_check("qwen3-8b", "float32", tmp_path, force_report=True)
    assert failure is None
    table = layer_table(ctx)
    assert all(r["ok"] for r in table) and table[-1]["module"] == "logits"
    assert props(ctx)["harness.detail.first_divergent_module"] == ""
    amp = props(ctx)["harness.detail.layer_amplification"]
    assert "model.layers.1" in amp


def test_wrong_kernel_caught(tmp_path):
    ctx, failure = run_check("llama-3.1-8b", "float32", tmp_path,
                             context=lambda: faults.FaultyKernel("aten.rsqrt", 1e-2))
    assert failure is not None
    assert props(ctx)["harness.detail.first_divergent_module"] == "model.layers.0.input_layernorm"
