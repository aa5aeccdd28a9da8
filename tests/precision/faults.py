"""Faults the tests inject into a model built from a suite (same seeded weights as the golden's).

Each is a model -> model transform (or, for a wrong backend kernel, a context manager), applied
to the *target* run only; the golden always comes from the clean model.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def rmsnorm_eps(layer: int, factor: float = 10.0):
    """One decoder layer's input RMSNorm with a changed epsilon."""
    def t(model):
        norm = model.model.layers[layer].input_layernorm
        attr = "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"
        setattr(norm, attr, getattr(norm, attr) * factor)
        return model
    return t


def _half_softmax_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scaling = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
    w = (query @ key.transpose(2, 3)) * scaling
    s_q, s_k = w.shape[-2:]
    if attention_mask is None:
        causal = torch.ones(s_q, s_k, dtype=torch.bool, device=w.device).tril(s_k - s_q)
        w = w.masked_fill(~causal, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        w = w.masked_fill(~attention_mask[..., :s_k], float("-inf"))
    else:
        w = w + attention_mask[..., :s_k]
    w = torch.softmax(w.to(torch.float16), dim=-1).to(query.dtype)  # the fault: softmax in half precision
    out = (w @ value).transpose(1, 2).contiguous()
    return out, w


def half_softmax(layer: int):
    """Attention softmax computed in float16 in one layer."""
    from transformers import AttentionInterface

    AttentionInterface.register("harness_half_softmax", _half_softmax_attention)

    def t(model):
        attn = model.model.layers[layer].self_attn
        cfg = copy.copy(attn.config)
        cfg._attn_implementation = "harness_half_softmax"
        attn.config = cfg
        return model
    return t


def perturbed_expert(layer: int, expert: int, scale: float = 1.25):
    """One routed expert of one MoE block with its output projection scaled."""
    def t(model):
        experts = model.model.layers[layer].mlp.experts
        with torch.no_grad():
            if hasattr(experts, "down_proj") and isinstance(experts.down_proj, torch.nn.Parameter):
                experts.down_proj[expert].mul_(scale)
            else:
                experts[expert].down_proj.weight.mul_(scale)
        return model
    return t


def rotary_base(new_base: float | None = None, factor: float = 2.0):
    """Rotary embeddings built with the wrong base: ``new_base`` (e.g. the 10000 default where the
    config says 500000), else base * factor. inv_freq = base^(-2i/d), so raising it to the power
    log(new)/log(base) rebases it (scaled rope types included, approximately)."""
    def t(model):
        rot = model.model.rotary_emb
        params = getattr(rot.config, "rope_parameters", None) or {}
        base = float(getattr(rot.config, "rope_theta", None) or params["rope_theta"])
        k = math.log(new_base or base * factor) / math.log(base)
        rot.inv_freq = rot.inv_freq.double().pow(k).to(rot.inv_freq.dtype)
        return model
    return t


class FaultyKernel(TorchDispatchMode):
    """A wrong backend kernel: ``op`` returns results off by ``rel`` for every dtype except
    float64 (the reference's), as a bad bf16/float32 kernel would."""

    def __init__(self, op: str = "aten.rsqrt", rel: float = 1e-2):
        super().__init__()
        self.op, self.rel = op, rel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        if name == self.op and isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != torch.float64:
            out = out * (1 + self.rel)
        return out


# --- faults a new accelerator ships: kernels that misbehave only in bfloat16/float16 -----------------
#
# Dispatcher level: the wrong kernel is registered with torch.library for the CPU dispatch key (as a
# vendor's backend registers its kernels for PrivateUse1), so the model code is untouched and every
# call of the op in the run goes through it. In float32/float64 the replacement computes the right
# result (from other aten ops, so it never calls itself); in bfloat16/float16 it is wrong.

LOW = (torch.bfloat16, torch.float16)


def _softmax_math(x: torch.Tensor, dim: int, scale: float = 1.0) -> torch.Tensor:
    xf = x.float() * scale
    xf = xf - xf.amax(dim, keepdim=True)
    e = xf.exp()
    return e / e.sum(dim, keepdim=True)


def _k_softmax(scale):
    def softmax(x, dim, half_to_float):
        s = scale if x.dtype in LOW else 1.0
        out = _softmax_math(x, dim, s)
        return out if half_to_float or x.dtype == torch.float32 else out.to(x.dtype if x.dtype != torch.float64 else x.dtype)
    return softmax


def _k_safe_softmax(scale):
    def safe_softmax(x, dim, dtype=None):
        s = scale if x.dtype in LOW else 1.0
        if x.dtype == torch.float64:
            xm = x - x.amax(dim, keepdim=True)
            e = xm.exp()
            out = e / e.sum(dim, keepdim=True)
        else:
            out = _softmax_math(x, dim, s)
        out = torch.nan_to_num(out, nan=0.0)  # fully masked rows are 0, as _safe_softmax does
        return out.to(dtype or x.dtype)
    return safe_softmax


def _k_sdpa_cpu(scale_error):
    def flash(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        sc = scale if scale is not None else q.shape[-1] ** -0.5
        if q.dtype in LOW:
            sc = sc * scale_error
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                                  scale=sc, enable_gqa=True)
        lse = torch.zeros(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32)
        return out, lse
    return flash


def _k_sdpa(scale_error):
    """``aten::scaled_dot_product_attention`` itself, registered for AutogradCPU so that it comes before
    the composite (which on CPU picks the flash kernel, or for unequal q/v head dims - DeepSeek's
    MLA - the math path, whose softmax runs in float32 for bf16 inputs and so never reaches a
    low-precision softmax kernel): a vendor's fused SDPA with the scale wrong in bf16/fp16."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        sc = scale if scale is not None else q.shape[-1] ** -0.5
        if q.dtype in LOW:
            sc = sc * scale_error
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                                 scale=sc, enable_gqa=enable_gqa)[0]
    return sdpa


def _k_silu(slope):
    def silu(x):
        xf = x.float() if x.dtype != torch.float64 else x
        out = xf * torch.sigmoid(xf)
        if x.dtype in LOW:
            out = out * slope
        return out.to(x.dtype)
    return silu


def _k_mm(block: int, min_k: int):
    """Matrix product whose partial sums over K-blocks of ``block`` are accumulated in the low
    dtype when K >= min_k (split-K without an fp32 accumulator); exact products through bmm."""
    def mm(a, b):
        if a.dtype not in LOW or a.shape[1] < min_k:
            return torch.ops.aten.bmm(a[None], b[None])[0]
        acc = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
        af, bf = a.float(), b.float()
        for j in range(0, a.shape[1], block):
            part = torch.ops.aten.bmm(af[None, :, j:j + block], bf[None, j:j + block])[0]
            acc = (acc.float() + part).to(a.dtype)  # the fault: the running sum is rounded to bf16
        return acc
    return mm


def _k_rms_norm(acc_low: bool):
    """``aten::rms_norm`` with transformers' semantics (float32 statistics, weight applied in the input
    dtype); faulty: the sum of squares accumulated element by element in the low dtype."""
    def rms_norm(x, normalized_shape, weight=None, eps=None):
        eps = 1e-6 if eps is None else eps
        xf = x.to(torch.float32) if x.dtype != torch.float64 else x.to(torch.float32)
        if acc_low and x.dtype in LOW:
            acc = torch.zeros(x.shape[:-1], dtype=x.dtype)
            sq = (x * x)
            for j in range(x.shape[-1]):
                acc = acc + sq[..., j]
            var = (acc.float() / x.shape[-1])[..., None]
        else:
            var = xf.pow(2).mean(-1, keepdim=True)
        y = (xf * torch.rsqrt(var + eps)).to(x.dtype)
        return weight * y if weight is not None else y
    return rms_norm


class KernelFault:
    """``with KernelFault("silu"):`` - faulty CPU kernels registered with torch.library for the
    duration (removed on exit, restoring the real ones). Kinds: ``sdpa_scale`` (SDPA and softmax
    with the scale off by ``rel``), ``silu_slope`` (SiLU off by ``rel``), ``matmul_bf16_acc``
    (aten::mm accumulating K-blocks of 4 in the low dtype for K >= 32: the pruned models' reductions
    are 64-256 long, so 16-32 partial sums, as a 4096-long reduction in K-tiles of 128-256 has), ``rmsnorm_bf16_acc``
    (aten::rms_norm accumulating in the low dtype; use with ``route_rmsnorm``)."""

    def __init__(self, kind: str, rel: float = 0.03):
        self.kind, self.rel = kind, rel
        self.lib = None

    def kernels(self) -> dict:
        f = 1 + self.rel
        return {"sdpa_scale": {"_scaled_dot_product_flash_attention_for_cpu": _k_sdpa_cpu(f),
                               "scaled_dot_product_attention": (_k_sdpa(f), "AutogradCPU"),
                               "_softmax": _k_softmax(f), "_safe_softmax": _k_safe_softmax(f)},
                "silu_slope": {"silu": _k_silu(f)},
                "matmul_bf16_acc": {"mm": _k_mm(4, 32)},
                "rmsnorm_bf16_acc": {"rms_norm": _k_rms_norm(True)},
                "rmsnorm_ok": {"rms_norm": _k_rms_norm(False)}}[self.kind]

    def __enter__(self):
        import warnings

        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
            for op, fn in self.kernels().items():
                fn, key = fn if isinstance(fn, tuple) else (fn, "CPU")
                self.lib.impl(op, fn, key)
        return self

    def __exit__(self, *exc):
        self.lib._destroy()
        self.lib = None


def route_rmsnorm(model):
    """Every RMSNorm module calls ``torch.nn.functional.rms_norm`` (the fused kernel a port uses)
    instead of transformers' Python code; with the real kernel (or ``rmsnorm_ok``) the numbers are
    the same as transformers' (float32 statistics)."""
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "weight"):
            eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))

            def fwd(h, _m=mod, _eps=eps):
                return torch.nn.functional.rms_norm(h, (h.shape[-1],), _m.weight, _eps)
            mod.forward = fwd
    return model


