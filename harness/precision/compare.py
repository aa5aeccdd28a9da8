"""Error metrics between a target tensor and its reference, and the per-module comparison of a
target run with a golden.

For each float tensor pair (target ``a``, reference ``r``, both taken to float64):

* ``max_abs_err``  max |a - r|
* ``max_rel_err``  max |a - r| / max(|r|, 1e-6 * max|r|)  (the floor keeps exact zeros finite)
* ``cosine``       <a, r> / (|a| |r|)
* ``rel_rmse``     |a - r| / |r|  (L2 norms: the RMS error relative to the RMS of the reference)
* ``within_1e3``   share of elements whose relative error (as in max_rel_err) is <= 1e-3
* ``scale_err``    <a - r, r> / <r, r>: the part of the error along the reference itself, i.e. the
                   target's overall scale error (0.01 for a 1% scale). Rounding noise is uncorrelated
                   with r, so it contributes only ~rel_rmse / sqrt(numel); a systematic fault (a
                   residual scale, a wrong SiLU slope) shows up here far above the noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

METRIC_KEYS = ("max_abs_err", "max_rel_err", "cosine", "rel_rmse", "within_1e3", "scale_err")


def _raw(a: torch.Tensor, r: torch.Tensor) -> list[float]:
    """One pass of torch ops and a single host sync: [max|d|, max rel, <a,r>, |a|, |r|, |d|, within]."""
    a = a.reshape(-1).double()
    r = r.reshape(-1).double()
    d = a - r
    ad = d.abs()
    ar = r.abs()
    rel = ad / torch.maximum(ar, ar.max() * 1e-6)
    norm = torch.linalg.vector_norm
    return torch.stack([ad.max(), rel.max(), torch.dot(a, r), norm(a), norm(r), norm(d),
                        torch.count_nonzero(rel <= 1e-3).double()]).tolist()


def tensor_metrics(a: torch.Tensor, r: torch.Tensor) -> dict[str, float]:
    n = a.numel()
    if n == 0:
        return dict(zip(METRIC_KEYS, (0.0, 0.0, 1.0, 0.0, 1.0, 0.0), strict=True))
    max_abs, max_rel, dot, an, rn, dn, within = _raw(a, r)
    if not math.isfinite(max_abs) or not math.isfinite(an):  # non-finite target output
        return dict(zip(METRIC_KEYS, (math.inf, math.inf, -1.0, math.inf, 0.0, math.inf), strict=True))
    if rn == 0.0:  # all-zero reference: relative measures fall back to absolute ones
        return dict(zip(METRIC_KEYS, (max_abs, max_abs, 1.0 if an == 0.0 else 0.0, dn,
                                      1.0 if max_abs == 0.0 else 0.0, 0.0), strict=True))
    cos = dot / (an * rn) if an > 0 else 0.0
    return {"max_abs_err": max_abs, "max_rel_err": max_rel if math.isfinite(max_rel) else math.inf,
            "cosine": cos, "rel_rmse": dn / rn, "within_1e3": within / n, "scale_err": dot / (rn * rn) - 1.0}


@dataclass
class ModuleResult:
    module: str
    metrics: dict[str, float]
    ok: bool
    reason: str = ""  # why not ok
    budget: float | None = None  # the rel_rmse it was held to
    enforced: bool = True  # propagated rows of modules that have an isolated row are reported only
    excluded_tokens: int = 0  # tokens left out after a legitimate routing flip
    scale_budget: float | None = None  # the |scale_err| it was held to (isolated rows)
    signed: object = None  # [harness.precision.signed.Signed] (offset, scale) of isolated rows with a clean measurement


@dataclass
class Comparison:
    rows: list[ModuleResult] = field(default_factory=list)
    logits: dict[str, float] = field(default_factory=dict)
    expert_agreement: dict[str, float] = field(default_factory=dict)  # router -> share of equal choices
    generation: dict[str, float] = field(default_factory=dict)
    generation_failure: str | None = None
    problems: list[str] = field(default_factory=list)  # structural: missing modules, shape changes
    isolated: list[ModuleResult] = field(default_factory=list)  # each module on the golden's inputs
    routing_flips: int = 0  # tokens left out of isolated comparisons after a legitimate (near-tie) flip
    wide_flips: list[str] = field(default_factory=list)

    @property
    def failing(self) -> list[ModuleResult]:
        """Enforced rows over budget, in execution order: isolated rows first (they localize), then
        propagated rows of modules without an isolated comparison (and the logits)."""
        return [r for r in self.isolated if not r.ok] + [r for r in self.rows if not r.ok and r.enforced]

    @property
    def first_divergent(self) -> ModuleResult | None:
        f = self.failing
        return f[0] if f else None

    @property
    def ok(self) -> bool:
        return not self.problems and not self.failing and self.generation_failure is None


def _target_view(golden, name: str, t: torch.Tensor) -> torch.Tensor:
    idx = golden.indices.get(name)
    return t.reshape(-1)[idx] if idx is not None else t


def compare_modules(golden, outputs: dict[str, torch.Tensor], tol: dict, enforce=None,
                    logits_budget: float | None = None) -> Comparison:
    """Every captured tensor of the golden, in execution order, against the target's (propagated:
    the whole model ran in the target dtype). ``enforce``: names whose row decides the verdict
    (None: all; with an isolated comparison, only modules that have no isolated row - propagated
    errors of MoE models include legitimate routing flips, measured up to 0.047 rel_rmse on
    kimi-k2's bf16 logits, so they are reported, and greedy generation stays the end-to-end
    verdict); ``logits_budget``: the logits' measured budget (else the tolerance)."""
    res = Comparison()
    cos_tol = tol["min_cosine"]
    shapes = golden.manifest["tensors"]
    for name in golden.order:
        ref = golden.modules[name]
        got = outputs.get(name)
        if got is None:
            res.problems.append(f"module {name} is in the golden but the target did not produce it")
            continue
        if list(got.shape) != shapes[name]["shape"]:
            res.problems.append(f"module {name}: shape {list(got.shape)} != golden {shapes[name]['shape']}")
            continue
        got = _target_view(golden, name, got)
        if not ref.is_floating_point():
            res.expert_agreement[name] = (got.to(ref.dtype) == ref).double().mean().item()
            continue
        m = tensor_metrics(got, ref)
        reasons = []
        rel_tol = logits_budget if name == "logits" and logits_budget is not None else tol["rel_rmse"]
        if not m["rel_rmse"] <= rel_tol:
            reasons.append(f"rel_rmse {m['rel_rmse']:.3g} > {rel_tol:.3g}")
        if not m["cosine"] >= cos_tol:
            reasons.append(f"cosine {m['cosine']:.6g} < {cos_tol:.6g}")
        if name == "logits":
            res.logits = dict(m)
            if tol.get("max_abs_err") is not None and not m["max_abs_err"] <= tol["max_abs_err"]:
                reasons.append(f"max_abs_err {m['max_abs_err']:.3g} > {tol['max_abs_err']:.3g}")
            if tol.get("min_within_1e3") is not None and not m["within_1e3"] >= tol["min_within_1e3"]:
                reasons.append(f"within_1e3 {m['within_1e3']:.3g} < {tol['min_within_1e3']:.3g}")
            if name not in golden.indices:
                res.logits["top1_agreement"] = (got.argmax(-1) == ref.argmax(-1)).double().mean().item()
        res.rows.append(ModuleResult(name, m, not reasons, "; ".join(reasons), budget=rel_tol,
                                     enforced=enforce is None or name in enforce))
    return res


