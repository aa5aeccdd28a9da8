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
import re
from dataclasses import dataclass, field

from harness.anatomy.moe import EXPERT_KEYS
from harness.suite.schema import PruneSection

# Token ids that must stay inside a pruned vocabulary.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class ModelBuildError(Exception):
    """Base of every "this suite's model cannot be built" error: one line, never a traceback."""


class AdapterError(ModelBuildError):
    """The suite's model builder (``model.adapter``) cannot be found or returned no module."""


class UnknownArchitectureError(ModelBuildError):
    """No way to build the model: the message names what was tried and which suite knob fixes it."""


class ConfigBuildError(ModelBuildError):
    """transformers refused the (pruned) config: the message names the keys involved."""


@dataclass
class ModelConfig:
    config: object  # transformers.PretrainedConfig
    architecture: str  # class name in transformers, e.g. DeepseekV3ForCausalLM
    model_type: str  # as published (may be unregistered, e.g. kimi_k2)
    resolved_via: str  # "architectures", "model.architecture", "model_type (causal LM)", ...
    quantization: dict | None = None  # the dropped quantization_config, if any
    notes: list[str] = field(default_factory=list)
    part: str | None = None  # "text_config" when the model is a wrapper's language decoder


def _transformers():
    import transformers  # heavy import, deferred so that `harness validate` stays fast

    return transformers


FIX_HINT = ("set model.architecture = '<a transformers class that runs it>' in the suite, or plug in your own "
            "builder with model.adapter = 'your_package.module:build' (see docs/adding-a-model.md)")


def model_class(name) -> type | None:
    """transformers' model class called ``name``, or None: only subclasses of PreTrainedModel count
    (``getattr(transformers, "logging")`` is a module, ``"AutoConfig"`` a config factory, neither a model)."""
    if not isinstance(name, str) or not name.isidentifier():
        return None
    tf = _transformers()
    try:
        cls = getattr(tf, name, None)
    except Exception:  # noqa: BLE001 - transformers' lazy module raises for a missing backend
        return None
    return cls if isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel) else None


def first_architecture(raw: dict) -> str | None:
    """``architectures[0]``; a config whose ``architectures`` is not a list of class names is refused
    (a string would otherwise be read one letter at a time)."""
    archs = raw.get("architectures")
    if archs is None or archs == []:
        return None
    if not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs):
        raise ConfigBuildError(f"config.json: architectures: must be a list of class names, got "
                               f"{type(archs).__name__} {str(archs)[:80]!r}")
    return archs[0]


def architecture_class(name: str):
    """The transformers model class called ``name``; a clear error if nobody knows it."""
    tf = _transformers()
    cls = model_class(name)
    if cls is None:
        raise UnknownArchitectureError(
            f"architecture {name!r} is not a model class in transformers {tf.__version__}: {FIX_HINT}")
    return cls


# Bounds of the config fields harness itself reads before building anything (pruning plans build
# per-layer lists, head arithmetic divides): checked first, so 10**12 layers is one line, not a hang,
# and 0 heads is named, not a ZeroDivisionError. The upper bounds are far above any published model
# (the largest have ~100 layers, 2**18 vocabulary, 384 experts) and far below what would exhaust memory.
CONFIG_BOUNDS = {
    "num_hidden_layers": (1, 10_000), "num_layers": (1, 10_000), "n_layers": (1, 10_000), "n_layer": (1, 10_000),
    "hidden_size": (1, 1 << 20), "intermediate_size": (1, 1 << 22), "moe_intermediate_size": (1, 1 << 22),
    "num_attention_heads": (1, 1 << 14), "num_key_value_heads": (1, 1 << 14), "head_dim": (1, 1 << 14),
    "vocab_size": (1, 1 << 26), "max_position_embeddings": (1, 1 << 31),
    "num_experts": (0, 1 << 16), "num_local_experts": (0, 1 << 16), "n_routed_experts": (0, 1 << 16),
    "num_experts_per_tok": (0, 1 << 16), "n_shared_experts": (0, 1 << 16), "first_k_dense_replace": (0, 10_000),
    "n_group": (1, 1 << 16), "topk_group": (1, 1 << 16), "kv_lora_rank": (1, 1 << 20), "q_lora_rank": (1, 1 << 20),
    "qk_nope_head_dim": (0, 1 << 14), "qk_rope_head_dim": (0, 1 << 14), "v_head_dim": (1, 1 << 14),
}


