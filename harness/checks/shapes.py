"""Real-shape op conformance (``shapes``): every operator signature the unpruned model runs, on the
backend at its published shapes, against float64 on the CPU (issue #47 item 1; docs/inspect.md).

The ``ops`` check runs each operator at the pruned model's shapes (hidden 128, 16 tokens), so a
kernel path that only the published widths reach (a split-K tile for K = 14336, head_dim 128's
attention kernel) is never compared there. This check takes the signatures of the full model's meta
trace (:func:`harness.inspect.signatures.suite_signatures`: every distinct operator x shapes x dtypes
x strides x scalar arguments of one forward + backward over ``tokens`` tokens; M is the token count,
K/N/head_dim are the model's), runs each on the backend with seeded N(0, 1) inputs and compares with
the same operator in float64 on the CPU under its own budget
(:func:`harness.inspect.signatures.budget`: ``budget_factor * (u(dtype) + u_acc * sqrt(K))``).

A tensor over ``max_numel`` elements (the 128256 x 4096 embedding) is sliced along its largest
dimension that no kernel reduces over (the vocabulary), the same size everywhere in the signature
(detail ``sliced``); a grouped GEMM keeps its group count (the published expert count) and gets
offsets as the router makes them, and its float64 reference is composed of per-expert float64 mm
(the CPU's ``_grouped_mm`` has no float64). Signatures that cannot run from their shapes alone, or
whose float64 reference refuses the seeded inputs, are left out with the reason; so are those past
``max_signatures`` (matmuls and attention are kept first). Metrics: ``shapes_signatures`` (the model runs),
``shapes_checked``, ``shapes_coverage`` and ``shapes_forward_coverage`` (checked / run).
A failure names the operator, the shape and the model's modules that call it.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import torch
from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, CouldNotRun
from harness.checks.ops import _execute, _Mismatch, compare_outputs, resolve_op

metrics.declare("shapes_signatures", "", "none", "distinct operator signatures one forward+backward of the "
                "unpruned model runs")
metrics.declare("shapes_checked", "", "higher", "signatures compared with float64 at their real shapes")
metrics.declare("shapes_coverage", "", "higher", "signatures checked / signatures the model runs")
metrics.declare("shapes_forward_coverage", "", "higher", "forward signatures checked / forward signatures")
metrics.declare("shapes_worst_budget_ratio", "", "lower", "worst error / budget over the checked signatures")


class ShapesConfig(CheckConfig):
    """Real-shape op conformance: the unpruned model's operator signatures against float64."""

    enabled: bool = Field(False, description="Opt-in: traces the unpruned model and runs its full-size ops.")
    scope: Literal["commit", "nightly"] = Field("nightly", description="Full-size operators take "
                       "about a minute per suite on a CPU: nightly unless the suite says commit.")
    tokens: int = Field(32, ge=1, le=4096, description="Tokens of the traced forward: the M of every GEMM.")
    backward: bool = Field(True, description="Trace and check the backward's signatures too.")
    max_signatures: int = Field(1000, ge=1, le=10**6, description="At most this many signatures (matmuls and attention "
                                "first); the rest are left out and counted in the coverage.")
    max_numel: int = Field(2**26, ge=1024, le=2**28, description="Largest tensor built on the host (elements); a larger "
                           "one is sliced along a dimension no kernel reduces over (the vocabulary).")
    max_numel_other: int = Field(2**22, ge=1024, le=2**28, description="The same for every operator but matmuls "
                                 "and attention (views, pointwise, norms: their kernels do not tile by size).")
    budget_factor: float = Field(8.0, gt=0, description="Safety factor of the per-signature budget "
                                 "factor * (u(dtype) + u_acc * sqrt(reduction length)).")
    seed: int = Field(0, ge=0, description="Seed of the generated inputs.")