def compare_isolated(golden, replayed, tol: dict, budgets: dict[str, float], router_limits: dict[str, float],
                     res: Comparison, scale_budgets: dict[str, float] | None = None, judge=None,
                     signed: dict[str, torch.Tensor] | None = None, dtype: str = "") -> None:
    """Each module's isolated output (``replayed``: the target module on the golden's inputs) against
    the golden, held to its own budget; tokens whose routing flipped at a margin within the router
    noise (``router_limits``) are left out and counted, flips at wider margins fail the module.
    ``signed``: the clean rows per kind and module (the golden's ``signed_error`` section in this dtype,
    ``signed.clean_rows``): a module whose row offsets or row scales depart from them beyond chance and
    the effect floor is biased (harness.precision.signed), whatever its size."""
    from harness.precision import signed as sg
    from harness.precision.isolate import keep_tokens, routing_mask

    signed = signed or {}
    for name in golden.order:
        got = replayed.outputs.get(name)
        ref = golden.modules.get(name)
        if got is None or ref is None or not ref.is_floating_point() or name in golden.indices:
            continue
        if list(got.shape) != list(ref.shape):
            res.problems.append(f"module {name} (isolated): shape {list(got.shape)} != golden {list(ref.shape)}")
            continue
        keep, legit, wide = routing_mask(name, replayed, golden.modules, router_limits, judge)
        res.routing_flips += legit
        res.wide_flips.extend(w for w in wide if w not in res.wide_flips)
        m = tensor_metrics(keep_tokens(got, keep), keep_tokens(ref, keep))
        b = budgets.get(name, tol["rel_rmse"])
        sb = (scale_budgets or {}).get(name)
        reasons = []
        if not m["rel_rmse"] <= b:
            reasons.append(f"isolated rel_rmse {m['rel_rmse']:.3g} > budget {b:.3g}")
        if sb is not None and not abs(m["scale_err"]) <= sb:
            reasons.append(f"isolated scale error {m['scale_err']:+.3g} beyond budget {sb:.3g}")
        if not m["cosine"] >= tol["min_cosine"]:
            reasons.append(f"isolated cosine {m['cosine']:.6g} < {tol['min_cosine']:.6g}")
        reasons.extend(wide)
        excluded = int((~keep).sum()) if keep is not None else 0
        # the sign tests need every row: with tokens left out after a routing flip they are not made
        bias, why = sg.judge(name, got, ref, signed, dtype) if not excluded else ([], None)
        if why:
            reasons.append(why)
        res.isolated.append(ModuleResult(name, m, not reasons, "; ".join(reasons), budget=b,
                                         excluded_tokens=excluded, scale_budget=sb, signed=bias or None))


