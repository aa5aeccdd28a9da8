"""Kept quantized: FP8 block-quantized Linear layers that run on the backend's own FP8 matmul.

With ``model.weights_quantized = "native"`` the attention and dense-MLP Linear layers whose checkpoint
weights are FP8 block-quantized keep their e4m3 weights and 128x128 ``weight_scale_inv`` and compute
``y = x W^T`` with ``torch._scaled_mm``, the FP8 GEMM torch dispatches to the backend (cuBLASLt on
CUDA, and a reference kernel on CPU in torch 2.13, which has per-tensor and row-wise scales but no
block scales). Block scales are applied the way DeepSeek-V3's kernels do: activations are quantized
dynamically per token in 1 x 128 groups, and for every 128-wide slice k of the input dimension

    y += _scaled_mm(x_q[:, k], W_q[:, k]^T, scale_a = x_scale[:, k] [M, 1], scale_b = s[:, k] [1, N])

(the weight scale varies along N in 128-row steps, i.e. a row-wise scale of the output). The
dequantized float64 model is the reference (``quant.dequant_fp8_block``); the difference is the
activation quantization, which is what a native FP8 deployment has too.

What exists on CPU (torch 2.13): ``torch._scaled_mm`` for float8_e4m3fn with per-tensor and row-wise
scales (used here), ``aten._weight_int4pack_mm_for_cpu`` for group-wise INT4 (used by
:class:`Int4GroupLinear`, below), nothing for MXFP4. Fused routed experts stay dequantized (their loop is
inside transformers' experts module).

Group-wise INT4 (compressed-tensors ``pack-quantized``, ``w = (q - z) * s`` per group of ``g`` inputs)
runs as ``aten._weight_int4pack_mm_for_cpu(x [M, K], W_packed, g, scales_and_zeros [K/g, N, 2])``, whose
weight is ``(u - 8) * scale + zero`` with ``u`` in [0, 15] (checked against a float64 dequantization in
the tests). compressed-tensors stores ``u = q + 8`` in the nibbles already, so ``scale = s`` and
``zero = -z * s`` (0 when symmetric). The kernel takes groups of 32, 64, 128 or 256, N a multiple of 16,
float32/bf16/fp16 activations; other Linear layers stay dequantized. It has no derivative, so the module
supplies the input gradient itself (``dy @ W`` with ``W`` dequantized on the fly in the activation dtype):
the smoke check's backward and training still run; the INT4 weights are buffers and do not train.

The e4m3 payload and the float32 scales are stored as uint8 / int32 *views*: ``build_model`` casts the
model with ``.to(dtype)``, which converts every floating tensor, and must not touch these.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def native_fp8(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Does this device run ``torch._scaled_mm`` with row-wise FP8 scales? (True, "") or (False, why)."""
    try:
        a = torch.ones(16, 32, device=device).to(FP8)
        b = torch.ones(32, 16, device=device).to(FP8).t().contiguous().t()
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
                         out_dtype=torch.float32)
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure means "not native here"
        return False, f"torch._scaled_mm (FP8, row-wise scales) not available on {device}: {type(e).__name__}"


class Fp8BlockLinear(torch.nn.Module):
    """A Linear whose weight stays e4m3 with one float32 scale per ``block`` tile."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.block = block
        self.register_buffer("q_bits", q.contiguous().view(torch.uint8))  # [N, K] e4m3 payload
        self.register_buffer("scale_bits", scale_inv.float().contiguous().view(torch.int32))  # [N/bo, K/bi]
        self.bias = torch.nn.Parameter(bias.detach().clone()) if bias is not None else None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3, block {self.block[0]}x{self.block[1]}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bo, bi = self.block
        w = self.q_bits.view(FP8)
        s = self.scale_bits.view(torch.float32)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # [M, K]
        m = x2.shape[0]
        pad_m = (-m) % 16  # _scaled_mm wants dims that are multiples of 16
        if pad_m:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad_m))
        y = torch.zeros(x2.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        sb_rows = s.repeat_interleave(bo, 0)[: self.out_features]  # [N, K/bi]
        for k in range(math.ceil(self.in_features / bi)):
            xs = x2[:, k * bi:(k + 1) * bi]
            amax = xs.abs().amax(-1, keepdim=True).clamp(min=1e-12)  # per token, per 1 x bi group
            sa = (amax / FP8_MAX).float()
            xq = (xs / sa).to(FP8)
            wk = w[:, k * bi:(k + 1) * bi]  # [N, bi]
            if xs.shape[1] % 16:  # a ragged last slice: zero-pad K to a multiple of 16
                p = (-xs.shape[1]) % 16
                xq = torch.nn.functional.pad(xq.float(), (0, p)).to(FP8)
                wk = torch.nn.functional.pad(wk.float(), (0, p)).to(FP8)
            y += torch._scaled_mm(xq, wk.t(), scale_a=sa, scale_b=sb_rows[:, k].reshape(1, -1).contiguous(),
                                  out_dtype=torch.float32)
        y = y[:m].to(x.dtype).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y


def _quantized_linears(model: torch.nn.Module, ckpt, plan, kind: str):
    """(name, module, stored tensor) of every plain nn.Linear whose checkpoint weight is stored in
    the quantized format ``kind`` (quant.locate's kinds); experts and row-sliced tensors excluded."""
    from harness.weights import quant

    by_param = {e.param: e for e in plan.entries if e.expert is None and e.rows is None}
    for name, mod in list(model.named_modules()):
        if type(mod) is not torch.nn.Linear:
            continue
        e = by_param.get(f"{name}.weight")
        st = quant.locate(ckpt, e.source) if e else None
        if st is not None and st.kind == kind:
            yield name, mod, st


def swap_fp8_linears(model: torch.nn.Module, ckpt, plan, reader, block: tuple[int, int] | None) -> list[str]:
    """Replace every nn.Linear whose checkpoint weight is FP8 block-quantized by an Fp8BlockLinear
    holding the checkpoint's own e4m3 payload and scales. Returns the module names swapped."""
    swapped = []
    for name, mod, st in _quantized_linears(model, ckpt, plan, "fp8_block"):
        q, s = reader.get(st.keys[0]), reader.get(st.keys[1])
        if tuple(q.shape) != (mod.out_features, mod.in_features) or (q.shape[1] % 16) or (q.shape[0] % 16):
            continue  # shapes _scaled_mm cannot take stay dequantized
        b = block or (128, 128)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, Fp8BlockLinear(q, s, b, mod.bias))
        swapped.append(name)
    return swapped


