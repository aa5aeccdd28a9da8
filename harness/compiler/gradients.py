"""The compiled backward against the golden's training section (the compile check's ``gradients``
step): one forward + backward of the LM loss (the training check's, on the golden's ids) through a
fresh compile of the model, every parameter's gradient at the golden's sketch indices against the
float64 reference under the training check's measured budgets, and the eager backward beside it (so
a compiled-only divergence says so). MoE routers are forced to the golden's choices and left out of
the graph (a near-tie flip is no compiler fault)."""

from __future__ import annotations

import contextlib
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

from harness.compiler import dynamo as dyn
from harness.compiler.numerics import routed
from harness.precision import backward as bw
from harness.precision import signed


class GradRow(NamedTuple):
    name: str  # the parameter
    compiled: float  # rel_rmse of the compiled gradient at the sketch indices against the golden's
    eager: float  # the same of the eager gradient
    budget: float | None  # grad_k x the training check's budget; None: not resolvable in the dtype


@dataclass
class BackwardReference:
    """What the comparison needs of the golden's training section and the model."""

    tensors: dict[str, torch.Tensor]  # the section's (pidx/, pgrad/, route/, labels)
    budgets: dict  # the section's clean maxima in the dtype
    order: list[str]  # the modules in the golden's backward order
    idx: dict[str, torch.Tensor]  # parameter -> its sketch indices
    routes: dict[str, torch.Tensor]  # router -> the golden's choices
    ids: torch.Tensor
    params: dict[str, torch.nn.Parameter]
    names: list[str]  # the sketched parameters the model has and trains


def reference(g, suite, dtype: str, model: torch.nn.Module, device) -> tuple[BackwardReference | None, str | None]:
    """The comparison's reference from the golden ``g``; (None, why) where there is none to compare
    against (why None: the training check is off)."""
    from harness.golden.store import GoldenError

    spec = bw.spec(suite)
    try:
        sec = g.section(bw.SECTION, spec) if spec is not None else None
    except GoldenError as e:
        return None, f"no compiled-backward comparison: {e}"
    clean = (sec.entry.get("budgets") or {}).get(dtype) if sec is not None else None
    if not clean:
        why = f"the golden's training section has no {dtype} budgets: no compiled backward" if sec is not None else None
        return None, why
    t = sec.tensors
    idx = {n: t[f"pidx/{n}"] for n in sec.entry["params"]}
    params = dict(model.named_parameters())
    return BackwardReference(
        tensors=t, budgets=clean, order=sec.entry.get("backward_order") or [], idx=idx,
        routes={r: t[f"route/{r}"] for r in sec.entry.get("routers", [])}, ids=t["labels"].to(device),
        params=params, names=[n for n in idx if n in params and params[n].requires_grad]), None


def param_grads(ref: BackwardReference, model) -> dict[str, torch.Tensor]:
    """The LM loss's gradient of each compared parameter (zeros where unused), on the CPU."""
    with torch.enable_grad():
        loss = bw.lm_loss(model, ref.ids)
        gs = torch.autograd.grad(loss, [ref.params[n] for n in ref.names], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(ref.params[n])).detach().cpu()
            for n, g in zip(ref.names, gs, strict=True)}


