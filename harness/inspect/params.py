"""Parameters of the *unpruned* model, counted on the meta device (no memory, no init cost).

Every parameter is put in one module kind:

==================  ===========================================================================
kind                what
==================  ===========================================================================
embedding           input token embedding (``nn.Embedding``)
lm_head             output projection (counted once if tied to the embedding)
attention           q/k/v/o projections, MLA down/up projections (their norms are ``norm``)
dense_mlp           MLP of dense layers
routed_experts      the routed experts (fused ``[E, ...]`` parameters in transformers 5)
shared_experts      always-on experts of the DeepSeek / Qwen2-MoE family
router              the gate that scores experts
norm                RMSNorm / LayerNorm weights
other               anything else
==================  ===========================================================================

*Activated* parameters are what one token touches: every parameter except the routed experts,
plus ``top_k / num_experts`` of those. Vendors differ on the embedding: DeepSeek and Moonshot
exclude the input embedding, Qwen and Mistral include it; both figures are reported
(``activated`` excludes the input embedding and includes lm_head; ``activated_with_embedding``
includes both).

Buffers (rotary ``inv_freq``, the router's ``e_score_correction_bias``) are not parameters; the
persistent ones are counted in checkpoint bytes only.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from harness.models.build import instantiate, model_config
from harness.models.config import (
    EXPERT_KEYS,
    TOPK_KEYS,
    ModelConfig,
    architecture_class,
    build_config,
    describe_quantization,
)
from harness.suite.loader import LoadedSuite

KINDS = ("embedding", "lm_head", "attention", "dense_mlp", "routed_experts", "shared_experts", "router",
         "norm", "other")


@dataclass
class Target:
    """What ``harness inspect`` looks at: a suite, or a bare config.json."""

    name: str
    raw_config: dict
    suite: LoadedSuite | None = None
    path: Path | None = None

    def model_config(self, pruned: bool) -> ModelConfig:
        if self.suite is not None:
            return model_config(self.suite, pruned=pruned)
        return build_config(self.raw_config, None)


def load_target(arg: str | Path, suites_dir: str | Path = "suites") -> Target:
    """A suite name, a suite .toml, or a config.json path."""
    from harness.suite.loader import load_suite, resolve_names

    p = Path(arg)
    if p.suffix == ".json":
        try:
            raw = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: cannot read config.json: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: top level is not a JSON object")
        return Target(p.stem, raw, None, p)
    (path,) = resolve_names([str(arg)], suites_dir)
    ls = load_suite(path)
    return Target(ls.name, ls.raw_config, ls, ls.path)


def meta_model(target: Target, pruned: bool = False, dtype: torch.dtype = torch.bfloat16,
               mc: ModelConfig | None = None) -> tuple[torch.nn.Module, ModelConfig]:
    """The model on the meta device: shapes and dtypes only, built in milliseconds at any size."""
    mc = mc or target.model_config(pruned)
    with torch.device("meta"):
        if target.suite is not None:
            model = instantiate(target.suite, mc, dtype)
        else:
            model = architecture_class(mc.architecture)(mc.config)
    from harness.models.build import cast_model

    return cast_model(model, dtype, "meta"), mc  # rotary inv_freq stays float32, as in the real build


def _text(cfg):
    """A wrapper's text config (``get_text_config``), else the config itself."""
    try:
        return cfg.get_text_config()
    except (AttributeError, ValueError):
        return cfg


def _num_experts(cfg) -> int | None:
    cfg = _text(cfg)
    for k in EXPERT_KEYS:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _is_experts(mod: torch.nn.Module, n_exp: int | None) -> bool:
    name = type(mod).__name__
    return name.endswith("Experts") and any(p.dim() == 3 for p in mod.parameters(recurse=False)) or (
        n_exp is not None and any(p.dim() == 3 and p.shape[0] == n_exp for p in mod.parameters(recurse=False)))


def module_kind(fqn: str, mod: torch.nn.Module, n_exp: int | None = None) -> str:
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
    if "Router" in cls or (last == "gate" and _parent_has_experts(fqn)):
        return "router"
    if _is_experts(mod, n_exp) or ".experts." in f"{fqn}.":
        return "routed_experts"
    if "attn" in fqn or "attention" in fqn:
        return "attention"
    if ".mlp" in fqn or "feed_forward" in fqn or "ffn" in fqn:
        return "dense_mlp"
    return "other"


_EXPERT_PARENTS: set[str] = set()


def _parent_has_experts(fqn: str) -> bool:
    return fqn.rsplit(".", 1)[0] in _EXPERT_PARENTS


