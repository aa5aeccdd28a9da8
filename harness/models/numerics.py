"""Realistic numerics without real weights: seeded random weights rescaled so that activation
statistics look like a trained model's.

With the default initialisation (std 0.02) attention is nearly uniform (its entropy is within a few
percent of log(keys)) and every decoder layer adds a tiny update to the residual stream. A kernel
fault that only matters for peaky attention (a softmax/SDPA scale off by 3%) is then invisible under
bfloat16 rounding. Trained checkpoints have peaky heads (entropy well below uniform) and a
residual stream whose RMS grows layer after layer. Two gains per decoder layer reproduce that:

* **attention gain** ``g_l``: multiplies the attention module's ``scaling`` (the softmax
  temperature every transformers attention passes to its kernel, so SDPA, eager and vendor kernels
  all see it) so that the std of the attention logits over the causal entries is
  ``attention_logit_std`` (default 3.0: measured mean normalised entropy 0.45-0.6, see
  docs/precision.md);
* **residual gain** ``r_l``: a power of two (exact in every dtype, so casting order does not
  matter) that multiplies the output projections of the layer's attention and MLP/experts
  (``o_proj``, ``down_proj``, ...), chosen so that the residual RMS grows by about
  ``residual_growth`` (default 1.5x) per layer.

``calibrate`` runs the float64 reference once per pass on the golden's input ids and returns the
gains, which the golden stores in its manifest (``numerics``); every later build (the target of the
precision check, budget measurement, quantization, bisection) applies the *stored* gains with
``apply`` after ``build_model``, so reference and target have identical weights up to the dtype.
"""

from __future__ import annotations

import copy
import math
import re

import torch

from harness.anatomy.layers import attention, indexed_layers

