"""Issue #50 class 6: a budget must never fail a correct path. The compile check failed
`compile[cpu-bfloat16-frontend]` at 0.043 > 0.04 on a config whose compiled and eager logits are
bit-identical: the eager model itself was over the capped budget. Compiled is then held to eager's own
distance + the compiled-vs-eager budget (the triangle inequality), said in a note; a compiler fault
still fails, against eager."""

from __future__ import annotations

import torch

from harness.compiler import numerics as num


def _at(ref: torch.Tensor, rel: float, seed: int) -> torch.Tensor:
    """``ref`` plus seeded noise of relative RMSE ``rel``."""
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=ref.dtype)
    return ref + noise * (rel * ref.norm() / noise.norm())


def test_eager_over_the_budget_is_not_the_compilers_divergence():
    ref = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eager = _at(ref, 0.043, 1)
    j = num.judge(eager.clone(), eager, lambda t: t, ref, 0.04, 0.004, "cpu")  # compiled == eager, bit for bit
    assert j.diverged is None, j.diverged
    assert abs(j.golden_bound - (0.043 + 0.004)) < 1e-9, j.golden_bound
    assert j.note.startswith("compile: eager itself is 0.043 from the golden, over the budget 0.04"), j.note
    # a compiler fault on top: it differs from eager by more than the eager budget and fails there
    bad = _at(eager, 0.02, 2)
    j = num.judge(bad, eager, lambda t: t, ref, 0.04, 0.004, "cpu")
    assert j.diverged is not None and ("diverge from eager" in j.diverged or "from the golden" in j.diverged), j
    # eager inside the budget: the bound is the budget, no note, and compiled over it fails
    eager = _at(ref, 0.02, 3)
    j = num.judge(_at(ref, 0.05, 4), eager, lambda t: t, ref, 0.04, 0.004, "cpu")
    assert j.golden_bound == 0.04 and j.note is None
    assert j.diverged.startswith("compiled logits diverge from the golden (rel_rmse 0.05 > budget 0.04"), j.diverged


def test_a_moe_model_is_left_to_the_forced_rerun():
    # a MoE model's eager distance is its routing flips: the forced rerun decides (harness.compiler.bounds)
    ref = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eager = _at(ref, 0.043, 1)
    j = num.judge(eager.clone(), eager, lambda t: t, ref, 0.04, 0.004, "cpu", eager_over=False)
    assert j.note is None and j.golden_bound == 0.04 and j.diverged is not None
