"""Context parallelism (cp) by all-gather of keys and values.

The Llama-3 paper's CP (torchtitan's "allgather" rotate method): each rank of a cp group holds one
contiguous chunk of every sequence - ``S / cp`` tokens at global positions ``[c S/cp, (c+1) S/cp)``
for cp coordinate ``c`` - and runs the whole model on it. Only attention mixes tokens: there the rank
computes Q, K, V for its chunk, all-gathers K and V over the cp group along the sequence, and attends
its queries to the whole sequence's keys under a causal mask offset by its chunk start. Everything
else (norms, MLPs, experts, the LM head) is per token and needs nothing.

The hook is transformers' own attention registry: ``harness_cp`` is registered with
``transformers.AttentionInterface`` and wraps transformers' ``sdpa_attention_forward`` with the
gathered K/V and its own boolean mask; the model is switched to it with ``set_attn_implementation``.
For an implementation not in ``masking_utils.ALL_MASK_ATTENTION_FUNCTIONS`` transformers builds no
mask (``_preprocess_mask_arguments`` exits early with the caller's ``attention_mask``: None here),
so the mask is entirely ours. Rotary embeddings see the global positions through ``position_ids``.
MLA (DeepSeek-V3, Kimi-K2) goes through the same interface with its K/V already expanded per head.

"Where the attention supports it": ``refusal`` names what this scheme cannot run - sliding-window or
linear-attention layers (a window would need its own offset mask and a partial gather; linear
attention is a recurrence, not softmax over gathered keys), attention sinks (gpt-oss: an extra
per-head logit the sdpa wrapper does not add), a sequence that does not split into equal chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "harness_cp"


class GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 of [B, H, s, D] (the sequence) over ``group``; the result is [B, H, cp s, D].

    gloo has no reduce-scatter, so backward is all-reduce (sum) of the full gradient - every rank's
    queries attended to every rank's keys - then this rank's slice of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.len = group, rank, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.len:(ctx.rank + 1) * ctx.len], None, None, None


class CPState:
    """What one attention module needs under cp: the group, this rank's cp index and the cp degree.
    ``mask`` and ``gather`` are attributes so that a test can replace them on one module."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return GatherSeq.apply(t, self.group, self.rank, self.size)

    def mask(self, q_len: int, kv_len: int, device) -> torch.Tensor:
        """[1, 1, q_len, kv_len] bool, True = attend: query i (global position offset + i) sees keys
        at global positions <= its own."""
        q_pos = torch.arange(q_len, device=device) + self.rank * q_len
        return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]).view(1, 1, q_len, kv_len)


def cp_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask, **kwargs):
    """The registered ``harness_cp`` attention: query [B, H, s, D] of this rank's chunk, key/value
    [B, Hkv, s, D] of the same chunk, gathered to [B, Hkv, cp s, D] before transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    st: CPState | None = getattr(module, "_harness_cp", None)
    if st is None:  # its chunk alone would be attended to: a silently wrong result
        raise ValueError(f"context parallelism: attention module {type(module).__name__} was not set up by "
                         "apply_cp (no layer_idx / is_causal)")
    if attention_mask is not None:
        raise ValueError("context parallelism: the model passed its own attention mask (padding or a "
                         "sliding window), which the cp attention does not support")
    k, v = st.gather(key), st.gather(value)
    mask = st.mask(query.shape[2], k.shape[2], query.device)
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, k, v, mask, is_causal=False, **kwargs)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, cp_attention)


def apply_cp(model: torch.nn.Module, group, rank: int, size: int) -> list[str]:
    """Switch every attention module of ``model`` to the cp attention over ``group``; returns their
    names. Raises where the model's attention is not transformers' functional interface."""
    register()
    model.set_attn_implementation(NAME)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation "
                         "(context parallelism hooks transformers' AttentionInterface)")
    names = []
    for name, mod in model.named_modules():
        # transformers' attention modules: a layer index and a causal flag (the decoder layers have
        # the index only, the model the flag only).
        if hasattr(mod, "is_causal") and hasattr(mod, "layer_idx") and hasattr(mod, "config"):
            mod._harness_cp = CPState(group, rank, size)
            names.append(name)
    if not names:
        raise ValueError("context parallelism found no attention modules (with layer_idx and is_causal)")
    return names


def chunk(t: torch.Tensor, size: int, index: int, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous chunk of the sequence dimension ``dim``."""
    n = t.shape[dim] // size
    return t.narrow(dim, index * n, n)