def rotary_low_precision(model):
    """Rotary positions held in the run dtype (position ids cast to bf16/fp16 before the angles are
    taken), as a port that casts every model input to the model dtype does. bf16 holds integers exactly
    only up to 256 (fp16 to 2048), so at the golden's 16 positions the tables are exact and every
    module matches: only the positions a deployment reaches (thousands, rounded to multiples of 16 and
    more) show it, which is what the rotary probe (``<name>@positions``) is for. It does not depend on
    head_dim: a table computed wholly in bf16 (angles too) is already off at 16 positions once head_dim
    is the published 128 (64 frequencies, most not exact in bf16), and is caught there as any module is.
    transformers computes the tables in float32 whatever the dtype, so on CPU no dispatcher kernel ever
    sees them in bf16: this replaces the rotary module's forward (its own formula, rounded positions)."""
    rot = model.model.rotary_emb
    orig = rot.forward

    def fwd(x, position_ids=None, *a, **k):
        if x.dtype in LOW and position_ids is not None:
            position_ids = position_ids.to(x.dtype).to(position_ids.dtype)
        return orig(x, position_ids, *a, **k)
    rot.forward = fwd
    return model


def residual_scale(layer: int, rel: float = 0.01):
    """Model level: one decoder layer's output (the residual stream after it) scaled by 1 + rel."""
    def t(model):
        def hook(_m, _a, out):
            if isinstance(out, torch.Tensor):
                return out * (1 + rel)
            return (out[0] * (1 + rel),) + tuple(out[1:])
        model.model.layers[layer].register_forward_hook(hook)
        return model
    return t


