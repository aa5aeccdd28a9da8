"""Quantization schemes of a checkpoint, read from its ``quantization_config``: the one answer to
"how are this release's Linear weights stored" that ``harness inspect`` (bytes per scenario), the
quantization check (which scheme to simulate) and the weight loaders share."""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field


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
        (modelopt: ``model.layers.0.self_attn*``) or module names (a prefix or a path component). An
        entry written by the multimodal wrapper's paths (``model.language_model.layers.0.self_attn``)
        also matches the text model's (``model.layers.0.self_attn``): the checks run the text model,
        and a list that never matched quantized every module it keeps (issue #50)."""
        return matches(self.ignore, fqn)


def matches(patterns: list[str], fqn: str) -> bool:
    """Whether any of a checkpoint's module patterns names ``fqn``: ``re:`` regexes (compressed-tensors
    matches them from the start), globs, or module names (a prefix or a path component), each also
    by the text model's path where it is written by the multimodal wrapper's."""
    for pat in (p for entry in patterns for p in text_paths(entry)):
        if pat.startswith("re:"):
            if re.match(pat[3:], fqn):
                return True
        elif any(c in pat for c in "*?["):
            if fnmatch.fnmatchcase(fqn, pat) or fnmatch.fnmatchcase(fqn, pat + ".*"):
                return True
        elif fqn == pat or fqn.startswith(pat + ".") or f".{pat}." in f".{fqn}." or fqn.endswith("." + pat):
            return True
        elif "." in pat and pat.split(".", 1)[0] not in fqn.split(".") and \
                f".{fqn}.".find(f".{pat.split('.', 1)[1]}.") >= 0 and pat.split(".", 1)[1].count(".") >= 1:
            return True  # the checkpoint's root (Nemotron-H's backbone.) where transformers has model.
    return False


# The multimodal wrapper's path of its language model -> the text-only model's (transformers 5: the
# wrapper holds ``model.language_model`` and ``lm_head``; older releases ``language_model.model``).
_WRAPPER_ROOTS = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head", "lm_head"),
                  (r"model\.language_model\.", r"model\."), (r"language_model\.model\.", r"model\."))


def text_paths(entry: str) -> list[str]:
    """``entry`` and, where it names a module by the wrapper's path, the same by the text model's."""
    out = [entry]
    for wrapped, text in _WRAPPER_ROOTS:
        if wrapped in entry:
            out.append(entry.replace(wrapped, text))
    return out


def quant_scheme(q: dict | None) -> QuantScheme | None:
    """The storage scheme of a ``quantization_config`` (FP8 per-block / per-channel / per-tensor,
    MXFP4, INT4/INT8 group-wise compressed-tensors, NVFP4), or None when it is not one we know. A
    release of several formats (:func:`quant_layout`) answers with its first group's scheme; what
    stores which module is the layout's to say."""
    lay = quant_layout(q)
    return lay.groups[0].scheme if lay is not None and lay.groups else None


def _ignore(q: dict) -> list[str]:
    return list(q.get("ignore") or q.get("modules_to_not_convert") or q.get("exclude_modules") or [])


def _weights_scheme(q: dict, w: dict) -> QuantScheme | None:
    """The scheme of one group's ``weights`` (compressed-tensors) or of the whole config (the other
    methods, ``w`` empty)."""
    method = str(q.get("quant_method") or "").lower()
    algo = str(q.get("quant_algo") or "").upper()
    ignore = _ignore(q)
    bits, wtype = w.get("num_bits"), str(w.get("type") or "")
    strategy = str(w.get("strategy") or "").lower()
    if method == "mxfp4" or algo == "MXFP4":
        return QuantScheme("mxfp4 (checkpoint)", "float4_e2m1 (packed, 2 per byte)", 4, "group", "float8_e8m0 "
                           "(one per 32)", 1, group=32, ignore=ignore, scale_name="scales")
    if algo == "NVFP4" or (bits == 4 and wtype == "float"):
        group = int(w.get("group_size") or q.get("group_size") or 16)  # modelopt: top-level group_size
        return QuantScheme(f"nvfp4 group {group} (checkpoint)", "float4_e2m1 (packed, 2 per byte)", 4, "group",
                           f"float8_e4m3fn (one per {group}) + fp32 global", 1, group=group, per_tensor_bytes=8,
                           ignore=ignore)
    if algo == "MXFP8":
        return QuantScheme("mxfp8 (checkpoint)", "float8_e4m3fn", 8, "group", "float8_e8m0 (one per 32)", 1,
                           group=32, ignore=ignore, scale_name="weight_scale")
    if bits in (4, 8) and wtype == "int":
        group = w.get("group_size")
        gran = "group" if strategy == "group" and group else ("channel" if strategy == "channel" else "tensor")
        label = f"int{bits} {gran}" + (f" {group}" if gran == "group" else "") + " (checkpoint)"
        zp = 0 if w.get("symmetric", True) else 1  # asymmetric: a zero point beside each scale
        return QuantScheme(label, f"int{bits} (packed)" if bits == 4 else "int8", bits, gran,
                           "bfloat16" + (" + zero point" if zp else ""), 2 * (1 + zp), group=int(group or 0) or None,
                           ignore=ignore)
    fmt = str(q.get("fmt") or "").lower()
    # "fp8", "fbgemm_fp8", DeepSeek's fmt "e4m3", ModelOpt's quant_algo, compressed-tensors' float8 weights
    if "fp8" in method or "e4m3" in fmt or algo.startswith("FP8") or (bits == 8 and wtype == "float"):
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


