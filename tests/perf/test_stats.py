"""Sample statistics: the Mann-Whitney U test against brute-force enumeration and known values."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from harness.perf import stats


def brute_force_p(x, y, alternative):
    """P-value by enumerating every split of the pooled values into groups of len(x), len(y):
    the permutation distribution of U, ties and all (what the test approximates)."""
    pooled = list(x) + list(y)
    m = len(x)

    def u_of(xs, ys):
        return sum((a > b) + 0.5 * (a == b) for a in xs for b in ys)

    u_obs = u_of(x, y)
    us = []
    for idx in itertools.combinations(range(len(pooled)), m):
        s = set(idx)
        us.append(u_of([pooled[i] for i in idx], [pooled[i] for i in range(len(pooled)) if i not in s]))
    us = np.array(us)
    ge, le = (us >= u_obs - 1e-12).mean(), (us <= u_obs + 1e-12).mean()
    return {"greater": ge, "less": le, "two-sided": min(1.0, 2 * min(ge, le))}[alternative]


def test_u_distribution_is_the_permutation_distribution():
    for m, n in ((1, 1), (2, 3), (4, 4), (3, 6)):
        pmf = stats.u_distribution(m, n)
        assert pmf.shape == (m * n + 1,)
        assert math.isclose(pmf.sum(), 1.0)
        counts = np.zeros(m * n + 1)
        for idx in itertools.combinations(range(m + n), m):  # x's ranks; U = sum(ranks) - m(m+1)/2
            counts[sum(i + 1 for i in idx) - m * (m + 1) // 2] += 1
        np.testing.assert_allclose(pmf, counts / counts.sum(), rtol=1e-12)


def test_known_values():
    # Fully separated 3 vs 3: U = 0, one of C(6, 3) = 20 arrangements is as extreme.
    r = stats.mann_whitney_u([1, 2, 3], [4, 5, 6], "less")
    assert (r.u, r.method) == (0.0, "exact") and math.isclose(r.p_value, 1 / 20)
    assert math.isclose(stats.mann_whitney_u([1, 2, 3], [4, 5, 6], "greater").p_value, 1.0)
    assert math.isclose(stats.mann_whitney_u([1, 2, 3], [4, 5, 6], "two-sided").p_value, 0.1)
    # 10 vs 10 fully separated: 1 / C(20, 10)
    r = stats.mann_whitney_u(range(10, 20), range(10), "greater")
    assert r.u == 100 and math.isclose(r.p_value, 1 / 184756)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("alternative", ["greater", "less", "two-sided"])
def test_exact_matches_enumeration(seed, alternative):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(0.3, 1, 5), rng.normal(0, 1, 6)
    r = stats.mann_whitney_u(x, y, alternative)
    assert r.method == "exact"
    assert math.isclose(r.p_value, brute_force_p(x, y, alternative), rel_tol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_asymptotic_with_ties_is_close_to_enumeration(seed):
    rng = np.random.default_rng(seed)
    # Timings rounded to a coarse clock: many ties.
    x, y = np.round(rng.normal(10.4, 1, 7)), np.round(rng.normal(10, 1, 7))
    r = stats.mann_whitney_u(x, y, "greater")
    assert r.method == "asymptotic"
    # the normal approximation at 7 vs 7 with a tie in every other value: within 0.04
    assert abs(r.p_value - brute_force_p(x, y, "greater")) < 0.04


def test_all_equal_is_no_evidence():
    assert stats.mann_whitney_u([1.0] * 5, [1.0] * 5).p_value == 1.0
    with pytest.raises(ValueError):
        stats.mann_whitney_u([], [1.0])


def test_summary_quantiles_and_bootstrap():
    s = stats.summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.n, s.median, s.q1, s.q3, s.iqr, s.min, s.max) == (5, 3.0, 2.0, 4.0, 2.0, 1.0, 100.0)
    assert s.ci_low <= s.median <= s.ci_high
    assert stats.summarize([1.0, 2.0, 3.0, 4.0, 100.0]) == s  # seeded bootstrap: reproducible
    lo, hi = stats.bootstrap_ci(np.random.default_rng(0).normal(5, 0.1, 200))
    assert 4.97 < lo < 5.0 < hi < 5.03
    assert math.isnan(stats.summarize([]).median)
