"""The published-widths check (issue #47 item 2): one decoder layer of each kind at the model's real
widths, every module alone against float64, forward and backward, each held to K x the CPU's error
at that shape + a floor. A GEMM that takes a wrong path only at the inner dimensions published widths
reach is invisible to the pruned precision check and named here with its module and shapes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from precision.helpers import run_check, suite

from harness.checks import CheckContext, CheckFailure, NotApplicable, registry, run_one


@contextlib.contextmanager
def split_k_fault(min_k: int = 4096, factor: float = 1.01):
    """A GEMM kernel whose split-K path (inner dimension >= ``min_k``) sums its partial products 1 %
    high; every smaller GEMM is exact. The pruned suites' widths (64-256) never take that path."""
    linear = torch.nn.functional.linear

    def wrong(x, w, b=None):
        out = linear(x, w, b)
        return out * factor if x.shape[-1] >= min_k else out

    torch.nn.functional.linear = wrong
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


def _tokens(ls, n: int):
    """The suite with [checks.width] tokens = n (fewer GEMM rows: the kernel paths under test are chosen
    by the inner dimension, not by the rows)."""
    import dataclasses

    checks = ls.suite.checks.model_copy(update={"width": ls.suite.checks.width.model_copy(update={"tokens": n})})
    return dataclasses.replace(ls, suite=ls.suite.model_copy(update={"checks": checks}))


def test_registered_nightly():
    check = registry().get("width")
    ls = suite("llama-3.1-8b")
    assert check.config(ls).scope == "nightly" and check.enabled(ls)


def test_a_gemm_wrong_only_at_published_inner_dims_is_named_with_its_module_and_shapes(tmp_path):
    # the pruned precision check cannot see it: no GEMM of the pruned model reaches K = 4096
    _, f = run_check("llama-3.1-8b", "float32", tmp_path, context=split_k_fault)
    assert f is None, str(f)
    ctx = CheckContext(_tokens(suite("llama-3.1-8b"), 8), _cpu(), "float32", check="width")
    with pytest.raises(CheckFailure) as e:
        registry().get("width").run(ctx, context=split_k_fault)
    msg = str(e.value)
    assert msg.startswith("published widths: model.layers.0.self_attn.q_proj (Linear, input [1, 8, 4096], "
                          "weight [4096, 4096]) forward rel_rmse 0.01"), msg
    props = dict(ctx.properties)
    assert "hidden_size 128 -> 4096" in props["harness.detail.width_restored"]
    assert "intermediate_size 256 -> 14336" in props["harness.detail.width_restored"]
    assert "vocab_size" not in props["harness.detail.width_restored"]
    assert "mlp.down_proj" in (e.value.details or "")  # K = 14336: over too, listed after the first


def test_moe_layer_at_published_widths_passes_clean_with_its_experts_compared():
    ctx = run_one(suite("qwen3-30b-a3b"), "width", "cpu", "bfloat16")
    props = dict(ctx.properties)
    assert float(props["metric.width_worst_budget_use"]) <= 1
    restored = props["harness.detail.width_restored"]
    assert "moe_intermediate_size 32 -> 768" in restored and "num_local_experts" not in restored
    # the suite keeps the published head_dim (#47 item 4): nothing to restore there
    assert "head_dim" not in restored and "num_key_value_heads 1 -> 4" in restored


def test_a_model_too_large_for_the_host_is_not_applicable_in_one_line():
    """deepseek-v3's dense + MoE layer at 7168 wide (8 experts of 2048) is 1.17B parameters: its
    float64 reference would be 8.7 GiB; the default bound says so (set max_params to run it)."""
    with pytest.raises(NotApplicable) as e:
        run_one(suite("deepseek-v3"), "width", "cpu", "float32")
    msg = str(e.value)
    assert "\n" not in msg and "at the published widths" in msg and "max_params" in msg


def _cpu():
    from harness.backends import get

    return get("cpu")

