"""Which source layers and experts a pruned model keeps, and the key of every tensor it reads.

A pruned model has ``prune.num_hidden_layers`` decoder layers and ``prune.num_experts`` routed experts
(widths stay as published: real weights cannot be narrowed). Pruned layer ``j`` takes the tensors of
source layer ``layers[j]``, pruned expert ``k`` those of source expert ``experts[k]``:

* default layers: each pruned layer takes the first unused source layer *of the same kind*, the kind
  being the layer's parameter names (dense MLP vs MoE) plus ``layer_types`` when the config has it
  (sliding vs full attention). DeepSeek-V3 (3 dense layers first) pruned to one dense + one MoE layer
  keeps source layers [0, 3]; Kimi-K2 (1 dense first) keeps [0, 1];
* default experts: the first ``num_experts``; the router's rows (``gate.weight`` [E, H],
  ``e_score_correction_bias`` [E]) are read for the same experts only;
* ``model.weights_layers`` / ``model.weights_experts`` in the suite override both.

transformers 5 fuses experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])
while checkpoints keep one tensor per expert (``experts.7.gate_proj.weight``). The mapping between them
is transformers' own conversion list for the model (``get_model_conversion_mapping``); this module
reads it (renamings, and converters made of ``MergeModulelist`` + ``Concatenate``) to know, for each
checkpoint key, the *view* of the model parameter it fills, so every tensor is copied straight into
place: no second copy of the model, bytes read = bytes kept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from harness.weights.layout import Checkpoint, WeightsError

LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)\.")
EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


@dataclass
class Selection:
    layers: list[int]  # source layer of pruned layer j
    experts: list[int] | None  # source expert of pruned expert k (None: the model has no routed experts)
    full_layers: int = 0
    full_experts: int | None = None
    # Pruned-model tensors indexed by expert along dim 0 that the checkpoint stores for all experts in one
    # tensor: the router's rows (gate.weight [E, H], e_score_correction_bias [E]) and experts a checkpoint
    # keeps fused (gpt-oss: experts.gate_up_proj [E, ...]). Read for the kept experts only.
    expert_rows: frozenset[str] = frozenset()

    def describe(self) -> str:
        s = f"layers {self.layers} of {self.full_layers}"
        if self.experts is not None:
            s += f", experts {_short(self.experts)} of {self.full_experts}"
        return s


def whole(n_layers: int) -> Selection:
    """Every layer and expert of an ``n_layers`` model, numbered as in the checkpoint (the full-size
    builds: nothing is renumbered; fused experts are read whole)."""
    return Selection(list(range(n_layers)), None, n_layers, None)


def _short(x: list[int]) -> str:
    return str(x) if len(x) <= 8 else f"[{x[0]}..{x[-1]}] ({len(x)})"


@dataclass
class Entry:
    """One checkpoint tensor -> one view of one model parameter."""

    source: str  # checkpoint key in the source numbering, e.g. model.layers.3.mlp.experts.17.up_proj.weight
    param: str  # model state_dict key (pruned numbering)
    expert: int | None = None  # index into the fused parameter's dim 0
    part: tuple[int, int] | None = None  # (offset, size) along the expert's dim 0 (gate / up of gate_up)
    rows: list[int] | None = None  # read only these rows of the source (router rows for kept experts)
    # transformers' Transpose(dim0, dim1, check_dims) conversion: the checkpoint stores the tensor with two
    # dims swapped (Qwen3-VL-MoE's fused experts [E, H, 2I]); with check_dims only when the shapes differ.
    transpose: tuple[int, int, bool] | None = None

    def adapt(self, src: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The source tensor in the model's layout (``shape``: the view it fills)."""
        if self.transpose is not None:
            d0, d1, check = self.transpose
            if not check or tuple(src.shape) != tuple(shape):
                src = src.transpose(d0, d1)
        return src

    def view(self, t: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            t = t[self.expert]
        if self.part is not None:
            t = t.narrow(0, *self.part)
        return t


@dataclass
class Plan:
    entries: list[Entry]
    selection: Selection
    skipped: list[str] = field(default_factory=list)  # tied parameters filled through their twin


def layer_kinds(model: torch.nn.Module, cfg) -> list[tuple]:
    """One hashable kind per decoder layer: its parameter names (+ layer_types[i])."""
    names: dict[int, set[str]] = {}
    for k in model.state_dict():
        m = LAYER_RE.search(k)
        if m:
            names.setdefault(int(m.group(2)), set()).add(k[m.end():])
    types = getattr(cfg, "layer_types", None) or []
    return [(tuple(sorted(names.get(i, ()))), types[i] if i < len(types) else None) for i in range(len(names))]


def select(full_meta: torch.nn.Module, full_cfg, pruned_meta: torch.nn.Module, pruned_cfg, *,
           layers: list[int] | None = None, experts: list[int] | None = None) -> Selection:
    from harness.anatomy.moe import EXPERT_KEYS

    fk, pk = layer_kinds(full_meta, full_cfg), layer_kinds(pruned_meta, pruned_cfg)
    if layers:
        if len(layers) != len(pk):
            raise WeightsError(f"model.weights_layers lists {len(layers)} layers, the pruned model has {len(pk)}")
        bad = [x for x in layers if not 0 <= x < len(fk)]
        if bad:
            raise WeightsError(f"model.weights_layers: layer {bad[0]} is not in the checkpoint's {len(fk)} layers")
        for j, src in enumerate(layers):
            if fk[src] != pk[j]:
                raise WeightsError(f"model.weights_layers: pruned layer {j} is a different kind of layer than source "
                                   f"layer {src} (e.g. dense vs MoE); pick a layer of the same kind")
    else:
        layers, used = [], set()
        for j, kind in enumerate(pk):
            src = next((i for i, k in enumerate(fk) if k == kind and i not in used), None)
            if src is None:
                raise WeightsError(f"pruned layer {j} has no layer of the same kind left in the checkpoint's "
                                   f"{len(fk)} layers; set model.weights_layers")
            used.add(src)
            layers.append(src)
    ne_full = next((getattr(full_cfg, k) for k in EXPERT_KEYS if isinstance(getattr(full_cfg, k, None), int)), None)
    ne = next((getattr(pruned_cfg, k) for k in EXPERT_KEYS if isinstance(getattr(pruned_cfg, k, None), int)), None)
    if ne is None:
        sel_e = None
    elif experts:
        if len(experts) != ne:
            raise WeightsError(f"model.weights_experts lists {len(experts)} experts, the pruned model has {ne}")
        if any(not 0 <= e < (ne_full or 0) for e in experts):
            raise WeightsError(f"model.weights_experts: the checkpoint has {ne_full} experts, got {experts}")
        sel_e = list(experts)
    else:
        if ne > (ne_full or 0):
            raise WeightsError(f"prune.num_experts = {ne} but the checkpoint has {ne_full} experts")
        sel_e = list(range(ne))
    return Selection(list(layers), sel_e, len(fk), ne_full,
                     _expert_indexed(full_meta, pruned_meta, layers, ne_full, ne) if sel_e is not None else frozenset())


def _expert_indexed(full_meta: torch.nn.Module, pruned_meta: torch.nn.Module, layers: list[int], ne_full, ne
                    ) -> frozenset[str]:
    """Pruned tensors whose dim 0 is the expert index: dim 0 is the expert count in both models (``ne_full`` in
    the full one, ``ne`` in the pruned one) and the other dims agree. Comparing with the full model, rather
    than matching names or one size, keeps a tensor that merely has ``ne`` rows (attention sinks [heads]
    with as many heads as kept experts) out."""
    fsd = full_meta.state_dict()
    out = set()
    for k, t in pruned_meta.state_dict().items():
        m = LAYER_RE.search(k)
        f = fsd.get(f"{k[:m.start(2)]}{layers[int(m.group(2))]}{k[m.end(2):]}" if m else k)
        if (f is not None and t.dim() >= 1 and f.dim() == t.dim() and t.shape[0] == ne and f.shape[0] == ne_full
                and f.shape[1:] == t.shape[1:]):
            out.add(k)
    return frozenset(out)


def _conversions(model: torch.nn.Module):
    """transformers' renamings and converters for this model (empty when it has none)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # an older transformers without conversion mappings: checkpoint keys = model keys
        return [], []
    try:
        convs = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # noqa: BLE001 - a vendor adapter's module is not a PreTrainedModel
        return [], []
    convs = [c for c in convs if not isinstance(c, PrefixChange)]
    renamings = [c.reverse_transform() for c in reversed(convs) if isinstance(c, WeightRenaming)]
    converters = [c for c in convs if isinstance(c, WeightConverter)]
    return renamings, converters


def _to_checkpoint(key: str, renamings) -> str:
    from transformers.core_model_loading import apply_renamings

    return apply_renamings(key, renamings) if renamings else key


def _plain(pattern: str) -> str:
    """A converter's key pattern as a plain suffix: ``^``, regex-escaped dots (DeepSeek-V4 writes
    ``\\.experts.gate_up_proj``) and leading dots removed; ``*`` stays the expert index."""
    return pattern.removeprefix("^").replace("\\.", ".").lstrip(".")


def _converter_for(param: str, converters):
    """(converter, prefix) when ``param`` is the target of a fusing converter."""
    for c in converters:
        for tp in c._original_target_patterns:
            t = _plain(tp)
            if param.endswith(t) and (param == t or param[: -len(t)].endswith(".")):
                return c, param[: -len(t)]
    return None, None


def _transpose_of(c) -> tuple[int, int, bool] | None:
    """(dim0, dim1, check_dims) of a converter that only transposes one tensor, else None."""
    from transformers.core_model_loading import Transpose

    ops = c.operations
    if len(ops) == 1 and isinstance(ops[0], Transpose) and len(c._original_source_patterns) == 1:
        return ops[0].dim0, ops[0].dim1, bool(ops[0].check_dims)
    return None


def _fused_layout(c, param: str, shape: torch.Size) -> tuple[list[str], int]:
    """Source patterns and the size of each one's part along the per-expert dim 0."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = [type(o) for o in c.operations]
    srcs = [_plain(s) for s in c._original_source_patterns]
    if ops == [MergeModulelist] and len(srcs) == 1:
        return srcs, shape[1]
    if ops == [MergeModulelist, Concatenate] and c.operations[0].dim == 0 and c.operations[1].dim == 1:
        return srcs, shape[1] // len(srcs)
    raise WeightsError(f"{param}: transformers converts it with {[o.__name__ for o in ops]}, which the pruned "
                       "loader does not map (it handles per-expert merges and gate/up concatenation)")


