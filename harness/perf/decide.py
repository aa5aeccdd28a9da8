"""The regression rule: a change needs size *and* evidence.

For one metric with samples now (``current``) and in the baseline, on machines of the same class:

1. **size**: the calibrated ratio of medians, ``(median now / median then) / kernel ratio``, is past
   the threshold the wrong way (``> 1 + threshold`` for lower-is-better metrics, ``< 1 - threshold``
   for higher-is-better ones). The kernel ratio (calibrate.py) takes out a machine that is
   uniformly slower or faster today;
2. **evidence**: the Mann-Whitney U test of the calibrated current samples against the baseline's,
   one-sided in the bad direction, gives ``p < alpha`` (default 0.01).

Both or it is not a regression: size alone fires on one unlucky run of a noisy machine, evidence
alone fires on a 0.5% shift measured very precisely. The same rule the other way round calls an
improvement. The check then re-measures a suspected regression once, interleaved with the
calibration kernels, and reports it only if the re-measurement says so too (checks/perf.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from harness.perf import stats

Verdict = Literal["regression", "improvement", "unchanged", "no-baseline", "incomparable", "suspected"]


@dataclass
class Decision:
    metric: str
    verdict: Verdict
    direction: str
    ratio: float  # median now / median then (raw)
    calibrated_ratio: float  # ratio / kernel ratio
    kernel_ratio: float  # 1.0 when not calibrated
    p_value: float  # one-sided, in the direction the ratio moved
    threshold: float
    alpha: float
    n_current: int
    n_baseline: int
    why: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["change"] = self.calibrated_ratio - 1.0
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    @property
    def change(self) -> float:
        """Relative change, calibrated: +0.12 = 12% larger now."""
        return self.calibrated_ratio - 1.0


def decide(metric: str, current: Sequence[float], baseline: Sequence[float], *, direction: str = "lower",
           threshold: float = 0.05, alpha: float = 0.01, kernel_ratio: float | None = None) -> Decision:
    """Apply the rule. ``kernel_ratio``: calibration kernel time now / then (None: uncalibrated)."""
    kr = kernel_ratio if kernel_ratio and math.isfinite(kernel_ratio) and kernel_ratio > 0 else 1.0
    cur = [float(v) for v in current if math.isfinite(v)]
    base = [float(v) for v in baseline if math.isfinite(v)]
    if not cur or not base or direction == "none":
        why = "no samples" if not cur or not base else "metric has no direction"
        return Decision(metric, "no-baseline" if not base else "unchanged", direction, math.nan, math.nan, kr,
                        math.nan, threshold, alpha, len(cur), len(base), why)
    # Times scale with the machine: divide them by how much slower the kernel runs now. Rates
    # (higher is better) scale the other way.
    scale = 1.0 / kr if direction == "lower" else kr
    adj = [v * scale for v in cur]
    m_cur, m_base = stats.summarize(cur).median, stats.summarize(base).median
    ratio = m_cur / m_base if m_base else math.inf
    cal = ratio * scale
    worse_up = direction == "lower"  # a larger value is worse
    up = stats.mann_whitney_u(adj, base, "greater").p_value
    down = stats.mann_whitney_u(adj, base, "less").p_value
    if cal > 1.0:
        p, bigger = up, True
    else:
        p, bigger = down, False
    past = cal > 1 + threshold if bigger else cal < 1 - threshold
    significant = p < alpha
    if past and significant:
        verdict: Verdict = "regression" if bigger == worse_up else "improvement"
        why = f"{cal - 1:+.1%} calibrated (threshold {threshold:.0%}), p={p:.2g} < {alpha}"
    else:
        verdict = "unchanged"
        parts = []
        if not past:
            parts.append(f"{cal - 1:+.1%} within threshold {threshold:.0%}")
        if not significant:
            parts.append(f"p={p:.2g} not < {alpha}")
        why = "; ".join(parts)
    return Decision(metric, verdict, direction, ratio, cal, kr, p, threshold, alpha, len(cur), len(base), why)
