"""Check ``precision``: the suite's model on a backend in a dtype, on the golden's stored inputs,
compared module by module with the golden (see docs/precision.md).

Fails when any captured module output or the logits exceed the resolved tolerance (rel_rmse,
cosine; max_abs_err / within_1e3 when set) or greedy generation disagrees beyond near ties. On a
failure (or with ``layer_report = "always"``) it records the layer table and the first divergent
module as details, prints the table with the error growth per layer, and plots error per module into
``results/precision/<suite>-<backend>-<dtype>.png``.

Check ``quantization``: for suites whose config declares FP8 weights (or that set a scheme), the
weights are quantized and dequantized (FP8 e4m3 with block scales, or int8 per channel) and the
logits compared with the float golden against the declared budget.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness import metrics
from harness.backends.base import Backend
from harness.checks import CheckContext, CheckFailure, CheckRegistry
from harness.golden.store import GoldenError, load_golden
from harness.precision import align
from harness.precision.compare import tensor_metrics
from harness.precision.runner import check_against_golden, tolerances_for
from harness.suite.loader import LoadedSuite

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
metrics.declare("quant_logits_rel_rmse", "", "lower", "quantized model: rel_rmse of the logits vs the golden")
metrics.declare("quant_logits_cosine", "", "higher", "quantized model: cosine of the logits vs the golden")
metrics.declare("quant_top1_agreement", "share", "higher", "quantized model: argmax agreement with the golden")


def results_path(ls: LoadedSuite, backend: str, dtype: str, results_dir: str | Path | None = None,
                 suffix: str = "") -> Path:
    if results_dir is None:
        from harness.settings import load_settings

        results_dir = load_settings().results_dir
    return Path(results_dir) / "precision" / f"{ls.name}-{backend}-{dtype}{suffix}.png"


def _golden(ctx: CheckContext, golden_root):
    try:
        return load_golden(ctx.suite, golden_root)
    except GoldenError as e:
        ctx.detail("golden_error", str(e))
        raise CheckFailure(f"golden unusable: {e}", metric="golden", expected="a valid golden",
                           observed=str(e).split(": ", 1)[-1][:200]) from None


def run_precision(ctx: CheckContext, *, transform=None, context=None, golden_root=None, results_dir=None,
                  force_report: bool = False):
    """The check's body; ``transform``/``context`` inject faults (tests, bisection)."""
    ls, be = ctx.suite, ctx.backend
    p = ls.suite.checks.precision
    g = _golden(ctx, golden_root)
    tol, src = tolerances_for(ls, be, ctx.dtype)
    for k, v in tol.items():
        if v is not None:
            ctx.tolerance(k, v)
    ctx.detail("tolerance_source", ", ".join(f"{k}={src[k]}" for k in tol if tol[k] is not None))
    res, tol, run = check_against_golden(ls, g, be, ctx.dtype, transform=transform, context=context, tol=tol)
    ctx.notes.extend(run.notes)
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
    table = None
    if not res.ok or force_report or p.layer_report == "always":
        for k, v in align.details(res, tol).items():
            ctx.detail(k, v)
        table = align.render(res, tol)
        try:
            png = align.plot(res, tol, results_path(ls, be.name, ctx.dtype, results_dir),
                             f"{ls.name} on {be.name} ({be.device_name()}) in {ctx.dtype} vs golden")
            if png:
                ctx.detail("error_plot", str(png))
                table += f"\nplot: {png}"
        except Exception as e:  # a plot must never hide the result
            ctx.notes.append(f"error plot not written: {type(e).__name__}: {e}")
    first = res.first_divergent
    if first is not None:
        raise CheckFailure(
            f"{first.module} diverges from the golden ({first.reason}); first of "
            f"{sum(not r.ok for r in res.rows)} module(s) over tolerance",
            metric=f"{first.module}.rel_rmse", expected=f"<= {tol['rel_rmse']:.3g} (cosine >= {tol['min_cosine']:.10g})",
            observed=f"{first.metrics['rel_rmse']:.4g} (cosine {first.metrics['cosine']:.10g})",
            tolerance=tol["rel_rmse"], details=table)
    if res.generation_failure:
        raise CheckFailure(f"greedy generation differs from the golden: {res.generation_failure}",
                           metric="generation_top1_agreement", expected="equal tokens except at near ties",
                           observed=f"{res.generation['top1_agreement']:.3f}", tolerance=tol["tie_margin"],
                           details=table)
    return res


class PrecisionCheck:
    name = "precision"
    headline = ("logits_rel_rmse", "worst_module_rel_rmse")  # `harness run`'s table

    def enabled(self, suite: LoadedSuite) -> bool:
        return suite.suite.checks.precision.enabled

    def variants(self, suite: LoadedSuite, backend: Backend) -> list[str | None]:
        return [None]

    def run(self, ctx: CheckContext) -> None:
        run_precision(ctx)


