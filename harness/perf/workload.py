"""The model the perf check times, and one repeat of each phase.

The smoke-sized model (hidden 64) is all Python overhead; a baseline of it says nothing about the
backend. The perf model keeps the suite's architecture and pruning *ratios* but is scaled to
``width`` (hidden 1024 by default, every width-like dimension scaled by the same factor: MLP,
expert MLP, explicit head_dim, MLA ranks), with ``layers`` decoder layers, so matmuls dominate on a
CPU. ``published`` keeps the real model's per-layer size (for a device's nightly run): ``layers``
layers at the published width, with one dense and one MoE layer when the model has both.
"""

from __future__ import annotations

import time

import torch

from harness.models.build import build_model, seeded_tokens
from harness.models.config import ModelConfig, build_config
from harness.perf.timing import timed_both
from harness.suite.schema import PruneSection

# Dimensions that scale with the model width (the same factor keeps the suite's ratios).
WIDTH_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def perf_prune(ls, width: int | str, layers: int, overrides: dict) -> PruneSection:
    """The PruneSection of the perf model (see the module doc)."""
    base = ls.suite.prune.model_dump(exclude_none=True)
    base.pop("overrides", None)
    if width == "published":
        p = {"num_hidden_layers": layers}
        if "vocab_size" in base:
            p["vocab_size"] = base["vocab_size"]
        fk = ls.raw_config.get("first_k_dense_replace")
        if isinstance(fk, int) and fk >= layers > 1:
            p["first_k_dense_replace"] = 1  # one dense and the rest MoE, as in the real model's tail
    else:
        p = dict(base)
        p["num_hidden_layers"] = layers
        hidden = base.get("hidden_size") or ls.raw_config.get("hidden_size")
        if width and hidden:
            f = int(width) / int(hidden)
            for k in WIDTH_KEYS:
                if base.get(k):
                    p[k] = max(1, int(round(base[k] * f)))
    extra = dict(overrides)
    free = extra.pop("overrides", None)
    p.update(extra)
    if free:
        p["overrides"] = free
    if "first_k_dense_replace" in p and p["first_k_dense_replace"] > layers:
        p["first_k_dense_replace"] = min(p["first_k_dense_replace"], layers)
    return PruneSection(**p)


def perf_model_config(ls, width: int | str, layers: int, overrides: dict) -> ModelConfig:
    m = ls.suite.model
    return build_config(ls.raw_config, perf_prune(ls, width, layers, overrides), architecture=m.architecture,
                        trust_remote_code=m.trust_remote_code)


def _cache_of(out):
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


class Workload:
    """The perf model on the device with its inputs; ``*_sample()`` does one timed repeat."""

    def __init__(self, ls, mc: ModelConfig, dtype: str, backend, batch: int, seq: int, decode_tokens: int,
                 seed: int = 0, cpu_clock: bool = False):
        self.backend, self.batch, self.seq, self.decode_tokens = backend, batch, seq, decode_tokens
        self.cpu_clock = cpu_clock  # also report each timing on the process CPU clock (*_cpu_s)
        self.sync = backend.synchronize
        self.model, self.mc = build_model(ls, dtype, backend.device(), seed=seed, mc=mc)
        vocab = self.mc.config.vocab_size
        self.ids = seeded_tokens(vocab, batch, seq, seed + 1).to(backend.device())  # [B, S]
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self._cache = None
        self._first = None
        self._opt = None
        if hasattr(self.model, "generation_config"):
            self.model.generation_config.eos_token_id = None

    # --- inference ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill_sample(self) -> dict[str, float]:
        """Prefill of B x S tokens with the KV cache on; TTFT also takes the first token to the
        host (what a user waits for)."""
        m = self.model
        m.eval()
        self.sync()
        c0, t0 = time.process_time(), time.perf_counter()
        out = m(input_ids=self.ids, use_cache=True)
        self.sync()
        c1, t1 = time.process_time(), time.perf_counter()
        first = out.logits[:, -1].argmax(-1).cpu()  # [B]
        c2, t2 = time.process_time(), time.perf_counter()
        self._cache, self._first = _cache_of(out), first
        r = {"prefill_s": t1 - t0, "ttft_s": t2 - t0}
        if self.cpu_clock:
            r.update(prefill_cpu_s=c1 - c0, ttft_cpu_s=c2 - c0)
        return r

    @torch.no_grad()
    def decode_sample(self) -> dict[str, float]:
        """``decode_tokens`` greedy steps with the KV cache after the prefill; per-token time.
        The cache is cropped back to the prompt (untimed) so every repeat decodes at the same
        contexts; without ``crop`` the prompt is prefilled again (untimed)."""
        m = self.model
        m.eval()
        if self._cache is not None and hasattr(self._cache, "crop") and hasattr(self._cache, "get_seq_length"):
            extra = int(self._cache.get_seq_length()) - self.seq
            if extra > 0:
                self._cache.crop(-extra)  # transformers 5: a negative count removes that many tokens
        else:
            self.prefill_sample()
        cache, nxt = self._cache, self._first.to(self.backend.device())[:, None]  # [B, 1]

        def steps():
            nonlocal nxt
            for _ in range(self.decode_tokens):
                out = m(input_ids=nxt, cache=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)  # [B, 1]

        wall, cpu = timed_both(steps, self.sync)
        r = {"decode_token_s": wall / self.decode_tokens}
        if self.cpu_clock:
            r["decode_token_cpu_s"] = cpu / self.decode_tokens
        return r

    # --- training ----------------------------------------------------------------------------
    def train_sample(self) -> dict[str, float]:
        """One optimizer step: forward, backward, AdamW, on the same [B, S] batch."""
        m = self.model
        m.train()
        if self._opt is None:
            params = [p for p in m.parameters() if p.requires_grad]
            eps = max(1e-8, 2 * torch.finfo(params[0].dtype).tiny)
            self._opt = torch.optim.AdamW(params, lr=1e-5, eps=eps)
        opt = self._opt

        def step():
            opt.zero_grad(set_to_none=True)
            m(input_ids=self.ids, labels=self.ids).loss.backward()
            opt.step()

        wall, cpu = timed_both(step, self.sync)
        return {"train_step_s": wall, "train_step_cpu_s": cpu} if self.cpu_clock else {"train_step_s": wall}

    def release_training(self) -> None:
        self._opt = None
        for p in self.model.parameters():
            p.grad = None
