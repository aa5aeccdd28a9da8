"""FLOPs per token and KV-cache bytes per token, from the config and the parameter counts.

FLOPs count a multiply-add as 2. Per token:

* **matmuls**: ``2 x`` the activated matmul parameters (attention projections, dense MLP, top-k
  routed experts, shared experts, router, lm_head; not the embedding lookup, not norms);
* **attention core** (QK^T and AV) per layer: ``2 x heads x (d_qk + d_v) x context``. Prefill of
  ``S`` tokens with a causal mask sees on average ``(S + 1) / 2`` tokens of context; decode at
  context ``L`` sees ``L``;
* **MLA** (DeepSeek-V3 / Kimi-K2): transformers caches the *compressed* latent
  (``kv_lora_rank + qk_rope_head_dim`` per token per layer) and re-expands it through ``kv_b_proj``
  for the whole context at every step, which costs ``2 x kv_lora_rank x heads x (qk_nope + v) x L``
  per layer per decoded token on top; inference engines absorb ``kv_b_proj`` into the query/output
  projections instead. Both cache sizes are reported: the compressed one and the decompressed
  per-head K/V an implementation without absorption would keep.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from harness.inspect.params import ParamReport

MATMUL_KINDS = ("attention", "dense_mlp", "routed_experts", "shared_experts", "router", "lm_head")


@dataclass
class FlopsReport:
    prefill_len: int
    decode_context: int
    matmul_flops_per_token: float
    prefill_flops_per_token: float
    decode_flops_per_token: float
    attention_flops_per_context_token: float  # per token of context, all layers
    kv_cache_bytes_per_token: dict[str, int] = field(default_factory=dict)  # layout -> bytes
    decode_flops_per_token_hf: float | None = None  # MLA as transformers runs it (re-expands the cache)
    kv_dtype_bytes: int = 2
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _get(cfg, name, default=None):
    try:
        v = getattr(cfg, name, None)
    except Exception:  # transformers' per-layer (heterogeneous) configs refuse ambiguous global reads
        v = None
    return default if v is None else v


def attention_layers(cfg) -> list[tuple[int, int, int, int]]:
    """(query heads, kv heads, d_qk, d_v) of every layer that has softmax attention (and a KV cache):
    Mamba / linear-attention layers of hybrid models are left out (``hybrid_override_pattern`` '*',
    ``layer_types`` without 'linear'/'mamba'), and per-layer configs (Gemma 4's full-attention layers
    with their own ``global_head_dim``) are read layer by layer."""
    layers = int(_get(cfg, "num_hidden_layers"))
    pattern = _get(cfg, "hybrid_override_pattern")
    types = _get(cfg, "layer_types")
    per_layer = _get(cfg, "per_layer_config")
    out = []
    for i in range(layers):
        if isinstance(pattern, str) and len(pattern) == layers and pattern[i] != "*":
            continue
        if isinstance(types, (list, tuple)) and len(types) >= layers and re.search(
                r"linear|mamba|conv|ssm|recurrent", str(types[i])):
            continue
        lc = per_layer[i] if per_layer is not None else cfg
        out.append(head_dims(lc))
    return out


def is_mla(cfg) -> bool:
    return bool(_get(cfg, "kv_lora_rank")) and bool(_get(cfg, "qk_rope_head_dim"))


def head_dims(cfg) -> tuple[int, int, int, int]:
    """(query heads, kv heads, d_qk, d_v) as the attention kernel sees them."""
    cfg = text_config(cfg)
    heads = int(_get(cfg, "num_attention_heads"))
    if is_mla(cfg):
        return heads, heads, int(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    hd = int(_get(cfg, "head_dim") or cfg.hidden_size // heads)
    return heads, int(_get(cfg, "num_key_value_heads", heads)), hd, hd


def text_config(cfg):
    """A multimodal wrapper's language-model config (FLOPs and KV cache are the decoder's), else ``cfg``."""
    try:
        return cfg.get_text_config()
    except (AttributeError, ValueError):
        return cfg


def compute_flops(cfg, params: ParamReport, prefill_len: int = 4096, decode_context: int = 4096,
                  kv_dtype_bytes: int = 2) -> FlopsReport:
    cfg = text_config(cfg)
    layers = int(_get(cfg, "num_hidden_layers"))
    heads, kv_heads, d_qk, d_v = head_dims(cfg)
    attn = attention_layers(cfg)
    matmul = 2.0 * sum(params.activated_by_kind.get(k, 0) for k in MATMUL_KINDS)
    attn_per_ctx = 2.0 * sum(h * (q + v) for h, _, q, v in attn)
    notes = []
    if len(attn) != layers:
        notes.append(f"{len(attn)} of {layers} layers have softmax attention (the others are Mamba / linear "
                     "attention, whose state does not grow with the context): attention FLOPs and KV cache "
                     "count those only")
    extra_decode = 0.0
    kv: dict[str, int] = {}
    if is_mla(cfg):
        n_attn = len(attn)
        latent = int(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        kv["mla_compressed (what transformers caches; kv_lora_rank + qk_rope_head_dim)"] = (
            n_attn * latent * kv_dtype_bytes)
        kv["decompressed per-head K and V (no absorption)"] = n_attn * heads * (d_qk + d_v) * kv_dtype_bytes
        extra_decode = 2.0 * n_attn * cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        notes.append("MLA: transformers re-expands the compressed cache through kv_b_proj over the whole "
                     "context at every step; decode_flops_per_token_hf includes that, decode_flops_per_token "
                     "does not (an absorbed-MLA engine does not pay it)")
    else:
        kv["k and v per kv head"] = sum(kvh * (q + v) for _, kvh, q, v in attn) * kv_dtype_bytes
        if kv_heads != heads:
            notes.append(f"GQA: {heads} query heads share {kv_heads} KV heads ({heads // kv_heads}:1)")
    prefill = matmul + attn_per_ctx * (prefill_len + 1) / 2
    decode = matmul + attn_per_ctx * decode_context
    hf = decode + extra_decode * decode_context if extra_decode else None
    return FlopsReport(prefill_len, decode_context, matmul, prefill, decode, attn_per_ctx, kv, hf, kv_dtype_bytes,
                       notes)
