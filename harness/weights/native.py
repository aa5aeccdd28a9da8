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
scales (used here), ``aten._weight_int4pack_mm_for_cpu`` for group-wise INT4 (not wired: transformers'
modules would need an int4 Linear, left for a follow-up), nothing for MXFP4. Fused routed experts
stay dequantized (their loop is inside transformers' experts module).

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


def swap_fp8_linears(model: torch.nn.Module, ckpt, plan, reader, block: tuple[int, int] | None) -> list[str]:
    """Replace every nn.Linear whose checkpoint weight is FP8 block-quantized by an Fp8BlockLinear
    holding the checkpoint's own e4m3 payload and scales. Returns the module names swapped."""
    from harness.weights import quant

    by_param = {e.param: e for e in plan.entries if e.expert is None and e.rows is None}
    swapped = []
    for name, mod in list(model.named_modules()):
        if type(mod) is not torch.nn.Linear:
            continue
        e = by_param.get(f"{name}.weight")
        st = quant.locate(ckpt, e.source) if e else None
        if st is None or st.kind != "fp8_block":
            continue
        q, s = reader.get(st.keys[0]), reader.get(st.keys[1])
        if tuple(q.shape) != (mod.out_features, mod.in_features) or (q.shape[1] % 16) or (q.shape[0] % 16):
            continue  # shapes _scaled_mm cannot take stay dequantized
        b = block or (128, 128)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, Fp8BlockLinear(q, s, b, mod.bias))
        swapped.append(name)
    return swapped
