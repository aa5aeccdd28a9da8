"""Sample statistics for timings: robust summaries and a rank test.

Timings on a shared machine are skewed (a context switch only ever adds time) and have outliers,
so everything here is rank- or quantile-based: the median and the IQR describe a sample set, a
percentile bootstrap gives the median's confidence interval, and the Mann-Whitney U test says
whether one set is stochastically larger than another without assuming normality.

Mann-Whitney is implemented here rather than taken from scipy, which harness does not otherwise
need (a large dependency for ~60 lines): the exact null distribution from the Gaussian binomial
generating function when there are no ties, the normal approximation with tie and continuity
corrections otherwise (the same choices as scipy.stats.mannwhitneyu's ``exact`` and
``asymptotic`` methods). tests/perf/test_stats.py checks both against brute-force enumeration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

Alternative = Literal["greater", "less", "two-sided"]

# Exact distribution up to this many pairs (m * n); beyond, the normal approximation is within
# 1e-3 of it anyway and the polynomial gets long.
EXACT_MAX_PAIRS = 10_000


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    q1: float
    q3: float
    iqr: float
    ci_low: float  # bootstrap confidence interval of the median
    ci_high: float
    mean: float
    min: float
    max: float

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def rel_iqr(self) -> float:
        return self.iqr / self.median if self.median else math.nan


def bootstrap_ci(samples: Sequence[float], level: float = 0.95, n_boot: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median (seeded: the same samples give the same CI)."""
    x = np.asarray(samples, dtype=float)
    if x.size == 0:
        return math.nan, math.nan
    if x.size == 1:
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, x.size, size=(n_boot, x.size))], axis=1)
    a = (1 - level) / 2
    lo, hi = np.quantile(meds, [a, 1 - a])
    return float(lo), float(hi)


def summarize(samples: Sequence[float], level: float = 0.95) -> Summary:
    x = np.asarray(samples, dtype=float)
    if x.size == 0:
        nan = math.nan
        return Summary(0, nan, nan, nan, nan, nan, nan, nan, nan, nan)
    q1, med, q3 = (float(v) for v in np.quantile(x, [0.25, 0.5, 0.75]))
    lo, hi = bootstrap_ci(x, level)
    return Summary(int(x.size), med, q1, q3, q3 - q1, lo, hi, float(x.mean()), float(x.min()), float(x.max()))


@dataclass(frozen=True)
class UTest:
    u: float  # U of the first sample: pairs (x_i > y_j) + half the ties
    p_value: float
    method: Literal["exact", "asymptotic"]


def _ranks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mid-ranks (1-based) and the sizes of the tie groups."""
    order = np.argsort(values, kind="mergesort")
    sorted_v = values[order]
    ranks = np.empty(values.size, dtype=float)
    ties = []
    i = 0
    while i < values.size:
        j = i
        while j + 1 < values.size and sorted_v[j + 1] == sorted_v[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        if j > i:
            ties.append(j - i + 1)
        i = j + 1
    return ranks, np.asarray(ties, dtype=float)


def u_distribution(m: int, n: int) -> np.ndarray:
    """P(U = u) for u = 0..m*n under the null, no ties. The count of arrangements with U = u is the
    coefficient of q^u in the Gaussian binomial [m+n choose m]_q = prod_{i=1..m} (1-q^(n+i))/(1-q^i)."""
    size = m * n + 1
    c = np.zeros(size + n + m + 1)
    c[0] = 1.0
    for i in range(1, m + 1):
        k = n + i  # multiply by (1 - q^k)
        c[k:] = c[k:] - c[:-k].copy()
        for r in range(i):  # divide by (1 - q^i): running sum along each residue class mod i
            c[r::i] = np.cumsum(c[r::i])
    c = np.clip(c[:size], 0, None)
    return c / c.sum()


def mann_whitney_u(x: Sequence[float], y: Sequence[float], alternative: Alternative = "greater") -> UTest:
    """Is ``x`` stochastically greater (``greater``), smaller (``less``) or either (``two-sided``)
    than ``y``? Exact when there are no ties and at most EXACT_MAX_PAIRS pairs."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    m, n = xa.size, ya.size
    if m == 0 or n == 0:
        raise ValueError("mann_whitney_u needs at least one sample on each side")
    ranks, ties = _ranks(np.concatenate([xa, ya]))
    u = float(ranks[:m].sum() - m * (m + 1) / 2)
    if ties.size == 0 and m * n <= EXACT_MAX_PAIRS:
        pmf = u_distribution(m, n)
        ui = int(round(u))
        p_ge = float(pmf[ui:].sum())  # P(U >= u)
        p_le = float(pmf[:ui + 1].sum())  # P(U <= u)
        p = {"greater": p_ge, "less": p_le, "two-sided": min(1.0, 2 * min(p_ge, p_le))}[alternative]
        return UTest(u, min(1.0, p), "exact")
    big_n = m + n
    mu = m * n / 2
    tie_term = float((ties ** 3 - ties).sum()) / (big_n * (big_n - 1)) if big_n > 1 else 0.0
    var = m * n / 12 * ((big_n + 1) - tie_term)
    if var <= 0:  # every value equal: no evidence either way
        return UTest(u, 1.0, "asymptotic")
    sd = math.sqrt(var)
    if alternative == "greater":
        z = (u - mu - 0.5) / sd
        p = 0.5 * math.erfc(z / math.sqrt(2))
    elif alternative == "less":
        z = (u - mu + 0.5) / sd
        p = 0.5 * math.erfc(-z / math.sqrt(2))
    else:
        z = (abs(u - mu) - 0.5) / sd
        p = min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))
    return UTest(u, min(1.0, max(0.0, p)), "asymptotic")
