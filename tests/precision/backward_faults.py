"""Backward and optimizer faults for the training check's tests, and goldens made for them.

As in tests/precision/faults.py (``KernelFault``), the wrong kernels are registered with
torch.library for the CPU dispatch key (as a vendor registers its kernels for PrivateUse1), so they
reach transformers' modules as a device's kernels would; the forward is exact, only the backward
(or the optimizer) is wrong, and only in the dtypes the target runs (never float64, the reference's).
Where no aten op carries the backward alone (RMSNorm decomposes into pow/mean/rsqrt on CPU, the
eager experts into linear), the fault is a custom op with its own autograd formula (how a vendor's
fused RMSNorm / grouped-GEMM kernel reaches a model) or a custom autograd path.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

REL = 0.05  # 5 % off: far outside a correct kernel's rounding, invisible to a forward comparison


class _Lib:
    """``with Fault():`` registers ``kernels()`` {op: fn} for CPU on enter and removes them on exit."""

    def kernels(self) -> dict:
        raise NotImplementedError

    def __enter__(self):
        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
            for op, fn in self.kernels().items():
                self.lib.impl(op, fn, "CPU")
        return self

    def __exit__(self, *exc):
        self.lib._destroy()


class SiluBackward(_Lib):
    """aten::silu_backward 5 % off in every dtype but float64; aten::silu (the forward) untouched."""

    def kernels(self):
        def silu_backward(grad, x):
            xf = x if x.dtype == torch.float64 else x.float()
            s = torch.sigmoid(xf)
            g = grad.to(xf.dtype) * s * (1 + xf * (1 - s))
            return (g if x.dtype == torch.float64 else g * (1 + REL)).to(x.dtype)
        return {"silu_backward": silu_backward}


class LogSoftmaxBackward(_Lib):
    """aten::_log_softmax_backward_data 5 % off (not in float64): the cross-entropy's backward, before
    every module, wrong."""

    def kernels(self):
        def backward(grad, out, dim, input_dtype):
            ct = torch.float64 if out.dtype == torch.float64 else torch.float32
            g = grad.to(ct) - out.to(ct).exp() * grad.to(ct).sum(dim, keepdim=True)
            return (g if out.dtype == torch.float64 else g * (1 + REL)).to(input_dtype)
        return {"_log_softmax_backward_data": backward}


def _attention_grads(g, q, k, v, mask, causal, scale):
    """(dq, dk, dv) of softmax(q k^T scale + mask) v, in float32 (float64 stays float64); k/v with
    fewer heads than q (GQA) get their gradients summed over the group."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    qf, kf, vf, gf = (t.to(ct) for t in (q, k, v, g))
    kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
    sc = scale if scale is not None else q.shape[-1] ** -0.5
    s = qf @ kf.transpose(-1, -2) * sc
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2]), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(ct)
    p = torch.softmax(s, -1)
    dv = p.transpose(-1, -2) @ gf
    dp = gf @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = ds @ kf * sc, ds.transpose(-1, -2) @ qf * sc
    fold = lambda t: t.unflatten(1, (k.shape[1], rep)).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


class AttentionBackward(_Lib):
    """CPU flash attention's backward with the query gradient 5 % large (not in float64); the forward
    kernel untouched."""

    def kernels(self):
        def backward(g, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
            dq, dk, dv = _attention_grads(g, q, k, v, attn_mask, is_causal, scale)
            if q.dtype != torch.float64:
                dq = dq * (1 + REL)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return {"_scaled_dot_product_flash_attention_for_cpu_backward": backward}


class FusedAdamWEps(_Lib):
    """aten::_fused_adamw_ (CPU) whose epsilon is clamped to the parameter dtype's machine epsilon for
    bf16/fp16 parameters (2^-7 in bf16 instead of 1e-8): the low-precision epsilon bug. Right for
    float32/float64."""

    def kernels(self):
        def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                         weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
            for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True):
                low = p.dtype in (torch.bfloat16, torch.float16)
                e = max(eps, torch.finfo(p.dtype).eps) if low else eps
                step = float(s.item())
                pf, gf, mf, vf = (t.float() if low else t for t in (p, -g if maximize else g, m, v))
                pf = pf * (1 - lr * weight_decay)
                mf = mf.lerp(gf, 1 - beta1)
                vf = vf * beta2 + (1 - beta2) * gf * gf
                denom = (vf.sqrt() / (1 - beta2 ** step) ** 0.5) + e
                pf = pf - lr / (1 - beta1 ** step) * mf / denom
                p.copy_(pf), m.copy_(mf), v.copy_(vf)
        return {"_fused_adamw_": fused_adamw_}