@dataclass
class ParamReport:
    total: int
    activated: int  # excludes the input embedding, includes lm_head (DeepSeek / Moonshot convention)
    activated_with_embedding: int  # includes the input embedding too (Qwen / Mistral convention)
    by_kind: dict[str, int]
    activated_by_kind: dict[str, float]
    non_embedding: int  # total minus input embedding and lm_head
    num_layers: int
    num_experts: int | None
    experts_per_token: int | None
    tied_embeddings: bool
    buffers_persistent: int  # elements in persistent buffers (state dict, not parameters)
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # scenario -> dtype -> bytes
    notes: list[str] = field(default_factory=list)
    by_part: dict[str, int] = field(default_factory=dict)  # multimodal wrappers: text, vision, projector, overall

    def to_dict(self) -> dict:
        return asdict(self)


def _weight_block_bytes(out_f: int, in_f: int, block: tuple[int, int]) -> tuple[int, int]:
    """(fp8 bytes, fp32 scale bytes) of one [out, in] weight quantized in ``block`` tiles."""
    return out_f * in_f, math.ceil(out_f / block[0]) * math.ceil(in_f / block[1]) * 4


@dataclass
class QuantScheme:
    """How a checkpoint stores its quantized Linear weights, read from ``quantization_config``.

    ``granularity``: ``block`` (one scale per ``block`` tile), ``channel`` (one per output row),
    ``tensor`` (one per matrix) or ``group`` (one per ``group`` consecutive input elements of a row).
    """

    label: str  # scenario name in ParamReport.bytes
    weight_dtype: str  # e.g. float8_e4m3fn, int4 (packed), float4_e2m1 (packed)
    weight_bits: int
    granularity: str
    scale_dtype: str
    scale_bytes: int
    block: tuple[int, int] | None = None
    group: int | None = None
    per_tensor_bytes: int = 0  # extra per quantized matrix (NVFP4's fp32 global scale, static input scales)
    ignore: list[str] = field(default_factory=list)
    scale_name: str = "weight_scale"

    def bytes_of(self, out_f: int, in_f: int) -> tuple[int, int]:
        """(weight bytes, scale bytes) of one [out, in] matrix."""
        w = math.ceil(out_f * in_f * self.weight_bits / 8)
        if self.granularity == "block":
            n = math.ceil(out_f / self.block[0]) * math.ceil(in_f / self.block[1])
        elif self.granularity == "channel":
            n = out_f
        elif self.granularity == "group":
            n = out_f * math.ceil(in_f / self.group)
        else:
            n = 1
        return w, n * self.scale_bytes + self.per_tensor_bytes

    def skips(self, fqn: str) -> bool:
        """``ignore`` / ``modules_to_not_convert`` entries: ``re:`` regexes (compressed-tensors), globs
        (modelopt: ``model.layers.0.self_attn*``) or module names (a prefix or a path component)."""
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], fqn):
                    return True
            elif any(c in pat for c in "*?["):
                if fnmatch.fnmatchcase(fqn, pat) or fnmatch.fnmatchcase(fqn, pat + ".*"):
                    return True
            elif fqn == pat or fqn.startswith(pat + ".") or f".{pat}." in f".{fqn}." or fqn.endswith("." + pat):
                return True
        return False


