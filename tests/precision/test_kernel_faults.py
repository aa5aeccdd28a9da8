"""Issue #11: low-precision kernel faults are caught in bfloat16, with the right module named first.

The faults (tests/precision/faults.py) are kernels registered with torch.library for the CPU key that
misbehave only in bfloat16/float16 (softmax/SDPA scale off 3%, SiLU slope off 3%, RMSNorm and matmul
accumulating in bf16), and at model level a 1% residual scale in one layer. Each of these passes with
the old check (propagated comparison, one tolerance per dtype).

Every fault runs on every bundled suite but kimi-k2 (30 cases; each suite uses every operator):
kimi-k2 is DeepseekV3ForCausalLM, deepseek-v3's architecture, so the same modules dispatch the same
kernels and its cases are covered by deepseek-v3's. The matrix once ran only under an environment
variable CI never set and the default run took one suite per fault, a subset of it (issue #44).
"""

from __future__ import annotations

import pytest

from harness.golden.store import load_golden
from precision import faults
from precision.helpers import GOLDEN, SUITES, modules_dispatching, props, run_check, suite


def _first_mlp(name: str) -> str:
    order = load_golden(suite(name), GOLDEN).order
    return next((n for n in order if n == "model.layers.0.mlp.experts"), "model.layers.0.mlp")


FAULTS = {
    # kind: (check options, module expected first (None: the suite's first MLP / experts))
    "sdpa_scale": ({"context": lambda: faults.KernelFault("sdpa_scale", 0.03)}, "model.layers.0.self_attn"),
    "silu_slope": ({"context": lambda: faults.KernelFault("silu_slope", 0.03)}, None),
    # every linear layer calls aten::mm: the first module over budget must be one that does
    "matmul_bf16_acc": ({"context": lambda: faults.KernelFault("matmul_bf16_acc")}, "aten.mm"),
    "rmsnorm_bf16_acc": ({"transform": faults.route_rmsnorm, "context": lambda: faults.KernelFault("rmsnorm_bf16_acc")},
                         "model.layers.0.input_layernorm"),
    "residual_scale": ({"transform": faults.residual_scale(0, 0.01)}, "model.layers.0"),
    # positions held in bf16: exact at the golden's 16, caught at the rotary probe's (thousands)
    "rotary_bf16": ({"transform": faults.rotary_low_precision}, "model.rotary_emb@positions"),
}
# kimi-k2: deepseek-v3's architecture (see the docstring)
MATRIX_SUITES = [n for n in SUITES if n != "kimi-k2"]


def _run_fault(kind: str, name: str, tmp_path) -> tuple[str, str, set[str]]:
    """(failure message or "", module named first, modules where the fault can be born)."""
    opts, first = FAULTS[kind]
    first = first or _first_mlp(name)
    ctx, failure = run_check(name, "bfloat16", tmp_path, **opts)
    if failure is None:
        return "", "", set()
    named = props(ctx)["harness.detail.first_divergent_module"]
    where = modules_dispatching(name, first) if first.startswith("aten.") else {first}
    return failure.message, named, where


def _assert_caught(message: str, named: str, where: set[str]) -> None:
    assert message, "not caught"
    assert named in where, message
    assert message.startswith(named + " diverges"), message
    assert "isolated" in message  # localized by the module run on the golden's own inputs


@pytest.mark.parametrize("name", MATRIX_SUITES)
@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_kernel_fault_caught_in_bf16(kind, name, tmp_path):
    message, named, where = _run_fault(kind, name, tmp_path)
    assert message, f"{kind} not caught on {name}"
    _assert_caught(message, named, where)


def test_fault_kernels_are_right_outside_low_precision(tmp_path):
    """The replacement kernels compute the right thing in float32 (only bf16/fp16 is wrong), and the
    routed RMSNorm with a correct kernel matches transformers' RMSNorm: the clean run passes."""
    for ctx_fn, transform in ((lambda: faults.KernelFault("rmsnorm_ok"), faults.route_rmsnorm),
                              (lambda: faults.KernelFault("sdpa_scale"), None),
                              (lambda: faults.KernelFault("silu_slope"), None)):
        _, failure = run_check("qwen3-8b", "float32", tmp_path, context=ctx_fn, transform=transform)
        assert failure is None, failure.report("float32")
    _, failure = run_check("llama-3.1-8b", "bfloat16", tmp_path, context=lambda: faults.KernelFault("rmsnorm_ok"),
                           transform=faults.route_rmsnorm)
    assert failure is None, failure.report("bf16 routed rmsnorm, correct kernel")


def test_old_check_misses_what_the_new_one_catches(tmp_path):
    """The same 3% SDPA scale fault with the propagated comparison and the per-dtype tolerance only
    (isolated = false) passes: the isolated comparison and the measured budgets are what catch it."""
    ls = suite("llama-3.1-8b")
    s = ls.suite.model_copy(deep=True)
    s.checks.precision.isolated = False
    old = type(ls)(ls.path, ls.name, s, ls.config_path, ls.raw_config)
    opts, _ = FAULTS["sdpa_scale"]
    _, failure = run_check(old, "bfloat16", tmp_path, **opts)
    assert failure is None