def renumber(key: str, sel: Selection) -> str:
    """A pruned-numbering checkpoint key -> the source numbering."""
    m = LAYER_RE.search(key)
    if m:
        key = f"{key[:m.start(2)]}{sel.layers[int(m.group(2))]}{key[m.end(2):]}"
    if sel.experts is not None:
        m = EXPERT_RE.search(key)
        if m:
            key = f"{key[:m.start(1)]}{sel.experts[int(m.group(1))]}{key[m.end(1):]}"
    return key


def plan(model: torch.nn.Module, sel: Selection) -> Plan:
    """Every checkpoint tensor the pruned ``model`` reads, with the parameter view it fills."""
    renamings, converters = _conversions(model)
    sd = model.state_dict(keep_vars=True)
    entries: list[Entry] = []
    seen: dict[int, str] = {}
    skipped = []
    for name, t in sd.items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else None
        if ptr is not None and ptr in seen:  # tied to an earlier parameter (lm_head = embed_tokens)
            skipped.append(name)
            continue
        if ptr is not None:
            seen[ptr] = name
        c, prefix = _converter_for(name, converters)
        tr = _transpose_of(c) if c is not None else None
        if tr is not None:
            ck = renumber(_to_checkpoint(prefix + _plain(c._original_source_patterns[0]), renamings), sel)
            rows = sel.experts if name in sel.expert_rows else None
            if rows is not None and 0 in tr[:2]:
                raise WeightsError(f"{name}: transformers transposes dim 0 of it on load, so its kept experts' rows "
                                   "cannot be read alone")
            entries.append(Entry(ck, name, rows=rows, transpose=tr))
            continue
        if c is not None:
            srcs, size = _fused_layout(c, name, t.shape)
            for k in range(t.shape[0]):
                for j, s in enumerate(srcs):
                    ck = _to_checkpoint(prefix + s.replace("*", str(k)), renamings)
                    entries.append(Entry(renumber(ck, sel), name, k, (j * size, size) if len(srcs) > 1 else None))
            continue
        ck = renumber(_to_checkpoint(name, renamings), sel)
        # router rows [E, H] / correction bias [E] / fused experts [E, ...] of the kept experts
        rows = sel.experts if name in sel.expert_rows else None
        entries.append(Entry(ck, name, rows=rows))
    return Plan(entries, sel, skipped)


