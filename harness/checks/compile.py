"""Check ``compile``: the suite's model through ``torch.compile`` with the backend's compiler, its
numerics against the golden and against eager, its graph breaks and recompiles against the counts
the suite commits, and its compile time (docs/compile.md).

Steps: ``golden`` (load it; a bad one is "could not run") -> ``setup`` (the compiler: the suite's
``backend``, else the harness backend's ``compile_backend``, else inductor; the ``frontend`` variant,
commit item of a suite whose ``codegen_scope`` is nightly: that compiler's front end only; none usable: not
applicable; tolerances and the logits budget as the precision check resolves them) -> ``build``
(the seeded model with the golden's numerics gains) -> ``compile`` (the first compiled forward on
the golden's ids: compile time, graph breaks) -> ``eager`` (the same model uncompiled) ->
``numerics`` (compiled logits and loss against the golden under the eager comparison's budget, and
against eager) -> ``breaks`` (against ``expected_graph_breaks``; over: each break's reason and user
frame from ``torch._dynamo.explain``) -> ``recompiles`` (prompt lengths and a decode-like step of
length 1, against ``expected_recompiles``) -> ``speed`` (nightly ``speed`` items only: compiled /
eager forward time through the perf check's timing and statistics, peak memory) -> ``bisect``
(diverging numerics: the smallest region whose compiled version alone diverges) -> ``record`` ->
``verdict``.

Each step is a call of harness/compiler's library (``bounds``: the logits bounds and the numerics;
``counts``: graph breaks and recompiles against the committed counts; ``backward``: the compiled
backward; ``bisect``) whose results the step records.

Whole-model outputs only: hooks on modules would force graph breaks (and change what is compiled),
so per-module comparisons are the bisection's, one compiled region at a time.
"""

from __future__ import annotations

import contextlib
import math
import time
from types import SimpleNamespace
from typing import Literal

import torch
from pydantic import Field, field_validator

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, NotApplicable
from harness.compiler import backward, bounds, counts, sweep
from harness.compiler import bisect as bis
from harness.compiler import dynamo as dyn
from harness.compiler import numerics as num
from harness.compiler.backward import Backward
from harness.golden.sections import load_golden_for
from harness.suite.schema import DTYPES

SPEED = "speed"  # the nightly variant: compiled / eager speed and memory
# The commit variant of a suite whose code generation runs nightly (codegen_scope): every step with the
# compiler's front end only (dyn.frontend). Cold code generation is where a new config's first run
# goes (DeepSeek-V4-Flash, 2 cores: 230 s, 85 % of it inductor's C++ code generation); the front end
# still checks the graph capture, graph breaks, recompiles and the forward and backward numerics of
# the graphs the compiler is handed, and the nightly item adds what its code generation does to them.
FRONTEND = "frontend"

metrics.declare("compile_time_s", "s", "lower", "compile: wall time of the first compiled forward on the golden's "
                "ids (dynamo + the compiler + one run)")
metrics.declare("compile_graph_breaks", "", "lower", "compile: graph breaks of the compiled forward (dynamo's counter)")
metrics.declare("compile_graphs", "", "none", "compile: graphs dynamo handed to the compiler for one forward")
metrics.declare("compile_recompiles", "", "lower", "compile: frame recompiles over the prompt lengths and the "
                "decode step after the first compile")
metrics.declare("compile_logits_rel_rmse", "", "lower", "compile: ||compiled - golden|| / ||golden|| of the logits")
metrics.declare("compile_logits_budget_use", "", "lower", "compile: compiled logits rel_rmse / the golden's "
                "propagated logits budget (fails > 1); with MoE routing forced, / at least eager's distance + the "
                "compiled-vs-eager budget")
metrics.declare("compile_vs_eager_rel_rmse", "", "lower", "compile: ||compiled - eager|| / ||eager|| of the logits, "
                "same backend and dtype")
metrics.declare("compile_router_flips", "", "none", "compile (MoE, numerics judged with routing forced): token "
                "choices of the compiled run's routers that differ from the golden's")
metrics.declare("compile_signed_min_p", "", "higher", "compile: smallest sign-test p of the compiled logits' "
                "per-position scale and offset against eager (harness.precision.signed.one_signed; fails below "
                "1e-4 / 2 with an effect above the dtype's floor)")
