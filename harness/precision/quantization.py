"""Quantization error against the float reference: which scheme a suite simulates, the seeded model
with quantize-dequantized weights, the error ``golden generate`` measures on the reference backend
and the budgets the quantization check derives from that measurement."""

from __future__ import annotations

import torch

from harness.anatomy.quant import family
from harness.precision.compare import tensor_metrics
from harness.suite.loader import LoadedSuite

# The formats this check quantize-dequantizes, each at the checkpoint's own granularity: FP8 e4m3
# (blocks, channels, tensor), MXFP4 (e2m1, one power-of-two e8m0 scale per 32), NVFP4 (e2m1, an e4m3
# scale per 16 under an fp32 global one), INT4/INT8 (per group / channel / tensor, symmetric or with a
# zero point). A format harness.anatomy.quant recognizes beyond these is a known gap, said in one line.
SIMULATED = ("fp8", "int8", "int4", "mxfp4", "nvfp4")
# When a suite forces a scheme without a checkpoint that declares one: the formats' usual groups.
DEFAULT_GROUP = {"mxfp4": 32, "nvfp4": 16, "int4": 128}


def _config(ls: LoadedSuite) -> dict | None:
    """The checkpoint's ``quantization_config``: top level, else a wrapper's ``text_config``'s
    (Kimi-K2.5 declares its INT4 experts there), as the model build reads it."""
    raw = ls.raw_config
    q = raw.get("quantization_config")
    if not q and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
    return q or None


def _declared(ls: LoadedSuite):
    from harness.anatomy.quant import quant_scheme as stored

    return stored(_config(ls))


def quant_scheme(ls: LoadedSuite) -> str | None:
    """The format family the suite's quantization items test: the suite's ``scheme``, or with
    ``auto`` the family of the checkpoint's ``quantization_config`` as harness.anatomy.quant reads
    it (the parser ``harness inspect`` uses: fp8 in any spelling, compressed-tensors, ModelOpt,
    mxfp4, nvfp4, int4/int8); None: no items."""
    q = ls.suite.checks.quantization
    if q.scheme == "none":
        return None
    if q.scheme != "auto":
        return q.scheme
    return family(_config(ls))


def describe(ls: LoadedSuite) -> str:
    """The checkpoint's format in inspect's words (``fp8 block 128x128 (checkpoint)``), or the scheme."""
    s = _declared(ls)
    return s.label if s is not None else str(quant_scheme(ls))


def block_size(ls: LoadedSuite) -> list[int] | None:
    """FP8 scale block (rows, cols): the suite's when it sets one, else the checkpoint's as
    harness.anatomy.quant reads it (``weight_block_size``, compressed-tensors' ``block_structure``);
    ``[1, -1]`` for one scale per output channel; ``None`` for one scale per tensor. A config that
    declares no FP8 granularity at all gets the suite's default block."""
    q = ls.suite.checks.quantization
    if "block_size" in q.model_fields_set:
        return list(q.block_size)
    s = _declared(ls)
    scheme = quant_scheme(ls)
    if s is None or family(_config(ls)) != scheme:  # no checkpoint format, or the suite forces another
        return [1, DEFAULT_GROUP[scheme]] if scheme in DEFAULT_GROUP else \
            ([1, -1] if scheme == "int8" else list(q.block_size))
    if s.granularity == "block":
        return list(s.block)
    if s.granularity == "group":
        return [1, int(s.group)]  # one scale per `group` consecutive inputs of a row
    return [1, -1] if s.granularity == "channel" else None


def symmetric(ls: LoadedSuite) -> bool:
    """Integer formats: symmetric (no zero point) unless the checkpoint declares one."""
    s = _declared(ls)
    return s is None or "zero point" not in s.scale_dtype


# Budgets from the golden's measurement: k x the worst clean value over the draws, plus a floor.
QUANT_K = 1.5
QUANT_FLOOR = 0.01  # rel_rmse: FP8 rounding of a backend's own dequant/GEMM order is ~1e-3