def eager_grads(ref: BackwardReference, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with routed(model, ref.routes):
        return param_grads(ref, model)


class Compiled(NamedTuple):
    grads: dict[str, torch.Tensor]  # parameter -> its gradient through the compiled model
    breaks: Counter  # the graph breaks of that compile, by dynamo's whole reason


def compiled_grads(ref: BackwardReference, model: torch.nn.Module, compile_kw: dict,
                   emulate: bool = False) -> Compiled:
    """The gradients of a fresh compile of ``model`` (``emulate``: with inductor's precision casts), and
    the graph breaks of that compile (a forced router is one by design; ``graph_breaks``)."""
    with routed(model, ref.routes), dyn.fresh():
        before = dyn.break_reasons()
        with dyn.emulated_precision() if emulate else contextlib.nullcontext():
            grads = param_grads(ref, dyn.compile_module(model, **compile_kw))
        return Compiled(grads, dyn.break_reasons() - before)


def graph_breaks(breaks: Counter, forward_breaks: int | None) -> tuple[str | None, str | None]:
    """(detail, note) on the gradients step's graph breaks. A forced router is kept out of the graph by
    design (its wrapper is named ``FORCED_MARK``): its backward is eager's, and that is said. Breaks
    elsewhere, beyond the forward's own (``forward_breaks``, which the ``breaks`` step judges), mean that
    more of the model ran outside the compiled graph here than the forward step saw: the note says the
    compiled backward was not compared there. (Until 2026-12-07 every module with an instance forward was
    kept out with the routers, and nothing said so.)"""
    from harness.precision.routing import FORCED_MARK

    routers = sum(n for r, n in breaks.items() if FORCED_MARK in r)
    # dynamo counts a break each time it traces past one (a restarted frame again): say how many routers
    names = {m for r in breaks for m in re.findall(re.escape(FORCED_MARK) + r"\[([^\]]+)\]", r)}
    other = Counter({dyn.first(r) + _skipped(r): n for r, n in breaks.items() if FORCED_MARK not in r})
    n_other = sum(other.values())
    if not routers and not n_other:
        return None, None
    said = []
    if routers:
        at = f"the {len(names)} forced router(s)" if names else "the forced routers"
        said.append(f"{routers} at {at} (kept out of the graph by design: their backward is eager's)")
    if n_other:
        said.append(f"{n_other} elsewhere (" + "; ".join(f"{n} x {r}" for r, n in other.most_common(3)) + ")")
    detail = f"{routers + n_other} graph break(s) in the compiled forward and backward: " + ", ".join(said)
    note = None
    if n_other > (forward_breaks or 0):
        reason, _ = other.most_common(1)[0]
        note = (f"compile: the gradients step's compile broke the graph {n_other} time(s) outside the forced "
                f"routers, the forward's compile {forward_breaks or 0} (first: {reason}): what a break skips ran "
                "eagerly there, and its compiled backward was not compared")
    return detail, note


def _skipped(reason: str) -> str:
    """The function a "Skip calling ..." break names (dynamo's second line), else nothing."""
    m = re.search(r"Skip calling function `<function (\S+)", reason)
    return f" ({m.group(1)})" if m else ""


def rows(ref: BackwardReference, compiled: dict, eager: dict, dtype: str, k: float, grad_k: float) -> list[GradRow]:
    """Per parameter: compiled and eager errors at the sketch indices, and the budget they are held to."""
    out = []
    for n in ref.names:
        golden, at = ref.tensors[f"pgrad/{n}"], ref.idx[n]
        b = bw.budget(ref.budgets.get("param", {}).get(n, math.inf), dtype, k)
        b = None if b is None else grad_k * b
        out.append(GradRow(n, bw.rel_rmse(bw.at(compiled[n], at), golden), bw.rel_rmse(bw.at(eager[n], at), golden), b))
    return out


def over_budget(rs: list[GradRow]) -> list[GradRow]:
    return [r for r in rs if r.budget is not None and not r.compiled <= r.budget]


def owner(name: str, order: list[str]) -> int:
    """The index in the golden's backward order of the innermost module holding parameter ``name``
    (len(order) where none does)."""
    owners = [i for i, m in enumerate(order) if name.startswith(m + ".")]
    return max(owners, key=lambda i: len(order[i])) if owners else len(order)


def in_backward_order(bad: list, order: list[str]) -> list:
    """``bad`` (GradRow or SignedRow) walking backward (the golden's backward order): where a wrong
    backward kernel is met first; parameters upstream of it inherit its error (the embedding last)."""
    return sorted(bad, key=lambda row: owner(row.name, order))


# --- the direction beside the size: compiled against eager (the clean run of this backend and dtype) ---
# A backward kernel 1 % high in bfloat16 moves every gradient upstream of it by 1 %, far inside the
# budget (grad_k x the training check's, measured on eager draws); its direction does not average out:
# every row of those gradients is scaled the same way. Eager on the same backend and dtype is the
# clean run, so the clean signed difference is 0 (harness.precision.signed.tensor_tests).
class SignedRow(NamedTuple):
    name: str  # the parameter
    test: signed.OneSigned  # its failing sign test
    use: float | None  # its compiled gradient's magnitude budget use (None: no budget in the dtype)


def signed_tests(ref: BackwardReference, compiled: dict, eager: dict) -> dict[str, list[signed.OneSigned]]:
    """Per parameter with something to test, the scale and offset sign tests of its compiled gradient
    against eager's (the whole gradient, not the sketch: rows are the test's samples)."""
    return {n: t for n in ref.names if (t := signed.tensor_tests(compiled[n], eager[n]))}


def one_signed(tests: dict[str, list[signed.OneSigned]], rs: list[GradRow], dtype: str) -> list[SignedRow]:
    """The parameters whose compiled gradient is one-signed against eager: a test below ALPHA / every
    test made (Bonferroni over the item's gradients) with an effect above the dtype's floor."""
    made, use = sum(map(len, tests.values())), {r.name: r.compiled / r.budget if r.budget else None for r in rs}
    return [SignedRow(n, bad, use.get(n)) for n, ts in tests.items()
            if (bad := signed.failing(ts, dtype, made, signed.GRAD_FLOORS)) is not None]


def signed_figures(tests: dict[str, list[signed.OneSigned]]) -> dict[str, float]:
    """The smallest p, and the largest effect of a test significant at the item's limit (the figure the
    floor judges: a failure above it; 0 where none is - a noisy row mean's large effect at p 0.1 says
    nothing)."""
    flat = [t for ts in tests.values() for t in ts]
    if not flat:
        return {}
    return {"compile_grad_signed_min_p": min(t.p for t in flat),
            "compile_grad_signed_max_effect": max((abs(t.effect) for t in signed.significant(flat, len(flat))),
                                                  default=0.0)}


def signed_failure(bad: list[SignedRow], tests: dict, dtype: str, order: list[str]) -> tuple[str, dict]:
    """The compiled backward's one-signed failure: the module of the first parameter met walking
    backward (``bad`` in that order) leads, as the forward's bisected region does."""
    n, t, use = bad[0]
    i = owner(n, order)
    module = order[i] if i < len(order) else n.rpartition(".")[0] or n
    limit = signed.ALPHA / max(sum(map(len, tests.values())), 1)
    inside = "" if use is None else f" ({use:.2g} of it)"
    table = "\n".join(f"  {r.name}: {r.test.words()}" + ("" if r.use is None else f", budget use {r.use:.2g}")
                      for r in bad[:40])
    return (f"{module}: compiled backward against eager: gradient of {n}: {t.words()}, inside the magnitude "
            f"budget{inside}; first of {len(bad)} parameter(s)",
            dict(metric="compile_grad_signed_min_p",
                 expected=f">= {limit:.2g} or |effect| <= {signed.GRAD_FLOORS.get(dtype, 0.0):.2g}",
                 observed=f"p={t.p:.2g}, effect {t.effect:+.3g}", tolerance=limit,
                 details="parameter gradients one-signed against eager (sign tests over rows):\n" + table))


# --- toward the truth: eager's own one-signed rounding, which the compiled arithmetic skips ---------------
# In half precision eager rounds every op's output, and a value shared by many rows (a norm's scale, a
# router score, an upstream gradient) rounded once more or less moves every row downstream the same way.
# Measured (Llama-4-Scout bf16, aot_eager front end, routers forced): eager's layer-0/1 attention
# gradients are one-signed against the same weights' float32 backward by -0.9 to -1.2 % (p to 1e-53),
# the compiled ones by -0.6 to -0.8 %, so compiled against eager read +0.24 to +0.39 %: above the bf16
# floor (2^-9) and a false alarm, while the compiled gradient is the *closer* to the truth. A fault moves
# the compiled gradient away from it, or past it by more than eager's own error. (What this gives up: a
# compiled-only error that lands nearer the truth than eager's rounding did, i.e. one that leaves the
# compiled gradient more exact than eager's.)
class TowardTruth(NamedTuple):
    row: SignedRow  # compiled against eager: one-signed
    eager: signed.OneSigned  # eager against the float32 backward, the same kind of test
    compiled: signed.OneSigned  # compiled against the float32 backward


def truth_grads(ref: BackwardReference, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Eager's gradients of the same weights in float32 (each floating parameter upcast in place and its
    own tensor put back after: nothing is rounded twice), routers forced as the check runs them."""
    params = [p for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.float()
        with routed(model, ref.routes):
            return param_grads(ref, model)
    finally:
        for p, d in zip(params, saved, strict=True):
            p.data = d


def toward_truth(one: list[SignedRow], compiled: dict, eager: dict, truth: dict
                 ) -> tuple[list[SignedRow], list[TowardTruth]]:
    """``one`` split into (still failing, explained). A compiled gradient one-signed against eager is
    explained where eager itself is one-signed against the float32 backward (the same kind of test, below
    ALPHA), the compiled one moved from eager toward it, and it is no farther from it than eager is (the
    same test's effect, compiled against float32): the compiled arithmetic is the more exact. A
    compiled-only fault moves the gradient away from the truth (a 1 % fault with eager exact), or past it
    by more than eager's own error. What keeps a fault from being explained is that magnitude condition: with
    eager's error only noise (no direction) its effect is tiny, and a fault must stay within it. The p-value
    only asks that eager's direction be real, so it is ALPHA, not the item's ALPHA / every test made, nor
    ALPHA / the gradients asked about (until 2026-12-07): a norm's weight vector of 128 rows, eager 1 % low as
    on Llama-4-Scout, reads p=5.9e-5 against float32, and that limit (2e-5 for 5 gradients) failed it."""
    limit = signed.ALPHA
    failing, explained = [], []
    for r in one:
        kind = r.test.kind
        e = {t.kind: t for t in signed.tensor_tests(eager[r.name], truth[r.name])}.get(kind)
        c = {t.kind: t for t in signed.tensor_tests(compiled[r.name], truth[r.name])}.get(kind)
        if (e is not None and c is not None and e.p < limit and e.effect * r.test.effect < 0
                and abs(c.effect) <= abs(e.effect)):
            explained.append(TowardTruth(r, e, c))
        else:
            failing.append(r)
    return failing, explained


def toward_truth_text(explained: list[TowardTruth]) -> str:
    r, e, c = explained[0]
    return (f"{len(explained)} parameter gradient(s) one-signed against eager, each closer than eager's to the "
            f"same weights' float32 backward (first {r.name}: compiled against eager {r.test.effect:+.2%}, eager "
            f"against float32 {e.effect:+.2%} (sign test p={e.p:.2g}), compiled against float32 {c.effect:+.2%}): "
            "eager's own rounding in this dtype, which the compiled arithmetic skips; not a compiler fault")


def precision_casts_text(bad: list[GradRow], one: list[SignedRow] = ()) -> str:
    """What is said where every over-budget (``bad``) and one-signed (``one``) gradient is within budget
    and without direction with inductor's precision casts."""
    said = []
    if bad:
        worst = max(bad, key=lambda r: r.compiled / r.budget)
        said.append(f"{len(bad)} parameter gradient(s) over budget (worst {worst.name}: {worst.compiled:.3g} > "
                    f"{worst.budget:.3g})")
    if one:
        said.append(f"{len(one)} one-signed against eager (first {one[0].name}: {one[0].test.words()})")
    return (f"{' and '.join(said)} under inductor's default precision, all within budget and without direction "
            "with emulate_precision_casts (the roundings eager does between fused ops)")


def table(bad: list[GradRow]) -> str:
    return "\n".join(f"  {r.name}: compiled {r.compiled:.3g}, eager {r.eager:.3g}, budget "
                     + ("not resolvable" if r.budget is None else f"{r.budget:.3g}") for r in bad[:40])


def failure(bad: list[GradRow]) -> tuple[str, dict]:
    """The compiled backward's failure: the first gradient met walking backward (``bad`` in that order)."""
    n, err, e_err, b = bad[0]
    who = "while eager's agrees" if e_err <= b else f"and eager's too ({e_err:.3g})"
    return (f"compiled backward diverges from the golden: gradient of {n} rel_rmse {err:.3g} > budget {b:.3g} "
            f"{who}; first of {len(bad)} parameter(s)",
            dict(metric="compile_grad_worst_budget_use", expected=f"<= {b:.3g}", observed=f"{err:.4g}", tolerance=b,
                 details="parameter gradients over budget (rel_rmse at the golden's sketch indices):\n" + table(bad)))


def with_precision_casts(ref: BackwardReference, model: torch.nn.Module, compile_kw: dict, eager: dict,
                         bad: list[GradRow], one: list[SignedRow], dtype: str, k: float,
                         grad_k: float) -> tuple[tuple[list[GradRow], dict] | None, str | None]:
    """Inductor fuses and skips the low-precision roundings eager does between ops (its
    emulate_precision_casts is off by default): a different, legitimate arithmetic whose error the
    budgets (measured on eager draws) do not model. Measured: DeepSeek-V4-Flash's attn_hc.base
    gradient, bfloat16, 1.12 x its budget, 0.80 x with the casts emulated. A kernel fault stays over
    budget (and one-signed) either way; only a divergence that the emulation removes is explained (and
    said), never silently passed. Returns the rows and the gradients with the casts emulated and what to
    say where that explains ``bad`` and ``one``, else (None, None)."""
    grads = compiled_grads(ref, model, compile_kw, emulate=True).grads
    emulated = rows(ref, grads, eager, dtype, k, grad_k)
    if over_budget(emulated) or one_signed(signed_tests(ref, grads, eager), emulated, dtype):
        return None, None
    return (emulated, grads), precision_casts_text(bad, one)
