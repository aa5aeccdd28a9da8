"""Quantized checkpoint formats, dequantized exactly (float64) for the reference path.

A model parameter ``X.weight`` of shape [out, in] may be stored as:

========================  ===============================================================================
format                    tensors in the checkpoint
========================  ===============================================================================
plain                     ``X.weight`` (bf16/fp16/fp32)
FP8 block (DeepSeek-V3,   ``X.weight`` float8_e4m3fn [out, in] and ``X.weight_scale_inv`` float32
Kimi-K2)                  [ceil(out/bo), ceil(in/bi)], one scale per bo x bi block (128x128); w = q * s
INT4 pack-quantized       ``X.weight_packed`` int32 [out, ceil(in/8)] (8 nibbles per word, value i at bits
(compressed-tensors)      4i, offset-coded q+8), ``X.weight_scale`` [out, in/group], ``X.weight_shape`` [2],
                          optional ``X.weight_zero_point`` (packed along dim 0); w = (q - z) * s
MXFP4 (gpt-oss)           ``X_blocks`` uint8 [..., G, 16] (two e2m1 values a byte, low nibble first) and
                          ``X_scales`` uint8 [..., G] (e8m0 exponents, bias 127); 32 values per scale
========================  ===============================================================================

Every dequantization is exact in float64: e4m3, int4 and e2m1 values times a float32/bf16 scale or a
power of two are representable in float64, so the result is the value the format means, not an
approximation of it.

The reference path always dequantizes. Kept quantized (``model.weights_quantized = "native"``): FP8
block and INT4 group-wise Linear layers on torch's own kernels, in :mod:`harness.weights.native`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.weights.layout import Checkpoint, WeightsError

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Stored:
    """How one logical tensor is stored: its format and the checkpoint keys that hold it."""

    name: str  # the logical (model-layout) checkpoint key, e.g. "...q_proj.weight"
    kind: str  # "plain" | "fp8_block" | "int4_pack" | "mxfp4"
    keys: tuple[str, ...]  # checkpoint keys read for it (payload first)


def locate(ckpt: Checkpoint, name: str) -> Stored | None:
    """Which format ``name`` is stored in, or None when the checkpoint has nothing for it."""
    t = ckpt.tensors
    if name in t:
        if t[name].dtype.startswith("float8") and f"{name}_scale_inv" in t:
            return Stored(name, "fp8_block", (name, f"{name}_scale_inv"))
        return Stored(name, "plain", (name,))
    if name.endswith(".weight") and f"{name}_packed" in t:
        keys = [f"{name}_packed", f"{name}_scale"] + [k for k in (f"{name}_zero_point", f"{name}_shape") if k in t]
        return Stored(name, "int4_pack", tuple(keys))
    if f"{name}_blocks" in t and f"{name}_scales" in t:
        return Stored(name, "mxfp4", (f"{name}_blocks", f"{name}_scales"))
    return None


def companion_keys(ckpt: Checkpoint, name: str) -> tuple[str, ...]:
    s = locate(ckpt, name)
    return s.keys if s else ()


def block_size(ckpt: Checkpoint) -> tuple[int, int] | None:
    q = ckpt.quantization() or {}
    b = q.get("weight_block_size")
    return (int(b[0]), int(b[1])) if b else None


def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """[out, in] e4m3 x [ceil(out/bo), ceil(in/bi)] float32 -> float64 [out, in].

    DeepSeek's name ``weight_scale_inv`` is the dequantization multiplier (w = q * s), the inverse of
    the quantization scale. The block is taken from ``quantization_config.weight_block_size`` or,
    without one, 128x128 when that tiles the weight, else inferred from the shapes."""
    out_f, in_f = w.shape
    so, si = scale_inv.shape
    if block is None:
        # Partial edge blocks make the shapes ambiguous (72 rows in 3 tiles: 24 or 32?): try the
        # 128x128 both models ship, then the smallest tile that fits.
        fits = math.ceil(out_f / 128) == so and math.ceil(in_f / 128) == si
        block = (128, 128) if fits else (math.ceil(out_f / so), math.ceil(in_f / si))
    bo, bi = block
    if math.ceil(out_f / bo) != so or math.ceil(in_f / bi) != si:
        raise WeightsError(f"weight_scale_inv {tuple(scale_inv.shape)} does not tile a {tuple(w.shape)} weight in "
                           f"{bo}x{bi} blocks")
    s = scale_inv.double().repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]
    return w.double() * s


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3 recipe (per-block amax / 448): float [out, in] -> (e4m3 [out, in], float32 scale_inv).
    Used to write FP8 checkpoints (tests, benchmarks) and by a backend that keeps weights in FP8."""
    out_f, in_f = w.shape
    bo, bi = block
    so, si = math.ceil(out_f / bo), math.ceil(in_f / bi)
    pad = torch.zeros(so * bo, si * bi, dtype=torch.float32)
    pad[:out_f, :in_f] = w.float()
    tiles = pad.reshape(so, bo, si, bi)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [so, si]
    scale_inv = (amax / torch.finfo(torch.float8_e4m3fn).max).float()
    q = (tiles / scale_inv[:, None, :, None]).reshape(so * bo, si * bi)[:out_f, :in_f].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv


