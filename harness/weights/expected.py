"""What the full (unpruned) model expects to find in its checkpoint, and how the checkpoint differs.

The reference is the model itself on the meta device (no memory, any size) in the config's dtype,
taken to checkpoint keys by transformers' own reverse conversion (``revert_weight_conversion``: fused
experts back to one tensor per expert), exactly what ``save_pretrained`` would write. Quantized
checkpoints are compared through their logical tensors (:mod:`quant`): an FP8 block weight must be
float8 with a ``weight_scale_inv`` that tiles it, an INT4 one must pack it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from harness.weights import quant
from harness.weights.layout import Checkpoint


@dataclass
class LayoutReport:
    expected: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name (shard): what"
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        return (f"{self.expected} tensors expected: {len(self.missing)} missing, {len(self.unexpected)} unexpected, "
                f"{len(self.mismatched)} mismatched")


def expected_tensors(meta_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint key -> meta tensor (shape, dtype) for the whole model."""
    sd = meta_model.state_dict()
    if getattr(meta_model.config, "tie_word_embeddings", False):
        for k in list(getattr(meta_model, "_tied_weights_keys", None) or {}):
            sd.pop(k, None)
    try:
        from transformers.core_model_loading import revert_weight_conversion

        return dict(revert_weight_conversion(meta_model, sd))
    except ImportError:
        return sd


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def compare(meta_model: torch.nn.Module, ckpt: Checkpoint) -> LayoutReport:
    exp = expected_tensors(meta_model)
    rep = LayoutReport(expected=len(exp))
    used: set[str] = set()
    block = quant.block_size(ckpt)
    for name, t in sorted(exp.items()):
        st = quant.locate(ckpt, name)
        if st is None:
            rep.missing.append(name)
            continue
        used.update(st.keys)
        _check_tensor(rep, ckpt, name, t, st, block)
    _leftovers(rep, meta_model, ckpt, used)
    return rep


def _check_tensor(rep: LayoutReport, ckpt: Checkpoint, name: str, t: torch.Tensor, st, block) -> None:
    """One expected tensor against what the checkpoint stores for it, read as its kind of storage."""
    info = ckpt.tensors[st.keys[0]]
    want = tuple(t.shape)
    where = f"{name} ({info.shard})"
    if st.kind == "plain":
        if info.shape != want:
            rep.mismatched.append(f"{where}: shape {list(info.shape)}, the config implies {list(want)}")
        elif info.dtype != _dtype_name(t):
            line = f"{where}: dtype {info.dtype}, the config implies {_dtype_name(t)}"
            # Norm weights, biases and router correction vectors are often kept in float32.
            (rep.notes if t.dim() == 1 and info.dtype.startswith("float") else rep.mismatched).append(line)
    elif st.kind == "fp8_block":
        _check_fp8_block(rep, ckpt, name, st, info, want, block)
    else:
        shape = quant.logical_shape(ckpt, st)
        if st.kind == "int4_pack":
            ok = shape[0] == want[0] and math.ceil(want[1] / 8) * 8 == shape[1]
        else:
            ok = tuple(shape) == want
        if not ok:
            rep.mismatched.append(f"{where}: {st.kind} holds {list(shape)}, the config implies {list(want)}")


def _check_fp8_block(rep: LayoutReport, ckpt: Checkpoint, name: str, st, info, want: tuple, block) -> None:
    """An FP8 block weight: the expected shape, a float8 dtype, and a weight_scale_inv that tiles it."""
    where = f"{name} ({info.shard})"
    s = ckpt.tensors[st.keys[1]]
    bo, bi = block or (128, 128)
    tiles = (math.ceil(want[0] / bo), math.ceil(want[1] / bi)) if len(want) == 2 else None
    if info.shape != want:
        rep.mismatched.append(f"{where}: shape {list(info.shape)}, the config implies {list(want)}")
    elif not info.dtype.startswith("float8"):
        rep.mismatched.append(f"{where}: dtype {info.dtype} with a weight_scale_inv, expected float8")
    elif s.shape != tiles:
        rep.mismatched.append(f"{name}_scale_inv ({s.shard}): shape {list(s.shape)}, {bo}x{bi} blocks of "
                              f"{list(want)} need {list(tiles or ())}")


def _leftovers(rep: LayoutReport, meta_model: torch.nn.Module, ckpt: Checkpoint, used: set[str]) -> None:
    """Checkpoint tensors nothing expected: unexpected, except the multi-token-prediction layers past
    num_hidden_layers that transformers does not build (a note per layer, not a mismatch)."""
    n_layers = int(getattr(meta_model.config, "num_hidden_layers", 0) or 0)
    extra_layers: dict[int, int] = {}
    for name in sorted(set(ckpt.tensors) - used):
        m = re.search(r"(^|\.)layers\.(\d+)\.", name)
        if m and int(m.group(2)) >= n_layers and getattr(meta_model.config, "num_nextn_predict_layers", 0):
            extra_layers[int(m.group(2))] = extra_layers.get(int(m.group(2)), 0) + 1
            continue
        rep.unexpected.append(f"{name} ({ckpt.tensors[name].shard})")
    for layer, n in sorted(extra_layers.items()):
        rep.notes.append(f"layer {layer}: {n} tensors of the multi-token-prediction layer (num_nextn_predict_layers), "
                         "not built by transformers")
