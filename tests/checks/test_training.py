"""The ``training`` check (issue #25): clean runs pass, and each backward / optimizer fault, registered
at the dispatcher (tests/precision/backward_faults.py), fails it at the right module while the
forward precision check passes with the same fault.

Goldens are generated once per process into a temporary folder (backward_faults.golden_root). The
default run: the clean matrix on two suites (a dense and an MoE one) in float32 and bfloat16 and one
suite per fault; every bundled suite with ``HARNESS_TRAINING_FULL=1``."""

from __future__ import annotations

import dataclasses
import os

import pytest
from precision import backward_faults as bf
from precision.helpers import SUITES, props, run_check, suite

from harness.backends import get
from harness.checks import CheckContext, CheckFailure, CouldNotRun, NotApplicable, registry
from harness.checks.training import TrainingConfig, run_training

FULL = os.environ.get("HARNESS_TRAINING_FULL") == "1"
CLEAN = SUITES if FULL else ["llama-3.1-8b", "qwen3-30b-a3b"]


def _run(name_or_ls, dtype, **kw):
    ls = suite(name_or_ls) if isinstance(name_or_ls, str) else name_or_ls
    ctx = CheckContext(ls, get("cpu"), dtype)
    try:
        run_training(ctx, golden_root=bf.golden_root(ls.name), **kw)
    except (CheckFailure, CouldNotRun) as f:
        return ctx, f
    return ctx, None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", CLEAN)
def test_clean_run_passes(name, dtype):
    ctx, f = _run(name, dtype)
    assert f is None, str(f)
    m = props(ctx)
    # a clean run on the reference backend reproduces draw 0 of the measurement: <= 1/k of every budget
    for k in ("training_backward_worst_budget_use", "training_replay_worst_budget_use",
              "training_optimizer_worst_budget_use", "training_trajectory_worst_envelope_use"):
        assert 0 < float(m[f"metric.{k}"]) <= 1 / 1.5 + 0.01, (k, m[f"metric.{k}"])
    assert float(m["metric.training_trajectory_first_step_out"]) == -1


FAULTS = {
    # fault: (suite, dtype, check options, first line starts with)
    "silu_backward": ("llama-3.1-8b", "float32", {"context": bf.SiluBackward}, "model.layers.1.mlp: backward diverges"),
    "rmsnorm_backward": ("qwen3-8b", "float32", {"transform": bf.route_rmsnorm_custom}, "model.norm: backward diverges"),
    "attention_backward": ("llama-3.1-8b", "bfloat16", {"context": bf.AttentionBackward},
                           "model.layers.1.self_attn: backward diverges"),
    "experts_backward": ("qwen3-30b-a3b", "bfloat16", {"transform": bf.experts_backward(0)},
                         "model.layers.0.mlp.experts: backward diverges"),
    "fused_adamw_eps": ("llama-3.1-8b", "bfloat16", {"context": bf.FusedAdamWEps},
                        "optimizer: AdamW (fused) diverges from the float64 reference in the decay group"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_fails_training_at_the_module_and_passes_precision(fault, tmp_path):
    name, dtype, opts, first = FAULTS[fault]
    _, f = _run(name, dtype, **opts)
    assert isinstance(f, CheckFailure), f"{fault} not caught"
    line = str(f).splitlines()[0]
    assert line.startswith(first), line
    if fault != "fused_adamw_eps":  # the isolated backward says the module itself is wrong
        assert "the module's own backward is wrong" in line, line
    _, pf = run_check(name, dtype, tmp_path, golden_root=bf.golden_root(name), **opts)
    assert pf is None, f"the forward precision check should not see a backward fault: {pf}"


def test_section_made_with_other_knobs_could_not_run():
    ls = suite("llama-3.1-8b")
    checks = ls.suite.checks.model_copy(update={"training": ls.suite.checks.training.model_copy(update={"steps": 5})})
    ls2 = dataclasses.replace(ls, suite=ls.suite.model_copy(update={"checks": checks}))
    _, f = _run(ls2, "float32")
    assert isinstance(f, CouldNotRun) and "golden generate llama-3.1-8b --update" in str(f), f


def test_float64_is_not_applicable():
    with pytest.raises(NotApplicable):
        run_training(CheckContext(suite("llama-3.1-8b"), get("cpu"), "float64"), golden_root=bf.golden_root("llama-3.1-8b"))


def test_config_is_strict_and_registered():
    with pytest.raises(ValueError):
        TrainingConfig(steps="3")
    with pytest.raises(ValueError):
        TrainingConfig(betas=[1.5, 0.9])
    check = registry().get("training")
    assert check.order == 25 and check.config_model is TrainingConfig
