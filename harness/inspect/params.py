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

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from harness.models.build import instantiate, model_config
from harness.models.config import EXPERT_KEYS, ModelConfig, architecture_class, build_config
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
    return model.to(dtype), mc


def _num_experts(cfg) -> int | None:
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

    def to_dict(self) -> dict:
        return asdict(self)


def _weight_block_bytes(out_f: int, in_f: int, block: tuple[int, int]) -> tuple[int, int]:
    """(fp8 bytes, fp32 scale bytes) of one [out, in] weight quantized in ``block`` tiles."""
    return out_f * in_f, math.ceil(out_f / block[0]) * math.ceil(in_f / block[1]) * 4


def count_parameters(model: torch.nn.Module, mc: ModelConfig) -> ParamReport:
    cfg = mc.config
    n_exp = _num_experts(cfg)
    top_k = getattr(cfg, "num_experts_per_tok", None) if n_exp else None
    _EXPERT_PARENTS.clear()
    for fqn, mod in model.named_modules():
        if _is_experts(mod, n_exp):
            _EXPERT_PARENTS.add(fqn.rsplit(".", 1)[0])

    by_kind: dict[str, int] = defaultdict(int)
    act_by_kind: dict[str, float] = defaultdict(float)
    seen: set[int] = set()
    quant = mc.quantization
    block = tuple((quant or {}).get("weight_block_size") or (128, 128))
    skip_q = set((quant or {}).get("modules_to_not_convert") or [])
    fp8 = scales = keep16 = 0
    for fqn, mod in model.named_modules():
        kind = module_kind(fqn, mod, n_exp)
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            by_kind[kind] += n
            if kind == "routed_experts" and p.dim() == 3 and top_k:
                act_by_kind[kind] += n * top_k / p.shape[0]
            else:
                act_by_kind[kind] += n
            # FP8 block quantization: Linear weights of attention / MLP / experts; everything else bf16.
            quantized = (quant is not None and kind in ("attention", "dense_mlp", "routed_experts",
                                                        "shared_experts")
                         and p.dim() >= 2 and pname != "bias" and not pname.endswith("_bias")
                         and not any(s in fqn for s in skip_q))
            if not quantized:
                keep16 += n
            elif p.dim() == 2:
                a, b = _weight_block_bytes(p.shape[0], p.shape[1], block)
                fp8, scales = fp8 + a, scales + b
            else:  # fused experts [E, out, in] (or [E, in, out] when transposed); gate_up is two weights
                e, d1, d2 = p.shape
                out_f, in_f = (d2, d1) if getattr(mod, "is_transposed", False) else (d1, d2)
                parts = 2 if "gate_up" in pname else 1
                a, b = _weight_block_bytes(out_f // parts, in_f, block)
                fp8, scales = fp8 + e * parts * a, scales + e * parts * b
    persistent = set(model.state_dict(keep_vars=True))
    buffers = sum(b.numel() for n, b in model.named_buffers() if n in persistent)
    total = sum(by_kind.values())
    emb = by_kind.get("embedding", 0)
    activated = int(round(sum(act_by_kind.values()) - emb))
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) and by_kind.get("lm_head", 0) == 0
    rep = ParamReport(
        total=total, activated=activated, activated_with_embedding=activated + emb,
        by_kind={k: by_kind[k] for k in KINDS if by_kind.get(k)},
        activated_by_kind={k: round(act_by_kind[k]) for k in KINDS if act_by_kind.get(k)},
        non_embedding=total - emb - by_kind.get("lm_head", 0),
        num_layers=int(getattr(cfg, "num_hidden_layers", 0) or 0), num_experts=n_exp, experts_per_token=top_k,
        tied_embeddings=tied, buffers_persistent=buffers)
    rep.bytes["float32"] = {"float32": total * 4 + buffers * 4}
    rep.bytes["bfloat16"] = {"bfloat16": total * 2, "float32 (buffers)": buffers * 4}
    if quant is not None:
        rep.bytes[f"fp8 block {block[0]}x{block[1]} (checkpoint)"] = {
            "float8_e4m3fn (weights)": fp8, "float32 (weight_scale_inv)": scales,
            "bfloat16 (embeddings, lm_head, norms, router)": keep16 * 2, "float32 (buffers)": buffers * 4}
        rep.notes.append(f"checkpoint is {quant.get('quant_method')} {quant.get('fmt', '')} with "
                         f"{block[0]}x{block[1]} blocks: 1 byte per quantized Linear weight + one fp32 "
                         "weight_scale_inv per block")
    for scenario in rep.bytes.values():
        scenario["total"] = sum(scenario.values())
    if mc.architecture == "DeepseekV3ForCausalLM" and (getattr(cfg, "num_nextn_predict_layers", 0) or
                                                       mc.config.to_dict().get("num_nextn_predict_layers")):
        rep.notes.append("the multi-token-prediction layer (num_nextn_predict_layers) is in the checkpoint but "
                         "not built by transformers: not counted")
    return rep


def inspect_params(target: Target) -> tuple[ParamReport, ModelConfig]:
    model, mc = meta_model(target, pruned=False)
    return count_parameters(model, mc), mc
