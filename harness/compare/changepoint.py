"""Across-runs test: did a metric's level shift, and has the new level held for a few runs?

A single slow run is noise; a shift that every one of the last ``min_bad`` runs shares is a change.
The test looks for the split of the series (earliest run first, current run last) that best
separates two levels (the smallest sum of squared deviations from the two segment levels, a
level being the segment's median), among the splits that satisfy

1. at least ``min_before`` runs precede the split and at least ``min_bad`` follow it,
2. the shift is large against the noise (a two-sample t statistic ``>= min_t``, the noise estimated
   robustly from the earlier segment) and past the relative ``threshold``,
3. *every* run after the split is past the threshold on the same side of the earlier level.

Rule 3 is what keeps one noisy run from ever opening an issue. The side decides: with the metric's
direction, a shift the wrong way is a regression, the other way an improvement (time to update
the golden or baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean, median


@dataclass(frozen=True)
class ChangePoint:
    index: int  # position in the series of the first run at the new level
    before: float  # level (median) before
    after: float  # level (median) after
    rel_change: float  # (after - before) / |before|
    t: float
    runs_after: int
    regression: bool  # False: an improvement


def rel_change(old: float, new: float) -> float:
    if old == 0:
        return math.inf if new > 0 else -math.inf if new < 0 else 0.0
    return (new - old) / abs(old)


def is_worse(old: float, new: float, direction: str, threshold: float) -> bool:
    """``new`` is past ``threshold`` (relative) on the bad side of ``old``."""
    r = rel_change(old, new)
    return r > threshold if direction == "lower" else r < -threshold if direction == "higher" else False


def is_better(old: float, new: float, direction: str, threshold: float) -> bool:
    flip = {"lower": "higher", "higher": "lower"}.get(direction, "none")
    return is_worse(old, new, flip, threshold)


def detect(series: list[float], direction: str, threshold: float, min_bad: int = 2,
           min_before: int = 3, min_t: float = 4.0) -> ChangePoint | None:
    n = len(series)
    if direction == "none" or n < min_before + min_bad or any(map(math.isnan, series)):
        return None
    # Cheap necessary condition first (most series are flat): the current value must be past the
    # threshold against the best (or worst) earlier value, or no split can satisfy rule 3.
    cur, earlier = series[-1], series[:-1]
    if not (is_worse(min(earlier) if direction == "lower" else max(earlier), cur, direction, threshold)
            or is_better(max(earlier) if direction == "lower" else min(earlier), cur, direction,
                         threshold)):
        return None
    best: tuple[float, ChangePoint] | None = None
    for k in range(min_before, n - min_bad + 1):
        before, after = series[:k], series[k:]
        # Levels are medians: one old spike must not make today's normal run look like a change.
        m0, m1 = median(before), median(after)
        worse = [is_worse(m0, v, direction, threshold) for v in after]
        better = [is_better(m0, v, direction, threshold) for v in after]
        if not (all(worse) or all(better)):
            continue
        sigma = _noise(before)
        scale = sigma * math.sqrt(1 / len(before) + 1 / len(after))
        t = math.inf if scale == 0 else abs(m1 - m0) / scale
        if t < min_t:
            continue
        cost = sum((v - m0) ** 2 for v in before) + sum((v - m1) ** 2 for v in after)  # least squares
        if best is None or cost < best[0]:
            best = (cost, ChangePoint(k, m0, m1, rel_change(m0, m1), t, len(after), all(worse)))
    return best[1] if best else None


def _noise(values: list[float]) -> float:
    """Robust standard deviation (scaled median absolute deviation), so one earlier spike does not
    hide a later shift; falls back to the plain standard deviation when the MAD is zero."""
    med = median(values)
    mad = 1.4826 * median(abs(v - med) for v in values)
    if mad > 0:
        return mad
    m = fmean(values)
    return math.sqrt(fmean((v - m) ** 2 for v in values))