metrics.declare("compile_signed_max_effect", "", "lower", "compile: largest |mean per-position scale or offset| of "
                "the compiled logits against eager")
metrics.declare("compile_loss_abs_err", "nats", "lower", "compile: |LM loss of the compiled logits - the golden's|")
metrics.declare("compile_loss_signed_p", "", "higher", "compile: sign-test p of the compiled per-token LM loss against "
                "eager's (fails below 1e-4 with an effect above the dtype's floor)")
metrics.declare("compile_loss_signed_effect", "", "lower", "compile: |mean per-token loss difference| of the compiled "
                "logits against eager, relative to eager's loss")
metrics.declare("compile_forward_s", "s", "lower", "compile (nightly): median compiled forward time")
metrics.declare("compile_eager_forward_s", "s", "lower", "compile (nightly): median eager forward time, "
                "interleaved with the compiled one")
metrics.declare("compile_speedup", "", "higher", "compile (nightly): eager / compiled median forward time")
metrics.declare("compile_peak_memory_bytes", "bytes", "lower", "compile (nightly): peak memory of a compiled forward")
metrics.declare("compile_eager_peak_memory_bytes", "bytes", "lower", "compile (nightly): peak memory of an eager forward")


metrics.declare("compile_grad_worst_budget_use", "", "lower", "compile: largest parameter-gradient error of the "
                "compiled backward against the golden / the training check's budget (fails > 1)")
metrics.declare("compile_grad_vs_eager_worst_budget_use", "", "none", "compile: the same of the eager backward, "
                "beside it")
metrics.declare("compile_backward_time_s", "s", "lower", "compile: first compiled forward + backward (its compile)")
metrics.declare("compile_grad_signed_min_p", "", "higher", "compile: smallest sign-test p of a parameter gradient's "
                "per-row scale or offset, compiled backward against eager (fails below 1e-4 / tests made with an "
                "effect above the dtype's floor)")
metrics.declare("compile_grad_signed_max_effect", "", "lower", "compile: largest |scale or mean row offset| of a "
                "parameter gradient against eager's among the sign tests below the limit (fails above the dtype's "
                "floor, harness.precision.signed.GRAD_FLOORS, unless in half precision the compiled gradient is the "
                "closer to the same weights' float32 backward; 0: none below it)")


TOL_GOLDEN = metrics.tolerance_property("compile_logits_rel_rmse", 0.0)[0]
TOL_EAGER = metrics.tolerance_property("compile_vs_eager_rel_rmse", 0.0)[0]
SRC = metrics.detail_property("compile_budget_source", "")[0]


