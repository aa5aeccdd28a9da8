"""Decoder layers and their attention: where a model's stack of transformer blocks is, whatever the
family calls its body (``model.layers``, a wrapper's ``model.language_model.layers``)."""

from __future__ import annotations

import torch

from harness.anatomy.moe import module_part, text_config


class AnatomyError(LookupError):
    """The model does not have the structure asked for (one line, names what is missing)."""


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """``(prefix, layers)``: the ModuleList of decoder layers, found by name (``<...>.layers``) and by
    length (the text config's ``num_hidden_layers``), the shallowest such list (a vision tower's
    ``encoder.layers`` sits deeper, and has another length)."""
    n = getattr(text_config(getattr(model, "config", None)), "num_hidden_layers", None)
    lists = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and name.split(".")[-1] == "layers"]
    # a wrapper's vision / audio tower may have as many layers, as shallow (Muse-Glimmer's pruned
    # model.vision_tower.layers beside model.language_model.layers: 4 and 4): the text part's first
    lists = [x for x in lists if module_part(x[0]) == "text"] or lists
    # The configured length first; any length only where none has it (a config edited after the build)
    sized = [x for x in lists if n is None or len(x[1]) == n] or lists
    best = min(sized, key=lambda x: x[0].count("."), default=None)
    if best is None:
        raise AnatomyError("no decoder-layer list (<...>.layers) found in the model")
    return best


def indexed_layers(model: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module]]:
    """``[(index, module name, layer)]`` of :func:`decoder_layers`."""
    prefix, layers = decoder_layers(model)
    return [(i, f"{prefix}.{i}", layer) for i, layer in enumerate(layers)]


def attention(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's attention module: the child with a ``scaling`` (the softmax temperature every
    transformers attention passes to its kernel); None for a layer without one (Mamba, linear attention)."""
    for attr in ("self_attn", "attention", "attn"):
        a = getattr(layer, attr, None)
        if a is not None and hasattr(a, "scaling"):
            return a
    return None
