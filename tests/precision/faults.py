"""Faults the tests inject into a model built from a suite (same seeded weights as the golden's).

Each is a model -> model transform (or, for a wrong backend kernel, a context manager), applied
to the *target* run only; the golden always comes from the clean model.
"""

from __future__ import annotations

import copy
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def rmsnorm_eps(layer: int, factor: float = 10.0):
    """One decoder layer's input RMSNorm with a changed epsilon."""
    def t(model):
        norm = model.model.layers[layer].input_layernorm
        attr = "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"
        setattr(norm, attr, getattr(norm, attr) * factor)
        return model
    return t


def _half_softmax_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scaling = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
    w = (query @ key.transpose(2, 3)) * scaling
    s_q, s_k = w.shape[-2:]
    if attention_mask is None:
        causal = torch.ones(s_q, s_k, dtype=torch.bool, device=w.device).tril(s_k - s_q)
        w = w.masked_fill(~causal, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        w = w.masked_fill(~attention_mask[..., :s_k], float("-inf"))
    else:
        w = w + attention_mask[..., :s_k]
    w = torch.softmax(w.to(torch.float16), dim=-1).to(query.dtype)  # the fault: softmax in half precision
    out = (w @ value).transpose(1, 2).contiguous()
    return out, w


def half_softmax(layer: int):
    """Attention softmax computed in float16 in one layer."""
    from transformers import AttentionInterface

    AttentionInterface.register("harness_half_softmax", _half_softmax_attention)

    def t(model):
        attn = model.model.layers[layer].self_attn
        cfg = copy.copy(attn.config)
        cfg._attn_implementation = "harness_half_softmax"
        attn.config = cfg
        return model
    return t


def perturbed_expert(layer: int, expert: int, scale: float = 1.25):
    """One routed expert of one MoE block with its output projection scaled."""
    def t(model):
        experts = model.model.layers[layer].mlp.experts
        with torch.no_grad():
            if hasattr(experts, "down_proj") and isinstance(experts.down_proj, torch.nn.Parameter):
                experts.down_proj[expert].mul_(scale)
            else:
                experts[expert].down_proj.weight.mul_(scale)
        return model
    return t


def rotary_base(new_base: float | None = None, factor: float = 2.0):
    """Rotary embeddings built with the wrong base: ``new_base`` (e.g. the 10000 default where the
    config says 500000), else base * factor. inv_freq = base^(-2i/d), so raising it to the power
    log(new)/log(base) rebases it (scaled rope types included, approximately)."""
    def t(model):
        rot = model.model.rotary_emb
        params = getattr(rot.config, "rope_parameters", None) or {}
        base = float(getattr(rot.config, "rope_theta", None) or params["rope_theta"])
        k = math.log(new_base or base * factor) / math.log(base)
        rot.inv_freq = rot.inv_freq.double().pow(k).to(rot.inv_freq.dtype)
        return model
    return t


class FaultyKernel(TorchDispatchMode):
    """A wrong backend kernel: ``op`` returns results off by ``rel`` for every dtype except
    float64 (the reference's), as a bad bf16/float32 kernel would."""

    def __init__(self, op: str = "aten.rsqrt", rel: float = 1e-2):
        super().__init__()
        self.op, self.rel = op, rel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        if name == self.op and isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != torch.float64:
            out = out * (1 + self.rel)
        return out