class ShapesCheck(Check):
    name = "shapes"
    order = 45
    config_model = ShapesConfig
    description = "the unpruned model's operator signatures at their real shapes against float64"
    headline = ("shapes_coverage", "shapes_worst_budget_ratio")
    steps = ("inventory", "select", "compare", "record")
    setup_steps = ("inventory",)

    def inventory(self, ctx: CheckContext, st) -> None:
        """The full model's signatures (meta trace, cached on disk)."""
        from harness.inspect.signatures import suite_signatures

        st.cfg = ctx.config
        try:
            st.sigs, meta = suite_signatures(ctx.suite, ctx.dtype, tokens=st.cfg.tokens, backward=st.cfg.backward)
        except Exception as e:
            raise CouldNotRun(f"the unpruned model's meta trace failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
        ctx.detail("trace", f"unpruned {meta['model']} on meta, {meta['dtype']}, 1x{meta['tokens']} tokens, "
                   f"{'forward+backward' if meta['backward'] else 'forward'}, {len(st.sigs)} signatures")

    def select(self, ctx: CheckContext, st) -> None:
        """Matmuls and attention first, then the rest in trace order, up to max_signatures."""
        from harness.inspect.signatures import ATTENTION, MATMUL

        ranked = sorted(st.sigs, key=lambda s: 0 if s.op in MATMUL or s.op.startswith(ATTENTION) else 1)
        st.todo, st.left = ranked[:st.cfg.max_signatures], Counter()
        if len(ranked) > len(st.todo):
            st.left["over max_signatures"] = len(ranked) - len(st.todo)
        st.checked, st.failures, st.sliced, st.notes, st.worst = [], [], [], set(), 0.0

    def compare(self, ctx: CheckContext, st) -> None:
        for sig in st.todo:
            why = self._one(ctx, st, sig)
            if why:
                st.left[why] += 1
            else:
                st.checked.append(sig)

    def record(self, ctx: CheckContext, st) -> None:
        n, fw = len(st.sigs), [s for s in st.sigs if s.forward]
        ctx.metric("shapes_signatures", n)
        ctx.metric("shapes_checked", len(st.checked))
        ctx.metric("shapes_coverage", len(st.checked) / n if n else 0.0)
        ctx.metric("shapes_forward_coverage", sum(1 for s in st.checked if s.forward) / len(fw) if fw else 0.0)
        ctx.metric("shapes_worst_budget_ratio", st.worst)
        ctx.tolerance("shapes_worst_budget_ratio", 1.0)
        if st.left:
            ctx.detail("left_out", "; ".join(f"{k}: {v}" for k, v in st.left.most_common()))
        if st.sliced:
            ctx.detail("sliced", "; ".join(st.sliced))
        ctx.notes.extend(sorted(st.notes))
        if st.failures:
            worst = max(st.failures, key=lambda f: f[0])
            raise CheckFailure(worst[1] + (f" (and {len(st.failures) - 1} more signature(s))"
                                           if len(st.failures) > 1 else ""),
                               metric="shapes_worst_budget_ratio", expected="<= 1", observed=f"{worst[0]:.4g}",
                               details="\n".join(f[1] for f in sorted(st.failures, key=lambda f: -f[0])))

    def _one(self, ctx: CheckContext, st, sig) -> str | None:
        """Compare one signature; returns why it was left out, or None when it was compared."""
        from harness.inspect.signatures import (
            ATTENTION,
            GROUPED,
            MATMUL,
            budget,
            grouped_mm_reference,
            make_inputs,
            resized,
            shrink,
        )

        gemm = sig.op in MATMUL or sig.op.startswith(ATTENTION)
        plan = shrink(sig, st.cfg.max_numel if gemm else min(st.cfg.max_numel, st.cfg.max_numel_other))
        if plan is None:
            return "too large for the host (only a reduction dimension to slice)"
        args, kwargs = resized(sig, plan)
        if plan:
            st.sliced.append(f"{sig.op} " + ", ".join(f"{a}->{b}" for a, b in plan.items()))
        try:
            a, k = make_inputs(args, kwargs, st.cfg.seed, sig.op)
            func = resolve_op(sig.op)
        except (ValueError, AttributeError):
            return "arguments not rebuildable from the signature"
        # an op with no float64 CPU kernel (_grouped_mm) gets one composed of float64 mm: otherwise
        # the backend is compared with the CPU's kernel in its own dtype, and the CPU with itself
        ref_func = grouped_mm_reference if sig.op == GROUPED else func
        try:
            ref, ref_name = _execute(ref_func, a, k, "cpu", torch.float64), "cpu float64"
        except Exception:
            try:
                ref, ref_name = _execute(func, a, k, "cpu"), f"cpu {ctx.dtype}"
            except Exception:
                return "the CPU reference refuses the seeded inputs"
            st.notes.add(f"{sig.op}: no float64 CPU kernel; compared with cpu {ctx.dtype}")
        where = f"{sig.op} at ({sig.shape_text()}) on {ctx.backend.name}"
        who = f"called by {sig.callers()}"
        try:
            out = _execute(func, a, k, ctx.device)
            err = compare_outputs(sig.op, out, ref)
        except _Mismatch as m:
            st.failures.append((float("inf"), f"{where} differs from the {ref_name} reference: {m}; {who}"))
            return None
        except Exception as e:
            st.failures.append((float("inf"), f"{where} raised {type(e).__name__}: "
                                f"{str(e).splitlines()[0][:200] if str(e) else ''}; {who}"))
            return None
        tol = budget(sig, args, st.cfg.budget_factor)
        ratio = err / tol if tol else (0.0 if err == 0 else float("inf"))
        st.worst = max(st.worst, ratio)
        if ratio > 1:
            st.failures.append((ratio, f"{where} is off the {ref_name} reference: error {err:.4g} > budget "
                                f"{tol:.4g}; {who}"))
        return None


def register(registry: CheckRegistry) -> None:
    registry.add(ShapesCheck())