class CompileConfig(CheckConfig):
    """torch.compile: compiled numerics against the golden and eager, graph breaks, recompiles, compile time."""

    backend: str | None = Field(None, description="torch.compile backend (a registered dynamo backend name); unset: "
                                "the harness backend's compile_backend, else 'inductor'.")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="torch.compile mode (unset: the compiler's default).")
    dynamic: bool | None = Field(None, description="torch.compile dynamic: unset = dynamo's automatic dynamic shapes "
                                 "(static first, dynamic after a size changes), true = dynamic from the start, "
                                 "false = a specialised graph per shape.")
    prompt_lens: list[int] = Field(default_factory=lambda: [8, 12], description="Prompt lengths run after the "
                                   "golden's (its seq_len) to count recompiles.")
    decode_step: bool = Field(True, description="Also run a decode-like step (a length-1 input) in the recompile sweep.")
    sweep_backend: str = Field("eager", description="dynamo backend of the recompile sweep; '' = the check's "
                               "compiler. dynamo's eager backend by default: guards and recompiles are dynamo's (the "
                               "same recompiles, frames and shapes as aot_eager on 13 suites, 1.0-2.8x faster), and "
                               "each recompile with inductor costs a C++ build (~10 s on a CPU).")
    expected_graph_breaks: int | dict[str, int] | None = Field(
        None, description="Graph breaks committed for this suite (or per dtype: {float32 = 0, bfloat16 = 1}); more "
        "fail naming the reason and source line, fewer pass with a note to lower it. Unset (or a dtype not "
        "listed): measured and recorded, with a note saying what to commit.")
    expected_recompiles: int | dict[str, int] | None = Field(
        None, description="Recompiles the sweep is allowed (or per dtype); more fail naming the shape and dynamo's "
        "guard-failure reason, fewer pass with a note. Unset: measured and recorded, with a note.")
    eager_k: float = Field(1.0, gt=0, description="Compiled vs eager logits are held to eager_k x the golden's "
                           "propagated logits budget in this dtype.")
    grad_k: float = Field(2.0, gt=0, description="Compiled parameter gradients are held to grad_k x the training "
                          "check's budget: the budgets are measured on eager draws, and a compiled backward (fused "
                          "kernels, reordered reductions) is another arithmetic - clean, it used 0.46-1.47 of the "
                          "eager budget over 17 Day-0 configs x 2 dtypes (eager: 0.51-0.69).")
    loss: bool = Field(True, description="Compare the LM loss of the compiled logits with the golden's (held to the "
                       "bound the logits budget implies: sqrt(2 / tokens) x budget x ||golden logits||).")
    gradients: bool = Field(True, description="Also compile the backward: the LM loss's parameter gradients of the "
                            "compiled model against the golden's training section (its sketches, under the training "
                            "check's measured budgets; routers forced to the golden's choices).")
    bisect: bool = Field(True, description="On diverging numerics, compile one region at a time to name the smallest "
                         "one responsible.")
    bisect_depth: int = Field(3, ge=1, description="Levels the bisection descends (decoder layer -> submodule -> ...).")
    speed_repeats: int = Field(10, ge=3, description="Nightly 'speed' item: interleaved eager/compiled forward samples.")
    codegen_scope: Literal["commit", "nightly"] = Field(
        "commit", description="Scope of the item that runs the compiler's code generation. 'nightly': commit runs get "
        "a 'frontend' item instead, every step through the compiler's front end only (inductor: "
        "aot_eager_decomp_partition - dynamo, AOTAutograd, inductor's decompositions, no code generation), and the "
        "full item runs nightly. `harness init` writes 'nightly' for a new config: its cold code generation takes "
        "minutes on a CPU (DeepSeek-V4-Flash: 230 s of a 2-core run).")

    @field_validator("prompt_lens")
    @classmethod
    def _lens(cls, v: list[int]) -> list[int]:
        if any(x < 1 or x > 32768 for x in v):  # each length is a forward of that many tokens
            raise ValueError(f"prompt lengths must be 1 .. 32768, got {v}")
        return v

    @field_validator("expected_graph_breaks", "expected_recompiles")
    @classmethod
    def _counts(cls, v):
        if v is None:
            return v
        vals = v.values() if isinstance(v, dict) else [v]
        if any(x < 0 for x in vals):
            raise ValueError(f"counts must be >= 0, got {v}")
        if isinstance(v, dict) and (bad := [k for k in v if k not in DTYPES]):
            raise ValueError(f"keys must be dtypes {DTYPES}, got {bad}")
        return v


def run_compile(ctx: CheckContext, **options):
    """The check with options (``transform``: model -> model after the build; ``context``: () -> a
    context manager around every compile and forward, e.g. a compiler fault; ``golden_root``).
    Returns the state."""
    return CompileCheck().run(ctx, **options)


