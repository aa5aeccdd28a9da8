"""Check ``precision``: the suite's model on a backend in a dtype, on the golden's stored inputs,
compared module by module with the golden (see docs/precision.md).

Steps: ``golden`` (load and validate it; a bad golden is "could not run", never blamed on the
target) -> ``tolerances`` (resolve per dtype / backend / device) -> ``compare`` (run the target on
the golden's inputs, align captured modules) -> ``record`` (metrics) -> ``report`` (layer table and
plot on failure) -> ``verdict`` (first divergent module, generation).

Fails when any captured module output or the logits exceed the resolved tolerance (rel_rmse,
cosine; max_abs_err / within_1e3 when set) or greedy generation disagrees beyond near ties. On a
failure (or with ``layer_report = "always"``) it records the layer table and the first divergent
module as details, prints the table with the error growth per layer, and plots error per module into
``results/precision/<suite>-<backend>-<dtype>.png``.

The quantization budget check lives in ``harness.checks.quantization``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, CouldNotRun
from harness.golden.store import GoldenError, load_golden
from harness.precision import align
from harness.precision.runner import check_against_golden, tolerances_for
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


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


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
    if results_dir is None:
        from harness.settings import load_settings

        results_dir = load_settings().results_dir
    return Path(results_dir) / "precision" / f"{ls.name}-{backend}-{dtype}{suffix}.png"


def load_golden_for(ctx: CheckContext, golden_root=None):
    """The suite's golden, or "could not run": a missing or bad golden is the golden's problem
    (regenerate it), never a verdict on the target."""
    try:
        return load_golden(ctx.suite, golden_root)
    except GoldenError as e:
        ctx.detail("golden_error", str(e))
        raise CouldNotRun(f"golden unusable: {e}", step="golden") from None


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
    name = "precision"
    config_model = PrecisionConfig
    headline = ("logits_rel_rmse", "worst_module_rel_rmse")  # `harness run`'s table
    steps = ("golden", "tolerances", "compare", "record", "report", "verdict")
    setup_steps = ("golden", "tolerances")

    def new_state(self, ctx: CheckContext):
        return SimpleNamespace(transform=None, context=None, golden_root=None, results_dir=None,
                               force_report=False)

    def golden(self, ctx: CheckContext, st) -> None:
        st.g = load_golden_for(ctx, st.golden_root)

    def tolerances(self, ctx: CheckContext, st) -> None:
        tol, src = tolerances_for(ctx.suite, ctx.backend, ctx.dtype)
        for k, v in tol.items():
            if v is not None:
                ctx.tolerance(k, v)
        ctx.detail("tolerance_source", ", ".join(f"{k}={src[k]}" for k in tol if tol[k] is not None))
        st.tol = tol

    def compare(self, ctx: CheckContext, st) -> None:
        """The target on the golden's inputs, captured modules aligned with the golden's."""
        st.res, st.tol, run = check_against_golden(ctx.suite, st.g, ctx.backend, ctx.dtype, transform=st.transform,
                                                   context=st.context, tol=st.tol)
        ctx.notes.extend(run.notes)

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
        if res.generation:
            ctx.metric("generation_top1_agreement", res.generation["top1_agreement"])
            ctx.metric("generation_logprob_max_abs_diff", res.generation["logprob_max_abs_diff"])
        if res.expert_agreement:
            ctx.metric("router_expert_agreement", min(res.expert_agreement.values()))
        if res.problems:
            raise CheckFailure(f"target outputs do not line up with the golden: {res.problems[0]}",
                               metric="captured_modules", expected="same modules and shapes as the golden",
                               observed=f"{len(res.problems)} problem(s)", details="\n".join(res.problems))

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
            raise CheckFailure(
                f"{first.module} diverges from the golden ({first.reason}); first of "
                f"{sum(not r.ok for r in res.rows)} module(s) over tolerance",
                metric=f"{first.module}.rel_rmse",
                expected=f"<= {tol['rel_rmse']:.3g} (cosine >= {tol['min_cosine']:.10g})",
                observed=f"{first.metrics['rel_rmse']:.4g} (cosine {first.metrics['cosine']:.10g})",
                tolerance=tol["rel_rmse"], details=table)
        if res.generation_failure:
            raise CheckFailure(f"greedy generation differs from the golden: {res.generation_failure}",
                               metric="generation_top1_agreement", expected="equal tokens except at near ties",
                               observed=f"{res.generation['top1_agreement']:.3f}", tolerance=tol["tie_margin"],
                               details=table)


def register(registry: CheckRegistry) -> None:
    registry.add(PrecisionCheck())