class WrongTopK:
    """``with WrongTopK(n_experts, k):`` a router top-k kernel (torch.library, CPU) that, for every
    second token, returns the (k+1)-th best expert instead of the k-th: routing flips at whatever
    margin the scores have, while the router logits themselves stay right."""

    def __init__(self, n_experts: int, k: int):
        self.n_experts, self.k = n_experts, k

    def __enter__(self):
        import warnings

        n_e, k_sel = self.n_experts, self.k

        def topk(x, k, dim=-1, largest=True, sorted=True):
            # the real values/indices from sort (not overridden), then the fault on router-shaped calls
            vals, idx = torch.sort(x, dim=dim, descending=largest, stable=True)
            vals, idx = vals.narrow(dim, 0, k).clone(), idx.narrow(dim, 0, k).clone()
            if k == k_sel and x.shape[-1] == n_e and x.dim() == 2 and dim in (-1, 1):
                full_v, full_i = torch.sort(x, dim=-1, descending=True, stable=True)
                rows = torch.arange(0, x.shape[0], 2)
                vals[rows, k - 1] = full_v[rows, k]
                idx[rows, k - 1] = full_i[rows, k]
            return vals, idx

        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lib.impl("topk", topk, "CPU")
        return self

    def __exit__(self, *exc):
        self.lib._destroy()


# --- biased rounding (the signed-error test, issue #25 item 3) -------------------------------------


def _mm(rounding: str, backward_only: bool):
    """aten::mm for the CPU key. In bf16/fp16: ``"up"`` computes in float32 and rounds with a biased
    threshold (up once the remainder exceeds a quarter of an ulp, not half): each element is off by
    less than one ulp, as a correct kernel's is, but a quarter ulp upward on average; ``"other"`` is
    another correct kernel (float64 accumulation, round to nearest: differs, without a direction).
    ``backward_only``: the forward's matmuls stay exact, only those autograd runs in a backward pass
    (the input and weight gradients of every linear layer) are biased."""
    def mm(a, b):
        if a.dtype not in LOW or (backward_only and torch._C._current_graph_task_id() == -1):
            return torch.ops.aten.bmm(a[None], b[None])[0]
        acc = torch.float32 if rounding == "up" else torch.float64
        y = torch.ops.aten.bmm(a.to(acc)[None], b.to(acc)[None])[0]
        r = y.to(a.dtype)
        if rounding == "up":  # the two bf16 neighbours of y, and the upper one from a quarter ulp on
            lo = torch.where(r.to(acc) > y, torch.nextafter(r, torch.full_like(r, -math.inf)), r)
            hi = torch.nextafter(lo, torch.full_like(lo, math.inf))
            frac = (y - lo.to(acc)) / (hi.to(acc) - lo.to(acc))
            r = torch.where(frac > 0.25, hi, lo)
        return r
    return mm


class MatmulKernel:
    """``with MatmulKernel("up"):`` aten::mm on the CPU key replaced (torch.library) for the duration;
    ``backward_only=True``: only the matmuls of a backward pass."""

    def __init__(self, rounding: str, backward_only: bool = False):
        self.rounding, self.backward_only = rounding, backward_only

    def __enter__(self):
        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # overriding the real kernel: on purpose
            self.lib.impl("mm", _mm(self.rounding, self.backward_only), "CPU")
        return self

    def __exit__(self, *exc):
        self.lib._destroy()