class CompileCheck(Check):
    cpu_threads = 1  # the pruned test models: one intra-op thread (harness.models.build.cpu_threads)
    name = "compile"
    order = 25
    config_model = CompileConfig
    description = "torch.compile: numerics against the golden and eager, graph breaks, recompiles, compile time."
    headline = ("compile_logits_budget_use", "compile_graph_breaks", "compile_time_s")
    steps = ("golden", "setup", "build", "compile", "eager", "numerics", "breaks", "recompiles", "gradients", "speed",
             "bisect", "record", "verdict")
    setup_steps = ("golden", "setup", "build")

    def variants(self, suite, backend) -> list[str | None]:
        if self.config(suite).codegen_scope == "nightly":
            return [FRONTEND, None, SPEED]
        return [None, SPEED]

    def scope(self, suite, variant) -> str:
        if variant == SPEED or (variant is None and self.config(suite).codegen_scope == "nightly"):
            return "nightly"
        return super().scope(suite, variant)

    def new_state(self, ctx: CheckContext):
        return SimpleNamespace(transform=None, context=None, golden_root=None, problems=[], bisection=None,
                               num=None, recompiled=[], speed={}, bisect_text=None, grad=Backward())

    def run_steps(self, ctx: CheckContext, st) -> None:
        ctx_mgr = st.context() if st.context is not None else contextlib.nullcontext()
        with ctx_mgr, torch.no_grad(), dyn.fresh():
            super().run_steps(ctx, st)

    # --- steps: each a call of harness/compiler's library, what it returns recorded --------------
    def golden(self, ctx: CheckContext, st) -> None:
        st.g = load_golden_for(ctx, st.golden_root)

    def setup(self, ctx: CheckContext, st) -> None:
        """The compiler the item runs (the front end's for the ``frontend`` variant; NotApplicable if
        none is usable) and the bounds of its logits (harness/compiler/bounds.py)."""
        cfg = st.cfg = ctx.config
        compiler = cfg.backend or ctx.backend.compile_backend or dyn.DEFAULT
        if ctx.variant == FRONTEND:
            fe, why = dyn.frontend(compiler)
            ok, compiler = fe is not None, fe
        else:
            ok, why = dyn.usable(compiler, ctx.backend.device_type)
        ctx.detail("compile_backend", f"{compiler}: {why}")
        if not ok:
            raise NotApplicable(f"no usable compiler on {ctx.backend.name}: {why}")
        st.compiler, st.compile_kw = compiler, {"backend": compiler, "mode": cfg.mode, "dynamic": cfg.dynamic}
        st.bounds = bounds.resolve(ctx.suite, ctx.backend, ctx.dtype, st.g, cfg.eager_k)
        ctx.tolerance("compile_logits_rel_rmse", st.bounds.budget)
        ctx.tolerance("compile_vs_eager_rel_rmse", st.bounds.eager)
        ctx.detail("compile_budget_source", st.bounds.source)

    def build(self, ctx: CheckContext, st) -> None:
        from harness.precision.runner import build_target

        st.model, mc = build_target(ctx.suite, ctx.backend, ctx.dtype, st.transform, st.g)
        ctx.notes.extend(mc.notes)
        st.ids = st.g.inputs.to(ctx.device)

    def compile(self, ctx: CheckContext, st) -> None:
        before, graphs = dyn.break_counter(), dyn.unique_graphs()
        st.compiled = dyn.compile_module(st.model, **st.compile_kw)
        t = time.perf_counter()
        st.logits = num.logits(st.compiled, st.ids)
        ctx.backend.synchronize()
        st.compile_s = time.perf_counter() - t
        st.breaks = dyn.break_counter() - before
        st.n_breaks, st.n_graphs = sum(st.breaks.values()), dyn.unique_graphs() - graphs

    def eager(self, ctx: CheckContext, st) -> None:
        st.eager_logits = num.logits(st.model, st.ids)

    def numerics(self, ctx: CheckContext, st) -> None:
        if ctx.variant == SPEED:
            return
        st.num = n = bounds.numerics(st.g, st.model, st.ids, st.logits, st.eager_logits, st.compile_kw, st.bounds,
                                     ctx.backend.name, st.cfg.loss, ctx.dtype)
        ctx.notes.extend(n.notes)
        if n.source is not None:  # the bounds replaced: the recorded source and tolerances with them
            ctx.properties[:] = [p for p in ctx.properties if p[0] != SRC]
            ctx.detail("compile_budget_source", n.source)
        if n.rebound:
            ctx.properties[:] = [p for p in ctx.properties if p[0] not in (TOL_GOLDEN, TOL_EAGER)]
            ctx.tolerance("compile_logits_rel_rmse", n.golden_bound)
            ctx.tolerance("compile_vs_eager_rel_rmse", n.eager_budget)
        if n.routing is not None:
            ctx.detail("compile_routing", n.routing)
        if n.loss_bound is not None:
            ctx.tolerance("compile_loss_abs_err", n.loss_bound)

    def breaks(self, ctx: CheckContext, st) -> None:
        if ctx.variant != SPEED:
            self._said(ctx, st, counts.breaks(st.breaks, st.cfg.expected_graph_breaks, ctx.suite.name, ctx.dtype,
                                              st.model, st.ids))

    def recompiles(self, ctx: CheckContext, st) -> None:
        if ctx.variant == SPEED:
            return
        try:
            res = counts.run_sweep(st.model, st.g, st.ids, st.cfg, st.compile_kw, st.compiler)
        except sweep.CompilerRaised as e:
            message, fields = counts.raised(e, st.compiler)
            raise CheckFailure(message, **fields) from e.error
        st.recompiled = res.recompiled
        self._said(ctx, st, counts.recompiles(res, st.cfg.expected_recompiles, st.cfg.dynamic, ctx.suite.name,
                                              ctx.dtype))

    def gradients(self, ctx: CheckContext, st) -> None:
        """The compiled backward against the golden's training section (harness/compiler/backward.py)."""
        if ctx.variant != SPEED and st.cfg.gradients:
            st.grad = backward.judge(st.g, ctx.suite, ctx.dtype, st.model, ctx.device, st.compile_kw, st.compiler,
                                     st.cfg.grad_k, st.n_breaks)
            self._said(ctx, st, st.grad)

    def speed(self, ctx: CheckContext, st) -> None:
        """Nightly: compiled and eager forwards interleaved, medians and peak memory (perf's timing and
        statistics: harness/perf/measure.py)."""
        # deferred: only a nightly speed item loads the perf library
        from harness.perf.measure import interleaved_medians, peak_memory
        from harness.perf.timing import memory_support, timer_safety

        if ctx.variant != SPEED:
            return
        ok, why = timer_safety(ctx.backend)
        if not ok:
            raise NotApplicable(f"no compile speed figures: {why}")
        forwards = {"compile_eager_peak_memory_bytes": lambda: num.logits(st.model, st.ids),
                    "compile_peak_memory_bytes": lambda: num.logits(st.compiled, st.ids)}
        (e, c), clock = interleaved_medians(ctx.backend, list(forwards.values()), st.cfg.speed_repeats)
        ctx.detail("compile_speed_clock", clock)
        st.speed = {"compile_eager_forward_s": e, "compile_forward_s": c, "compile_speedup": e / c if c else math.nan}
        if memory_support(ctx.backend)[0]:
            st.speed.update(peak_memory(ctx.backend, forwards))

    def bisect(self, ctx: CheckContext, st) -> None:
        if ctx.variant == SPEED or st.num.diverged is None or not st.cfg.bisect:
            return
        routes = num.golden_routes(st.g) if st.num.routing_forced else None
        by_sign = st.num.sign_judge(st.ids, ctx.dtype)
        with num.routed(st.model, routes):
            st.bisection = bis.localize(st.model, lambda m: num.logits(m, st.ids), st.num.eager_logits,
                                        st.num.eager_budget, st.compile_kw, st.cfg.bisect_depth, by_sign)
        st.bisect_text = bis.describe(st.bisection)
        ctx.detail("compile_bisection", st.bisect_text)

    def record(self, ctx: CheckContext, st) -> None:
        figures = {"compile_time_s": st.compile_s, "compile_graph_breaks": st.n_breaks, "compile_graphs": st.n_graphs}
        if ctx.variant == SPEED:
            figures |= st.speed
        else:
            figures |= {"compile_recompiles": len(st.recompiled)} | st.num.figures() | st.grad.figures()
        for k, v in figures.items():
            ctx.metric(k, v)

    def verdict(self, ctx: CheckContext, st) -> None:
        if ctx.variant != SPEED and st.num.diverged is not None:
            message, fields = st.num.failure(bis.where(st.bisection, st.num.eager_budget), st.bisect_text)
            raise CheckFailure(message, **fields)
        if st.problems:
            first = st.problems[0]
            also = [f"also: {p.message}" for p in st.problems[1:]]
            if also:
                first.details = "\n".join([first.details or "", "", *also])
            raise first

    def _said(self, ctx: CheckContext, st, out) -> None:
        """A library step's notes and details recorded, its failure kept for the verdict."""
        ctx.notes.extend(out.notes)
        for k, v in out.details.items():
            ctx.detail(k, v)
        if out.failure is not None:
            message, fields = out.failure
            st.problems.append(CheckFailure(message, **fields))


def register(registry: CheckRegistry) -> None:
    registry.add(CompileCheck())
