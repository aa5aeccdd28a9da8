"""The across-runs test: shifts that hold are found, single spikes never are."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.compare.changepoint import detect, is_better, is_worse

noise = st.floats(min_value=-0.02, max_value=0.02, allow_nan=False)


def test_shift_that_holds_two_runs_is_found():
    cp = detect([1.0, 1.01, 0.99, 1.0, 1.02, 1.3, 1.31], "lower", 0.1)
    assert cp is not None and cp.regression and cp.index == 5 and cp.runs_after == 2
    assert cp.before == 1.0 and abs(cp.rel_change - 0.305) < 1e-9  # levels are medians


def test_improvement_and_direction():
    cp = detect([100, 101, 99, 100, 130, 131], "higher", 0.1)
    assert cp is not None and not cp.regression
    assert detect([100, 101, 99, 100, 130, 131], "none", 0.1) is None


def test_too_short_or_alternating_is_not_a_change():
    assert detect([1.0, 1.3, 1.3], "lower", 0.1) is None
    assert detect([1.0, 1.0, 1.0, 1.3, 1.0, 1.3], "lower", 0.1) is None


def test_worse_and_better_helpers():
    assert is_worse(1.0, 1.2, "lower", 0.1) and not is_worse(1.0, 1.05, "lower", 0.1)
    assert is_worse(1.0, 0.8, "higher", 0.1) and is_better(1.0, 0.8, "lower", 0.1)
    assert is_worse(0.0, 0.1, "lower", 0.1)  # from zero any increase is infinite


@settings(max_examples=60, deadline=None)
@given(st.lists(noise, min_size=6, max_size=25), st.floats(min_value=2.0, max_value=10.0), st.integers(0, 24))
def test_one_spike_never_reports(jitter, spike, where):
    series = [1.0 + j for j in jitter]
    series[where % len(series)] *= spike  # one bad run, anywhere, including the current one
    assert detect(series, "lower", 0.1) is None
    assert detect([2 - v for v in series], "higher", 0.1) is None  # and a single drop likewise


@settings(max_examples=60, deadline=None)
@given(st.lists(noise, min_size=5, max_size=20), st.lists(noise, min_size=2, max_size=6),
       st.floats(min_value=0.25, max_value=3.0))
def test_sustained_shift_is_always_found(before, after, jump):
    series = [1.0 + j for j in before] + [1.0 + jump + j for j in after]
    cp = detect(series, "lower", 0.1)
    assert cp is not None and cp.regression and cp.index == len(before)