def _family(s: QuantScheme) -> str:
    if s.label.startswith(("mxfp4", "nvfp4", "mxfp8")):
        return s.label.split()[0]
    if s.weight_dtype.startswith("float8"):
        return "fp8"
    return f"int{s.weight_bits}"


@dataclass(frozen=True)
class ActQuant:
    """Input activations a group declares quantized (compressed-tensors' ``input_activations``,
    ModelOpt's W?A? algorithms): ``family`` nvfp4 (e2m1 per ``group`` under an e4m3 scale), fp8
    (e4m3: per token when ``group`` is None, else per ``group``) or int8 (per token)."""

    family: str
    group: int | None = None
    per_tensor: bool = False  # one scale for the whole input (a static calibrated scale), not per token

    def describe(self) -> str:
        grain = f"per {self.group}" if self.group else ("per tensor" if self.per_tensor else "per token")
        return f"{self.family} inputs ({grain})"


@dataclass
class QuantGroup:
    """Modules stored in one format: ``targets`` (``Linear``: every quantizable Linear no other group
    names; else module names, globs or ``re:`` regexes, by checkpoint or model paths)."""

    family: str
    scheme: QuantScheme
    targets: list[str]
    act: ActQuant | None = None

    @property
    def catch_all(self) -> bool:
        return any(t[:1].isupper() and "." not in t and not t.startswith("re:") for t in self.targets)


@dataclass
class QuantLayout:
    """Which module of a release is stored in which format: one group for a single-format release;
    one per format for a mixed one (NVFP4 experts beside FP8 attention, issue #50). ``unread``: the
    declared formats harness cannot read (one line each), never dropped without a word."""

    groups: list[QuantGroup]
    ignore: list[str]
    unread: list[str] = field(default_factory=list)

    @property
    def families(self) -> list[str]:
        return list(dict.fromkeys(g.family for g in self.groups))

    @property
    def mixed(self) -> bool:
        return len(self.families) > 1

    def group_of(self, names: list[str]) -> QuantGroup | None:
        """The group storing the module known by ``names`` (its model path first, then its checkpoint
        paths), or None: kept in high precision. The ignore list wins; then a group naming it; then
        a ``Linear`` catch-all (compressed-tensors' order: a name or regex over a class)."""
        if any(matches(self.ignore, n) for n in names):
            return None
        for g in self.groups:
            if not g.catch_all and any(matches(g.targets, n) for n in names):
                return g
        return next((g for g in self.groups if g.catch_all), None)


def _act(a) -> ActQuant | None:
    if not isinstance(a, dict) or not a.get("num_bits"):
        return None
    bits, typ = int(a["num_bits"]), str(a.get("type") or "float")
    if bits == 4 and typ == "float":
        return ActQuant("nvfp4", int(a.get("group_size") or 16))
    if bits == 8:
        group = int(a["group_size"]) if a.get("group_size") else None
        return ActQuant("fp8" if typ == "float" else "int8", group,
                        per_tensor=group is None and str(a.get("strategy") or "tensor").lower() == "tensor")
    return None


