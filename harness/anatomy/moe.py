"""Mixture-of-experts structure: expert and top-k counts from a config, which modules are routed
experts and routers, and what kind a module is (for parameter accounting). The router outputs a
capture records are in ``harness.anatomy.capture``."""

from __future__ import annotations

import re

import torch

# Config keys, in the order transformers' model families use them.
EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")
TOPK_KEYS = ("num_experts_per_tok", "top_k_experts", "num_experts_per_token", "moe_topk", "moe_top_k")
# Router modules by name: MoE blocks call theirs ``gate`` (Mixtral, Qwen, DeepSeek) or ``router``.
ROUTER_SUFFIXES = (".gate", ".router")


def text_config(cfg):
    """A wrapper's text config (``get_text_config``), else the config itself."""
    try:
        return cfg.get_text_config()
    except (AttributeError, ValueError):
        return cfg


def num_experts(cfg) -> int | None:
    """Routed experts per MoE layer (of a wrapper's text model), None for a dense model."""
    cfg = text_config(cfg)
    for k in EXPERT_KEYS:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def experts_per_token(cfg) -> int | None:
    cfg = text_config(cfg)
    return next((getattr(cfg, k) for k in TOPK_KEYS if isinstance(getattr(cfg, k, None), int)), None)


def is_router(name: str) -> bool:
    return bool(name) and name.endswith(ROUTER_SUFFIXES)


def is_experts(mod: torch.nn.Module, n_exp: int | None) -> bool:
    """Routed experts held as 3-D parameters ``[E, out, in]`` (transformers 5's fused experts)."""
    name = type(mod).__name__
    return name.endswith("Experts") and any(p.dim() == 3 for p in mod.parameters(recurse=False)) or (
        n_exp is not None and any(p.dim() == 3 and p.shape[0] == n_exp for p in mod.parameters(recurse=False)))


def expert_parents(model: torch.nn.Module, n_exp: int | None) -> set[str]:
    """The modules (MoE blocks) whose child holds routed experts."""
    return {fqn.rsplit(".", 1)[0] for fqn, mod in model.named_modules() if fqn and is_experts(mod, n_exp)}


def module_kind(fqn: str, mod: torch.nn.Module, n_exp: int | None = None,
                expert_parents: frozenset[str] | set[str] = frozenset()) -> str:
    """What a module is, for parameter accounting: embedding, lm_head, norm, shared_experts, router,
    routed_experts, attention, dense_mlp or other. ``expert_parents``: the modules holding routed
    experts (:func:`expert_parents`), whose ``gate`` is their router."""
    cls = type(mod).__name__
    last = fqn.rsplit(".", 1)[-1]
    if isinstance(mod, torch.nn.Embedding) or last in ("embed_tokens", "wte", "word_embeddings"):
        return "embedding"
    if last in ("lm_head", "output"):
        return "lm_head"
    if "Norm" in cls or cls.endswith("LayerNorm"):
        return "norm"
    if "shared_expert" in fqn:
        return "shared_experts"
    if "Router" in cls or (last == "gate" and fqn.rsplit(".", 1)[0] in expert_parents):
        return "router"
    if is_experts(mod, n_exp) or ".experts." in f"{fqn}.":
        return "routed_experts"
    if "attn" in fqn or "attention" in fqn:
        return "attention"
    if ".mlp" in fqn or "feed_forward" in fqn or "ffn" in fqn:
        return "dense_mlp"
    return "other"


def module_part(fqn: str) -> str:
    """Which part of a multimodal wrapper a module belongs to: text, vision or projector."""
    low = fqn.lower()
    # (vision|image|audio)_(adapter|projection): Muse-Glimmer's projector is vision_adapter + vision_projection
    if re.search(r"projector|multi_modal|mm_proj|merger|connector|aligner|embed_vision|"
                 r"(vision|image|audio)_(adapter|projection)", low):
        return "projector"
    if re.search(r"vision|visual|vit\b|image|patch|audio", low):
        return "vision"
    return "text"
