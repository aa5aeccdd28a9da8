"""Check ``precision``: the suite's model on a backend in a dtype, on the golden's stored inputs,
compared module by module with the golden (see docs/precision.md).

Steps: ``golden`` (load and validate it; a bad golden is "could not run", never blamed on the
target) -> ``tolerances`` (per-dtype ceilings, resolved per dtype / backend / device) -> ``budgets``
(per-module budgets from the clean errors the golden measured: k x clean + floor, under the
ceiling) -> ``compare`` (propagated: the whole target model on the golden's inputs) -> ``isolate``
(each captured module of the target on the golden's recorded inputs of that module) -> ``routing``
(verdict rows; in MoE modules, tokens whose routing flipped at a near tie are left out and counted,
flips at wide margins fail) -> ``record`` (metrics) -> ``report`` (layer table and plot on
failure) -> ``verdict`` (first module over its budget, generation).

Fails when a module's isolated error exceeds its budget (rel_rmse or scale error) or is one-signed
against the golden's clean dtype run (a sign test of its row offsets and row scales), a router flips at
a wide margin, a module without an isolated comparison exceeds the tolerance propagated, or greedy
generation disagrees beyond near ties. On a failure (or with ``layer_report = "always"``) it records
the layer table and the first divergent module as details, prints the table with both comparisons
and the error growth per layer, and plots error per module into
``results/precision/<suite>-<backend>-<dtype>.png``.

The quantization budget check lives in ``harness.checks.quantization``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry
from harness.golden.sections import GoldenSection, load_golden_for
from harness.precision import align, signed
from harness.precision.runner import (
    budgets_for,
    build_target,
    compare_run,
    run_isolated,
    run_model,
    selection_judge,
    tolerances_for,
)
from harness.suite.loader import LoadedSuite
from harness.suite.schema import DTYPES

metrics.declare("logits_max_abs_err", "", "lower", "max |target - golden| of the logits")
metrics.declare("logits_max_rel_err", "", "lower", "max elementwise relative error of the logits (floored)")
metrics.declare("logits_cosine", "", "higher", "cosine similarity of the logits with the golden's")
metrics.declare("logits_rel_rmse", "", "lower", "||target - golden|| / ||golden|| of the logits")
metrics.declare("logits_within_1e3", "share", "higher", "share of logits within 1e-3 relative error")
metrics.declare("logits_top1_agreement", "share", "higher", "share of positions whose argmax equals the golden's")
metrics.declare("worst_module_rel_rmse", "", "lower", "largest rel_rmse over the captured modules")
metrics.declare("min_module_cosine", "", "higher", "smallest cosine over the captured modules")
metrics.declare("modules_over_tolerance", "", "lower", "captured modules whose error exceeds the tolerance")
metrics.declare("generation_top1_agreement", "share", "higher", "greedy tokens equal to the golden's")
metrics.declare("generation_logprob_max_abs_diff", "nats", "lower", "max |logprob diff| of agreeing greedy tokens")
metrics.declare("router_expert_agreement", "share", "higher", "min share of router choices equal to the golden's")
metrics.declare("isolated_worst_rel_rmse", "", "lower", "largest rel_rmse of a module run on the golden's inputs")
metrics.declare("isolated_worst_budget_use", "", "lower", "largest isolated rel_rmse / the module's budget (fails > 1)")
metrics.declare("isolated_modules_over_budget", "", "lower", "modules whose isolated error exceeds their budget")
metrics.declare("isolated_signed_min_p", "", "higher", "smallest sign-test p of a module's row offsets or row scales "
                "against the clean dtype run's (harness.precision.signed; fails below 1e-4 / tests with an effect above "
                "the floor)")
metrics.declare("isolated_signed_max_effect", "", "lower", "largest |mean row offset or row scale - clean| of a "
                "module (offsets relative to its RMS)")
metrics.declare("routing_flips_near_tie", "", "lower", "tokens left out of isolated MoE comparisons after a "
                "legitimate near-tie routing flip")


class _Table(BaseModel):
    # strict: a TOML `true` is no integer, a string no number; every value has the type the key declares.
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True)


class Tolerance(_Table):
    """Precision tolerances. Unset fields fall back to the next less specific entry, then to the
    built-in defaults for the dtype (harness/precision/tolerance.py)."""

    rel_rmse: float | None = Field(None, ge=0, description="Max relative RMSE (||a-r||/||r||) of every "
                                   "captured module output and of the logits.")
    min_cosine: float | None = Field(None, le=1, description="Min cosine similarity of every captured output.")
    max_abs_err: float | None = Field(None, ge=0, description="Max absolute error of the logits (unset: recorded only).")
    min_within_1e3: float | None = Field(None, ge=0, le=1, description="Min share of logits within 1e-3 "
                                         "relative error (unset: recorded only).")
    logprob_atol: float | None = Field(None, ge=0, description="Max |logprob difference| of greedy tokens "
                                       "where target and reference agree.")
    tie_margin: float | None = Field(None, ge=0, description="A greedy token mismatch is accepted only where "
                                     "the reference's logprob gap between the two tokens is below this.")


class ToleranceOverride(Tolerance):
    dtype: str | None = Field(None, description="Applies to this run dtype (unset: any).")
    backend: str | None = Field(None, description="Applies to this backend (unset: any).")
    device: str | None = Field(None, description="Applies to device names matching this glob, e.g. "
                               "'NVIDIA H100*' (a device generation; unset: any).")


class PrecisionConfig(CheckConfig):
    """Golden-output precision check: module by module against the float64 golden."""

    batch_size: int = Field(2, ge=1, description="Sequences in the golden input.")
    seq_len: int = Field(16, ge=2, description="Tokens per sequence in the golden input.")
    seed: int = Field(0, description="Weight seed (the golden input ids are stored, not regenerated).")
    generate_tokens: int = Field(4, ge=0, description="Greedy tokens stored with their logprobs.")
    reference: str = Field("cpu:float64", description="BACKEND:DTYPE the golden is made with.")
    capture: list[str] | None = Field(None, description="Regexes of module names to capture (unset: "
                                      "embeddings, rotary, each layer, norms, attention, MLP/MoE, router, final norm).")
    golden_mode: Literal["full", "sampled"] = Field(
        "full", description="'sampled' stores per-tensor statistics and a fixed sample of elements instead "
        "of whole tensors (for large models).")
    sample_size: int = Field(4096, ge=16, description="Elements kept per tensor in 'sampled' mode.")
    numerics: Literal["realistic", "init"] = Field(
        "realistic", description="'realistic': rescale the seeded weights so activations look like a trained "
        "model's (peaky attention, residual RMS growing per layer; gains calibrated on the reference and "
        "stored in the golden); 'init': the bare initialisation (near-uniform attention).")
    attention_logit_std: float = Field(3.0, gt=0, description="realistic numerics: std of the attention logits "
                                       "the attention gain aims at (3.0: normalised entropy ~0.4-0.5).")
    residual_growth: float = Field(1.5, ge=1, description="realistic numerics: residual-stream RMS growth per "
                                   "decoder layer the residual gains aim at (rounded to powers of two).")
    isolated: bool = Field(True, description="Also run each captured module on the golden's recorded inputs "
                           "(isolated comparison) and localize with it; off: propagated comparison only.")
    budget_draws: int = Field(4, ge=1, description="Input draws over which `golden generate` measures each "
                              "module's clean error per low-precision dtype (draw 0 is the golden's input).")
    budget_k: float = Field(1.5, ge=1, description="A module fails when its isolated error exceeds "
                            "budget_k x its measured clean error (max over draws) + the dtype's floor; "
                            "the per-dtype tolerance stays the ceiling.")
    layer_report: Literal["on_failure", "always"] = Field("on_failure", description="When to write the "
                                                          "layer table and error plot.")
    tolerances: dict[str, Tolerance] = Field(default_factory=dict, description="Per dtype overrides of the defaults.")
    overrides: list[ToleranceOverride] = Field(default_factory=list, description="Per backend / device "
                                               "generation overrides; the most specific match wins, field by field.")

    @field_validator("tolerances")
    @classmethod
    def _dtype_keys(cls, v: dict) -> dict:
        bad = [k for k in v if k not in DTYPES]
        if bad:
            raise ValueError(f"keys must be dtypes {DTYPES}, got {bad}")
        return v




def results_path(ls: LoadedSuite, backend: str, dtype: str, results_dir: str | Path | None = None,
                 suffix: str = "") -> Path:
    from harness.files import paths
    from harness.settings import results_root

    return paths.join(results_root(results_dir) / "precision", f"{ls.name}-{backend}-{dtype}{suffix}.png",
                      source=ls.path, field="model.name")


def run_precision(ctx: CheckContext, *, transform=None, context=None, golden_root=None, results_dir=None,
                  force_report: bool = False):
    """The check with options: ``transform``/``context`` inject faults (tests, bisection),
    ``golden_root``/``results_dir`` redirect files. Returns the alignment result when it passes."""
    st = SimpleNamespace(transform=transform, context=context, golden_root=golden_root,
                         results_dir=results_dir, force_report=force_report)
    check = PrecisionCheck()
    ctx.check = ctx.check or check.name
    check.run_steps(ctx, st)
    return st.res


class PrecisionCheck(Check):
    cpu_threads = 1  # the pruned test models: one intra-op thread (harness.models.build.cpu_threads)
    name = "precision"
    order = 20
    config_model = PrecisionConfig
    headline = ("isolated_worst_budget_use", "logits_rel_rmse")  # `harness run`'s table (budget use > 1 fails)
    steps = ("golden", "tolerances", "budgets", "compare", "isolate", "routing", "record", "report", "verdict")
    setup_steps = ("golden", "tolerances", "budgets")
    # the clean dtype runs' signed row errors, for the isolated comparison's sign test (read by
    # harness.precision.runner)
    golden_sections = (GoldenSection(signed.SECTION, signed.spec, signed.build),)

    def new_state(self, ctx: CheckContext):
        return SimpleNamespace(transform=None, context=None, golden_root=None, results_dir=None,
                               force_report=False, model=None)

    def golden(self, ctx: CheckContext, st) -> None:
        st.g = load_golden_for(ctx, st.golden_root)

    def tolerances(self, ctx: CheckContext, st) -> None:
        tol, src = tolerances_for(ctx.suite, ctx.backend, ctx.dtype)
        for k, v in tol.items():
            if v is not None:
                ctx.tolerance(k, v)
        ctx.detail("tolerance_source", ", ".join(f"{k}={src[k]}" for k in tol if tol[k] is not None))
        st.tol, st.tol_source = tol, src

    def budgets(self, ctx: CheckContext, st) -> None:
        """Per-module budgets from the golden's measured clean errors in this dtype (k x clean + floor,
        the tolerance as ceiling), the logits' propagated budget and the router flip limits."""
        p = ctx.suite.suite.checks.precision
        st.budgets = budgets_for(st.g, ctx.dtype, st.tol, p.budget_k, st.tol_source)
        per = st.budgets.modules
        if st.budgets.logprob_atol is not None:
            ctx.tolerance("generation_logprob_budget", st.budgets.logprob_atol)
        if st.budgets.tie_margin is not None:
            ctx.tolerance("generation_tie_budget", st.budgets.tie_margin)
        if per:
            ctx.detail("budget_source", f"measured clean error x {p.budget_k:g} + floor, ceiling "
                       f"{st.tol['rel_rmse']:.3g} ({len(per)} modules, {st.g.budgets(ctx.dtype).get('draws')} draws)")
        else:
            ctx.detail("budget_source", f"no measurement for {ctx.dtype} in the golden: tolerance {st.tol['rel_rmse']:.3g}")

    def compare(self, ctx: CheckContext, st) -> None:
        """Propagated: the target on the golden's inputs, every captured module aligned with the golden's."""
        ls = ctx.suite
        st.model, mc = build_target(ls, ctx.backend, ctx.dtype, st.transform, st.g)
        st.run = run_model(st.model, st.g, ls, ctx.backend.device(), st.context)
        ctx.notes.extend(mc.notes)

    def isolate(self, ctx: CheckContext, st) -> None:
        """Isolated: each captured module of the target on the golden's recorded inputs (run dtype)."""
        if ctx.suite.suite.checks.precision.isolated and st.g.structures:
            st.run.replayed = run_isolated(st.model, st.g, ctx.dtype, ctx.backend.device(), st.context)
        elif ctx.suite.suite.checks.precision.isolated:
            ctx.notes.append("golden has no recorded module inputs (sampled mode): propagated comparison only")

    def routing(self, ctx: CheckContext, st) -> None:
        """Verdict rows, routing-aware: in isolated MoE modules, tokens whose experts flipped at a
        near tie (golden router margin within the measured router noise) are left out and counted;
        a flip at a wide margin fails the module."""
        st.res = compare_run(st.g, st.run, st.tol, st.budgets, selection_judge(ctx.suite, st.g, ctx.dtype))
        st.model = None  # free the target before reporting

    def record(self, ctx: CheckContext, st) -> None:
        res = st.res
        lg = res.logits
        for k in ("max_abs_err", "max_rel_err", "cosine", "rel_rmse", "within_1e3", "top1_agreement"):
            if k in lg:
                ctx.metric(f"logits_{k}", lg[k])
        if res.rows:
            ctx.metric("worst_module_rel_rmse", max(r.metrics["rel_rmse"] for r in res.rows))
            ctx.metric("min_module_cosine", min(r.metrics["cosine"] for r in res.rows))
        ctx.metric("modules_over_tolerance", sum(not r.ok for r in res.rows))
        # every module's error over its budget, compact, on a pass too (the full layer_table is kept for
        # failures): what `harness report` plots for each item
        ctx.detail("module_budget_use", metrics.budget_use_json(
            (r["module"], r["rel_rmse"] / r["tolerance"] if r["tolerance"] else 0.0) for r in align.layer_table(res, st.tol)))
        if res.generation:
            ctx.metric("generation_top1_agreement", res.generation["top1_agreement"])
            ctx.metric("generation_logprob_max_abs_diff", res.generation["logprob_max_abs_diff"])
        if res.expert_agreement:
            ctx.metric("router_expert_agreement", min(res.expert_agreement.values()))
        if res.isolated:
            ctx.metric("isolated_worst_rel_rmse", max(r.metrics["rel_rmse"] for r in res.isolated))
            ctx.metric("isolated_worst_budget_use", max(r.metrics["rel_rmse"] / r.budget if r.budget else 0.0
                                                        for r in res.isolated))
            ctx.metric("isolated_modules_over_budget", sum(not r.ok for r in res.isolated))
            ctx.metric("routing_flips_near_tie", res.routing_flips)
            self._signed(ctx, st)
        if res.problems:
            raise CheckFailure(f"target outputs do not line up with the golden: {res.problems[0]}",
                               metric="captured_modules", expected="same modules and shapes as the golden",
                               observed=f"{len(res.problems)} problem(s)", details="\n".join(res.problems))

    def _signed(self, ctx: CheckContext, st) -> None:
        """The sign tests' figures (offset and scale of every module together), and a note where the
        golden holds no clean rows to test against."""
        tested = [t for r in st.res.isolated for t in (r.signed or ())]
        if tested:
            ctx.metric("isolated_signed_min_p", min(t.p for t in tested))
            ctx.metric("isolated_signed_max_effect", max(abs(t.effect) for t in tested))
        clean = st.budgets.signed or {}
        if not any(clean.values()):
            ctx.notes.append("no signed-error test: the golden has no signed_error section for this dtype")
        elif not clean.get("scale"):
            ctx.notes.append(f"no scale sign test: the golden's signed_error section has no clean row scales for "
                             f"{ctx.dtype} (made before issue #51; `harness golden generate {ctx.suite.name} --update`)")

    def report(self, ctx: CheckContext, st) -> None:
        """Layer table, details and error plot, on failure or when the suite asks for them always."""
        res, tol, ls, be = st.res, st.tol, ctx.suite, ctx.backend
        st.table = None
        if res.ok and not st.force_report and ls.suite.checks.precision.layer_report != "always":
            return
        for k, v in align.details(res, tol).items():
            ctx.detail(k, v)
        st.table = align.render(res, tol)
        try:
            png = align.plot(res, tol, results_path(ls, be.name, ctx.dtype, st.results_dir),
                             f"{ls.name} on {be.name} ({be.device_name()}) in {ctx.dtype} vs golden")
            if png:
                ctx.detail("error_plot", str(png))
                st.table += f"\nplot: {png}"
        except Exception as e:  # a plot must never hide the result
            ctx.notes.append(f"error plot not written: {type(e).__name__}: {e}")

    def verdict(self, ctx: CheckContext, st) -> None:
        res, tol, table = st.res, st.tol, st.table
        first = res.first_divergent
        if first is not None:
            n_bad = len(res.failing)
            iso = first in res.isolated
            prop = next((r for r in res.rows if r.module == first.module), None)
            also = (f"; propagated rel_rmse {prop.metrics['rel_rmse']:.3g}" if iso and prop is not None else "")
            raise CheckFailure(
                f"{first.module} diverges from the golden ({first.reason}{also}); first of "
                f"{n_bad} module(s) over budget" + (" (isolated: the module run on the golden's inputs)" if iso else ""),
                metric=f"{first.module}.{'isolated_' if iso else ''}rel_rmse",
                expected=f"<= {first.budget:.3g} (cosine >= {tol['min_cosine']:.10g})",
                observed=f"{first.metrics['rel_rmse']:.4g} (cosine {first.metrics['cosine']:.10g})",
                tolerance=first.budget, details=table)
        if res.generation_failure:
            raise CheckFailure(f"greedy generation differs from the golden: {res.generation_failure}",
                               metric="generation_top1_agreement", expected="equal tokens except at near ties",
                               observed=f"{res.generation['top1_agreement']:.3f}",
                               tolerance=st.budgets.tie_margin if st.budgets.tie_margin is not None else tol["tie_margin"],
                               details=table)


def register(registry: CheckRegistry) -> None:
    registry.add(PrecisionCheck())