_PROBE = "harness_numerics_probe"
OUT_PROJ = re.compile(r"(?:^|\.)(o_proj|out_proj|wo|dense|down_proj|w2|fc2|c_proj)(?:\.weight|\.bias|_bias)?$")
def _probe_attention(stats: dict, inner: str):
    """An attention function that records the logits' std and the rows' normalised entropy, then
    calls the implementation the model was using."""
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def fn(module, query, key, value, attention_mask, scaling=None, **kwargs):
        k = repeat_kv(key, query.shape[1] // key.shape[1])
        sc = scaling if scaling is not None else query.shape[-1] ** -0.5
        w = (query.double() @ k.double().transpose(2, 3)) * sc  # [B, H, S, S]
        s_q, s_k = w.shape[-2:]
        causal = torch.ones(s_q, s_k, dtype=torch.bool, device=w.device).tril(s_k - s_q)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            causal = causal & attention_mask[..., :s_k]
        elif attention_mask is not None:
            causal = causal & (attention_mask[..., :s_k] > -1e30)
        causal = causal.expand_as(w)
        vals = w[causal]
        p = torch.softmax(w.masked_fill(~causal, float("-inf")), -1)
        ent = -(p * p.clamp_min(1e-300).log()).sum(-1)  # [B, H, S]
        n = causal.sum(-1)
        keep = n > 1
        ratio = (ent[keep] / n[keep].double().log()).mean().item() if keep.any() else float("nan")
        stats[module._harness_layer] = {"logit_std": vals.std().item(), "entropy_ratio": ratio}
        impl = inner if inner in ALL_ATTENTION_FUNCTIONS else "sdpa"
        return ALL_ATTENTION_FUNCTIONS[impl](module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return fn


def measure(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """One forward: per layer the attention logit std and normalised entropy (1.0 = uniform), and
    the RMS of the residual stream after the embeddings and after each layer."""
    from transformers import AttentionInterface

    from harness.anatomy.capture import first_tensor, forward_logits

    attn_stats: dict[int, dict] = {}
    rms: dict[str, float] = {}
    saved, handles = [], []
    for idx, _name, layer in indexed_layers(model):
        a = attention(layer)
        if a is not None and hasattr(a, "config"):
            inner = a.config._attn_implementation
            AttentionInterface.register(_PROBE, _probe_attention(attn_stats, inner))
            saved.append((a, a.config))
            cfg = copy.copy(a.config)
            cfg._attn_implementation = _PROBE
            a.config = cfg
            a._harness_layer = idx

        def hook(_m, args, out, idx=idx):
            t = first_tensor(out)
            rms[str(idx)] = t.double().pow(2).mean().sqrt().item()
            if "in" not in rms:
                rms["in"] = first_tensor(args).double().pow(2).mean().sqrt().item() if args else float("nan")
        handles.append(layer.register_forward_hook(hook))

    def pre(_m, args, kwargs):
        x = first_tensor(args) if args else first_tensor(kwargs.get("hidden_states"))
        if x is not None and "in" not in rms:
            rms["in"] = x.double().pow(2).mean().sqrt().item()
    layers = indexed_layers(model)
    if layers:
        handles.append(layers[0][2].register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            forward_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
        for a, cfg in saved:
            a.config = cfg
    # Pair the probe's per-call records with layers (modules keep the layer index they were tagged with).
    return {"attention": {str(k): v for k, v in sorted(attn_stats.items())}, "rms": rms}


def apply(model: torch.nn.Module, numerics: dict | None) -> torch.nn.Module:
    """Apply stored gains (a manifest's ``numerics`` entry) in place; ``None``/empty: unchanged."""
    if not numerics:
        return model
    ag, rg = numerics.get("attention_gain", {}), numerics.get("residual_gain", {})
    for idx, _name, layer in indexed_layers(model):
        a = attention(layer)
        g = ag.get(str(idx))
        if a is not None and g is not None:
            a.scaling = float(a.scaling) * g
        r = rg.get(str(idx))
        if r is not None and r != 1.0:
            with torch.no_grad():
                for pname, p in layer.named_parameters():
                    if _is_out_proj(pname):
                        p.mul_(r)
    return model


def _is_out_proj(pname: str) -> bool:
    # only the residual branches' output projections: attention and MLP / experts / shared experts
    # (never a router, a norm, or an inner projection whose scale a norm would undo)
    if ".gate." in pname or "norm" in pname:
        return False
    return bool(OUT_PROJ.search(pname))


def calibrate(model: torch.nn.Module, ids: torch.Tensor, logit_std: float = 3.0, growth: float = 1.5) -> dict:
    """Gains for ``model`` (float64 reference, modified in place) on ``ids``; returns the manifest
    entry with the gains and the statistics before and after."""
    before = measure(model, ids)
    ag = {}
    for k, s in before["attention"].items():
        ag[k] = round(logit_std / s["logit_std"], 6) if s["logit_std"] > 0 else 1.0
    apply(model, {"attention_gain": ag})
    mid = measure(model, ids)
    rg: dict[str, float] = {}
    h_orig = mid["rms"].get("in", float("nan"))  # the stream's RMS before the gains, at this layer's input
    h_new = h_orig  # ... and as predicted with the gains chosen so far
    for idx, _n, _layer in indexed_layers(model):
        out = mid["rms"].get(str(idx))
        if out is None or not (math.isfinite(h_orig) and h_orig > 0):
            continue
        # out^2 ~= in^2 + b^2 (branch uncorrelated with the stream): b, the branch RMS, does not depend
        # on the stream's scale (the branch starts with a norm), so r scales it directly.
        b2 = max(out * out - h_orig * h_orig, 1e-30)
        want = math.sqrt((growth * growth - 1.0) * h_new * h_new / b2)
        r = float(2.0 ** round(math.log2(want)))
        rg[str(idx)] = r
        h_new = math.sqrt(h_new * h_new + r * r * b2)
        h_orig = out
    apply(model, {"residual_gain": rg})
    after = measure(model, ids)
    return {"attention_logit_std": logit_std, "residual_growth": growth, "attention_gain": ag,
            "residual_gain": rg, "before": before, "after": after}