def check_config_ranges(raw: dict, where: str = "config.json") -> None:
    """Refuse (ConfigBuildError, one line naming the key and the bound) a field of CONFIG_BOUNDS that
    is not an integer in range, at the top level and in every nested ``*_config`` table."""
    tables = [("", raw)] + [(f"{k}.", v) for k, v in raw.items() if k.endswith("_config") and isinstance(v, dict)
                            and k not in ("quantization_config", "rope_scaling")]
    for prefix, d in tables:
        for key, (lo, hi) in CONFIG_BOUNDS.items():
            if key not in d or d[key] is None:
                continue
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigBuildError(f"{where}: {prefix}{key}: must be an integer in [{lo}, {hi}], "
                                       f"got {type(v).__name__} {v!r}"[:300])
        heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
        if isinstance(heads, int) and isinstance(kv, int) and kv > heads:
            raise ConfigBuildError(f"{where}: {prefix}num_key_value_heads: must be <= num_attention_heads "
                                   f"({heads}), got {kv}")


def registry_class(model_type: str) -> tuple[str | None, str]:
    """(class name, which registry) for a registered model_type: causal LM first, then image-text-to-text."""
    from transformers.models.auto import modeling_auto as ma

    for mapping, label in ((ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal-LM mapping"),
                           (ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "image-text-to-text mapping")):
        name = mapping.get(model_type)
        if name and model_class(name) is not None:
            return name, label
    return None, ""


def resolve_architecture(raw: dict, override: str | None = None) -> tuple[str, str, list[str]]:
    """(class name, how it was found, notes) through transformers' own registries.

    Order: ``model.architecture`` when the suite sets it; else ``architectures[0]`` when transformers
    has that class; else the config's ``model_type`` through the config mapping and the causal-LM /
    image-text-to-text model mappings (``kimi_k25`` -> ``Kimi_K25ForConditionalGeneration``).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    tf = _transformers()
    if override:
        architecture_class(override)
        return override, "model.architecture", []
    arch = first_architecture(raw)
    if arch and model_class(arch) is not None:
        return arch, "architectures", []
    mt = raw.get("model_type") or ""
    tried = [f"architectures[0] {arch!r}: " + ("no such class" if arch else "absent"),
             f"model_type {mt!r}: " + ("registered" if mt in CONFIG_MAPPING_NAMES else "not in the config mapping")]
    if mt in CONFIG_MAPPING_NAMES:
        name, label = registry_class(mt)
        if name:
            return name, f"model_type ({label})", [
                f"architectures[0] {arch!r} is not a class in transformers {tf.__version__}; model_type {mt!r} "
                f"maps to {name} through its {label}"]
        tried.append(f"model_type {mt!r} has no causal-LM or image-text-to-text model class")
    remote = ""
    if raw.get("auto_map"):
        remote = (f"; its auto_map points at remote code ({', '.join(sorted(set(map(str, raw['auto_map'].values()))))}), "
                  "which harness never runs")
    raise UnknownArchitectureError(f"transformers {tf.__version__} cannot build this model (tried {'; '.join(tried)})"
                                   f"{remote}: {FIX_HINT}")


def remote_code_only(raw: dict) -> str | None:
    """One line saying why a config can only run with its own remote code, or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    tf = _transformers()
    arch = first_architecture(raw)
    mt = raw.get("model_type") or ""
    if not raw.get("auto_map") or (arch and model_class(arch) is not None) or mt in CONFIG_MAPPING_NAMES:
        return None
    return (f"remote code only: neither architectures[0] {arch!r} nor model_type {mt!r} is in transformers "
            f"{tf.__version__}, and auto_map points at code shipped beside the config "
            f"({', '.join(sorted(set(map(str, raw['auto_map'].values()))))}), which harness never runs")


def _set_path(d: dict, dotted: str, value) -> None:
    """``d["a"]["b"] = value`` for ``"a.b"`` (nested config keys in [prune.overrides])."""
    *parents, last = dotted.split(".")
    for p in parents:
        nxt = d.get(p)
        if not isinstance(nxt, dict):
            nxt = d[p] = {}
        d = nxt
    d[last] = copy.deepcopy(value)


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
    for k, v in prune.overrides.items():
        _set_path(d, k, v)
    notes += _remap_token_ids(d, d.get("vocab_size"))
    return notes


def _remap_token_ids(d: dict, vocab: int | None, where: str = "") -> list[str]:
    """Token ids past a (pruned) vocabulary -> the last ids, in ``d`` and its nested configs.

    A wrapper's top-level ids (``image_token_id``) index its text vocabulary."""
    notes: list[str] = []
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else None
    if vocab is None and text is not None:
        vocab = text.get("vocab_size")
    for k, v in list(d.items()):
        if isinstance(v, dict) and k.endswith("_config") and k != "quantization_config":
            notes += _remap_token_ids(v, v.get("vocab_size") or (vocab if k == "text_config" else None), f"{where}{k}.")
            continue
        if not vocab or not (k.endswith(("token_id", "token_ids", "token_index")) or k in TOKEN_ID_KEYS):
            continue
        i = TOKEN_ID_KEYS.index(k) if k in TOKEN_ID_KEYS else 3
        last = max(0, vocab - 1 - i)
        if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
            d[k] = last
            notes.append(f"{where}{k} {v} -> {last} (pruned vocab {vocab})")
        elif _is_int_list(v) and any(x >= vocab for x in v):
            d[k] = [x if x < vocab else last for x in v]
            notes.append(f"{where}{k} {v} -> {d[k]} (pruned vocab {vocab})")
    return notes


def _is_int_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _text_part_for(raw: dict, cls) -> str | None:
    """The nested config (``text_config``) ``cls`` is built from, when ``cls`` is a wrapper's decoder."""
    cfg_cls = getattr(cls, "config_class", None)
    for part in ("text_config", "language_config", "llm_config"):
        sub = raw.get(part)
        if not isinstance(sub, dict) or cfg_cls is None:
            continue
        top_mt = raw.get("model_type")
        if (sub.get("architectures") or [None])[0] == cls.__name__:
            return part
        if getattr(cfg_cls, "base_config_key", None) == part or (
                sub.get("model_type") and getattr(cfg_cls, "model_type", None) == sub.get("model_type")
                and cfg_cls.model_type != top_mt):
            return part
    return None


def _config_error(e: Exception, d: dict, cfg_name: str) -> ConfigBuildError:
    msg = " ".join(str(e).split())
    keys = sorted({k for k in re.findall(r"`?([a-z_][a-z0-9_]{2,})`?", msg) if k in d})
    hint = f" (keys: {', '.join(keys)})" if keys else ""
    return ConfigBuildError(f"{cfg_name} rejects the config{hint}: {type(e).__name__}: {msg}; "
                            "fix the key in [prune] / [prune.overrides]")


def build_config(raw: dict, prune: PruneSection | None = None, *, architecture: str | None = None,
                 trust_remote_code: bool = False, keep_quantization: bool = False) -> ModelConfig:
    """Turn a published config.json dict (unchanged by this call) into a transformers config."""
    check_config_ranges(raw)
    arch, via, notes = resolve_architecture(raw, architecture)
    cls = architecture_class(arch)
    part = _text_part_for(raw, cls)
    d = _text_part(raw, part) if part else copy.deepcopy(raw)
    if part:
        notes.append(f"builds the language decoder {arch} from the config's {part}")
    if not trust_remote_code and d.pop("auto_map", None) is not None:
        notes.append("auto_map ignored (trust_remote_code is off)")
    quant = None if keep_quantization else _pop_quantization(d)
    if quant is not None:
        notes.append(f"quantization_config dropped for a random-weight build: {describe_quantization(quant)}")
    if prune is not None:
        notes += apply_prune(d, prune)
    sub = getattr(getattr(cls, "config_class", None), "sub_configs", None) or {}
    if not part and "text_config" in sub and not isinstance(raw.get("text_config"), dict):
        d = _nest_flat_config(d, sub, arch, notes)
    model_type = d.pop("model_type", None) or ""
    config_cls = _config_class(cls, model_type, part, via, arch, notes)
    try:
        cfg = config_cls(**d)
    except Exception as e:  # transformers validates configs with ValueError/TypeError/AttributeError...
        raise _config_error(e, d, config_cls.__name__) from None
    cfg.architectures = [arch]
    if hasattr(cfg, "get_text_config") and cfg.get_text_config() is not cfg:
        # A wrapper built whole: checks size token ids and logits by config.vocab_size and walk the
        # decoder by config.num_hidden_layers; give them the language model's.
        for k in ("vocab_size", "num_hidden_layers", "hidden_size"):
            if not hasattr(cfg, k) and hasattr(cfg.get_text_config(), k):
                setattr(cfg, k, getattr(cfg.get_text_config(), k))
    return ModelConfig(cfg, arch, raw.get("model_type") or model_type, via, quant, notes, part)


def text_config_dict(raw: dict, architecture: str | None = None) -> dict:
    """The published config dict of what a suite builds (a copy): a wrapper's language decoder part
    (its ``text_config``, as ``build_config`` takes it), else the whole config; unpruned."""
    arch, _via, _notes = resolve_architecture(raw, architecture)
    part = _text_part_for(raw, architecture_class(arch))
    return _text_part(raw, part) if part else copy.deepcopy(raw)


def _text_part(raw: dict, part: str) -> dict:
    """A multimodal wrapper's language decoder: the causal LM built from text_config alone (with the
    wrapper's tie_word_embeddings and quantization_config where it has none)."""
    d = copy.deepcopy(raw[part])
    for k in ("tie_word_embeddings", "quantization_config"):
        if k in raw and k not in d:
            d[k] = copy.deepcopy(raw[k])
    return d


def _pop_quantization(d: dict) -> dict | None:
    """The config's quantization_config (or its text_config's), removed from it; DeepSeek-V4's
    ``expert_dtype`` (fp4 routed experts beside FP8 blocks) copied in as ``_expert_dtype``, so the
    readers of the format see both (harness.anatomy.quant.quant_layout)."""
    quant = d.pop("quantization_config", None)
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    if quant is None and text:
        quant = text.pop("quantization_config", None)
    expert_dtype = d.get("expert_dtype") or text.get("expert_dtype")
    return {**quant, "_expert_dtype": expert_dtype} if isinstance(quant, dict) and expert_dtype else quant


def _nest_flat_config(d: dict, sub: dict, arch: str, notes: list[str]) -> dict:
    """A flat (remote-code format) config for a wrapper transformers registers (Step-3.7's step3p7):
    its keys describe the language model; without this they would be ignored for the defaults.
    Nested here, after pruning, so that [prune] keys reach the text model and "vision_config.*"
    overrides the wrapper's default vision tower."""
    keep = {"architectures", "model_type", "tie_word_embeddings", *sub}
    d = {**{k: v for k, v in d.items() if k in keep}, "text_config": {k: v for k, v in d.items() if k not in keep}}
    text_cls = sub["text_config"]
    known = set(text_cls().to_dict()) if hasattr(text_cls, "to_dict") else set(d["text_config"])
    unread = sorted(k for k in d["text_config"] if k not in known and k not in ("torch_dtype", "auto_map"))
    notes.append(f"flat config read as {arch}'s text_config; its other parts "
                 f"({', '.join(k for k in sub if k != 'text_config')}) are transformers' defaults"
                 + (f"; keys {text_cls.__name__} does not read (its defaults stand instead): {', '.join(unread)}"
                    if unread else ""))
    return d


def _config_class(cls, model_type: str, part: str | None, via: str, arch: str, notes: list[str]):
    """The transformers config class for ``model_type``, else the architecture's own (Day-0: an
    unregistered model_type on a known architecture runs as that architecture)."""
    tf = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg_cls = getattr(cls, "config_class", None)
    if model_type in CONFIG_MAPPING and (cfg_cls is None or CONFIG_MAPPING[model_type] is cfg_cls
                                         or not part and via == "architectures"):
        return CONFIG_MAPPING[model_type]
    if model_type not in CONFIG_MAPPING:
        notes.append(f"model_type {model_type!r} is not registered in transformers {tf.__version__}; "
                     f"running it as {arch} ({cfg_cls.__name__})")
    return cfg_cls


def describe_quantization(q: dict) -> str:
    """One line for a quantization_config: method, format, block/group."""
    bits = [str(q.get("quant_method") or q.get("quant_algo") or "?")]
    for k in ("fmt", "format", "quant_algo", "weight_block_size"):
        if q.get(k) is not None and str(q.get(k)) not in bits:
            bits.append(f"{k} {q[k]}")
    if q.get("_declared_in"):
        bits.append(f"(declared in {q['_declared_in']}, not config.json)")
    return " ".join(bits)


def use_eager_experts(cfg) -> None:
    """Route MoE experts through the plain per-expert loop. transformers 5 defaults to
    ``torch._grouped_mm``, which rejects float64 on CPU; references and op traces need eager."""
    cfg._experts_implementation = "eager"