def unpack_int4(packed: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> int8 values in [-8, 7] (offset-coded nibbles, value i at bits 4i), ``n`` along ``dim``."""
    p = packed if dim == 1 else packed.t()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    vals = (p.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [rows, words, 8]
    vals = vals.reshape(p.shape[0], -1)[:, :n].to(torch.int8) - 8
    return vals if dim == 1 else vals.t()


def dequant_int4_pack(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int],
                      zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` INT4, group-wise along the input dim -> float64 [out, in]."""
    out_f, in_f = shape
    if packed.shape[0] != out_f or packed.shape[1] != math.ceil(in_f / 8):
        raise WeightsError(f"weight_packed {tuple(packed.shape)} does not hold a {shape} int4 weight")
    q = unpack_int4(packed, in_f).double()  # [out, in]
    groups = scale.shape[1]
    g = math.ceil(in_f / groups)
    s = scale.double().repeat_interleave(g, 1)[:, :in_f]
    if zero_point is not None:
        z = unpack_int4(zero_point, out_f, dim=0).double().repeat_interleave(g, 1)[:, :in_f]
        q = q - z
    return q * s


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4: uint8 [..., G, 16] + e8m0 uint8 [..., G] -> float64 [..., G * 32] (checkpoint order;
    transformers' gpt-oss loader additionally transposes the expert matrices)."""
    if blocks.shape[:-1] != scales.shape:
        raise WeightsError(f"mxfp4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float64)
    b = blocks.to(torch.uint8)
    out = torch.empty(*b.shape[:-1], b.shape[-1] * 2, dtype=torch.float64)
    out[..., 0::2] = lut[(b & 0x0F).long()]
    out[..., 1::2] = lut[(b >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1).double())
    return out.reshape(*b.shape[:-2], -1)


def mxfp4_to_model(x: torch.Tensor) -> torch.Tensor:
    """An MXFP4 expert stack in checkpoint order [E, out, in] -> the model's [E, in, out] (a view).

    gpt-oss checkpoints store ``experts.gate_up_proj_blocks`` as [E, 2I, H/32, 16] and ``down_proj_blocks``
    as [E, H, I/32, 16], while ``GptOssExperts`` holds ``gate_up_proj`` [E, H, 2I] and ``down_proj``
    [E, I, H] (it computes ``x @ W``); transformers' loader (``integrations/mxfp4.py``,
    ``convert_moe_packed_tensors``) transposes dims 1 and 2 after dequantizing, always. The shapes cannot
    tell: gpt-oss has I == H, so ``down_proj`` has the same shape either way. A 2-D MXFP4 Linear weight is
    already [out, in], the Linear layout."""
    return x.transpose(1, 2) if x.dim() == 3 else x


def read_dequantized(reader, stored: Stored, block: tuple[int, int] | None = None,
                     rows: list[int] | None = None) -> torch.Tensor:
    """The logical tensor ``stored.name`` in the model's layout: as stored for plain tensors, float64 for
    quantized ones. ``rows``: only those indices along dim 0 (kept experts), read alone where the format
    allows (plain, MXFP4: one row of blocks and scales per expert)."""
    if rows is not None:
        if stored.kind == "plain":
            return reader.rows(stored.name, rows)
        if stored.kind == "mxfp4":
            return mxfp4_to_model(dequant_mxfp4(reader.rows(stored.keys[0], rows), reader.rows(stored.keys[1], rows)))
        return read_dequantized(reader, stored, block)[rows]
    if stored.kind == "plain":
        return reader.get(stored.name)
    if stored.kind == "fp8_block":
        return dequant_fp8_block(reader.get(stored.keys[0]), reader.get(stored.keys[1]), block)
    if stored.kind == "int4_pack":
        name = stored.name
        packed, scale = reader.get(f"{name}_packed"), reader.get(f"{name}_scale")
        ck = reader.ckpt.tensors
        shape = (tuple(int(x) for x in reader.get(f"{name}_shape").tolist()) if f"{name}_shape" in ck
                 else (packed.shape[0], packed.shape[1] * 8))
        zp = reader.get(f"{name}_zero_point") if f"{name}_zero_point" in ck else None
        return dequant_int4_pack(packed, scale, shape, zp)
    if stored.kind == "mxfp4":
        return mxfp4_to_model(dequant_mxfp4(reader.get(stored.keys[0]), reader.get(stored.keys[1])))
    raise WeightsError(f"{stored.name}: unknown storage format {stored.kind}")


def logical_shape(ckpt: Checkpoint, stored: Stored) -> tuple[int, ...]:
    """The shape the stored tensor stands for (what the model expects), from the headers alone."""
    t = ckpt.tensors
    if stored.kind in ("plain", "fp8_block"):
        return t[stored.name].shape
    if stored.kind == "int4_pack":
        p = t[f"{stored.name}_packed"].shape
        return (p[0], p[1] * 8)  # upper bound; weight_shape (a tensor) holds the exact in-features
    b = t[stored.keys[0]].shape
    s = (*b[:-2], b[-2] * b[-1] * 2)
    return (s[0], s[2], s[1]) if len(s) == 3 else s  # expert stacks in the model's order (mxfp4_to_model)