# ModelOpt's per-layer algorithms (hf_quant_config.json ``quantized_layers``) as (weights' spelling
# for _weights_scheme, activations); weight-only algorithms (W4A16, _WO) leave activations alone.
_MODELOPT = {
    "FP8": ({"quant_algo": "FP8"}, ActQuant("fp8", per_tensor=True)),  # W8A8, a static (calibrated) input scale
    "FP8_PER_CHANNEL_PER_TOKEN": ({"quant_algo": "FP8", "_w": {"strategy": "channel"}}, ActQuant("fp8")),
    "FP8_PB_WO": ({"quant_algo": "FP8", "weight_block_size": [128, 128]}, None),
    "NVFP4": ({"quant_algo": "NVFP4"}, ActQuant("nvfp4", 16)),
    "W4A16_NVFP4": ({"quant_algo": "NVFP4"}, None),
    "NVFP4_AWQ": ({"quant_algo": "NVFP4"}, ActQuant("nvfp4", 16)),
    "MXFP8": ({"quant_algo": "MXFP8"}, None),
    "MXFP4": ({"quant_algo": "MXFP4"}, None),
    "W4A16_AWQ": ({"_w": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}, None),
    "W4A8_AWQ": ({"_w": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}, ActQuant("fp8")),
    "INT4_AWQ": ({"_w": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}, None),
    "W8A8_SQ_PER_CHANNEL": ({"_w": {"num_bits": 8, "type": "int", "strategy": "channel"}}, ActQuant("int8")),
}
_UNQUANTIZED = {"", "NONE", "UNQUANTIZED", "BF16", "FP16"}


def _modelopt_groups(q: dict, layers: dict) -> tuple[list[QuantGroup], list[str]]:
    """``quantized_layers`` {path: {quant_algo, group_size}} -> one group per (algorithm, group size)."""
    by: dict[tuple, list[str]] = {}
    unread = []
    for path, spec in layers.items():
        spec = spec if isinstance(spec, dict) else {}
        algo = str(spec.get("quant_algo") or "").upper()
        if algo in _UNQUANTIZED:
            continue
        by.setdefault((algo, spec.get("group_size")), []).append(str(path))
    groups = []
    for (algo, gs), paths in by.items():
        known = _MODELOPT.get(algo)
        if known is None:
            unread.append(f"{algo} ({len(paths)} modules, e.g. {paths[0]})")
            continue
        spelling, act = known
        w = dict(spelling.get("_w") or {})
        if gs and algo in ("NVFP4", "W4A16_NVFP4", "NVFP4_AWQ"):
            w.update(num_bits=4, type="float", group_size=int(gs))
        qq = {k: v for k, v in spelling.items() if k != "_w"} | {"ignore": _ignore(q)}
        s = _weights_scheme(qq, w)
        groups.append(QuantGroup(_family(s), s, paths, act))
    return groups, unread


def quant_layout(q: dict | None) -> QuantLayout | None:
    """Every format a ``quantization_config`` stores, with the modules each targets: compressed-
    tensors' ``config_groups`` (each with its ``targets``), ModelOpt's ``quantized_layers`` (per-layer
    algorithms, a ``MIXED_PRECISION`` release), DeepSeek's ``expert_dtype`` fp4 beside FP8 blocks
    (copied in as ``_expert_dtype`` by the readers), else one format for every Linear. None: no
    quantization, or none harness can read."""
    if not q:
        return None
    ignore = _ignore(q)
    groups: list[QuantGroup] = []
    unread: list[str] = []
    layers = q.get("quantized_layers")
    if isinstance(layers, dict) and layers:
        groups, unread = _modelopt_groups(q, layers)
    elif isinstance(q.get("config_groups"), dict) and q["config_groups"]:
        for name, g in q["config_groups"].items():
            if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
                continue
            s = _weights_scheme(q, g["weights"])
            targets = [str(t) for t in (g.get("targets") or ["Linear"])]
            if s is None:
                unread.append(f"{name}: weights {g['weights'].get('num_bits')}-bit {g['weights'].get('type')}")
                continue
            groups.append(QuantGroup(_family(s), s, targets, _act(g.get("input_activations"))))
    else:
        s = _weights_scheme(q, {})
        if s is not None:
            act = ActQuant("nvfp4", s.group) if _family(s) == "nvfp4" and str(q.get("quant_algo")).upper() == "NVFP4" \
                else None  # ModelOpt's NVFP4 is W4A4
            if str(q.get("_expert_dtype") or "").lower() == "fp4" and _family(s) == "fp8":
                # DeepSeek-V4: routed experts in FP4 (e2m1, one ue8m0 scale per 32), the rest FP8 blocks
                fp4 = _weights_scheme({"quant_method": "mxfp4", "ignore": ignore}, {})
                groups.append(QuantGroup("mxfp4", fp4, [r"re:.*\.(experts)(\.\d+)?(\.|$)"]))
            groups.append(QuantGroup(_family(s), s, ["Linear"], act))
    if not groups and not unread:
        return None
    return QuantLayout(groups, ignore, unread)


def family(q: dict | None) -> str | None:
    """``fp8`` / ``mxfp4`` / ``nvfp4`` / ``mxfp8`` / ``int4`` / ``int8`` of a ``quantization_config``
    (its first group's, for a mixed release), else None."""
    s = quant_scheme(q)
    return None if s is None else _family(s)
