"""From a published config.json to a transformers config object, Day-0 cases included.

Three things a release-day config does that a plain ``AutoConfig`` call does not survive:

* a ``model_type`` transformers does not register (Kimi-K2's ``kimi_k2``) on an architecture it
  does know (``DeepseekV3ForCausalLM``): we resolve the config class from ``architectures[0]``;
* an FP8 ``quantization_config``: a pruned random-weight build has no FP8 checkpoint to load, so we
  drop it deliberately and record what it said (``ModelConfig.quantization``);
* ``auto_map`` pointing at remote code: ignored unless the suite sets ``trust_remote_code``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from harness.suite.schema import PruneSection

# What each config family calls its routed-expert count.
EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")
# Token ids that must stay inside a pruned vocabulary.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class UnknownArchitectureError(Exception):
    pass


@dataclass
class ModelConfig:
    config: object  # transformers.PretrainedConfig
    architecture: str  # class name in transformers, e.g. DeepseekV3ForCausalLM
    model_type: str  # as published (may be unregistered, e.g. kimi_k2)
    resolved_via: str  # "model_type" or "architectures"
    quantization: dict | None = None  # the dropped quantization_config, if any
    notes: list[str] = field(default_factory=list)


def _transformers():
    import transformers  # heavy import, deferred so that `harness validate` stays fast

    return transformers


def architecture_class(name: str):
    """The transformers class named by ``architectures[0]``; a clear error if nobody knows it."""
    tf = _transformers()
    cls = getattr(tf, name, None)
    if cls is None:
        raise UnknownArchitectureError(
            f"architecture {name!r} is not known to transformers {tf.__version__}. "
            "Plug in your own implementation with a custom adapter: set model.adapter = "
            "'your_package.module:build' in the suite, where build(config_dict, dtype, device) returns "
            "a torch.nn.Module whose forward(input_ids, labels=None) returns an object with .logits/.loss "
            "(see docs/adding-a-model.md).")
    return cls


def apply_prune(d: dict, prune: PruneSection) -> list[str]:
    """Apply the suite's pruning to a config dict in place; returns notes on what was remapped."""
    notes = []
    for key, value in prune.model_dump(exclude_none=True, exclude={"overrides", "num_experts"}).items():
        d[key] = value
    if prune.num_experts is not None:
        keys = [k for k in EXPERT_KEYS if k in d]
        if not keys:
            notes.append("prune.num_experts ignored: the config has no routed experts")
        for k in keys:
            d[k] = prune.num_experts
    d.update(copy.deepcopy(prune.overrides))
    vocab = d.get("vocab_size")
    if prune.vocab_size is not None and vocab:
        # Published bos/eos ids point past a pruned vocabulary; map them to the last ids.
        for i, k in enumerate(TOKEN_ID_KEYS):
            v = d.get(k)
            if isinstance(v, int) and v >= vocab:
                d[k] = vocab - 1 - i
                notes.append(f"{k} {v} -> {d[k]} (pruned vocab {vocab})")
            elif isinstance(v, list):
                d[k] = [x if x < vocab else vocab - 1 - i for x in v]
    return notes


def build_config(raw: dict, prune: PruneSection | None = None, *, architecture: str | None = None,
                 trust_remote_code: bool = False, keep_quantization: bool = False) -> ModelConfig:
    """Turn a published config.json dict (unchanged by this call) into a transformers config."""
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = copy.deepcopy(raw)
    notes: list[str] = []
    arch = architecture or (d.get("architectures") or [None])[0]
    if arch is None:
        raise UnknownArchitectureError("config.json has no 'architectures' and the suite sets no model.architecture")
    if not trust_remote_code and d.pop("auto_map", None) is not None:
        notes.append("auto_map ignored (trust_remote_code is off)")
    quant = None if keep_quantization else d.pop("quantization_config", None)
    if quant is not None:
        notes.append(f"quantization_config dropped for a random-weight build: {quant.get('quant_method')} "
                     f"{quant.get('fmt', '')} blocks {quant.get('weight_block_size')}")
    if prune is not None:
        notes += apply_prune(d, prune)

    model_type = d.pop("model_type", None) or ""
    if model_type in CONFIG_MAPPING:
        config_cls, via = CONFIG_MAPPING[model_type], "model_type"
    else:
        # Day-0: an unregistered model_type on a known architecture runs as that architecture.
        config_cls, via = architecture_class(arch).config_class, "architectures"
        notes.append(f"model_type {model_type!r} is not registered in transformers {tf.__version__}; "
                     f"running it as {arch} ({config_cls.__name__})")
    cfg = config_cls(**d)
    cfg.architectures = [arch]
    return ModelConfig(cfg, arch, model_type, via, quant, notes)


def use_eager_experts(cfg) -> None:
    """Route MoE experts through the plain per-expert loop. transformers 5 defaults to
    ``torch._grouped_mm``, which rejects float64 on CPU; references and op traces need eager."""
    cfg._experts_implementation = "eager"
