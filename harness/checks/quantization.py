"""Check ``quantization``: the error budget of quantized weights.

For suites whose config declares FP8 weights (or that set a scheme), the seeded weights are
quantized and dequantized (FP8 e4m3 with block scales, or int8 per channel) and the logits compared
with the float golden (the precision check's) against the declared budget.

Steps: ``golden`` (setup) -> ``quantize`` (build in float32, quantize-dequantize, move to the item's
device and activation dtype) -> ``compare`` (logits vs golden: rel_rmse, cosine, top-1 agreement).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import torch
from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry
from harness.checks.precision import load_golden_for
from harness.precision.compare import tensor_metrics
from harness.suite.loader import LoadedSuite

metrics.declare("quant_logits_rel_rmse", "", "lower", "quantized model: rel_rmse of the logits vs the golden")
metrics.declare("quant_logits_cosine", "", "higher", "quantized model: cosine of the logits vs the golden")
metrics.declare("quant_top1_agreement", "share", "higher", "quantized model: argmax agreement with the golden")


class QuantizationConfig(CheckConfig):
    """Quantized-weights error budget against the float golden (FP8 checkpoints)."""

    scheme: Literal["auto", "fp8", "int8", "none"] = Field(
        "auto", description="'auto': fp8 when config.json declares an fp8 quantization_config; "
        "'fp8' (e4m3, block scales) or 'int8' (per-channel) forces it; 'none' generates no items.")
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



def quant_scheme(ls: LoadedSuite) -> str | None:
    q = ls.suite.checks.quantization
    if q.scheme == "none":
        return None
    if q.scheme != "auto":
        return q.scheme
    qc = ls.raw_config.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower() + str(qc.get("fmt", "")).lower()
    if "fp8" in method or "e4m3" in method:
        return "fp8"
    return None


def block_size(ls: LoadedSuite) -> list[int] | None:
    """FP8 scale block (rows, cols): the suite's when it sets one, else the checkpoint's
    ``weight_block_size``; ``None`` where the config declares none (``null``: one scale per tensor)."""
    q = ls.suite.checks.quantization
    if "block_size" in q.model_fields_set:
        return list(q.block_size)
    qc = ls.raw_config.get("quantization_config") or {}
    if "weight_block_size" in qc:
        b = qc["weight_block_size"]
        return [int(x) for x in b] if isinstance(b, list) and len(b) == 2 else None
    return list(q.block_size)


# Budgets from the golden's measurement: k x the worst clean value over the draws, plus a floor.
QUANT_K = 1.5
QUANT_FLOOR = 0.01  # rel_rmse: FP8 rounding of a backend's own dequant/GEMM order is ~1e-3


def quantized_model(ls: LoadedSuite, numerics_entry: dict | None, dtype: str, device="cpu",
                    scheme: str | None = None) -> tuple[torch.nn.Module, int]:
    """The suite's model with quantize-dequantized weights (the golden's numerics gains applied
    first), activations in ``dtype``; and the number of tensors quantized."""
    from harness.models.build import build_model, cast_model
    from harness.precision import numerics

    model, _ = build_model(ls, "float32", "cpu", seed=ls.suite.checks.precision.seed)
    numerics.apply(model, numerics_entry)
    n = quantize_weights(model, scheme or quant_scheme(ls) or "fp8", block_size(ls))
    return cast_model(model, getattr(torch, dtype), device).eval(), n


def _logit_errors(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    m = tensor_metrics(logits, ref)
    return {"rel_rmse": m["rel_rmse"], "cosine": m["cosine"],
            "top1": (logits.argmax(-1) == ref.argmax(-1)).double().mean().item(), "positions": ref[..., 0].numel()}


def measure(ls: LoadedSuite, draws: list[torch.Tensor], reference_logits: list[torch.Tensor], dtypes: list[str],
            numerics_entry: dict | None) -> dict | None:
    """The manifest's ``quantization``: the quantized model's logits error against the float64 reference
    on each input draw, per activation dtype, on the reference backend (CPU): worst rel_rmse and
    cosine, lowest top-1 agreement."""
    from harness.golden.capture import forward_logits

    scheme = quant_scheme(ls)
    if scheme is None:
        return None
    out = {"scheme": scheme, "block_size": block_size(ls), "draws": len(draws), "k": QUANT_K, "dtypes": {}}
    for dtype in dtypes:
        model, _ = quantized_model(ls, numerics_entry, dtype)
        rows = []
        with torch.no_grad():
            for ids, ref in zip(draws, reference_logits, strict=True):
                rows.append(_logit_errors(forward_logits(model, ids).float(), ref.float()))
        out["dtypes"][dtype] = {"rel_rmse_max": float(f"{max(r['rel_rmse'] for r in rows):.4g}"),
                                "cosine_min": float(f"{min(r['cosine'] for r in rows):.6g}"),
                                "top1_min": float(f"{min(r['top1'] for r in rows):.4g}"),
                                "positions": rows[0]["positions"]}
    return out


def budgets(ls: LoadedSuite, manifest: dict, dtype: str) -> tuple[dict, str]:
    """({"rel_rmse", "min_cosine", "min_top1_agreement"}, where they came from) for a run: a value the
    suite sets is the budget; otherwise k x the golden's measured clean error (+ floor) when the
    golden measured this scheme and block in this dtype, else the declared defaults."""
    q = ls.suite.checks.quantization
    declared = {"rel_rmse": q.rel_rmse, "min_cosine": q.min_cosine, "min_top1_agreement": q.min_top1_agreement}
    meas = manifest.get("quantization") or {}
    m = (meas.get("dtypes") or {}).get(dtype)
    if not m or meas.get("scheme") != quant_scheme(ls) or meas.get("block_size") != block_size(ls):
        why = "the golden has no measurement" if not meas else \
            f"the golden measured {meas.get('scheme')} blocks {meas.get('block_size')} in {sorted(meas.get('dtypes') or {})}"
        return declared, f"declared budgets ({why})"
    n = max(int(m.get("positions") or 1), 1)
    out = {"rel_rmse": QUANT_K * m["rel_rmse_max"] + QUANT_FLOOR,
           "min_cosine": 1 - (QUANT_K * (1 - m["cosine_min"]) + 1e-4),
           # disagreements: k x the measured share, plus one position (a near tie another backend breaks)
           "min_top1_agreement": max(0.0, 1 - (QUANT_K * (1 - m["top1_min"]) + 1 / n))}
    src = f"measured by golden generate ({meas.get('draws')} draws, k={QUANT_K:g})"
    for key in ("rel_rmse", "min_cosine", "min_top1_agreement"):
        if key in q.model_fields_set:
            out[key] = declared[key]
            src += f"; {key} set by the suite"
    return out, src


def _fp8_block(w: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    r, c = w.shape
    br, bc = block or (r, c)  # None: one scale for the tensor
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


def quantize_weights(model: torch.nn.Module, scheme: str, block: list[int] | None) -> int:
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


class QuantizationCheck(Check):
    name = "quantization"
    order = 30
    config_model = QuantizationConfig
    headline = ("quant_logits_rel_rmse", "quant_top1_agreement")
    steps = ("golden", "quantize", "compare")
    setup_steps = ("golden",)

    def enabled(self, suite: LoadedSuite) -> bool:
        return self.config(suite).enabled and quant_scheme(suite) is not None

    def new_state(self, ctx: CheckContext):
        return SimpleNamespace(golden_root=None, transform=None)

    def golden(self, ctx: CheckContext, st) -> None:
        st.g = load_golden_for(ctx, st.golden_root)

    def quantize(self, ctx: CheckContext, st) -> None:
        ls, q = ctx.suite, ctx.config
        st.scheme = quant_scheme(ls) or "fp8"
        st.act = q.compute_dtype or ctx.dtype
        st.model, n = quantized_model(ls, st.g.manifest.get("numerics"), st.act, ctx.device, st.scheme)
        if st.transform is not None:  # tests: a faulty quantized kernel
            st.model = st.transform(st.model)
        blk = block_size(ls)
        ctx.notes.append(f"{st.scheme} weights ({n} tensors, quantize-dequantize, "
                         f"{'blocks ' + 'x'.join(map(str, blk)) if blk else 'one scale per tensor'}), "
                         f"activations in {st.act}")

    def compare(self, ctx: CheckContext, st) -> None:
        from harness.golden.capture import forward_logits

        g, scheme = st.g, st.scheme
        b, src = budgets(ctx.suite, g.manifest, st.act)
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
    registry.add(QuantizationCheck())
