"""The greedy tie budget (harness.precision.runner.budgets_for): a greedy flip is legitimate up to
k x the widest reference logprob gap at which the clean dtype model flipped at golden generate, so a
model whose bf16 logits are noisy (Qwen3.5's linear attention: clean flips at gaps 0.20-0.30, 3 false
alarms in 10 reruns under the fixed 0.1) is not failed for its own rounding."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness.golden.store import Golden
from harness.precision.compare import Comparison, compare_generation
from harness.precision.runner import TIE_CEILING_FACTOR, budgets_for
from harness.precision.tolerance import DEFAULTS

TOL = dict(DEFAULTS["bfloat16"])  # tie_margin 0.1


def golden(gaps: list[float]) -> Golden:
    # One sequence of 2 greedy tokens; the reference's top-4 candidates at token 0 are ids 7, 3, 5, 9
    # at logprobs -0.5, -0.75, -1.0, -3.0 (gaps 0.25, 0.5 and 2.5 behind the chosen one).
    gen = {"tokens": torch.tensor([[7, 2]]), "logprobs": torch.tensor([[-0.5, -0.1]], dtype=torch.float64),
           "top_ids": torch.tensor([[[7, 3, 5, 9], [2, 1, 0, 4]]]),
           "top_logprobs": torch.tensor([[[-0.5, -0.75, -1.0, -3.0], [-0.1, -3.0, -4.0, -5.0]]], dtype=torch.float64)}
    budgets = {"bfloat16": {"generation": {"logprob_diff": {"max": 0.02, "mean": 0.01, "min": 0.0, "n": 4, "std": 0.01},
                                           "mismatch_gaps": gaps}}}
    return Golden(Path("."), {"budgets": budgets, "order": []}, torch.zeros(1, 4, dtype=torch.long), {}, generation=gen)


def verdict(g: Golden, target_token: int, tie: float | None) -> str | None:
    tol = dict(TOL) if tie is None else dict(TOL, tie_margin=tie)
    res = Comparison()
    compare_generation(g, {"tokens": torch.tensor([[target_token, 2]]),
                           "logprobs": torch.tensor([[-0.6, -0.1]])}, tol, res)
    return res.generation_failure


def test_a_measured_clean_flip_widens_the_tie_margin_to_k_times_its_gap():
    g = golden([0.01, 0.196, math.inf])  # the clean bf16 model flipped at gap 0.196 (and once off the list)
    b = budgets_for(g, "bfloat16", TOL, 1.5)
    assert b.tie_margin == pytest.approx(1.5 * 0.196)  # the infinite gap is not a measurement of noise
    # the target picks the reference's 2nd candidate (gap 0.25): a false alarm under 0.1, legitimate now
    assert "gap 0.25 > tie_margin 0.1" in verdict(g, 3, None)
    assert verdict(g, 3, b.tie_margin) is None
    # the 3rd candidate (gap 0.5) is past k x the widest clean flip: still a failure
    assert "gap 0.5 > tie_margin 0.294" in verdict(g, 5, b.tie_margin)


def test_the_tie_budget_never_narrows_has_a_ceiling_and_yields_to_the_suite():
    assert budgets_for(golden([0.01, 0.05]), "bfloat16", TOL, 1.5).tie_margin == 0.1  # never below the default
    assert budgets_for(golden([5.0]), "bfloat16", TOL, 1.5).tie_margin == TIE_CEILING_FACTOR * 0.1  # 1 nat
    assert budgets_for(golden([0.3]), "bfloat16", TOL, 1.5, {"tie_margin": "suite[bfloat16]"}).tie_margin is None
    assert budgets_for(golden([]), "bfloat16", TOL, 1.5).tie_margin is None  # nothing measured: the default
    assert budgets_for(golden([math.inf]), "bfloat16", TOL, 1.5).tie_margin is None