# --- quantization budget ---------------------------------------------------------------------


def quant_scheme(ls: LoadedSuite) -> str | None:
    q = ls.suite.checks.precision.quantization
    if q.scheme == "none":
        return None
    if q.scheme != "auto":
        return q.scheme
    qc = ls.raw_config.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower() + str(qc.get("fmt", "")).lower()
    if "fp8" in method or "e4m3" in method:
        return "fp8"
    return None


def _fp8_block(w: torch.Tensor, block: list[int]) -> torch.Tensor:
    r, c = w.shape
    br, bc = block
    pr, pc = (-r) % br, (-c) % bc
    x = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
    x = x.reshape((r + pr) // br, br, (c + pc) // bc, bc)
    scale = x.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (x / scale).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(r + pr, c + pc)[:r, :c].to(w.dtype)


def _int8_channel(w: torch.Tensor) -> torch.Tensor:
    x = w.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    return ((x / scale).round().clamp(-127, 127) * scale).to(w.dtype)


def quantize_weights(model: torch.nn.Module, scheme: str, block: list[int]) -> int:
    """Quantize-dequantize every Linear weight except the LM head and routers (as FP8 checkpoints
    leave them); 3-D fused expert weights too. Returns the number of tensors quantized."""
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or "embed" in name or "norm" in name or name.startswith("lm_head") \
                    or name.endswith(".gate.weight"):
                continue
            flat = p.reshape(-1, p.shape[-1])
            q = _fp8_block(flat, block) if scheme == "fp8" else _int8_channel(flat)
            p.copy_(q.reshape(p.shape))
            n += 1
    return n


class QuantizationCheck:
    name = "quantization"
    headline = ("quant_logits_rel_rmse", "quant_top1_agreement")

    def enabled(self, suite: LoadedSuite) -> bool:
        return suite.suite.checks.precision.enabled and quant_scheme(suite) is not None

    def variants(self, suite: LoadedSuite, backend: Backend) -> list[str | None]:
        return [None]

    def run(self, ctx: CheckContext, golden_root=None) -> None:
        ls = ctx.suite
        q = ls.suite.checks.precision.quantization
        scheme = quant_scheme(ls) or "fp8"
        g = _golden(ctx, golden_root)
        from harness.models.build import build_model

        model, _ = build_model(ls, "float32", "cpu", seed=ls.suite.checks.precision.seed)
        n = quantize_weights(model, scheme, q.block_size)
        act = q.compute_dtype or ctx.dtype
        model = model.to(ctx.device, getattr(torch, act)).eval()
        ctx.notes.append(f"{scheme} weights ({n} tensors, quantize-dequantize), activations in {act}")
        from harness.golden.capture import forward_logits

        with torch.no_grad():
            logits = forward_logits(model, g.inputs.to(ctx.device)).cpu()
        ref = g.modules["logits"]
        got = logits.reshape(-1)[g.indices["logits"]] if "logits" in g.indices else logits
        m = tensor_metrics(got, ref)
        ctx.metric("quant_logits_rel_rmse", m["rel_rmse"])
        ctx.metric("quant_logits_cosine", m["cosine"])
        ctx.tolerance("quant_logits_rel_rmse", q.rel_rmse)
        ctx.tolerance("quant_logits_cosine", q.min_cosine)
        top1 = None
        if "logits" not in g.indices:
            top1 = ctx.metric("quant_top1_agreement", (logits.argmax(-1) == ref.argmax(-1)).double().mean().item())
            ctx.tolerance("quant_top1_agreement", q.min_top1_agreement)
        if not m["rel_rmse"] <= q.rel_rmse:
            raise CheckFailure(f"{scheme} weights exceed the error budget", metric="quant_logits_rel_rmse",
                               expected=f"<= {q.rel_rmse}", observed=f"{m['rel_rmse']:.4g}", tolerance=q.rel_rmse)
        if not m["cosine"] >= q.min_cosine:
            raise CheckFailure(f"{scheme} weights exceed the error budget", metric="quant_logits_cosine",
                               expected=f">= {q.min_cosine}", observed=f"{m['cosine']:.6g}", tolerance=q.min_cosine)
        if top1 is not None and top1 < q.min_top1_agreement:
            raise CheckFailure(f"{scheme} weights change too many argmax tokens", metric="quant_top1_agreement",
                               expected=f">= {q.min_top1_agreement}", observed=f"{top1:.3f}",
                               tolerance=q.min_top1_agreement)


def register(registry: CheckRegistry) -> None:
    registry.add(PrecisionCheck())
    registry.add(QuantizationCheck())
