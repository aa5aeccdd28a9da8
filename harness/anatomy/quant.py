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
        for pat in (p for entry in self.ignore for p in text_paths(entry)):
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
        group = int(w.get("group_size") or q.get("group_size") or 16)  # modelopt: top-level group_size
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
    fmt = str(q.get("fmt") or "").lower()
    # "fp8", "fbgemm_fp8", DeepSeek's fmt "e4m3", ModelOpt's quant_algo, compressed-tensors' float8 weights
    if "fp8" in method or "e4m3" in fmt or algo == "FP8" or (bits == 8 and wtype == "float"):
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


def family(q: dict | None) -> str | None:
    """``fp8`` / ``mxfp4`` / ``nvfp4`` / ``int4`` / ``int8`` of a ``quantization_config``, else None."""
    s = quant_scheme(q)
    if s is None:
        return None
    if s.weight_dtype.startswith("float8"):
        return "fp8"
    if s.label.startswith(("mxfp4", "nvfp4")):
        return s.label.split()[0]
    return f"int{s.weight_bits}"

