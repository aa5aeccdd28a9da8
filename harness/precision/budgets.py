"""Per-module error budgets from measurement.

When a golden is made, each captured module's *clean* isolated error is measured on the reference
backend in every low-precision dtype the suite lists: the float64 model is run on several input
draws (draw 0 is the golden's own input ids), recording every module's inputs and outputs; the
same weights in the dtype then run each module on those inputs converted to the dtype, and the
module's rel_rmse against the float64 output is its clean error for that draw. The manifest stores,
per dtype and module, the mean / std / max over the draws, and per router the largest router-logit
error seen in any isolated call (``router_noise``: how close to a tie a legitimate routing flip
can be). The propagated logits error (the whole model in the dtype) is measured the same way.

A module then fails when ``error > k * clean_max + floor`` (``budget``), capped by the per-dtype
default tolerance (the ceiling). ``k`` and the floors are chosen from the measured spread (see
docs/precision.md, "Budgets"): over the bundled suites the largest ratio of one draw's clean error
to the max over the other draws is about 1.2, a correct kernel on another backend (other
accumulation order, fused kernels that round intermediates) adds at most a similar factor, so
k = 2 leaves a >= 1.6x margin for clean runs while a kernel fault that doubles a module's own
error is caught.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harness.anatomy.capture import EXPERTS_SUFFIX
from harness.anatomy.moe import ROUTER_SUFFIXES
from harness.precision.compare import tensor_metrics
from harness.precision.isolate import keep_tokens, replay

K = 1.5
# Floors: a quarter of the dtype's unit roundoff for bf16/fp16 (2^-8, 2^-11) - below what rounding a
# module's output alone costs (~0.6 x unit roundoff in rel_rmse), so they only matter for modules
# whose clean error is (almost) zero. float32: 8 unit roundoffs (2^-21, 4.8e-7): on CPU a norm or a
# rotary table is bit-identical to the reference (transformers computes them in float32 even in the
# float64 model), and another backend's float32 rsqrt/cos may differ by an ulp or two - that is not
# a fault.
FLOORS = {"bfloat16": 2.0 ** -10, "float16": 2.0 ** -13, "float32": 2.0 ** -21, "float64": 1e-12}
# Floors of the scale error |<a-r, r>| / <r, r>: rounding noise puts it at ~rel_rmse / sqrt(numel)
# (~1e-4 in bf16 for a 2x16x64 activation); the floor sits ~5-10 sigma above that, so that a
# systematic error of a few tenths of a percent (a scale, a slope) is still caught.
SCALE_FLOORS = {"bfloat16": 1e-3, "float16": 1.5e-4, "float32": 5e-7, "float64": 1e-12}


def scale_budget(stats: dict, dtype: str, k: float = K) -> float:
    return k * stats["max"] + SCALE_FLOORS.get(dtype, 0.0)


# One-sided 99.9 % quantiles of Student's t by degrees of freedom (standard tables; a df between two
# rows takes the smaller df's, the larger quantile). No scipy in the runtime dependencies.
T999 = {1: 318.31, 2: 22.327, 3: 10.215, 4: 7.173, 5: 5.893, 6: 5.208, 7: 4.785, 8: 4.501, 9: 4.297,
        10: 4.144, 11: 4.025, 12: 3.930, 13: 3.852, 14: 3.787, 15: 3.733, 16: 3.686, 17: 3.646, 18: 3.610,
        19: 3.579, 20: 3.552, 24: 3.467, 30: 3.385, 40: 3.307, 60: 3.232, 120: 3.160}


def prediction_bound(samples: list[float]) -> float | None:
    """Upper 99.9 % prediction bound of one more draw from the distribution ``samples`` were drawn
    from: mean + t(n-1) x std x sqrt(1 + 1/n). A clean error measured once per kernel choice and
    input draw is one sample of what a correct backend measures; where those samples spread (bf16
    weight changes after AdamW steps, whose few sign-following entries flip with the arithmetic order:
    issue #50, kimi-k2's lm_head 0.08 to 0.127 over correct orders), their maximum times k is no bound
    for an order not measured, this is. None: fewer than two finite samples."""
    vals = [v for v in samples if math.isfinite(v)]
    if len(vals) < 2 or len(vals) < len(samples):
        return None
    n = len(vals)
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    t = T999[max(d for d in T999 if d <= n - 1)]
    return mean + t * std * math.sqrt(1 + 1 / n)


MEASURED_DTYPES = ("bfloat16", "float16", "float32")


def _rounded(d):
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    return float(f"{d:.4g}") if isinstance(d, float) else d


def budget(stats: dict, dtype: str, ceiling: float, k: float = K, floor: float | None = None) -> float:
    f = FLOORS.get(dtype, 0.0) if floor is None else floor
    return min(ceiling, k * stats["max"] + f)


def _summary(values: list[float]) -> dict:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return {"mean": math.inf, "std": 0.0, "max": math.inf, "n": 0}
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if len(vals) > 1 else 0.0
    return {"mean": mean, "std": std, "max": max(vals), "min": min(vals), "n": len(vals)}


def isolated_errors(names: list[str], ref_outputs: dict, structures: dict, tensors: dict, model, dtype, device,
                    context=None) -> tuple[dict[str, float], dict[str, float], dict[str, float], int]:
    """(rel_rmse per module, |scale error| per module, largest router-logit abs error per router,
    routing flips) of ``model``
    run module by module on a reference run's recorded inputs. Tokens whose routing flipped are
    left out (measurement cannot judge them; the check does, against the noise measured here)."""
    rp = replay(model, structures, ref_outputs, tensors, dtype, device, names, context)
    errs, scales, noise, flips = {}, {}, {}, 0
    for name in names:
        got = rp.outputs.get(name)
        ref = ref_outputs.get(name)
        if got is None or ref is None or not ref.is_floating_point() or got.shape != ref.shape:
            continue
        keep = None
        for gate, chosen in (rp.inner_choices.get(name) or {}).items():
            rc = ref_outputs.get(gate + EXPERTS_SUFFIX)
            if rc is not None and rc.shape == chosen.shape:
                same = (rc.reshape(chosen.shape[0], -1) == chosen.reshape(chosen.shape[0], -1)).all(-1)
                flips += int((~same).sum())
                keep = same if keep is None else keep & same
        for gate, lg in (rp.inner_logits.get(name) or {}).items():
            rl = ref_outputs.get(gate)
            if rl is not None and rl.shape == lg.shape:
                noise[gate] = max(noise.get(gate, 0.0), (lg.double() - rl.double()).abs().max().item())
        if name.endswith(ROUTER_SUFFIXES):
            noise[name] = max(noise.get(name, 0.0), (got.double() - ref.double()).abs().max().item())
        m = tensor_metrics(keep_tokens(got, keep), keep_tokens(ref, keep))
        errs[name], scales[name] = m["rel_rmse"], abs(m["scale_err"])
    return errs, scales, noise, flips


@dataclass
class _Measured:
    """One dtype's clean errors, gathered over the draws."""
    modules: dict[str, list[float]] = field(default_factory=dict)  # module -> rel_rmse per draw
    scales: dict[str, list[float]] = field(default_factory=dict)  # module -> |scale error| per draw
    noise: dict[str, float] = field(default_factory=dict)  # router -> largest router-logit error
    logits: list[float] = field(default_factory=list)  # propagated logits rel_rmse per draw
    # the same with every router forced to the reference's choices on that draw (MoE models only)
    logits_forced: list[float] = field(default_factory=list)
    unforced: set[str] = field(default_factory=set)  # routers whose choice could not be replaced
    gen_lp: list[float] = field(default_factory=list)  # greedy generation's logprob diff per draw
    tie_gaps: list[float] = field(default_factory=list)  # reference gaps where greedy tokens differ
    flips: int = 0


def measure(ls, draws: list[torch.Tensor], reference_model, dtypes: list[str], reference_runs=None,
            numerics_entry: dict | None = None) -> dict:
    """The manifest's ``budgets``: {dtype: {"k", "floor", "draws", "modules": {name: stats + budget},
    "router_noise": {gate: value}, "propagated": {"logits": stats[, "logits_forced": stats]}, "flips": n}}
    (``logits_forced``: MoE models whose every router could be forced, ``_forced_logits``)."""
    runs = _reference_runs(ls, draws, reference_model, reference_runs)
    # the reference's greedy generation per draw: made once, compared against every dtype's
    ref_gens: dict[int, dict] = {}
    result = {}
    for dtype in dtypes:
        m = _measure_dtype(ls, dtype, draws, runs, reference_model, ref_gens, numerics_entry)
        result[dtype] = _entry(m, dtype, len(draws), ls.suite.checks.precision.generate_tokens)
    return result


def _reference_runs(ls, draws: list[torch.Tensor], reference_model, reference_runs) -> list[tuple]:
    """(outputs, capture with inputs) of the reference on every draw; runs the caller already made
    (the golden's own, draw 0) are reused and the list is extended in place."""
    from harness.anatomy.capture import capture_with_inputs

    runs = reference_runs or []
    for i in range(len(runs), len(draws)):
        outs, cap = capture_with_inputs(reference_model, draws[i], ls.suite.checks.precision.capture)
        runs.append((outs, cap))
    return runs


def _measure_dtype(ls, dtype: str, draws: list[torch.Tensor], runs: list[tuple], reference_model,
                   ref_gens: dict, numerics_entry: dict | None) -> _Measured:
    """The same weights built in ``dtype`` (the suite's realistic numerics applied), measured on every draw."""
    from harness.anatomy.capture import forward_logits
    from harness.models import numerics
    from harness.models.build import build_model, torch_dtype

    p = ls.suite.checks.precision
    dt = torch_dtype(dtype)
    model, _ = build_model(ls, dtype, "cpu", seed=p.seed)
    numerics.apply(model, numerics_entry)
    model.eval()
    m = _Measured()
    for draw, ((outs, cap), ids) in enumerate(zip(runs, draws, strict=True)):
        names = [n for n in outs if n in cap.inputs]
        errs, sc, nz, fl = isolated_errors(names, outs, cap.inputs, cap.input_tensors, model, dt, "cpu")
        m.flips += fl
        for n, e in errs.items():
            m.modules.setdefault(n, []).append(e)
            m.scales.setdefault(n, []).append(sc[n])
        for g, v in nz.items():
            m.noise[g] = max(m.noise.get(g, 0.0), v)
        with torch.no_grad():
            lg = forward_logits(model, ids).to("cpu")
        m.logits.append(tensor_metrics(lg, outs["logits"])["rel_rmse"])
        _forced_logits(m, model, ids, outs)
        if p.generate_tokens:
            lp, gap = _generation_errors(reference_model, model, ids, p.generate_tokens, ref_gens, draw)
            m.gen_lp.append(lp)
            m.tie_gaps.extend(gap)
    return m


def _forced_logits(m: _Measured, model, ids: torch.Tensor, outs: dict) -> None:
    """A MoE model's logits error with every router forced to the reference's choices on this draw.
    The unforced figure of a MoE model includes its routing flips: one token sent to other experts
    moves the logits by far more than rounding (mixtral-8x7b bfloat16: 0.011-0.028 over four draws),
    so its budget sits at the tolerance's cap and a compiled or kernel fault of a few percent hides
    under it. Forced, the figure is the arithmetic's alone: the budget that checks comparing a
    forced run with the golden use (the compile check's MoE path). Not measured when a router
    cannot be forced (said by ``unforced``)."""
    from harness.anatomy.capture import forward_logits
    from harness.precision.routing import ForcedRouting

    n = len(EXPERTS_SUFFIX)
    routes = {k[:-n]: v for k, v in outs.items() if k.endswith(EXPERTS_SUFFIX)}
    if not routes:
        return
    forced = ForcedRouting({"step": routes}, phase="step")
    handles = forced.attach(model)
    try:
        with torch.no_grad():
            lg = forward_logits(model, ids).to("cpu")
    finally:
        for h in handles:
            h.remove()
    if forced.unforced:
        m.unforced.update(forced.unforced)
        return
    m.logits_forced.append(tensor_metrics(lg, outs["logits"])["rel_rmse"])


def _entry(m: _Measured, dtype: str, n_draws: int, n_gen: int) -> dict:
    """The manifest entry of one dtype: stats and budget per module, router noise, propagated logits."""
    from harness.precision.tolerance import DEFAULTS

    ceiling = DEFAULTS.get(dtype, DEFAULTS["float32"])["rel_rmse"]
    mods = {}
    for n, vals in m.modules.items():
        st = _summary(vals)
        st["budget"] = budget(st, dtype, ceiling)
        sst = _summary(m.scales[n])
        st["scale"] = {"mean": sst["mean"], "max": sst["max"], "budget": scale_budget(sst, dtype)}
        mods[n] = _rounded(st)
    lst = _summary(m.logits)
    lst["budget"] = budget(lst, dtype, ceiling)
    entry = {"k": K, "floor": FLOORS.get(dtype, 0.0), "scale_floor": SCALE_FLOORS.get(dtype, 0.0),
             "draws": n_draws, "modules": mods,
             "router_noise": {g: float(f"{v:.4g}") for g, v in m.noise.items()},
             "propagated": {"logits": {k: float(f"{v:.4g}") if isinstance(v, float) else v
                                       for k, v in lst.items()}},
             "flips": m.flips}
    if m.logits_forced and not m.unforced and len(m.logits_forced) == len(m.logits):
        fst = _summary(m.logits_forced)
        fst["budget"] = budget(fst, dtype, ceiling)
        entry["propagated"]["logits_forced"] = _rounded(fst)
    if n_gen:
        entry["generation"] = _rounded({"logprob_diff": _summary(m.gen_lp), "mismatch_gaps": sorted(m.tie_gaps)})
    return entry


def _generation_errors(reference_model, model, ids, n: int, ref_gens: dict, draw: int) -> tuple[float, list[float]]:
    """(max |logprob diff| of agreeing greedy tokens, reference gaps at mismatching tokens) of the
    dtype model's greedy generation against the reference's on one draw."""
    from harness.anatomy.capture import greedy

    ref = ref_gens.get(draw)
    if ref is None:
        ref = ref_gens[draw] = greedy(reference_model, ids, n)
    got = greedy(model, ids, n)
    lp, gaps = 0.0, []
    for b in range(ref["tokens"].shape[0]):
        for t in range(n):
            if got["tokens"][b, t] == ref["tokens"][b, t]:
                lp = max(lp, abs(got["logprobs"][b, t].item() - ref["logprobs"][b, t].item()))
                continue
            hit = (ref["top_ids"][b, t] == got["tokens"][b, t]).nonzero()
            gaps.append((ref["logprobs"][b, t] - ref["top_logprobs"][b, t, hit[0, 0]]).item() if len(hit) else math.inf)
            break
    return lp, gaps
