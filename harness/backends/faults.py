"""Known kernel faults, installed on a backend's own dispatch key: what ``harness certify`` injects.

Each :class:`Fault` replaces one or a few aten operators with a wrong kernel registered through
``torch.library`` for one dispatch key (``Backend.dispatch_key``: ``PrivateUse1`` for torch_npu,
torch_musa, the test device; ``CPU`` for the cpu backend), so the fault runs exactly where the
vendor's own kernel would have run, and nowhere else. The wrong kernel computes through the kernel
it replaces: ``torch.library.get_kernel`` returns the kernel the dispatcher had for that key (the
vendor's, a composite, or the backend's fallback), saved before the override and called boxed, so
a fault never recurses into itself and differs from the right answer only by what it says it does.
Tensors of other dtypes pass through untouched (float64 in particular: the checks' own reference
arithmetic on CPU stays exact).

A process installs a fault when ``HARNESS_CERTIFY_FAULT`` names one and ``HARNESS_CERTIFY_BACKEND``
the backend of the item it is about to run (``harness.run.execute`` calls :func:`install_from_env`
before every item, after the backend's module is imported, so the fault replaces the vendor's
kernel rather than being replaced by it). ``HARNESS_CERTIFY_LOG`` names a file where each process
appends one line per faulty kernel the first time it runs (and one per exception the fault's own
code raised): ``harness certify`` tells "caught" from "its kernel never ran" with it.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.settings import env as setting

LOW = (torch.float32, torch.bfloat16, torch.float16)  # every dtype but float64


class FaultError(Exception):
    """A fault that cannot be installed (unknown name, no dispatch key, a torch without get_kernel)."""


# A wrong kernel, made from the kernel it replaces: make(original) -> kernel(keyset, *args, **kwargs).
KernelFactory = Callable[[Callable], Callable]


@dataclass(frozen=True)
class Fault:
    name: str
    summary: str  # what it does, one line
    check: str  # the cheapest check that must catch it
    kernels: dict[str, KernelFactory]  # aten overload -> its wrong kernel
    why: str = ""  # why that check (and not a cheaper one)

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(self.kernels)

    def register(self, lib: torch.library.Library, dispatch_key: str) -> list[str]:
        """Install every wrong kernel on ``dispatch_key``; returns the overloads installed: those this
        torch has and the dispatcher has a kernel for on that key (a CUDA-only attention kernel has
        none for CPU: it cannot run there, so there is nothing to replace)."""
        if not hasattr(torch.library, "get_kernel"):
            raise FaultError(f"torch {torch.__version__} has no torch.library.get_kernel (torch >= 2.9): a fault "
                             "could not call the kernel it replaces")
        done = []
        for op, make in self.kernels.items():
            if not _exists(op):
                continue
            try:
                call = torch.library.get_kernel(op, dispatch_key).call_boxed
            except RuntimeError:  # "no kernel for <key> for <op>"
                continue
            with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point
                warnings.simplefilter("ignore")
                lib.impl(op.removeprefix("aten::"), _logged(self.name, op, make(call)), dispatch_key, with_keyset=True)
            done.append(op)
        return done


def _exists(op: str) -> bool:
    name, _, overload = op.removeprefix("aten::").partition(".")
    packet = getattr(torch.ops.aten, name, None)
    return packet is not None and (overload or "default") in packet.overloads()


_FIRED: set[str] = set()


def _log(rec: dict) -> None:
    path = setting("HARNESS_CERTIFY_LOG")
    if path is None:
        return
    line = (json.dumps({**rec, "pid": os.getpid()}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write under O_APPEND: lines of concurrent processes do not interleave
    finally:
        os.close(fd)


def _logged(fault: str, op: str, kernel: Callable) -> Callable:
    def run(keyset, *args, **kwargs):
        if op not in _FIRED:
            _FIRED.add(op)
            _log({"fault": fault, "op": op, "event": "ran"})
        try:
            return kernel(keyset, *args, **kwargs)
        except Exception as e:  # the fault's own code (or the kernel it calls) raised: not a catch
            _log({"fault": fault, "op": op, "event": "raised", "error": f"{type(e).__name__}: {e}"[:500]})
            raise
    return run


# --- the wrong kernels -------------------------------------------------------------------------------
SLOPE = 1.05  # activation output and softmax temperature: 5% off
NAN_INDEX = 0  # the element of each rsqrt output that becomes NaN


def _scaled_softmax(call):
    def k(ks, x, dim, half_to_float):
        return call(ks, x * SLOPE if x.dtype in LOW else x, dim, half_to_float)
    return k


def _scaled_attention(call):
    """A fused attention kernel applying its softmax scale 5% off (the fused form of a softmax
    temperature error: softmax(1.05 * q k^T * scale))."""
    def k(ks, query, *args, scale=None, **kwargs):
        if query.dtype in LOW:
            scale = (scale if scale is not None else 1.0 / math.sqrt(query.size(-1))) * SLOPE
        return call(ks, query, *args, scale=scale, **kwargs)
    return k


def _steep(call):
    def k(ks, x, *args, **kwargs):
        y = call(ks, x, *args, **kwargs)
        return y * SLOPE if x.dtype in LOW else y
    return k


def _nan_element(call):
    def k(ks, x):
        y = call(ks, x)
        if x.dtype in LOW and y.numel() > NAN_INDEX:
            y.view(-1)[NAN_INDEX] = float("nan")
        return y
    return k


def _bf16(t):
    return t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


def _bf16_matmul(call):
    """A float32 matmul computed in bfloat16: inputs rounded to bfloat16, the kernel run in bfloat16,
    its result widened back to float32."""
    def k(ks, *args, **kwargs):
        if not any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            return call(ks, *args, **kwargs)
        return call(ks, *map(_bf16, args), **kwargs).to(torch.float32)
    return k


def _steep_backward(call):
    def k(ks, grad_output, x, *args, **kwargs):
        g = call(ks, grad_output, x, *args, **kwargs)
        return g * SLOPE if x.dtype in LOW else g
    return k


# Fused attention kernels a backend may register instead of the unfused softmax (CPU's flash kernel,
# CUDA's, and the PrivateUse1 hook of scaled_dot_product_attention); those this torch lacks are skipped.
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_fused_attention_overrideable",
             "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_cudnn_attention")

CATALOGUE: dict[str, Fault] = {f.name: f for f in (
    Fault("softmax-scale", "softmax temperature 5% off: aten::_softmax computes softmax(1.05 x); fused attention "
          "kernels apply 1.05 x their scale", "precision",
          {"aten::_softmax": _scaled_softmax, **dict.fromkeys(ATTENTION, _scaled_attention)},
          "a forward fault: the forward against the float64 golden, module by module"),
    Fault("activation-slope", "activation output 5% too steep: aten::silu and aten::gelu return 1.05 f(x)",
          "precision", {"aten::silu": _steep, "aten::gelu": _steep},
          "a forward fault: the forward against the float64 golden, module by module"),
    Fault("matmul-bf16", "float32 matmuls computed in bfloat16: aten::mm, bmm, addmm, baddbmm round inputs and "
          "result to bfloat16 (about 3 significant digits)", "precision",
          {op: _bf16_matmul for op in ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")},
          "a forward fault: float32's budget is a few ulps, bfloat16 rounding is 2^-9"),
    Fault("nan-one-element", "one NaN per call: element 0 of every aten::rsqrt output (RMSNorm's scale of one token)",
          "precision", {"aten::rsqrt": _nan_element},
          "a non-finite value: the first module whose output is not finite against the golden"),
    Fault("wrong-backward", "backward only: aten::silu_backward and aten::gelu_backward return 1.05 x the gradient; "
          "the forward is exact", "training",
          {"aten::silu_backward": _steep_backward, "aten::gelu_backward": _steep_backward},
          "the forward is exact, so only the gradients against the golden can see it"),
)}


def get(name: str) -> Fault:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise FaultError(f"unknown fault {name!r} (known: {', '.join(CATALOGUE)})") from None


# (fault, key) -> its Library (kept alive: dropping one unregisters its kernels) and the overloads replaced
_INSTALLED: dict[tuple[str, str], tuple[torch.library.Library, list[str]]] = {}


def install(fault: Fault, dispatch_key: str) -> list[str]:
    """Register ``fault`` on ``dispatch_key`` in this process (once); returns the overloads it replaced."""
    key = (fault.name, dispatch_key)
    if key not in _INSTALLED:
        lib = torch.library.Library("aten", "IMPL")
        _INSTALLED[key] = (lib, fault.register(lib, dispatch_key))
    return _INSTALLED[key][1]


def install_from_env(backend) -> str | None:
    """Install the fault ``HARNESS_CERTIFY_FAULT`` names if ``HARNESS_CERTIFY_BACKEND`` is ``backend``;
    returns its name, or None when there is nothing to install for this backend."""
    name = setting("HARNESS_CERTIFY_FAULT")
    if not name:
        return None
    target = setting("HARNESS_CERTIFY_BACKEND")
    if not target:
        raise FaultError("HARNESS_CERTIFY_FAULT is set without HARNESS_CERTIFY_BACKEND (the backend to install it on)")
    if target != backend.name:
        return None
    if not backend.dispatch_key:
        raise FaultError(f"backend {backend.name} declares no dispatch_key: nowhere to install fault {name!r}")
    fault = get(name)
    if not backend.available():  # imports the vendor's module first: the fault must replace its kernels
        return None
    install(fault, backend.dispatch_key)
    return fault.name