INT4_GROUPS = (32, 64, 128, 256)


def native_int4(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Does this device run ``aten._weight_int4pack_mm_for_cpu``? (True, "") or (False, why)."""
    try:
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32, device=device), 2)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.ones(2, 64, device=device), w, 32,
                                                   torch.ones(2, 16, 2, device=device))
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure means "not native here"
        return False, f"aten._weight_int4pack_mm_for_cpu not available on {device}: {type(e).__name__}"


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """[N, K] values in [0, 15] -> int32 [N, ceil(K/8)], value i of a word at bits 4i."""
    n, k = u.shape
    v = torch.nn.functional.pad(u.to(torch.int64), (0, (-k) % 8)).reshape(n, -1, 8)
    w = (v << torch.arange(0, 32, 4)).sum(-1)
    return (w - ((w >> 31) << 32)).to(torch.int32)  # two's complement into int32


class _Int4MM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, mod):  # x2 [M, K]
        ctx.mod = mod
        sz = mod.scales_and_zeros.view(torch.float32).to(x2.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), mod.w_int4pack, mod.group, sz)

    @staticmethod
    def backward(ctx, dy):  # dL/dx = dy @ W, W [N, K] dequantized in dy's dtype
        return dy @ ctx.mod.dequantized(dy.dtype), None


class Int4GroupLinear(torch.nn.Module):
    """A Linear whose weight stays 4-bit, group-wise scaled, packed for torch's CPU INT4 kernel."""

    def __init__(self, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None):
        """``u`` [N, K] in [0, 15] (the stored nibbles), ``scale`` and ``zero`` [N, K/group] (float)."""
        super().__init__()
        self.out_features, self.in_features = u.shape
        self.group = group
        # [N, K/8] int32, eight nibbles a word (compressed-tensors' packing): what the backward dequantizes
        self.register_buffer("nibbles", _pack_nibbles(u))
        # [N, K/2] uint8 in the CPU kernel's own layout
        self.register_buffer("w_int4pack",
                             torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(), 2))
        sz = torch.stack([scale.float().t(), zero.float().t()], -1).contiguous()  # [K/g, N, 2]
        # float32 kept as an int32 view: build_model's .to(dtype) converts floating tensors only
        self.register_buffer("scales_and_zeros", sz.view(torch.int32))
        self.bias = torch.nn.Parameter(bias.detach().clone()) if bias is not None else None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 group {self.group}"

    def dequantized(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The weight the kernel computes with, [N, K]: (u - 8) * scale + zero, in ``dtype``."""
        sz = self.scales_and_zeros.view(torch.float32).to(dtype)
        s = sz[..., 0].t().repeat_interleave(self.group, 1)
        z = sz[..., 1].t().repeat_interleave(self.group, 1)
        from harness.weights.quant import unpack_int4

        u = unpack_int4(self.nibbles, self.in_features) + 8  # [N, K] in [0, 15]
        return (u.to(dtype) - 8) * s + z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _Int4MM.apply(x.reshape(-1, self.in_features), self).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y


def swap_int4_linears(model: torch.nn.Module, ckpt, plan, reader) -> list[str]:
    """Replace every nn.Linear whose checkpoint weight is INT4 pack-quantized (and whose shape and group
    the CPU kernel takes) by an Int4GroupLinear holding the checkpoint's own nibbles and scales."""
    from harness.weights import quant

    swapped = []
    for name, mod, st in _quantized_linears(model, ckpt, plan, "int4_pack"):
        n, k = mod.out_features, mod.in_features
        scale = reader.get(f"{st.name}_scale")
        group = k // scale.shape[1] if scale.dim() == 2 and scale.shape[0] == n else 0
        if group not in INT4_GROUPS or group * scale.shape[1] != k or n % 16:
            continue  # what the kernel cannot take stays dequantized
        u = quant.unpack_int4(reader.get(f"{st.name}_packed"), k).to(torch.int32) + 8  # the stored nibbles
        zero = torch.zeros(n, k // group, dtype=torch.float64)
        if f"{st.name}_zero_point" in ckpt.tensors:
            z = quant.unpack_int4(reader.get(f"{st.name}_zero_point"), n, dim=0).double()
            zero = -z * scale.double()
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                Int4GroupLinear(u, scale.double(), zero, group, mod.bias))
        swapped.append(name)
    return swapped
