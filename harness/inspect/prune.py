"""Pruning chosen from the architecture, for ``harness init`` on a model the project has never seen.

The pruned model must keep what makes the architecture distinctive while running in seconds:

* layers: 2; with DeepSeek-style ``first_k_dense_replace`` one dense layer then one MoE layer;
* width: hidden 64; query/KV heads keep the published GQA ratio (kv 2 for ratios up to 4,
  kv 1 above; at most 16 query heads); an explicit ``head_dim`` stays explicit (16, so that
  ``heads x head_dim != hidden`` when it was so in the original);
* MLA: ranks and head dims shrunk together (q_lora 32, kv_lora 16, nope 16, rope 8, v 16);
* MoE: 8 routed experts (or fewer if the model has fewer), top-2, one shared expert if it had any,
  group-limited routing kept as 4 groups / top-2 groups when the model uses groups;
* vocabulary 512 (token ids in the config are remapped by the loader).
"""

from __future__ import annotations

import math

from harness.models.config import EXPERT_KEYS


def _even_head_dim(hidden: int, heads: int) -> int:
    """A hidden size >= ``hidden`` divisible by ``heads`` with an even head dim (rotary needs pairs)."""
    hd = max(2, math.ceil(hidden / heads))
    hd += hd % 2
    return heads * hd


def choose_prune(raw: dict) -> tuple[dict, list[str]]:
    """(prune keys, comments explaining them) for a published config.json dict."""
    p: dict = {}
    why: list[str] = []
    heads = int(raw.get("num_attention_heads") or 8)
    kv = int(raw.get("num_key_value_heads") or heads)
    mla = bool(raw.get("kv_lora_rank")) and bool(raw.get("qk_rope_head_dim"))
    n_exp_key = next((k for k in EXPERT_KEYS if isinstance(raw.get(k), int) and raw[k] > 0), None)
    n_exp = raw.get(n_exp_key) if n_exp_key else None

    p["num_hidden_layers"] = 2
    if n_exp and int(raw.get("first_k_dense_replace") or 0) > 0:
        p["first_k_dense_replace"] = 1
        why.append("layer 0 dense, layer 1 MoE (first_k_dense_replace = 1), as the real model starts dense")
    elif n_exp and raw.get("mlp_only_layers"):
        p["overrides"] = {"mlp_only_layers": [0]}
        why.append("layer 0 dense (mlp_only_layers), layer 1 MoE")
    elif n_exp:
        why.append("both layers MoE, as every layer of the real model is")
    else:
        why.append("dense decoder: 2 layers")

    hidden = 64
    if mla:
        q_heads = kv_heads = 4
        why.append("MLA: 4 heads, ranks q_lora 32 / kv_lora 16, head dims nope 16 + rope 8, v 16")
    else:
        ratio = max(1, heads // max(kv, 1)) if heads % max(kv, 1) == 0 else 1
        if ratio > 16:
            kv_heads, q_heads = 1, 16
            why.append(f"GQA ratio {ratio}:1 capped at 16:1")
        else:
            kv_heads = 2 if ratio <= 4 else 1
            q_heads = kv_heads * ratio
            why.append(f"keeps the published GQA ratio {heads}:{kv} = {ratio}:1 ({q_heads} query / {kv_heads} KV heads)")
    p["num_attention_heads"], p["num_key_value_heads"] = q_heads, kv_heads
    explicit_hd = raw.get("head_dim")
    if not mla and explicit_hd and explicit_hd * heads != raw.get("hidden_size"):
        p["head_dim"] = 16
        why.append(f"explicit head_dim kept explicit: {explicit_hd} != {raw.get('hidden_size')}/{heads} in the "
                   "real config; 16 here")
    elif not mla:
        hidden = _even_head_dim(hidden, q_heads)
        if explicit_hd:
            p["head_dim"] = hidden // q_heads
    p["hidden_size"] = hidden
    p["intermediate_size"] = 2 * hidden
    if mla:
        if raw.get("q_lora_rank"):
            p["q_lora_rank"] = 32
        p.update(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

    if n_exp:
        e = min(int(n_exp), 8)
        k = min(int(raw.get("num_experts_per_tok") or 2), 2, e)
        p["num_experts"], p["num_experts_per_tok"] = e, k
        if raw.get("moe_intermediate_size"):
            p["moe_intermediate_size"] = 32
        if raw.get("n_shared_experts"):
            p["n_shared_experts"] = 1
        if raw.get("shared_expert_intermediate_size"):
            p.setdefault("overrides", {})["shared_expert_intermediate_size"] = 32
        n_group = int(raw.get("n_group") or 1)
        if n_group > 1 and e % 4 == 0:
            p["n_group"], p["topk_group"] = 4, 2
            why.append(f"group-limited routing kept: {e} experts in 4 groups, tokens pick 2 groups, top-{k}")
        elif n_group > 1 or raw.get("n_group") == 1:
            p["n_group"], p["topk_group"] = 1, 1
        why.append(f"{e} routed experts, top-{k}" + (", 1 shared expert" if raw.get("n_shared_experts") else ""))
    p["vocab_size"] = 512
    return p, why


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def suite_toml(config_rel: str, raw: dict, prune: dict, why: list[str], *, title: str | None = None,
               notes: list[str] | None = None) -> str:
    arch = (raw.get("architectures") or ["?"])[0]
    lines = [f"# {title or config_rel}: generated by `harness init` from {config_rel}",
             f"# architecture {arch}, model_type {raw.get('model_type', '?')!s}. Pruning:"]
    lines += [f"#   - {w}" for w in why]
    lines += [f"# note: {n}" for n in notes or []]
    lines += ["[model]", f"config = {_toml_value(config_rel)}"]
    lines += ["", "[prune]"]
    overrides = prune.get("overrides") or {}
    for k, v in prune.items():
        if k != "overrides":
            lines.append(f"{k} = {_toml_value(v)}")
    if overrides:
        lines += ["", "[prune.overrides]"] + [f"{k} = {_toml_value(v)}" for k, v in overrides.items()]
    return "\n".join(lines) + "\n"
