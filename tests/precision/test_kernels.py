"""harness.precision.kernels: the kernel choices the clean measurement spans are correct kernels in
another order - as accurate as the CPU's own against float64, not bit-identical to it - and leave the
float64 reference alone."""

from __future__ import annotations

import pytest
import torch

from harness.precision import kernels

OPS = {
    "mm": lambda a, b, c: a[0] @ b[0],
    "bmm": lambda a, b, c: torch.bmm(a, b),
    "addmm": lambda a, b, c: torch.addmm(c[0, 0], a[0], b[0], beta=0.5, alpha=2.0),
    "baddbmm": lambda a, b, c: torch.baddbmm(c, a, b),
    "linear": lambda a, b, c: torch.nn.functional.linear(a[0], b[0].T, c[0, 0]),
}


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 16, 512, generator=g, dtype=torch.float64)
    b = torch.randn(3, 512, 24, generator=g, dtype=torch.float64)
    c = torch.randn(3, 16, 24, generator=g, dtype=torch.float64)
    return a, b, c, (a.to(dtype), b.to(dtype), c.to(dtype))


def _rel(x, r):
    return ((x.double() - r).norm() / r.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(OPS))
def test_split_k_is_as_accurate_as_the_cpus_order_and_another_order(op, dtype):
    _, _, _, low = _inputs(dtype)
    ref = OPS[op](*(t.double() for t in low))  # exact products of the rounded inputs
    plain = OPS[op](*low)
    with kernels.attention("split-k"):
        split = OPS[op](*low)
    assert split.dtype == dtype and split.shape == plain.shape
    # both are a correct kernel: within a few units of rounding of the result dtype (a K = 512
    # float32 reduction: ~2.4 eps) and the split no less accurate than the CPU's own order, give or take
    eps = torch.finfo(dtype).eps
    es, ep = _rel(split, ref), _rel(plain, ref)
    assert es < 4 * eps and ep < 4 * eps and es < 1.5 * ep, (es, ep)
    if dtype == torch.float32:  # and another order: not the CPU's bits (bf16 rounds both to the same most often)
        assert not torch.equal(split, plain)


def test_split_k_reaches_autograds_products_and_leaves_float64_alone():
    a, b, _, (a32, b32, _) = _inputs(torch.float32)
    w = b32[0].clone().requires_grad_()
    with kernels.attention("split-k"):
        (a32[0] @ w).pow(2).sum().backward()
        split_grad = w.grad.clone()
        f64 = a[0] @ b[0]
    w.grad = None
    (a32[0] @ w).pow(2).sum().backward()
    assert not torch.equal(split_grad, w.grad)  # the backward's mm ran split too
    assert _rel(split_grad, w.grad.double()) < 1e-5
    assert torch.equal(f64, a[0] @ b[0])  # the reference dtype untouched


def test_every_choice_is_known_and_others_refused():
    assert kernels.KERNELS == ("default", "math", "split-k")
    for k in kernels.KERNELS:
        with kernels.attention(k):
            pass
    with pytest.raises(ValueError, match="unknown kernel choice"):
        with kernels.attention("fast"):
            pass