def quantized_model(ls: LoadedSuite, numerics_entry: dict | None, dtype: str, device="cpu",
                    scheme: str | None = None) -> tuple[torch.nn.Module, int]:
    """The suite's model with quantize-dequantized weights (the golden's numerics gains applied
    first), activations in ``dtype``; and the number of tensors quantized."""
    from harness.models import numerics
    from harness.models.build import build_model, cast_model

    model, _ = build_model(ls, "float32", "cpu", seed=ls.suite.checks.precision.seed)
    numerics.apply(model, numerics_entry)
    s = _declared(ls)
    n = quantize_weights(model, scheme or quant_scheme(ls) or "fp8", block_size(ls), symmetric=symmetric(ls),
                         skip=s.skips if s is not None and s.ignore else None)
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
    from harness.anatomy.capture import forward_logits

    scheme = quant_scheme(ls)
    if scheme not in SIMULATED:
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
    bc = c if bc <= 0 else bc  # [1, -1]: one scale per output row (a per-channel checkpoint)
    pr, pc = (-r) % br, (-c) % bc
    x = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
    x = x.reshape((r + pr) // br, br, (c + pc) // bc, bc)
    scale = x.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (x / scale).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(r + pr, c + pc)[:r, :c].to(w.dtype)


# e2m1's representable magnitudes (FP4 in MXFP4 and NVFP4)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the larger magnitude), saturating at 6."""
    mids = (E2M1[1:] + E2M1[:-1]) / 2
    return E2M1[torch.bucketize(x.abs().clamp(max=6.0).contiguous(), mids, right=True)] * x.sign()


def _grouped(w: torch.Tensor, g: int) -> tuple[torch.Tensor, int]:
    """[r, c] -> [r, ceil(c / g), g] (zero-padded: zeros never raise a group's maximum) and the pad."""
    r, c = w.shape
    pad = (-c) % g
    return torch.nn.functional.pad(w.float(), (0, pad)).reshape(r, (c + pad) // g, g), pad


def _ungrouped(x: torch.Tensor, pad: int, like: torch.Tensor) -> torch.Tensor:
    x = x.reshape(x.shape[0], -1)
    return (x[:, : x.shape[1] - pad] if pad else x).to(like.dtype)


def _mxfp4(w: torch.Tensor, g: int = 32) -> torch.Tensor:
    """OCP MX: one shared power-of-two scale (e8m0) per ``g`` elements, 2^(floor(log2 amax) - 2), so
    the largest element lands in e2m1's top binade [4, 6] (above 6 it saturates)."""
    x, pad = _grouped(w, g)
    amax = x.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    return _ungrouped(_e2m1(x / scale) * scale, pad, w)


def _nvfp4(w: torch.Tensor, g: int = 16) -> torch.Tensor:
    """NVFP4: an fp32 global scale (amax / (6 x 448)) and per ``g`` elements an e4m3 scale of
    amax_group / 6 relative to it; elements e2m1."""
    x, pad = _grouped(w, g)
    glob = x.abs().amax().clamp_min(1e-12) / (6.0 * 448.0)
    local = (x.abs().amax(-1, keepdim=True) / 6.0 / glob).to(torch.float8_e4m3fn).float().clamp_min(2.0 ** -9)
    scale = local * glob
    return _ungrouped(_e2m1(x / scale) * scale, pad, w)


def _int(w: torch.Tensor, bits: int, g: int | None, sym: bool = True) -> torch.Tensor:
    """Integer quantization as compressed-tensors computes it: one scale per ``g`` inputs of a row
    (``g`` None or <= 0: per row), symmetric (scale amax / ((qmax - qmin) / 2)) or with a zero point."""
    x, pad = _grouped(w, g) if g and g > 0 else (w.float().unsqueeze(1), 0)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if sym:
        scale = (x.abs().amax(-1, keepdim=True) / ((qmax - qmin) / 2)).clamp_min(1e-12)
        q = (x / scale).round().clamp(qmin, qmax) * scale
    else:
        lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / (qmax - qmin)).clamp_min(1e-12)
        zp = qmin - (lo / scale).round()
        q = ((x / scale).round() + zp).clamp(qmin, qmax).sub(zp) * scale
    return _ungrouped(q, pad, w)


def _int8_channel(w: torch.Tensor) -> torch.Tensor:
    return _int(w, 8, None)


def quantize_weights(model: torch.nn.Module, scheme: str, block: list[int] | None, *, symmetric: bool = True,
                     skip=None) -> int:
    """Quantize-dequantize every Linear weight except the LM head and routers (as checkpoints leave
    them), and what the checkpoint's ``ignore`` list keeps (``skip(module name)``: gpt-oss keeps its
    attention in bf16, Laguna its attention projections); 3-D fused expert weights too, grouped along
    their input dimension (dim 1 where the experts module is ``is_transposed``, gpt-oss). Returns the
    number of tensors quantized."""
    n = 0
    group = block[1] if block and block[0] == 1 else None  # [1, g]: g inputs per scale; [1, -1]: per row
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or "embed" in name or "norm" in name or name.startswith("lm_head") \
                    or name.endswith(".gate.weight") or name.endswith("bias"):  # gpt-oss's 2-D expert biases
                continue
            owner = name.rsplit(".", 1)[0]
            if skip is not None and skip(owner if name.endswith(".weight") else name):
                continue
            w = p.transpose(-1, -2) if p.dim() == 3 and getattr(mods.get(owner), "is_transposed", False) else p
            flat = w.reshape(-1, w.shape[-1])
            if scheme == "fp8":
                q = _fp8_block(flat, block)
            elif scheme == "mxfp4":
                q = _mxfp4(flat, group or 32)
            elif scheme == "nvfp4":
                q = _nvfp4(flat, group or 16)
            else:
                q = _int(flat, 4 if scheme == "int4" else 8, group, symmetric)
            w.copy_(q.reshape(w.shape))
            n += 1
    return n
