"""The regression rule on synthetic sample sets: size AND evidence, direction, calibration."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.perf.decide import decide

# Timings as a machine gives them: a level (1 ms to 1 s) times a spread of up to 5%, 8 to 40 of them.
samples = st.builds(lambda level, jitter: [level * j for j in jitter],
                    st.floats(min_value=1e-3, max_value=1.0),
                    st.lists(st.floats(min_value=1.0, max_value=1.05), min_size=8, max_size=40, unique=True))


@settings(max_examples=60, deadline=None)
@given(base=samples, factor=st.floats(min_value=1.2, max_value=3.0))
def test_a_large_shift_of_enough_samples_is_a_regression(base, factor):
    d = decide("prefill_s", [v * factor for v in base], base)
    assert d.verdict == "regression", d.why
    assert math.isclose(d.calibrated_ratio, factor, rel_tol=1e-9)
    assert d.p_value < 0.01


@settings(max_examples=60, deadline=None)
@given(base=samples, factor=st.floats(min_value=0.96, max_value=1.049))
def test_within_the_threshold_is_never_a_regression(base, factor):
    # However significant: every sample moved, but by less than 5%.
    d = decide("prefill_s", [v * factor for v in base], base)
    assert d.verdict == "unchanged"


@settings(max_examples=40, deadline=None)
@given(base=samples)
def test_the_same_samples_are_unchanged(base):
    d = decide("prefill_s", list(base), base)
    assert d.verdict == "unchanged" and d.ratio == 1.0 and d.p_value > 0.4


@settings(max_examples=40, deadline=None)
@given(base=st.lists(st.floats(min_value=1e-3, max_value=1.0), min_size=3, max_size=3, unique=True),
       factor=st.floats(min_value=1.5, max_value=3.0))
def test_size_without_evidence_is_not_a_regression(base, factor):
    # 3 vs 3 can never reach p < 0.01 (the smallest one-sided p is 1/20).
    d = decide("prefill_s", [v * factor for v in base], base)
    assert d.verdict == "unchanged" and d.p_value >= 0.05 and "not <" in d.why


@settings(max_examples=40, deadline=None)
@given(base=samples, factor=st.floats(min_value=1.2, max_value=3.0))
def test_direction_higher_is_better(base, factor):
    # A throughput that grew is an improvement; one that fell is a regression.
    assert decide("tokens_per_s", [v * factor for v in base], base, direction="higher").verdict == "improvement"
    assert decide("tokens_per_s", [v / factor for v in base], base, direction="higher").verdict == "regression"
    assert decide("prefill_s", [v / factor for v in base], base).verdict == "improvement"


@settings(max_examples=40, deadline=None)
@given(base=samples, machine=st.floats(min_value=0.6, max_value=1.6), model=st.floats(min_value=1.2, max_value=2.0))
def test_the_kernel_ratio_takes_out_the_machine(base, machine, model):
    # The machine is `machine` x slower today (its kernels say so): only the model's own change counts.
    cur = [v * machine for v in base]
    d = decide("prefill_s", cur, base, kernel_ratio=machine)
    assert d.verdict == "unchanged" and math.isclose(d.calibrated_ratio, 1.0, rel_tol=1e-9)
    d = decide("prefill_s", [v * model for v in cur], base, kernel_ratio=machine)
    assert d.verdict == "regression" and math.isclose(d.calibrated_ratio, model, rel_tol=1e-9)


def test_per_metric_threshold_and_missing_baseline():
    base = [0.1 + i * 1e-4 for i in range(20)]
    cur = [v * 1.08 for v in base]
    assert decide("decode_token_s", cur, base, threshold=0.10).verdict == "unchanged"
    assert decide("decode_token_s", cur, base, threshold=0.05).verdict == "regression"
    d = decide("prefill_s", cur, [])
    assert d.verdict == "no-baseline" and d.to_dict()["p_value"] is None