def quant_scheme(q: dict | None) -> QuantScheme | None:
    """The storage scheme of a ``quantization_config`` (FP8 per-block / per-channel / per-tensor,
    MXFP4, INT4/INT8 group-wise compressed-tensors, NVFP4), or None when it is not one we know."""
    if not q:
        return None
    method = str(q.get("quant_method") or "").lower()
    algo = str(q.get("quant_algo") or "").upper()
    ignore = list(q.get("ignore") or q.get("modules_to_not_convert") or q.get("exclude_modules") or [])
    w = {}
    for g in (q.get("config_groups") or {}).values():
        if isinstance(g, dict) and isinstance(g.get("weights"), dict):
            w = g["weights"]
            break
    bits, wtype = w.get("num_bits"), str(w.get("type") or "")
    strategy = str(w.get("strategy") or "").lower()
    if method == "mxfp4" or algo == "MXFP4":
        return QuantScheme("mxfp4 (checkpoint)", "float4_e2m1 (packed, 2 per byte)", 4, "group", "float8_e8m0 "
                           "(one per 32)", 1, group=32, ignore=ignore, scale_name="scales")
    if algo == "NVFP4" or (bits == 4 and wtype == "float"):
        group = int(w.get("group_size") or 16)
        return QuantScheme(f"nvfp4 group {group} (checkpoint)", "float4_e2m1 (packed, 2 per byte)", 4, "group",
                           f"float8_e4m3fn (one per {group}) + fp32 global", 1, group=group, per_tensor_bytes=8,
                           ignore=ignore)
    if bits in (4, 8) and wtype == "int":
        group = w.get("group_size")
        gran = "group" if strategy == "group" and group else ("channel" if strategy == "channel" else "tensor")
        label = f"int{bits} {gran}" + (f" {group}" if gran == "group" else "") + " (checkpoint)"
        zp = 0 if w.get("symmetric", True) else 1  # asymmetric: a zero point beside each scale
        return QuantScheme(label, f"int{bits} (packed)" if bits == 4 else "int8", bits, gran,
                           "bfloat16" + (" + zero point" if zp else ""), 2 * (1 + zp), group=int(group or 0) or None,
                           ignore=ignore)
    if method == "fp8" or algo == "FP8" or (bits == 8 and wtype == "float"):
        block = q.get("weight_block_size") or w.get("block_structure")
        if isinstance(block, str):
            block = [int(x) for x in re.findall(r"\d+", block)]
        if block:
            b = (int(block[0]), int(block[1]))
            return QuantScheme(f"fp8 block {b[0]}x{b[1]} (checkpoint)", "float8_e4m3fn", 8, "block", "float32", 4,
                               block=b, ignore=ignore, scale_name="weight_scale_inv")
        if strategy == "channel":
            return QuantScheme("fp8 per-channel (checkpoint)", "float8_e4m3fn", 8, "channel", "float32", 4,
                               ignore=ignore)
        static_input = isinstance(w, dict) and w and (q.get("config_groups") or {}) and not any(
            (g.get("input_activations") or {}).get("dynamic", True) for g in q["config_groups"].values()
            if isinstance(g, dict))
        return QuantScheme("fp8 per-tensor (checkpoint)", "float8_e4m3fn", 8, "tensor",
                           "float32" + (" (+ static input_scale)" if static_input else ""), 4,
                           per_tensor_bytes=4 if static_input else 0, ignore=ignore)
    return None


def module_part(fqn: str) -> str:
    """Which part of a multimodal wrapper a module belongs to: text, vision or projector."""
    low = fqn.lower()
    if re.search(r"projector|multi_modal|mm_proj|merger|connector|aligner|embed_vision", low):
        return "projector"
    if re.search(r"vision|visual|vit\b|image|patch|audio", low):
        return "vision"
    return "text"


@dataclass
class _Count:
    """What the steps of :func:`count_parameters` share."""

    model: torch.nn.Module
    mc: ModelConfig
    tcfg: object = None
    n_exp: int = 0
    top_k: int | None = None
    scheme: QuantScheme | None = None
    by_kind: dict = field(default_factory=lambda: defaultdict(int))
    act_by_kind: dict = field(default_factory=lambda: defaultdict(float))
    by_part: dict = field(default_factory=lambda: defaultdict(int))
    qbytes: int = 0
    scales: int = 0
    keep16: int = 0
    buffers: int = 0
    rep: ParamReport | None = None


def count_parameters(model: torch.nn.Module, mc: ModelConfig) -> ParamReport:
    """Parameters by kind and part, activated per token, and checkpoint bytes per format, as named
    steps: find_experts -> tally -> summarize -> checkpoint_bytes -> mtp_note."""
    c = _Count(model, mc)
    for step in (_find_experts, _tally, _summarize, _checkpoint_bytes, _mtp_note):
        step(c)
    return c.rep


def _find_experts(c: _Count) -> None:
    """Expert count and top-k from the (text) config; which modules hold routed experts."""
    c.tcfg = _text(c.mc.config)
    c.n_exp = _num_experts(c.mc.config)
    c.top_k = next((getattr(c.tcfg, k) for k in TOPK_KEYS if isinstance(getattr(c.tcfg, k, None), int)),
                   None) if c.n_exp else None
    _EXPERT_PARENTS.clear()
    for fqn, mod in c.model.named_modules():
        if _is_experts(mod, c.n_exp):
            _EXPERT_PARENTS.add(fqn.rsplit(".", 1)[0])
    c.scheme = quant_scheme(c.mc.quantization)


