"""#25 item 3: a biased low-precision kernel is caught by the signed-error test while every magnitude
budget passes, and a correct kernel that merely rounds differently is not.

The biased kernel: aten::mm in bf16 computed in float32 and rounded to bf16 with a biased threshold
(up once the remainder exceeds a quarter of an ulp, not half): each element is off by less than one
bf16 ulp, as a correct kernel's is, with about the same spread, but a quarter ulp upward on average.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.precision import runner, signed
from precision.faults import MatmulKernel
from precision.helpers import props, run_check


def test_sign_test_p_values():
    assert signed.sign_p(0, 0) == 1.0
    assert signed.sign_p(32, 32) == pytest.approx(2 * 0.5 ** 32)
    assert signed.sign_p(16, 32) == 1.0
    assert signed.sign_p(3, 10) == pytest.approx(2 * sum(math.comb(10, i) for i in range(7, 11)) / 1024)
    assert not signed.reachable(10, 30) and signed.reachable(32, 30)


def test_signed_test_on_tensors():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(32, 64, generator=g)
    noise = torch.randn(32, 64, generator=g) * 1e-3
    clean = signed.row_errors(ref + noise, ref)
    assert signed.signed_test(ref + noise, ref, clean).rows == 0  # the reference backend itself: exactly 0
    other = signed.signed_test(ref + torch.randn(32, 64, generator=g) * 1e-3, ref, clean)
    assert other.p > 1e-3  # unbiased noise
    biased = signed.signed_test(ref + noise + 2e-3 * ref.abs(), ref, clean)
    assert biased.p < 1e-8 and biased.effect > 1e-3 and biased.same_sign == 32


@pytest.mark.parametrize("name", ["llama-3.1-8b", "mixtral-8x7b"])
def test_biased_bf16_matmul_caught_by_the_signed_test_only(name, tmp_path, monkeypatch):
    ctx, failure = run_check(name, "bfloat16", tmp_path, context=lambda: MatmulKernel("up"))
    assert failure is not None
    first = props(ctx)["harness.detail.first_divergent_module"]
    assert failure.message.startswith(f"{first} diverges") and "a biased kernel" in failure.message
    assert "isolated rel_rmse" not in failure.message.split("; propagated")[0]  # its size is within budget
    # without the signed test every magnitude budget passes: the bias is invisible to them
    monkeypatch.setattr(runner, "signed_rows", lambda golden, dtype: {})
    _, failure = run_check(name, "bfloat16", tmp_path, context=lambda: MatmulKernel("up"))
    assert failure is None, failure.message


@pytest.mark.parametrize("name", ["llama-3.1-8b", "mixtral-8x7b"])
def test_unbiased_other_rounding_is_no_false_alarm(name, tmp_path):
    """A correct kernel of another backend (float64 accumulation, round to nearest) differs from the
    CPU's in many elements, without a direction: the signed test stays quiet."""
    ctx, failure = run_check(name, "bfloat16", tmp_path, context=lambda: MatmulKernel("other"))
    assert failure is None, failure.message


def test_one_signed_scale_and_offset_over_positions():
    """The compile check's test of a whole output against a same-dtype reference (clean difference 0):
    a 1 % scale on every position fails as 'scale', a shift as 'offset'; symmetric rounding-like noise
    and a one-signed effect under the dtype's floor do not. Clean on the bundled suites (compile
    items, cpu, 2026-12-06): smallest p 0.22, largest effect 5.5e-5 in bfloat16 (floor 2^-9) and
    3.4e-9 in float32 (floor 2^-20); the frontend items are bit-identical to eager."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 16, 200, generator=g, dtype=torch.float64)
    noise = torch.randn(ref.shape, generator=g, dtype=torch.float64) * 1e-3
    bad, tests = signed.one_signed(ref * 1.01 + noise, ref, "bfloat16")
    assert bad is not None and bad.kind == "scale" and bad.same_sign == 32 and abs(bad.effect - 0.01) < 1e-3
    assert {t.kind for t in tests} == {"scale", "offset"}
    bad, _ = signed.one_signed(ref + 0.01 * ref.pow(2).mean().sqrt() + noise, ref, "bfloat16")
    assert bad is not None and bad.kind == "offset"
    assert signed.one_signed(ref + noise, ref, "bfloat16")[0] is None  # no direction
    tiny = ref * (1 + 2.0 ** -11) + noise * 1e-3  # one-signed, under bfloat16's floor
    assert signed.one_signed(tiny, ref, "bfloat16")[0] is None
    assert signed.one_signed(tiny, ref, "float32")[0] is not None  # over float32's
