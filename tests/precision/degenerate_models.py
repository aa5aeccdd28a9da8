"""Model adapters (``model.adapter = "precision.degenerate_models:<name>"``) whose float64 reference
says nothing, the way issue #50's unpruned 108-layer hybrid did: the real transformers Llama built
from the suite's pruned config, with one weight set the way a broken bring-up leaves it."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM


def silent_head(config, dtype, device):
    """An LM head of zeros: every logit exactly 0.0 (what the unpruned hybrid's reference held)."""
    m = LlamaForCausalLM(config)
    with torch.no_grad():
        m.lm_head.weight.zero_()
    return m


def one_row_head(config, dtype, device):
    """Every vocabulary row of the LM head the same vector: logits nonzero but one value per position."""
    m = LlamaForCausalLM(config)
    with torch.no_grad():
        m.lm_head.weight.copy_(m.lm_head.weight[:1].expand_as(m.lm_head.weight))
    return m


def overflow(config, dtype, device):
    """A final norm whose output overflows (a hook: the model is built in float32, then cast): the
    LM head's sums are inf and nan."""
    m = LlamaForCausalLM(config)
    m.model.norm.register_forward_hook(lambda mod, args, out: out * 1e308 * 1e308)
    return m
