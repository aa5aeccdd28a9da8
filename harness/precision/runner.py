"""Run the suite's model on a target backend/dtype over a golden's stored inputs and compare.

``transform`` (model -> model) and ``context`` (() -> context manager around the forward passes)
let tests and tools inject faults or fixes without touching the suite: the golden always comes
from the clean reference, the target starts from the same seeded weights.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.anatomy.capture import capture_forward, greedy
from harness.anatomy.moe import ROUTER_SUFFIXES
from harness.golden.store import Golden
from harness.precision import tolerance
from harness.precision.compare import Comparison, compare_generation, compare_isolated, compare_modules
from harness.precision.isolate import Replayed, replay
from harness.suite.loader import LoadedSuite

Transform = Callable[[torch.nn.Module], torch.nn.Module]


@dataclass
class TargetRun:
    outputs: dict[str, torch.Tensor]
    generation: dict[str, torch.Tensor]
    notes: list[str]
    replayed: Replayed | None = None  # isolated outputs (each module on the golden's inputs)


def build_target(ls: LoadedSuite, backend, dtype: str, transform: Transform | None = None,
                 golden: Golden | None = None):
    """The suite's model on the backend in the dtype, with the golden's realistic-numerics gains."""
    from harness.models import numerics
    from harness.models.build import build_model

    model, mc = build_model(ls, dtype, backend.device(), seed=ls.suite.checks.precision.seed)
    if golden is not None:
        numerics.apply(model, golden.manifest.get("numerics"))
    if transform is not None:
        model = transform(model)
    model.eval()
    return model, mc


def run_model(model, golden: Golden, ls: LoadedSuite, device, context=None, generate: bool = True) -> TargetRun:
    p = ls.suite.checks.precision
    ids = golden.inputs.to(device)
    ctx = context() if context is not None else contextlib.nullcontext()
    with ctx:
        outs = capture_forward(model, ids, p.capture)
        n = golden.generation["tokens"].shape[1] if generate and golden.generation else 0
        gen = greedy(model, ids, n) if n else {}
    return TargetRun(outs, gen, [])


def run_isolated(model, golden: Golden, dtype: str, device, context=None) -> Replayed:
    """Each captured module of ``model`` on the golden's recorded inputs, converted to ``dtype``."""
    from harness.models.build import torch_dtype

    names = [n for n in golden.order if n in golden.structures]
    return replay(model, golden.structures, golden.modules, golden.module_inputs, torch_dtype(dtype), device,
                  names, context)


@dataclass
class Budgets:
    """What one run is held to, from the golden's measurement for its dtype (see budgets_for)."""

    modules: dict[str, float] = field(default_factory=dict)  # isolated rel_rmse budget per module
    scales: dict[str, float] = field(default_factory=dict)  # isolated |scale error| budget per module
    logits: float | None = None  # propagated logits rel_rmse (enforced only without isolated rows)
    # the same with a MoE model's routers forced to the reference's choices (None: not measured - no
    # router, a router that cannot be forced, a golden from before 2026-12-04)
    logits_forced: float | None = None
    router_limits: dict[str, float] = field(default_factory=dict)  # widest legitimate flip margin per router
    logprob_atol: float | None = None  # greedy-token logprob budget
    tie_margin: float | None = None  # widest legitimate greedy flip (reference logprob gap), measured
    signed: dict = field(default_factory=dict)  # clean rows per kind and module (signed.clean_rows; sign tests)
    dtype: str = ""


# A measured flip gap widens the tie margin up to this factor of the dtype's tie_margin (bfloat16:
# 1 nat, a token e times less likely than the reference's): a broken clean measurement must not
# excuse every flip.
TIE_CEILING_FACTOR = 10.0