def compare_generation(golden, gen: dict[str, torch.Tensor], tol: dict, res: Comparison) -> None:
    """Greedy tokens: equal, or different only where the reference's candidates were near-tied
    (the reference's logprob gap between its token and the target's is <= tie_margin); after a
    (tolerated) divergence the rest of that sequence is conditioned on other tokens and not compared.
    Logprobs of agreeing tokens must be within logprob_atol."""
    ref = golden.generation
    if not ref or ref["tokens"].shape[1] == 0:
        return
    rt, rl, rti, rtl = ref["tokens"], ref["logprobs"], ref["top_ids"], ref["top_logprobs"]
    tt, tl = gen["tokens"].cpu(), gen["logprobs"].cpu().double()
    n_b, n_t = rt.shape
    agree, compared, lp_diff, ties = 0, 0, 0.0, 0
    for b in range(n_b):
        for t in range(n_t):
            compared += 1
            if tt[b, t] == rt[b, t]:
                agree += 1
                d = abs(tl[b, t].item() - rl[b, t].item())
                # NaN fails: max(x, nan) would keep x and let an all-NaN target pass
                lp_diff = d if not math.isfinite(d) else max(lp_diff, d)
                if not math.isfinite(d):
                    break
                continue
            if not math.isfinite(tl[b, t].item()):
                lp_diff = math.nan  # a NaN/inf logprob is never a near tie
                break
            hit = (rti[b, t] == tt[b, t]).nonzero()
            gap = (rl[b, t] - rtl[b, t, hit[0, 0]]).item() if len(hit) else math.inf
            if gap <= tol["tie_margin"]:
                ties += 1
            elif res.generation_failure is None:
                why = (f"reference logprob gap {gap:.3g} > tie_margin {tol['tie_margin']:.3g}" if len(hit) else
                       f"not among the reference's top {rti.shape[-1]} candidates")
                res.generation_failure = (
                    f"greedy token {t} of sequence {b}: target {tt[b, t].item()} vs reference {rt[b, t].item()} ({why})")
            compared += n_t - 1 - t
            break
    res.generation = {"top1_agreement": agree / max(compared, 1), "logprob_max_abs_diff": lp_diff,
                      "near_tie_mismatches": float(ties)}
    if not lp_diff <= tol["logprob_atol"] and res.generation_failure is None:
        res.generation_failure = (f"greedy-token logprobs differ by {lp_diff:.3g} > logprob_atol "
                                  f"{tol['logprob_atol']:.3g}" + (" (non-finite target logprob)"
                                                                   if not math.isfinite(lp_diff) else ""))
