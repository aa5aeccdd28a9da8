"""Calibration kernels and the calibrated ratio."""

from __future__ import annotations

import math

import pytest
import torch

from harness.backends import get
from harness.perf import calibrate as calib
from harness.perf.timing import Budget


def cal(matmul, matvec, copy, **over):
    """A calibration record as calibrate() writes it, with given kernel samples (seconds)."""
    rec = {"dtype": "float32", "matmul_shape": [128, 1024, 1024], "matvec_shape": [4096, 4096],
           "copy_bytes": 32 << 20, "clock": "wall",
           "samples": {"calib_matmul_s": matmul, "calib_matvec_s": matvec, "calib_copy_s": copy}}
    rec.update(over)
    return rec


def test_kernel_ratio_is_the_ratio_of_the_phase_kernel_medians():
    then = cal([1.0, 1.0, 1.1], [2.0, 2.0], [3.0])
    now = cal([1.2, 1.2, 1.3], [2.5, 2.5], [9.0])
    assert math.isclose(calib.kernel_ratio("prefill_s", now, then), 1.2)  # matmul
    assert math.isclose(calib.kernel_ratio("train_step_s", now, then), 1.2)
    assert math.isclose(calib.kernel_ratio("decode_token_s", now, then), 1.25)  # matvec, not copy
    assert calib.kernel_ratio("peak_memory_bytes", now, then) is None


def test_samples_interleaved_with_the_phase_win_over_the_calibration_step():
    then, now = cal([1.0], [1.0], [1.0]), cal([1.0], [1.0], [1.0])
    r = calib.kernel_ratio("prefill_s", now, then, {"prefill": {"calib_matmul_s": [1.5, 1.5]}},
                           {"prefill": {"calib_matmul_s": [1.0, 1.0]}})
    assert math.isclose(r, 1.5)


def test_cpu_clock_reads_the_cpu_samples():
    then = cal([1.0], [1.0], [1.0])
    then["samples"]["calib_matmul_cpu_s"] = [0.5]
    now = cal([3.0], [1.0], [1.0])  # wall: 3x slower (a busy neighbour) ...
    now["samples"]["calib_matmul_cpu_s"] = [0.55]  # ... CPU: 10% slower (the machine)
    assert math.isclose(calib.kernel_ratio("prefill_s", now, then, clock="cpu"), 1.1)
    assert math.isclose(calib.kernel_ratio("prefill_s", now, then, clock="wall"), 3.0)


@pytest.mark.parametrize("field,value", [("dtype", "bfloat16"), ("matmul_shape", [64, 64, 64]),
                                         ("copy_bytes", 1 << 20)])
def test_different_kernels_are_not_a_ratio(field, value):
    then = cal([1.0], [1.0], [1.0])
    assert calib.kernel_ratio("prefill_s", cal([2.0], [1.0], [1.0], **{field: value}), then) is None


def test_real_kernels_measure_rates_on_both_clocks():
    k, rec = calib.calibrate(get("cpu"), torch.float32, "float32", Budget(0, 3, 3, 0.01), clock="cpu",
                             min_sample_s=0.001)
    assert set(rec["samples"]) == {f"calib_{n}{c}_s" for n in calib.KINDS for c in ("", "_cpu")}
    assert all(len(v) == 3 for v in rec["samples"].values())
    m, kk, n = k.shape
    med = rec["summary"]["calib_matmul_cpu_s"]["median"]
    assert math.isclose(rec["matmul_flops_per_s"], 2 * m * kk * n / med)
    assert rec["copy_bytes_per_s"] > 0 and rec["matvec_bytes_per_s"] > 0 and rec["clock"] == "cpu"
    assert k.work["matvec"] == 4096 * 4096 * 4 and k.work["copy"] == 2 * (32 << 20)


def test_kernel_spread_is_the_wider_relative_iqr_of_now_and_then():
    then = cal([1.0, 1.0, 1.0, 1.0], [2.0], [3.0])
    now = cal([1.0, 1.1, 1.2, 1.3, 1.4], [2.0], [3.0])
    s = calib.kernel_spread("prefill_s", now, then)
    assert math.isclose(s, 0.2 / 1.2, rel_tol=1e-6)  # IQR 1.1-1.3 over the median 1.2
    assert calib.kernel_spread("prefill_s", then, then) == 0.0
    assert calib.kernel_spread("peak_memory_bytes", now, then) is None and calib.kernel_spread("prefill_s", {}, then) is None
