"""Published widths (``width``): one decoder layer of each kind at the model's real widths, every
module compared alone with float64, forward and backward (issue #47 item 2; docs/precision.md
"Published widths").

The suite's pruned model gets its published widths back (harness/precision/width.py: hidden,
intermediate and per-expert sizes, head counts and dims, MLA ranks) and keeps its pruned layer
structure, expert count, routing and vocabulary. Steps:

* ``build``: the float64 reference (CPU, eager attention and experts), the same seeded weights in
  the run dtype on the CPU (the clean reference backend) and on the backend under test;
* ``reference``: one forward of the reference over ``tokens`` seeded tokens, every module's inputs
  and output kept;
* ``compare``: each module run alone on those inputs cast to the dtype, on the CPU and on the
  backend: forward output, input gradient and parameter gradients (a seeded output gradient) against
  float64, each held to ``K x`` the CPU's error at that module and shape ``+ FLOORS[dtype]``;
* ``record`` -> ``verdict``: the first module in execution order over its budget, named with its
  class, input and weight shapes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, NotApplicable

metrics.declare("width_worst_budget_use", "", "lower", "largest error / budget of a module at the published widths "
                "(forward, input or parameter gradient; budget K x the CPU's error at that shape + a floor; fails > 1)")
metrics.declare("width_compared", "", "none", "quantities compared (modules x forward / gradients)")
metrics.declare("width_parameters", "", "none", "parameters of the published-width layers built")


class WidthConfig(CheckConfig):
    """One decoder layer of each kind at the published widths, each module against float64."""

    enabled: bool = Field(True, description="Llama-3.1-8B's layer (218M parameters): about 20 s on a 2-core CPU.")
    scope: Literal["commit", "nightly"] = Field("nightly", description="Nightly unless the suite says commit.")
    tokens: int = Field(32, ge=2, le=4096, description="Tokens of the reference forward (rows of every GEMM).")
    max_params: float = Field(1e9, gt=0, description="Largest published-width model built (its float64 "
                              "reference is 8 bytes a parameter); larger is not applicable, in one line.")
    backward: bool = Field(True, description="Compare input and parameter gradients too.")
    seed: int = Field(3, ge=0, description="Seed of the token ids and output gradients.")


class WidthCheck(Check):
    cpu_threads = None  # published-width GEMMs: every core
    name = "width"
    order = 26
    config_model = WidthConfig
    description = "one decoder layer of each kind at the published widths, each module against float64"
    headline = ("width_worst_budget_use", "width_compared")
    steps = ("build", "reference", "compare", "record", "verdict")
    setup_steps = ("build", "reference")

    def build(self, ctx: CheckContext, st) -> None:
        import copy

        import torch

        from harness.anatomy.layers import decoder_layers
        from harness.anatomy.moe import text_config
        from harness.models.build import build_model, cast_model, model_config
        from harness.models.config import architecture_class
        from harness.precision import width

        full = text_config(model_config(ctx.suite, pruned=False).config)
        mc = model_config(ctx.suite)
        tc = text_config(mc.config)
        st.restored = width.published_widths(tc, full)
        st.kinds = width.one_of_each_kind(tc)
        if not st.restored:
            raise NotApplicable("the suite's model already runs the published widths (nothing was pruned narrower)")
        with torch.device("meta"):
            n = width.params_of(architecture_class(mc.architecture)(mc.config))
        if n > ctx.config.max_params:
            raise NotApplicable(f"{n / 1e9:.2f}B parameters at the published widths (float64 reference "
                                f"{n * 8 / 2**30:.1f} GiB) > [checks.width] max_params {ctx.config.max_params:.3g}")
        # one seeded build, cast three ways: the float64 reference (eager attention and experts: the
        # reference's arithmetic, not a kernel's), the CPU's run dtype and the backend's
        m32, _ = build_model(ctx.suite, "float32", "cpu", seed=ctx.suite.suite.checks.precision.seed, mc=mc)
        st.ref = cast_model(copy.deepcopy(m32), torch.float64, "cpu")
        st.ref.set_attn_implementation("eager")
        for c in {id(m.config): m.config for m in st.ref.modules() if hasattr(m, "config")}.values():
            c._experts_implementation = "eager"  # read at forward time; grouped_mm has no float64 on CPU
        dt = getattr(torch, ctx.dtype)
        st.model = cast_model(copy.deepcopy(m32) if ctx.device.type != "cpu" else m32, dt, ctx.device)
        st.clean = st.model if ctx.device.type == "cpu" else cast_model(m32, dt, "cpu")
        if getattr(st, "transform", None) is not None:
            st.model = st.transform(st.model)
        st.prefix = decoder_layers(st.ref)[0]
        ctx.metric("width_parameters", n)
        ctx.detail("width_restored", ", ".join(f"{k} {a} -> {b}" for k, (a, b) in st.restored.items())
                   + f"; {st.kinds}")

    def reference(self, ctx: CheckContext, st) -> None:
        from harness.models.build import seeded_tokens
        from harness.precision import width

        ids = seeded_tokens(st.ref.config.get_text_config().vocab_size, 1, ctx.config.tokens, ctx.config.seed)
        st.cap = width.capture(st.ref, width.compared_modules(st.ref, st.prefix), ids)
        if st.cap.skipped:
            ctx.notes.append("not compared (inputs that cannot be stored): "
                             + ", ".join(f"{k} ({v})" for k, v in st.cap.skipped.items()))

    def compare(self, ctx: CheckContext, st) -> None:
        import contextlib

        import torch

        from harness.precision import width

        dt, floor = getattr(torch, ctx.dtype), width.FLOORS.get(ctx.dtype, 0.0)
        fault = getattr(st, "context", None) or contextlib.nullcontext
        mods = {k: dict(m.named_modules()) for k, m in (("ref", st.ref), ("clean", st.clean), ("model", st.model))}
        g = torch.Generator().manual_seed(ctx.config.seed)
        st.rows = []
        for name in st.cap.order:
            args, kwargs = st.cap.inputs(name)
            has_params = any(True for _ in mods["ref"][name].parameters())
            go = torch.randn(st.cap.output(name).shape, generator=g, dtype=torch.float64) \
                if ctx.config.backward and has_params else None
            own = not width.is_attention(name)  # an attention's projections: compared as leaves
            ref = width.run_module(mods["ref"][name], args, kwargs, torch.float64, "cpu", go, own)
            clean = width.run_module(mods["clean"][name], args, kwargs, dt, "cpu", go, own)
            with fault():
                got = width.run_module(mods["model"][name], args, kwargs, dt, ctx.device, go, own)
            shapes = width.shapes(args, mods["ref"][name])
            for kind, r, c, t in [("forward", ref[0], clean[0], got[0])] + [
                    (k, ref[1][k], clean[1].get(k), got[1].get(k)) for k in ref[1]]:
                if c is None or t is None:
                    continue
                e, ce = width.rel(t, r), width.rel(c, r)
                st.rows.append(width.Compared(name, kind, e, ce, width.K * ce + floor, shapes))

    def record(self, ctx: CheckContext, st) -> None:
        worst = sorted(st.rows, key=lambda c: -c.use)[:5]
        ctx.metric("width_compared", len(st.rows))
        ctx.metric("width_worst_budget_use", worst[0].use if worst else 0.0)
        ctx.detail("width_worst", "; ".join(f"{c.module} {c.kind} {c.error:.3g} / {c.budget:.3g}" for c in worst))

    def verdict(self, ctx: CheckContext, st) -> None:
        from harness.precision.width import K, is_attention

        # the most specific module first: a leaf over budget before the attention module holding it
        over = sorted((c for c in st.rows if not c.error <= c.budget), key=lambda c: is_attention(c.module))
        if not over:
            return
        c, k = over[0], ctx.config
        others = sorted({o.module for o in over[1:]} - {c.module})
        raise CheckFailure(
            f"published widths: {c.module} ({c.shapes}) {c.kind} rel_rmse {c.error:.3g} over its budget "
            f"{c.budget:.3g} (the CPU's {c.clean:.3g} x {K:g} + floor), {k.tokens} tokens",
            metric="width_worst_budget_use", expected="<= 1", observed=f"{c.use:.3g}", tolerance=1.0,
            details=("also over: " + ", ".join(others[:8]) + (f" (+{len(others) - 8})" if len(others) > 8 else ""))
            if others else None)


def register(registry: CheckRegistry) -> None:
    registry.add(WidthCheck())