def budgets_for(golden: Golden, dtype: str, tol: dict, k: float, source: dict | None = None) -> Budgets:
    """Budgets for a run: k x measured clean error + the dtype's floor, capped by the tolerance (the
    ceiling). Modules without a measurement (dtype not measured) get the tolerance. A router flip is
    legitimate when the golden's margin is within 2 k x the router logits' measured error (2: a flip
    needs the difference of two logits to change sign). Greedy logprobs: k x the measured max + 0.01
    nats (capped by logprob_atol). Greedy flips: where the clean dtype model, measured at golden
    generate, flipped a greedy token at a reference logprob gap wider than the dtype's tie_margin,
    k x the widest such gap (at most TIE_CEILING_FACTOR x tie_margin), unless ``source`` (where each
    tolerance field came from, ``tolerance.resolve``) says the suite set tie_margin itself."""
    from harness.precision.budgets import budget, scale_budget

    b = golden.budgets(dtype)
    ceiling = tol["rel_rmse"]
    signed = signed_rows(golden, dtype)
    mods = b.get("modules") or {}
    out = Budgets({n: budget(st, dtype, ceiling, k) for n, st in mods.items()},
                  {n: scale_budget(st["scale"], dtype, k) for n, st in mods.items() if "scale" in st})
    lg = (b.get("propagated") or {}).get("logits")
    out.logits = budget(lg, dtype, ceiling, k) if lg else None
    lf = (b.get("propagated") or {}).get("logits_forced")
    out.logits_forced = budget(lf, dtype, ceiling, k) if lf else None
    out.router_limits = {g: 2 * k * v for g, v in (b.get("router_noise") or {}).items()}
    out.signed, out.dtype = signed, dtype
    gen = (b.get("generation") or {}).get("logprob_diff")
    if gen and gen.get("n"):
        out.logprob_atol = min(tol["logprob_atol"], k * gen["max"] + 0.01)
    gaps = [g for g in (b.get("generation") or {}).get("mismatch_gaps") or [] if math.isfinite(g)]
    explicit_tie = not (source or {}).get("tie_margin", "default").startswith("default")
    if gaps and not explicit_tie and tol.get("tie_margin") is not None:
        out.tie_margin = max(tol["tie_margin"], min(k * max(gaps), TIE_CEILING_FACTOR * tol["tie_margin"]))
    return out


def signed_rows(golden: Golden, dtype: str) -> dict[str, dict[str, torch.Tensor]]:
    """{"offset" | "scale": {module: the clean rows in ``dtype``}} from the golden's ``signed_error``
    section ({} when the golden has none: sampled mode, a reference not in float64)."""
    from harness.precision import signed

    sec = (golden.manifest.get("sections") or {}).get(signed.SECTION)
    if sec is None:
        return {}
    return signed.clean_rows(golden.section(signed.SECTION).tensors, dtype)


def compare_run(golden: Golden, run: TargetRun, tol: dict, budgets: Budgets | None = None,
                judge=None) -> Comparison:
    bud = budgets or Budgets()
    enforce = None
    if run.replayed is not None:
        enforce = {n for n in golden.order if n not in run.replayed.outputs}
        if "lm_head" in run.replayed.outputs:
            # logits = f(lm_head) (soft-capping): lm_head's isolated row localizes; the end-to-end
            # verdict is the greedy generation's, as for every model
            enforce.discard("logits")
    res = compare_modules(golden, run.outputs, tol, enforce=enforce, logits_budget=bud.logits)
    if run.replayed is not None:
        lim = dict.fromkeys([n for n in golden.order if n.endswith(ROUTER_SUFFIXES)], tol["tie_margin"])
        lim.update(bud.router_limits)
        compare_isolated(golden, run.replayed, tol, bud.modules, lim, res, bud.scales, judge, bud.signed, bud.dtype)
    if run.generation:
        gtol = dict(tol)
        if bud.logprob_atol is not None:
            gtol["logprob_atol"] = bud.logprob_atol
        if bud.tie_margin is not None:
            gtol["tie_margin"] = bud.tie_margin
        compare_generation(golden, run.generation, gtol, res)
    return res


def selection_judge(ls: LoadedSuite, golden: Golden, dtype: str | None = None):
    """The judge of routing flips in the router's selection space (``isolate.SelectionJudge``); the
    reference model (float64, the golden's numerics gains) is built only if a flip needs judging."""
    from harness.precision.isolate import SelectionJudge

    def reference():
        from harness.models import numerics
        from harness.models.build import build_model

        model, _ = build_model(ls, "float64", "cpu", seed=ls.suite.checks.precision.seed)
        numerics.apply(model, golden.manifest.get("numerics"))
        return model.eval()

    from harness.models.build import torch_dtype

    return SelectionJudge(reference, golden.structures, golden.modules, golden.module_inputs,
                          torch_dtype(dtype) if dtype else None)


def tolerances_for(ls: LoadedSuite, backend, dtype: str) -> tuple[dict, dict]:
    return tolerance.resolve(ls.suite.checks.precision, backend.name, backend.device_name(), dtype)


def check_against_golden(ls: LoadedSuite, golden: Golden, backend, dtype: str, *, transform: Transform | None = None,
                         context=None, tol: dict | None = None, isolated: bool | None = None
                         ) -> tuple[Comparison, dict, TargetRun]:
    p = ls.suite.checks.precision
    src = None
    if not tol:
        tol, src = tolerances_for(ls, backend, dtype)
    model, mc = build_target(ls, backend, dtype, transform, golden)
    run = run_model(model, golden, ls, backend.device(), context)
    if (p.isolated if isolated is None else isolated) and golden.structures:
        run.replayed = run_isolated(model, golden, dtype, backend.device(), context)
    run.notes = list(mc.notes)
    return (compare_run(golden, run, tol, budgets_for(golden, dtype, tol, p.budget_k, src),
                        selection_judge(ls, golden, dtype)),
            tol, run)