def positions(seq_len: int, size: int, index: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global position ids [1, seq_len / size] of chunk ``index`` (one row, as the model makes its
    own: the rotary embedding's output keeps the reference's shape [1, S, D], chunked), on the rank's
    ``device`` (the model's: host position ids meet device weights in the rotary embedding)."""
    n = seq_len // size
    return torch.arange(index * n, (index + 1) * n, device=device).unsqueeze(0)


def gather_tokens(t: torch.Tensor, batch: int, group, size: int) -> torch.Tensor:
    """Token rows of this chunk [batch * S / size, ...] (batch-major) -> the whole sequences'
    [batch * S, ...] in the same order, by an all-gather over the cp group (every cp rank gets them)."""
    x = t.reshape(batch, -1, *t.shape[1:]).contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=1).reshape(-1, *t.shape[1:])


def chunk_loss(logits: torch.Tensor, ids: torch.Tensor, size: int, index: int) -> torch.Tensor:
    """This chunk's share of the mean next-token cross-entropy of ``ids`` [b, S] (float32): the sum of
    its tokens' losses over ``b (S - 1)``. Targets are the *global* shifted ids - the chunk's last token
    predicts the next chunk's first; the sequence's final position has none - so the cp ranks' shares
    sum to ``reference.lm_loss`` of the whole sequences. ``logits`` [b, S / size, V]."""
    b, s = ids.shape
    n = s // size
    start = index * n
    stop = min(start + n, s - 1)  # positions with a target
    tgt = ids[:, start + 1:stop + 1]
    part = logits[:, :stop - start].float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(part, tgt.reshape(-1), reduction="sum") / (b * (s - 1))


def attention_facts(cfg) -> dict:
    """What ``refusal`` needs from a config (and its text sub-config)."""
    cfg = getattr(cfg, "text_config", None) or cfg
    kinds = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]))
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None  # Qwen2/3 carry a window size that is off unless use_sliding_window
    sinks = "gpt_oss" in str(getattr(cfg, "model_type", "")) or bool(getattr(cfg, "attention_sinks", False))
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks index_topk keys per
    # query under the causal mask it reads from the model (attention_mask[:, 0]); this scheme builds
    # its own mask inside the attention call, so the indexer would get none.
    indexer = getattr(cfg, "index_topk", None)
    return {"layer_types": kinds, "sliding_window": window, "sinks": sinks, "indexer_topk": indexer}


def refusal(facts: dict, cp: int, seq_lens: tuple[int, ...]) -> str | None:
    """Why cp cannot run on this model and sequence length, in one line, or None."""
    if facts.get("sinks"):
        return "context parallelism does not support attention sinks (gpt-oss `sinks`: an extra per-head logit)"
    if facts.get("indexer_topk"):
        return (f"context parallelism does not support sparse attention's indexer (DSA, index_topk "
                f"{facts['indexer_topk']}: it reads the model's causal mask, which this scheme builds inside "
                "the attention call, and selects keys across the whole sequence)")
    # Layer kinds that do not mix tokens (Nemotron-H lists its MoE and MLP blocks) need nothing;
    # any other kind than full attention (sliding, chunked, linear/mamba, unknown) is refused.
    other = [k for k in facts.get("layer_types", []) if k not in ("full_attention", "moe", "mlp")]
    if other:
        return (f"context parallelism needs full attention in every layer; this model has {', '.join(other)} "
                "layers (a window or a recurrence is not an all-gather of K/V)")
    window = facts.get("sliding_window")
    if window is not None and any(window < s for s in seq_lens):
        return (f"context parallelism needs full attention; sliding_window {window} is shorter than the "
                f"sequence ({max(seq_lens)} tokens)")
    bad = [s for s in seq_lens if s % cp]
    if bad:
        return f"seq_len {bad[0]} does not split into {cp} equal context-parallel chunks"
    return None
