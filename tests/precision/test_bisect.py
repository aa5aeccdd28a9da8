"""Precision bisection returns the faulty module; the forced-fallback op mode the faulty op."""

from __future__ import annotations

from harness.backends import get
from harness.golden.store import load_golden
from harness.precision.bisect import bisect_modules, bisect_ops, minimal_set
from precision import faults
from precision.helpers import GOLDEN, suite


def _setup(name):
    ls = suite(name)
    return ls, load_golden(ls, GOLDEN), get("cpu")


def test_minimal_set_finds_needed_elements():
    calls = []

    def needs_c_and_f(s):
        calls.append(list(s))
        return {"c", "f"} <= set(s)

    assert sorted(minimal_set(list("abcdefgh"), needs_c_and_f)) == ["c", "f"]
    assert minimal_set(list("ab"), lambda s: False) is None
    assert len(calls) < 20


def test_bisect_modules_rmsnorm_eps():
    ls, g, be = _setup("llama-3.1-8b")
    res = bisect_modules(ls, g, be, "float32", transform=faults.rmsnorm_eps(1))
    assert not res.baseline_ok
    assert res.found == ["model.layers.1.input_layernorm"]


def test_bisect_modules_half_softmax():
    ls, g, be = _setup("qwen3-8b")
    res = bisect_modules(ls, g, be, "float32", transform=faults.half_softmax(0))
    assert res.found == ["model.layers.0.self_attn"]


def test_bisect_modules_expert_bf16():
    ls, g, be = _setup("mixtral-8x7b")
    res = bisect_modules(ls, g, be, "bfloat16", transform=faults.perturbed_expert(1, 2))
    assert res.found == ["model.layers.1.mlp.experts"]


def test_bisect_clean_is_noop():
    ls, g, be = _setup("qwen3-8b")
    res = bisect_modules(ls, g, be, "bfloat16")
    assert res.baseline_ok and res.found is None and res.tests == 1


def test_bisect_float32_promotion_fixes_precision_loss(monkeypatch):
    # Tolerance set just below the clean bf16 run's worst module error: precision alone fails it,
    # and running a few modules in float32 ("higher precision for critical layers") fixes it.
    from harness.precision import tolerance
    from harness.precision.runner import build_target, compare_run, run_model

    ls, g, be = _setup("qwen3-8b")
    model, _ = build_target(ls, be, "bfloat16", golden=g)
    loose = dict(tolerance.DEFAULTS["bfloat16"], rel_rmse=1.0, min_cosine=0.0)
    r = compare_run(g, run_model(model, g, ls, be.device(), generate=False), loose)
    worst = max(x.metrics["rel_rmse"] for x in r.rows)
    monkeypatch.setitem(tolerance.DEFAULTS, "bfloat16", dict(loose, rel_rmse=worst * 0.99))
    res = bisect_modules(ls, g, be, "bfloat16", with_="float32")
    assert not res.baseline_ok
    assert res.found and len(res.found) < len(res.candidates), res.log


def test_bisect_ops_forced_fallback_finds_wrong_kernel():
    ls, g, be = _setup("llama-3.1-8b")
    res = bisect_ops(ls, g, be, "float32", context=lambda: faults.FaultyKernel("aten.rsqrt", 1e-2))
    assert not res.baseline_ok
    assert "aten.rsqrt" in res.candidates and "aten.mm" in res.candidates
    assert res.found == ["aten.rsqrt"]


def test_bisect_ops_other_kernel():
    ls, g, be = _setup("qwen3-8b")
    res = bisect_ops(ls, g, be, "float32", context=lambda: faults.FaultyKernel("aten.silu", 1e-2))
    assert res.found == ["aten.silu"]
