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

from harness.anatomy.moe import (
    expert_parents,
    experts_per_token,
    module_kind,
    module_part,
    num_experts,
    text_config,
)
from harness.anatomy.quant import QuantLayout, QuantScheme, quant_layout, quant_scheme
from harness.models.build import instantiate, model_config
from harness.models.config import (
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
    pruned_only: bool = False  # the suite's pruned test model whatever is asked (the parallel check's plan)

    def model_config(self, pruned: bool) -> ModelConfig:
        if self.suite is not None:
            return model_config(self.suite, pruned=pruned or self.pruned_only)
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
        from harness.models.prune import PlanRefused, plan_for
        from harness.suite.loader import with_declared_quantization

        raw = with_declared_quantization(raw, p)  # FP8 / NVFP4 declared in hf_quant_config.json

        try:  # the decision `harness init` makes (issue #29): a config it refuses is not counted either
            plan_for(raw, p.name)
        except PlanRefused as e:
            raise ValueError(f"{e} (harness init refuses it for the same reason)") from None
        return Target(p.parent.name if p.name == "config.json" else p.stem, raw, None, p)  # a model directory
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
    # the checkpoint's bytes by kind where it is quantized (weights + scales, 16 bits for the rest; no
    # buffers): the plan's per-kind weights, so a stage of bf16 attention and INT4 experts weighs its own
    stored_by_kind: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _weight_block_bytes(out_f: int, in_f: int, block: tuple[int, int]) -> tuple[int, int]:
    """(fp8 bytes, fp32 scale bytes) of one [out, in] weight quantized in ``block`` tiles."""
    return out_f * in_f, math.ceil(out_f / block[0]) * math.ceil(in_f / block[1]) * 4


@dataclass
class _Count:
    """What the steps of :func:`count_parameters` share."""

    model: torch.nn.Module
    mc: ModelConfig
    tcfg: object = None
    n_exp: int = 0
    top_k: int | None = None
    scheme: QuantScheme | None = None
    layout: QuantLayout | None = None
    groups: dict = field(default_factory=dict)  # parameter -> its QuantGroup (a mixed release's layout)
    per_label: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # label -> [weights, scales]
    parents: set[str] = field(default_factory=set)  # MoE blocks holding routed experts
    by_kind: dict = field(default_factory=lambda: defaultdict(int))
    act_by_kind: dict = field(default_factory=lambda: defaultdict(float))
    by_part: dict = field(default_factory=lambda: defaultdict(int))
    stored_by_kind: dict = field(default_factory=lambda: defaultdict(int))
    qbytes: int = 0
    scales: int = 0
    keep16: int = 0
    buffers: int = 0
    rep: ParamReport | None = None


def count_parameters(model: torch.nn.Module, mc: ModelConfig) -> ParamReport:
    """Parameters by kind and part, activated per token, and checkpoint bytes per format, as named
    steps: find_experts -> tally -> summarize -> stored_by_kind -> checkpoint_bytes -> mtp_note."""
    c = _Count(model, mc)
    for step in (_find_experts, _tally, _summarize, _stored_by_kind, _checkpoint_bytes, _mtp_note):
        step(c)
    return c.rep


def _find_experts(c: _Count) -> None:
    """Expert count and top-k from the (text) config; which modules hold routed experts."""
    c.tcfg = text_config(c.mc.config)
    c.n_exp = num_experts(c.mc.config)
    c.top_k = experts_per_token(c.mc.config) if c.n_exp else None
    c.parents = expert_parents(c.model, c.n_exp)
    c.scheme = quant_scheme(c.mc.quantization)
    c.layout = quant_layout(c.mc.quantization)
    if c.layout is not None and (c.layout.mixed or any(not g.catch_all for g in c.layout.groups)):
        # which module is stored in which format, by the model's names and the checkpoint's (issue #50:
        # NVFP4 experts beside FP8 attention were counted as FP8 throughout, 1.5-1.7x the real size)
        from harness.weights.rename import checkpoint_names

        c.groups = {p: c.layout.group_of(names) for p, names in checkpoint_names(c.model).items()}


def _tally(c: _Count) -> None:
    """Each parameter once (tied ones too): its kind, part, activated share and checkpoint bytes."""
    seen: set[int] = set()
    for fqn, mod in c.model.named_modules():
        kind = module_kind(fqn, mod, c.n_exp, c.parents)
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
            pscheme = _stored_scheme(c, fqn, mod, pname, p, kind, part)
            if pscheme is None:
                c.keep16 += n
                c.stored_by_kind[kind] += 2 * n
                continue
            a, b = _scheme_bytes(pscheme, mod, pname, p.shape)
            c.qbytes, c.scales = c.qbytes + a, c.scales + b
            c.stored_by_kind[kind] += a + b
            c.per_label[pscheme.label][0] += a
            c.per_label[pscheme.label][1] += b
    persistent = set(c.model.state_dict(keep_vars=True))
    c.buffers = sum(b.numel() for n, b in c.model.named_buffers() if n in persistent)


def _stored_scheme(c: _Count, fqn: str, mod: torch.nn.Module, pname: str, p: torch.Tensor, kind: str,
                   part: str) -> QuantScheme | None:
    """The format the checkpoint stores parameter ``fqn.pname`` in, or None (16 bits). Quantized:
    Linear weights of attention / MLP / experts of the language model, unless the config's ignore
    list keeps them; with a layout that names its modules, the parameter's own group's format."""
    pscheme = c.scheme
    head = False
    if c.groups:
        g = c.groups.get(f"{fqn}.{pname}" if fqn else pname)
        pscheme = g.scheme if g is not None else None
        head = g is not None and not g.catch_all and kind == "lm_head"
    quantized = (pscheme is not None and part == "text"
                 and (kind in ("attention", "dense_mlp", "routed_experts", "shared_experts") or head)
                 and p.dim() >= 2 and pname != "bias" and not pname.endswith("_bias")
                 and not pscheme.skips(fqn) and not pscheme.skips(f"{fqn}.{pname}"))
    return pscheme if quantized else None


def _scheme_bytes(pscheme: QuantScheme, mod: torch.nn.Module, pname: str, shape) -> tuple[int, int]:
    """(weight bytes, scale bytes) of a stored parameter of ``shape``: [out, in], or fused experts
    [E, out, in] ([E, in, out] when the module is transposed; gate_up holds two weights)."""
    if len(shape) == 2:
        return pscheme.bytes_of(shape[0], shape[1])
    e, d1, d2 = shape
    out_f, in_f = (d2, d1) if getattr(mod, "is_transposed", False) else (d1, d2)
    parts = 2 if "gate_up" in pname else 1
    a, b = pscheme.bytes_of(out_f // parts, in_f)
    return e * parts * a, e * parts * b


class StoredBytes:
    """What a parameter, or a rank's shard of it, weighs as the checkpoint stores it: ``harness plan
    --rehearse`` holds the plan's FP8 / NVFP4 / INT4 figures against the rehearsed ranks' local
    shards (the rehearsal builds bf16 on the meta device). Built from the whole, unparallelized
    model; parameters are looked up by their names there."""

    def __init__(self, model: torch.nn.Module, mc: ModelConfig):
        c = _Count(model, mc)
        _find_experts(c)
        self.by_name: dict[str, tuple[QuantScheme, torch.nn.Module, str]] = {}
        for fqn, mod in model.named_modules():
            kind, part = module_kind(fqn, mod, c.n_exp, c.parents), module_part(fqn)
            for pname, p in mod.named_parameters(recurse=False):
                pscheme = _stored_scheme(c, fqn, mod, pname, p, kind, part)
                if pscheme is not None:
                    self.by_name[f"{fqn}.{pname}" if fqn else pname] = (pscheme, mod, pname)

    def of(self, name: str, local: torch.Tensor) -> int:
        """Bytes of ``local`` (a shard of parameter ``name``) as stored: quantized weights and their
        scales, or 2 B a parameter (16 bits, as inspect counts the rest of a quantized checkpoint)."""
        hit = self.by_name.get(name)
        if hit is None or local.dim() < 2:
            return local.numel() * 2
        pscheme, mod, pname = hit
        a, b = _scheme_bytes(pscheme, mod, pname, tuple(local.shape))
        return a + b


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


def _stored_by_kind(c: _Count) -> None:
    """The checkpoint's bytes by kind where it is quantized (the plan's per-kind weights)."""
    if c.qbytes:
        c.rep.stored_by_kind = {k: c.stored_by_kind[k] for k in KINDS if c.stored_by_kind.get(k)}


def _mixed_bytes(c: _Count) -> None:
    """A release of several formats: one scenario with each format's weights and scales beside the
    modules it keeps in 16 bits, and a note of which format stores which modules."""
    rep, lay = c.rep, c.layout
    label = "mixed " + " + ".join(c.per_label)
    entry = {}
    for g in lay.groups:
        lab = g.scheme.label
        if lab in c.per_label and f"{g.scheme.weight_dtype} ({lab})" not in entry:
            entry[f"{g.scheme.weight_dtype} ({lab})"] = c.per_label[lab][0]
            entry[f"{g.scheme.scale_dtype} ({lab} {g.scheme.scale_name})"] = c.per_label[lab][1]
    entry["bfloat16 (embeddings, norms, router, modules no format names)"] = c.keep16 * 2
    entry["float32 (buffers)"] = c.buffers * 4
    rep.bytes[label] = entry
    parts = [f"{g.family} ({g.scheme.label}{'; ' + g.act.describe() if g.act else ''}): "
             + (", ".join(g.targets[:3]) + (f" (+{len(g.targets) - 3} more)" if len(g.targets) > 3 else ""))
             for g in lay.groups]
    rep.notes.append(f"checkpoint is {describe_quantization(c.mc.quantization)}, several formats by module: "
                     + "; ".join(parts) + (f"; not read: {'; '.join(lay.unread)}" if lay.unread else ""))


def _checkpoint_bytes(c: _Count) -> None:
    """Bytes per format: float32, bfloat16, and the config's quantized checkpoint format."""
    rep, scheme, quant, buffers, total = c.rep, c.scheme, c.mc.quantization, c.buffers, c.rep.total
    rep.bytes["float32"] = {"float32": total * 4 + buffers * 4}
    rep.bytes["bfloat16"] = {"bfloat16": total * 2, "float32 (buffers)": buffers * 4}
    if c.groups and c.layout.mixed:
        _mixed_bytes(c)
    elif scheme is not None:
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
