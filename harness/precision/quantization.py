"""Quantization error against the float reference: which scheme a suite simulates, the seeded model
with quantize-dequantized weights, the error ``golden generate`` measures on the reference backend
and the budgets the quantization check derives from that measurement."""

from __future__ import annotations

import torch

from harness.anatomy.quant import QuantGroup, QuantLayout, QuantScheme, family, quant_layout
from harness.precision.compare import tensor_metrics
from harness.suite.loader import LoadedSuite

# The formats this check quantize-dequantizes, each at the checkpoint's own granularity: FP8 e4m3
# (blocks, channels, tensor), MXFP4 (e2m1, one power-of-two e8m0 scale per 32), NVFP4 (e2m1, an e4m3
# scale per 16 under an fp32 global one), INT4/INT8 (per group / channel / tensor, symmetric or with a
# zero point). A format harness.anatomy.quant recognizes beyond these is a known gap, said in one line.
SIMULATED = ("fp8", "int8", "int4", "mxfp4", "nvfp4", "mxfp8")
# When a suite forces a scheme without a checkpoint that declares one: the formats' usual groups.
DEFAULT_GROUP = {"mxfp4": 32, "nvfp4": 16, "int4": 128, "mxfp8": 32}


def _config(ls: LoadedSuite) -> dict | None:
    """The checkpoint's ``quantization_config``: top level, else a wrapper's ``text_config``'s
    (Kimi-K2.5 declares its INT4 experts there), as the model build reads it."""
    raw = ls.raw_config
    q = raw.get("quantization_config")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    if not q:
        q = text.get("quantization_config")
    expert_dtype = raw.get("expert_dtype") or text.get("expert_dtype")  # DeepSeek-V4: fp4 experts
    return ({**q, "_expert_dtype": expert_dtype} if expert_dtype else q) if q else None


def layout(ls: LoadedSuite) -> QuantLayout | None:
    """Which modules the checkpoint stores in which format (harness.anatomy.quant.quant_layout)."""
    return quant_layout(_config(ls))


def formats(ls: LoadedSuite) -> list[str]:
    """The format families the suite's quantization items test, one item each when there are several
    (a mixed release: NVFP4 experts beside FP8 attention); the suite's ``scheme`` when it forces one."""
    q = ls.suite.checks.quantization
    if q.scheme == "none":
        return []
    if q.scheme != "auto":
        return [q.scheme]
    lay = layout(ls)
    return lay.families if lay is not None else []


def follows_checkpoint(ls: LoadedSuite, fam: str) -> bool:
    """Whether ``fam`` is simulated module by module as the checkpoint stores it (its groups, their
    granularity and activations), not forced onto every Linear by the suite's ``scheme`` / ``block_size``."""
    q = ls.suite.checks.quantization
    lay = layout(ls)
    return lay is not None and fam in lay.families and "block_size" not in q.model_fields_set


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


def describe(ls: LoadedSuite, fam: str | None = None) -> str:
    """The checkpoint's format in inspect's words (``fp8 block 128x128 (checkpoint)``), or the scheme;
    ``fam``: that format's of a mixed release."""
    lay = layout(ls)
    if fam is not None and lay is not None and fam in lay.families:
        return " + ".join(dict.fromkeys(g.scheme.label for g in lay.groups if g.family == fam))
    s = _declared(ls)
    return s.label if s is not None else str(quant_scheme(ls))


def granularity(s: QuantScheme) -> list[int] | None:
    """A stored scheme's scale layout as block_size says it: [rows, cols] blocks, [1, g] groups,
    [1, -1] one scale per output row, None one per tensor."""
    if s.granularity == "block":
        return list(s.block)
    if s.granularity == "group":
        return [1, int(s.group)]
    return [1, -1] if s.granularity == "channel" else None