# --- RMSNorm through a custom op with its own (wrong) backward --------------------------------------
def _rms(x, w, eps):
    """transformers' RMSNorm: float32 statistics, the weight applied in the input dtype."""
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


@torch.library.custom_op("harness_faults::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, w, eps).clone()


def _rms_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.eps = inputs[2]


def _rms_backward(ctx, g):
    """The exact gradients (autograd of the same formula), then the input gradient 5 % large in
    every dtype but float64: a fused RMSNorm backward that is wrong while its forward is right."""
    x, w = ctx.saved_tensors
    with torch.enable_grad():
        xd, wd = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        dx, dw = torch.autograd.grad(_rms(xd, wd, ctx.eps), (xd, wd), g)
    return (dx if x.dtype == torch.float64 else dx * (1 + REL)), dw, None


torch.library.register_autograd("harness_faults::rms_norm", _rms_backward, setup_context=_rms_setup)


def route_rmsnorm_custom(model):
    """Every RMSNorm module computes through ``harness_faults::rms_norm`` (same forward numbers)."""
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "weight"):
            eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))
            mod.forward = lambda h, _m=mod, _e=eps: rms_norm_op(h, _m.weight, _e)
    return model


# --- one MoE layer's experts with a wrong input gradient ------------------------------------------
class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f):
        ctx.f = f
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.f, None


def experts_backward(layer: int):
    """Layer ``layer``'s routed experts with their input gradient 5 % large (the grouped-GEMM dgrad of
    that layer wrong; not in float64); forward and weight gradients exact."""
    def t(model):
        ex = model.model.layers[layer].mlp.experts
        orig = ex.forward

        def fwd(hidden_states, *a, **k):
            f = 1.0 if hidden_states.dtype == torch.float64 else 1 + REL
            return orig(_ScaleGrad.apply(hidden_states, f), *a, **k)
        ex.forward = fwd
        return model
    return t


# --- goldens for the tests ------------------------------------------------------------------------
_ROOT: list[Path] = []


def training_suite(name: str, **knobs):
    """The bundled suite ``name`` with other ``[checks.training]`` values (no file written)."""
    import dataclasses

    from precision.helpers import suite

    ls = suite(name)
    if not knobs:
        return ls
    checks = ls.suite.checks.model_copy(update={"training": ls.suite.checks.training.model_copy(update=knobs)})
    return dataclasses.replace(ls, suite=ls.suite.model_copy(update={"checks": checks}))


@functools.cache
def _golden(name: str, knobs: tuple) -> Path:
    from harness.precision.generate import generate

    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="harness-training-golden-")))
        atexit.register(shutil.rmtree, _ROOT[0], True)
    root = _ROOT[0] / "-".join(f"{k}={v}" for k, v in knobs) if knobs else _ROOT[0]
    generate(training_suite(name, **dict(knobs)), root=root)
    return root


def golden_root(name: str, **knobs) -> Path:
    """A golden of suite ``name`` (forward + training section; ``knobs``: other [checks.training]
    values) generated once per test process into a temporary folder (never the repository's golden/)."""
    return _golden(name, tuple(sorted(knobs.items())))