def _tally(c: _Count) -> None:
    """Each parameter once (tied ones too): its kind, part, activated share and checkpoint bytes."""
    seen: set[int] = set()
    scheme = c.scheme
    for fqn, mod in c.model.named_modules():
        kind = module_kind(fqn, mod, c.n_exp)
        part = module_part(fqn)
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            c.by_kind[kind] += n
            c.by_part[part] += n
            if kind == "routed_experts" and p.dim() == 3 and c.top_k:
                c.act_by_kind[kind] += n * c.top_k / p.shape[0]  # [E, out, in]: top_k of E experts per token
            else:
                c.act_by_kind[kind] += n
            # Quantized: Linear weights of attention / MLP / experts of the language model, unless the
            # config's ignore list keeps them; everything else stays bf16.
            quantized = (scheme is not None and part == "text"
                         and kind in ("attention", "dense_mlp", "routed_experts", "shared_experts")
                         and p.dim() >= 2 and pname != "bias" and not pname.endswith("_bias")
                         and not scheme.skips(fqn) and not scheme.skips(f"{fqn}.{pname}"))
            if not quantized:
                c.keep16 += n
            elif p.dim() == 2:
                a, b = scheme.bytes_of(p.shape[0], p.shape[1])
                c.qbytes, c.scales = c.qbytes + a, c.scales + b
            else:  # fused experts [E, out, in] (or [E, in, out] when transposed); gate_up is two weights
                e, d1, d2 = p.shape
                out_f, in_f = (d2, d1) if getattr(mod, "is_transposed", False) else (d1, d2)
                parts = 2 if "gate_up" in pname else 1
                a, b = scheme.bytes_of(out_f // parts, in_f)
                c.qbytes, c.scales = c.qbytes + e * parts * a, c.scales + e * parts * b
    persistent = set(c.model.state_dict(keep_vars=True))
    c.buffers = sum(b.numel() for n, b in c.model.named_buffers() if n in persistent)


def _summarize(c: _Count) -> None:
    """Totals, activated (with and without the input embedding), per part for wrappers."""
    by_kind, act_by_kind, tcfg = c.by_kind, c.act_by_kind, c.tcfg
    total = sum(by_kind.values())
    emb = by_kind.get("embedding", 0)
    activated = int(round(sum(act_by_kind.values()) - emb))
    tied = bool(getattr(tcfg, "tie_word_embeddings", False)) and by_kind.get("lm_head", 0) == 0
    c.rep = rep = ParamReport(
        total=total, activated=activated, activated_with_embedding=activated + emb,
        by_kind={k: by_kind[k] for k in KINDS if by_kind.get(k)},
        activated_by_kind={k: round(act_by_kind[k]) for k in KINDS if act_by_kind.get(k)},
        non_embedding=total - emb - by_kind.get("lm_head", 0),
        num_layers=int(getattr(tcfg, "num_hidden_layers", 0) or 0), num_experts=c.n_exp,
        experts_per_token=c.top_k, tied_embeddings=tied, buffers_persistent=c.buffers)
    if set(c.by_part) - {"text"}:
        rep.by_part = {k: c.by_part[k] for k in ("text", "vision", "projector") if c.by_part.get(k)}
        rep.by_part["overall"] = total
        rep.notes.append("parts: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in rep.by_part.items()))


def _checkpoint_bytes(c: _Count) -> None:
    """Bytes per format: float32, bfloat16, and the config's quantized checkpoint format."""
    rep, scheme, quant, buffers, total = c.rep, c.scheme, c.mc.quantization, c.buffers, c.rep.total
    rep.bytes["float32"] = {"float32": total * 4 + buffers * 4}
    rep.bytes["bfloat16"] = {"bfloat16": total * 2, "float32 (buffers)": buffers * 4}
    if scheme is not None:
        rep.bytes[scheme.label] = {
            f"{scheme.weight_dtype} (weights)": c.qbytes, f"{scheme.scale_dtype} ({scheme.scale_name})": c.scales,
            "bfloat16 (embeddings, lm_head, norms, router)": c.keep16 * 2, "float32 (buffers)": buffers * 4}
        grain = {"block": f"{scheme.block[0]}x{scheme.block[1]} blocks" if scheme.block else "",
                 "group": f"groups of {scheme.group}", "channel": "output channels", "tensor": "tensors"}
        rep.notes.append(f"checkpoint is {describe_quantization(quant)}: {scheme.weight_bits}-bit quantized Linear "
                         f"weights with one {scheme.scale_name} per {grain[scheme.granularity]}"
                         + (f"; kept unquantized: {', '.join(scheme.ignore[:6])}" +
                            (f" (+{len(scheme.ignore) - 6} more)" if len(scheme.ignore) > 6 else "")
                            if scheme.ignore else ""))
    elif quant is not None:
        rep.notes.append(f"quantization_config {describe_quantization(quant)} is not a format harness accounts "
                         "for; checkpoint bytes shown for float32 / bfloat16 only")
    for scenario in rep.bytes.values():
        scenario["total"] = sum(scenario.values())


def _mtp_note(c: _Count) -> None:
    mtp = next((k for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")
                if (c.tcfg.to_dict().get(k) or 0) > 0), None)
    if mtp:
        c.rep.notes.append(f"the multi-token-prediction layers ({mtp}) are in the checkpoint but not built by "
                           "transformers: not counted")


def inspect_params(target: Target) -> tuple[ParamReport, ModelConfig]:
    model, mc = meta_model(target, pruned=False)
    return count_parameters(model, mc), mc