def block_size(ls: LoadedSuite, fam: str | None = None) -> list[int] | None:
    """FP8 scale block (rows, cols): the suite's when it sets one, else the checkpoint's as
    harness.anatomy.quant reads it (``weight_block_size``, compressed-tensors' ``block_structure``);
    ``[1, -1]`` for one scale per output channel; ``None`` for one scale per tensor. A config that
    declares no FP8 granularity at all gets the suite's default block. ``fam``: that format's groups'
    (the first group's) in a mixed release."""
    q = ls.suite.checks.quantization
    if "block_size" in q.model_fields_set:
        return list(q.block_size)
    lay = layout(ls)
    if fam is not None and lay is not None and lay.mixed and fam in lay.families:
        return granularity(next(g for g in lay.groups if g.family == fam).scheme)
    s = _declared(ls)
    scheme = quant_scheme(ls)
    if s is None or family(_config(ls)) != scheme:  # no checkpoint format, or the suite forces another
        return [1, DEFAULT_GROUP[scheme]] if scheme in DEFAULT_GROUP else \
            ([1, -1] if scheme == "int8" else list(q.block_size))
    return granularity(s)


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
    first), activations in ``dtype``; and the number of tensors quantized. ``scheme``: the format
    family to simulate (a mixed release's items take one each). Where the checkpoint says which
    modules it stores in that format, exactly those are quantized, each group at its granularity,
    with the input activations the group declares (NVFP4's 4-bit inputs, FP8's e4m3 inputs);
    modules in the release's other formats stay in high precision, so each item's error is its own."""
    from harness.models import numerics
    from harness.models.build import build_model, cast_model

    model, _ = build_model(ls, "float32", "cpu", seed=ls.suite.checks.precision.seed)
    numerics.apply(model, numerics_entry)
    fam = scheme or quant_scheme(ls) or "fp8"
    if follows_checkpoint(ls, fam):
        n = quantize_layout(model, layout(ls), fam, symmetric=symmetric(ls))
    else:  # the suite forces a format or a block: every quantizable Linear, the ignore list kept
        s = _declared(ls)
        n = quantize_weights(model, fam, block_size(ls), symmetric=symmetric(ls),
                             skip=s.skips if s is not None and s.ignore else None)
    return cast_model(model, getattr(torch, dtype), device).eval(), n


def groups_of(model: torch.nn.Module, lay: QuantLayout) -> dict[str, QuantGroup | None]:
    """Each parameter's group in the checkpoint's layout, by the model's and the checkpoint's names."""
    from harness.weights.rename import checkpoint_names

    return {p: lay.group_of(names) for p, names in checkpoint_names(model).items()}


def quantize_layout(model: torch.nn.Module, lay: QuantLayout, fam: str, *, symmetric: bool = True) -> int:
    """Quantize-dequantize the parameters the layout stores in ``fam`` (each group at its own
    granularity; the LM head only where a group names it), and hook their modules' inputs where the
    group declares quantized activations. Returns the number of tensors quantized."""
    from harness.anatomy.quant import matches

    of = groups_of(model, lay)
    n = 0
    for g in (g for g in lay.groups if g.family == fam):
        picked = {p for p, gg in of.items() if gg is g}
        done: list[str] = []
        n += quantize_weights(model, fam, granularity(g.scheme), symmetric=symmetric, select=picked.__contains__,
                              head=not g.catch_all and matches(g.targets, "lm_head"), done=done)
        if g.act is not None:  # the inputs of the modules whose weights are stored in this format
            quantize_inputs(model, {p.rsplit(".", 1)[0] for p in done}, g.act)
    return n


def quantize_inputs(model: torch.nn.Module, owners: set[str], act) -> int:
    """Forward pre-hooks that quantize-dequantize the first input of each module in ``owners`` as
    ``act`` (harness.anatomy.quant.ActQuant) says: NVFP4 per group of 16, FP8 per token / group /
    tensor, INT8 per token. A fused experts module sees its hidden states (the gate/up input)."""
    def fake(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        if act.family == "nvfp4":
            q = _nvfp4(flat, act.group or 16)
        elif act.family == "int8":
            q = _int(flat, 8, None)
        else:
            q = _fp8_block(flat, None if act.per_tensor else [1, act.group or -1])
        return q.reshape(x.shape).to(x.dtype)

    def hook(_mod, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() and args[0].numel():
            return (fake(args[0]), *args[1:])
        return None

    mods = dict(model.named_modules())
    for name in owners:
        if name in mods:
            mods[name].register_forward_pre_hook(hook)
    return len(owners)


def _logit_errors(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    m = tensor_metrics(logits, ref)
    return {"rel_rmse": m["rel_rmse"], "cosine": m["cosine"],
            "top1": (logits.argmax(-1) == ref.argmax(-1)).double().mean().item(), "positions": ref[..., 0].numel()}


def acts(ls: LoadedSuite, fam: str) -> list[str] | None:
    """The input activations simulated with ``fam`` (part of what a golden's measurement is of)."""
    lay = layout(ls)
    if not follows_checkpoint(ls, fam):
        return None
    out = sorted({g.act.describe() for g in lay.groups if g.family == fam and g.act is not None})
    return out or None


def measure(ls: LoadedSuite, draws: list[torch.Tensor], reference_logits: list[torch.Tensor], dtypes: list[str],
            numerics_entry: dict | None) -> dict | None:
    """The manifest's ``quantization``: the quantized model's logits error against the float64 reference
    on each input draw, per activation dtype, on the reference backend (CPU): worst rel_rmse and
    cosine, lowest top-1 agreement. A release of several formats: ``{"formats": {family: ...}}``,
    each measured with only that format's modules quantized."""
    fams = [f for f in formats(ls) if f in SIMULATED]
    if not fams:
        return None
    if len(formats(ls)) > 1:
        return {"formats": {f: _measure_one(ls, f, draws, reference_logits, dtypes, numerics_entry) for f in fams}}
    return _measure_one(ls, fams[0], draws, reference_logits, dtypes, numerics_entry)


def _measure_one(ls, fam, draws, reference_logits, dtypes, numerics_entry) -> dict:
    from harness.anatomy.capture import forward_logits

    out = {"scheme": fam, "block_size": block_size(ls, fam), "acts": acts(ls, fam), "draws": len(draws),
           "k": QUANT_K, "dtypes": {}}
    for dtype in dtypes:
        model, _ = quantized_model(ls, numerics_entry, dtype, scheme=fam)
        rows = []
        with torch.no_grad():
            for ids, ref in zip(draws, reference_logits, strict=True):
                rows.append(_logit_errors(forward_logits(model, ids).float(), ref.float()))
        out["dtypes"][dtype] = {"rel_rmse_max": float(f"{max(r['rel_rmse'] for r in rows):.4g}"),
                                "cosine_min": float(f"{min(r['cosine'] for r in rows):.6g}"),
                                "top1_min": float(f"{min(r['top1'] for r in rows):.4g}"),
                                "positions": rows[0]["positions"]}
    return out


# Top-1 agreement judges only where the clean quantized model keeps most argmaxes: a bound derived
# below this from a format that flips most of them (NVFP4 on random seeded weights: 0.3-0.6) could
# not fail a wrong kernel that flips the rest, so it is not a budget (issue #50: a tolerance of 0.0).
TOP1_INFORMATIVE = 0.5


def budgets(ls: LoadedSuite, manifest: dict, dtype: str, fam: str | None = None) -> tuple[dict, str]:
    """({"rel_rmse", "min_cosine", "min_top1_agreement"}, where they came from) for a run: a value the
    suite sets is the budget; otherwise k x the golden's measured clean error (+ floor) when the
    golden measured this scheme, block and activations in this dtype, else the declared defaults.
    ``min_top1_agreement`` None: top-1 is not judged (the measured agreement carries no bound)."""
    q = ls.suite.checks.quantization
    fam = fam or quant_scheme(ls)
    declared = {"rel_rmse": q.rel_rmse, "min_cosine": q.min_cosine, "min_top1_agreement": q.min_top1_agreement}
    meas = manifest.get("quantization") or {}
    if "formats" in meas:
        meas = meas["formats"].get(fam) or {}
    m = (meas.get("dtypes") or {}).get(dtype)
    if not m or meas.get("scheme") != fam or meas.get("block_size") != block_size(ls, fam) \
            or meas.get("acts") != acts(ls, fam):
        why = "the golden has no measurement" if not meas else \
            f"the golden measured {meas.get('scheme')} blocks {meas.get('block_size')} inputs {meas.get('acts')} " \
            f"in {sorted(meas.get('dtypes') or {})}"
        return declared, f"declared budgets ({why})"
    n = max(int(m.get("positions") or 1), 1)
    # disagreements: k x the measured share, plus one position (a near tie another backend breaks)
    top1 = 1 - (QUANT_K * (1 - m["top1_min"]) + 1 / n)
    out = {"rel_rmse": QUANT_K * m["rel_rmse_max"] + QUANT_FLOOR,
           "min_cosine": 1 - (QUANT_K * (1 - m["cosine_min"]) + 1e-4),
           "min_top1_agreement": top1 if top1 >= TOP1_INFORMATIVE else None}
    src = f"measured by golden generate ({meas.get('draws')} draws, k={QUANT_K:g})"
    if out["min_top1_agreement"] is None:
        src += (f"; top-1 not judged: the clean {fam} model keeps {m['top1_min']:.0%} of the argmaxes, a bound "
                f"under {TOP1_INFORMATIVE:.0%} nothing could fail")
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


def _mxfp8(w: torch.Tensor, g: int = 32) -> torch.Tensor:
    """OCP MXFP8 (e4m3 elements): one power-of-two scale per ``g`` elements, 2^(floor(log2 amax) - 8),
    so the largest element lands in e4m3's top binade [256, 448]."""
    x, pad = _grouped(w, g)
    amax = x.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 8)
    return _ungrouped((x / scale).to(torch.float8_e4m3fn).float() * scale, pad, w)


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
                     skip=None, select=None, head: bool = False, done: list | None = None) -> int:
    """Quantize-dequantize every Linear weight except the LM head and routers (as checkpoints leave
    them), and what the checkpoint's ``ignore`` list keeps (``skip(module name)``: gpt-oss keeps its
    attention in bf16, Laguna its attention projections); 3-D fused expert weights too, grouped along
    their input dimension (dim 1 where the experts module is ``is_transposed``, gpt-oss). Returns the
    number of tensors quantized. ``select(parameter name)``: only those (a mixed release's format);
    ``head``: the LM head too (a release whose group names it: Qwen3.6's NVFP4 lm_head); ``done``
    gets the names of the parameters quantized."""
    n = 0
    group = block[1] if block and block[0] == 1 else None  # [1, g]: g inputs per scale; [1, -1]: per row
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or "embed" in name or "norm" in name or (name.startswith("lm_head") and not head) \
                    or name.endswith(".gate.weight") or name.endswith("bias"):  # gpt-oss's 2-D expert biases
                continue
            if select is not None and not select(name):
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
            elif scheme == "mxfp8":
                q = _mxfp8(flat, group or 32)
            else:
                q = _int(flat, 4 if scheme == "int4" else 8, group, symmetric)
            w.copy_(q.reshape(w.shape))
            n += 1
            if done is not None:
                done.append(name)
    return n