def tied_twin(model: torch.nn.Module, name: str) -> bool:
    return name in set(getattr(model, "_tied_weights_keys", None) or {})


def check_against(ckpt: Checkpoint, p: Plan) -> list[str]:
    """Keys the plan needs that the checkpoint does not hold (in any format)."""
    from harness.weights.quant import locate

    return [e.source for e in p.entries if locate(ckpt, e.source) is None]


def checkpoint_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every parameter's names as a checkpoint's quantization config may write them: the parameter's
    own module path and its path first, then the checkpoint's spelling of each (transformers'
    renamings reversed: DeepSeek-V4's ``layers.0.attn.wq_b`` for ``model.layers.0.self_attn.q_b_proj``)
    and, for experts fused on load, each source tensor of expert 0 (``layers.0.ffn.experts.0.w1``).
    A config's targets and per-layer entries name modules by either spelling (issue #50)."""
    renamings, converters = _conversions(model)
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        names = [owner, name]
        try:
            ck = [_to_checkpoint(name, renamings)]
            c, prefix = _converter_for(name, converters)
            if c is not None:
                ck += [_to_checkpoint(prefix + _plain(s).replace("*", "0"), renamings)
                       for s in c._original_source_patterns]
        except Exception:  # noqa: BLE001 - a renaming transformers cannot reverse: the model's names stand
            ck = []
        for k in ck:
            names += [k.rsplit(".", 1)[0] if k.endswith((".weight", ".bias")) else k, k]
        out[name] = list(dict.fromkeys(names))
    return out
