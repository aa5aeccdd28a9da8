"""Check ``quantization``: the error budget of quantized weights.

For suites whose checkpoint declares quantized weights (config.json, a wrapper's text_config, or
hf_quant_config.json beside it) or that set a scheme, the seeded weights are quantized and
dequantized in that format at its granularity (FP8 e4m3 blocks / channels / tensor, MXFP4, MXFP8,
NVFP4, INT4 / INT8 groups, skipping what the checkpoint's ignore list keeps), with the input
activations the checkpoint declares (NVFP4's 4-bit, FP8's), and the logits compared with the float
golden (the precision check's) against the budget golden generate measured. A release of several
formats (NVFP4 experts beside FP8 attention: compressed-tensors groups with targets, ModelOpt's
per-layer ``quantized_layers``) gets one item per format, each quantizing only that format's modules
and judged by that format's own measurement.

Steps: ``golden`` (setup) -> ``quantize`` (build in float32, quantize-dequantize, move to the item's
device and activation dtype) -> ``compare`` (logits vs golden: rel_rmse, cosine, top-1 agreement).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import torch
from pydantic import Field

from harness import metrics
from harness.checks import (
    Check,
    CheckConfig,
    CheckContext,
    CheckFailure,
    CheckRegistry,
    KnownGap,
    NotApplicable,
)
from harness.golden.sections import load_golden_for
from harness.precision.compare import tensor_metrics
from harness.precision.quantization import (
    SIMULATED,
    block_size,
    budgets,
    describe,
    formats,
    layout,
    quant_scheme,
    quantized_model,
)
from harness.suite.loader import LoadedSuite

metrics.declare("quant_logits_rel_rmse", "", "lower", "quantized model: rel_rmse of the logits vs the golden")
metrics.declare("quant_logits_cosine", "", "higher", "quantized model: cosine of the logits vs the golden")
metrics.declare("quant_top1_agreement", "share", "higher", "quantized model: argmax agreement with the golden")


class QuantizationConfig(CheckConfig):
    """Quantized-weights error budget against the float golden (FP8 checkpoints)."""

    scheme: Literal["auto", "fp8", "int8", "int4", "mxfp4", "nvfp4", "mxfp8", "none"] = Field(
        "auto", description="'auto': the format the checkpoint declares (config.json's quantization_config, "
        "a wrapper's text_config, or hf_quant_config.json beside it), at its granularity; 'fp8' (e4m3, block "
        "scales), 'int8' (per channel), 'int4' (group 128), 'mxfp4' (group 32), 'nvfp4' (group 16) force one; "
        "'none' generates no items.")
    block_size: list[int] = Field(default_factory=lambda: [128, 128], description="FP8 weight block (rows, cols).")
    compute_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="Dtype activations run in (unset: the item's dtype).")
    # The budgets below apply only where the golden holds no measurement (an older golden, another
    # scheme or block) or when the suite sets them (then they are the budget, measured or not).
    # golden generate measures the quantized model's own error on the reference backend (see
    # ``measure``): FP8 error on random weights depends on the model (DeepSeek-V3.2's 0.21 logits
    # rel_rmse vs deepseek-v3's 0.14 with the same format), so one fixed number errs both ways.
    rel_rmse: float = Field(0.2, ge=0, description="Budget: max relative RMSE of the logits vs the golden "
                            "(default: k x the golden's measured quantization error + 0.01).")
    min_cosine: float = Field(0.98, le=1, description="Budget: min cosine similarity of the logits "
                              "(default: from the golden's measurement).")
    min_top1_agreement: float = Field(0.8, ge=0, le=1, description="Budget: min share of positions whose "
                                      "argmax token equals the golden's (default: from the golden's measurement).")



class QuantizationCheck(Check):
    cpu_threads = 1  # the pruned test models: one intra-op thread (harness.models.build.cpu_threads)
    name = "quantization"
    order = 30
    config_model = QuantizationConfig
    headline = ("quant_logits_rel_rmse", "quant_top1_agreement")
    steps = ("golden", "quantize", "compare")
    setup_steps = ("golden",)

    def enabled(self, suite: LoadedSuite) -> bool:
        return self.config(suite).enabled and quant_scheme(suite) is not None

    def variants(self, suite, backend) -> list[str | None]:
        # one item per format of a mixed release (its own modules, its own budget); one plain item else
        fams = formats(suite)
        return fams if len(fams) > 1 else [None]

    def new_state(self, ctx: CheckContext):
        return SimpleNamespace(golden_root=None, transform=None)

    def golden(self, ctx: CheckContext, st) -> None:
        st.scheme = ctx.variant or quant_scheme(ctx.suite) or "fp8"
        if st.scheme not in SIMULATED:  # recognized (inspect counts its bytes), not simulated: say so
            raise KnownGap(f"{describe(ctx.suite, ctx.variant)} weights: the quantization check simulates "
                           f"{', '.join(SIMULATED)} only; {st.scheme} is not checked against the golden yet")
        lay = layout(ctx.suite)
        if lay is not None and lay.unread:  # a group in a format harness cannot read stays unquantized
            ctx.notes.append("not simulated (a format harness cannot read): " + "; ".join(lay.unread))
        st.g = load_golden_for(ctx, st.golden_root)

    def quantize(self, ctx: CheckContext, st) -> None:
        ls, q = ctx.suite, ctx.config
        st.act = q.compute_dtype or ctx.dtype
        st.model, n = quantized_model(ls, st.g.manifest.get("numerics"), st.act, ctx.device, st.scheme)
        if n == 0:  # a format whose targets name no module of the model would pass at error 0
            raise NotApplicable(f"{describe(ls, ctx.variant)}: the checkpoint's targets for {st.scheme} name no "
                                "module of the model (by its names or the checkpoint's), so nothing is quantized")
        if st.transform is not None:  # tests: a faulty quantized kernel
            st.model = st.transform(st.model)
        blk = block_size(ls, st.scheme)
        gran = ("one scale per output channel" if blk and blk[1] <= 0 else
                f"one scale per {blk[1]} inputs" if blk and blk[0] == 1 else "blocks " + "x".join(map(str, blk))
                if blk else "one scale per tensor")
        ctx.notes.append(f"{st.scheme} weights ({n} tensors, quantize-dequantize, {gran}), "
                         f"activations in {st.act}")

    def compare(self, ctx: CheckContext, st) -> None:
        from harness.anatomy.capture import forward_logits

        g, scheme = st.g, st.scheme
        b, src = budgets(ctx.suite, g.manifest, st.act, st.scheme)
        q = SimpleNamespace(rel_rmse=b["rel_rmse"], min_cosine=b["min_cosine"],
                            min_top1_agreement=b["min_top1_agreement"])
        ctx.detail("budget_source", src)
        with torch.no_grad():
            logits = forward_logits(st.model, g.inputs.to(ctx.device)).cpu()  # [B, S, vocab]
        ref = g.modules["logits"]
        got = logits.reshape(-1)[g.indices["logits"]] if "logits" in g.indices else logits
        m = tensor_metrics(got, ref)
        ctx.metric("quant_logits_rel_rmse", m["rel_rmse"])
        ctx.metric("quant_logits_cosine", m["cosine"])
        ctx.tolerance("quant_logits_rel_rmse", q.rel_rmse)
        ctx.tolerance("quant_logits_cosine", q.min_cosine)
        top1 = None
        if "logits" not in g.indices and q.min_top1_agreement is not None:
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
    registry.add(QuantizationCheck())
