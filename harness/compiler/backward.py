"""The compile check's ``gradients`` step as one library call: the compiled backward's parameter
gradients against the golden's training section (harness/compiler/gradients.py), with the eager
backward beside them; harness/checks/compile.py records what comes back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from harness.compiler import dynamo as dyn
from harness.messages import first_line


@dataclass
class Backward:
    rows: list = field(default_factory=list)  # gradients.GradRow per sketched parameter
    signed: dict = field(default_factory=dict)  # parameter -> its sign tests against eager (gradients.signed_tests)
    seconds: float | None = None  # the first compiled forward + backward (its compile)
    notes: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)
    failure: tuple[str, dict] | None = None  # message and fields of the first diverging gradient

    def figures(self) -> dict[str, float]:
        """The worst gradient's budget use, compiled and eager, and the backward's compile time (none
        where no gradient was judged)."""
        judged = [r for r in self.rows if r.budget]
        if not judged:
            return {}
        from harness.compiler.gradients import signed_figures

        return {"compile_grad_worst_budget_use": max(r.compiled / r.budget for r in judged),
                "compile_grad_vs_eager_worst_budget_use": max(r.eager / r.budget for r in judged),
                "compile_backward_time_s": self.seconds} | signed_figures(self.signed)


def judge(g, suite, dtype: str, model, device, compile_kw: dict, compiler: str, grad_k: float,
          forward_breaks: int | None = None) -> Backward:
    """One compiled forward + backward of the LM loss against the golden's sketches under grad_k x the
    training check's budgets. In half precision, a compiler that can emulate eager's rounding
    (``dyn.can_emulate_precision``) gets a second try with precision casts before anything fails, and a
    gradient one-signed against eager is then held against the same weights' float32 backward: where it
    is closer than eager's to that, eager's rounding is the one-signed one (gradients.toward_truth).
    ``forward_breaks``: the forward compile's graph breaks; more elsewhere than the forced routers here
    are said (gradients.graph_breaks)."""
    # deferred, as the backward's library is: only an item that compares gradients loads it
    from harness.compiler import gradients as grd

    out = Backward()
    ref, why = grd.reference(g, suite, dtype, model, device)
    if ref is None:
        if why:
            out.notes.append(f"compile: {why}")
        return out
    eager = grd.eager_grads(ref, model)
    k = suite.suite.checks.training.budget_k
    t0 = time.perf_counter()
    compiled, breaks = grd.compiled_grads(ref, model, compile_kw)
    out.seconds = time.perf_counter() - t0
    detail, note = grd.graph_breaks(breaks, forward_breaks)
    if detail:
        out.details["compile_grad_graph_breaks"] = detail
    if note:
        out.notes.append(note)
    out.rows = grd.rows(ref, compiled, eager, dtype, k, grad_k)
    # the direction beside the size: each gradient against eager's (the clean run), a one-signed error
    # well inside the budget fails too
    out.signed = grd.signed_tests(ref, compiled, eager)
    bad, one = grd.over_budget(out.rows), grd.one_signed(out.signed, out.rows, dtype)
    if (bad or one) and dtype in ("bfloat16", "float16") and dyn.can_emulate_precision(compiler):
        emulated, text = grd.with_precision_casts(ref, model, compile_kw, eager, bad, one, dtype, k, grad_k)
        if emulated is not None:
            out.details["compile_grad_precision_casts"] = text
            out.notes.append(f"compile: {text}")
            (out.rows, grads), bad, one = emulated, [], []
            out.signed = grd.signed_tests(ref, grads, eager)
    if one and not bad and dtype in ("bfloat16", "float16"):
        # is eager the one that is one-signed, against the same weights' float32 backward?
        try:
            truth = grd.truth_grads(ref, model)
        except Exception as e:  # noqa: BLE001 - harness's own diagnostic: a model that runs in its dtype only
            # (a vendor's kernel without float32) keeps the finding it had, and says why it was not explained
            truth = None
            out.notes.append(f"compile: the same weights' float32 backward (to tell eager's own rounding from the "
                             f"compiler's) could not run: {type(e).__name__}: {first_line(e)}")
        one, explained = grd.toward_truth(one, compiled, eager, truth) if truth is not None else (one, [])
        if explained:
            text = grd.toward_truth_text(explained)
            out.details["compile_grad_toward_float32"] = text
            out.notes.append(f"compile: {text}")
    if bad:
        out.failure = grd.failure(grd.in_backward_order(bad, ref.order))
    elif one:
        out.failure = grd.signed_failure(grd.in_backward_order(one, ref.order), out.signed, dtype, ref.order)
    return out
