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

Two holds keep a shared machine from filing what it cannot show (issue #51 item 3). A regression
by the rule above is instead:

* ``noisy`` ("too noisy to judge") when the raw, uncalibrated samples disagree: their median is not
  worse than the baseline's, or they give no evidence at all in the bad direction (one-sided
  p >= 0.5). Measured: 7 of 8 false alarms of one night were raw times *faster* than the baseline
  that the kernel ratio turned into a "regression"; a real slowdown also slows the raw time unless
  the machine got faster by more than the slowdown, which the kernel check then misses (said so).
  Also ``noisy`` when the calibration kernel's own spread (IQR / median, ``kernel_spread``) exceeds
  the threshold, the raw change alone is not past it, and the calibrated change is not past the
  threshold *plus* that spread: the kernel then cannot resolve the change it is correcting. A change
  beyond threshold + spread is more than the kernel's own noise can make, and is judged. Measured
  (benchmarks/bench_perf_holds.py, replayed on one run's samples: 20 clean, 20 with every Linear 20%
  slower, baseline at load 9-10 and trials at 2-6): holding on the spread alone kept 11 of 20
  slowdowns (prefill +20-23% calibrated, raw +0.3-3.9%, spread 9.5%); widened, 19 of 20 caught and the
  clean trials' largest calibrated change (+5.8%, decode) stays far inside;
* ``noisy`` too when the baseline's own processes disagree by more than the change exceeds the
  threshold: the calibrated change is within threshold + ``process_spread`` (half the range of the
  baseline processes' medians, relative to theirs: baseline.process_spread). Each process draws a
  level of its own on a loaded CPU (decode on the CPU clock: three baseline processes at 0.87, 1.00
  and 1.28 of their median, one night) and the re-measure, in the same process, keeps that level;
  what one process's level can make is no finding. Measured (benchmarks/bench_perf_holds.py, two
  runs of 20 clean and 20 with every Linear 20% slower, replayed): clean decode read +14% to +29% in
  5 of 20 trials of the run whose baseline processes spread that wide (2 confirmed on re-measure);
  with this hold 0 of 40 clean and 36 of 40 slowed trials regress;
* ``thin-baseline`` when the baseline holds one process's samples (``baseline_runs`` 1) and the
  change is within ``thin_margin``: one process's level can be 15% off another's on a loaded CPU
  (docs/perf.md), so one process is no yardstick for less. Beyond the margin it is a regression.

Neither is filed; the check notes them (harness/perf/judge.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from harness.perf import stats

Verdict = Literal["regression", "improvement", "unchanged", "no-baseline", "incomparable", "suspected", "noisy",
                  "thin-baseline"]
HELD = ("noisy", "thin-baseline")  # a regression by the rule that the machine or the baseline cannot back


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
    raw_p_value: float = math.nan  # one-sided in the bad direction, uncalibrated samples
    baseline_runs: int | None = None  # processes the baseline's samples come from (None: not known)
    held_by: str = ""  # the hold that made a regression by the rule "noisy" or "thin-baseline": raw, spread, process, thin

    def to_dict(self) -> dict:
        d = asdict(self)
        d["change"] = self.calibrated_ratio - 1.0
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    @property
    def change(self) -> float:
        """Relative change, calibrated: +0.12 = 12% larger now."""
        return self.calibrated_ratio - 1.0


def decide(metric: str, current: Sequence[float], baseline: Sequence[float], *, direction: str = "lower",
           threshold: float = 0.05, alpha: float = 0.01, kernel_ratio: float | None = None,
           kernel_spread: float | None = None, baseline_runs: int | None = None,
           thin_margin: float | None = None, raw_baseline: Sequence[float] | None = None,
           process_spread: float | None = None) -> Decision:
    """Apply the rule. ``kernel_ratio``: calibration kernel time now / then (None: uncalibrated);
    ``kernel_spread``: the kernel's IQR / median (the larger of now and then); ``baseline_runs``:
    processes of the baseline; ``thin_margin``: the change a one-process baseline still judges;
    ``raw_baseline``: the baseline as measured where ``baseline`` was rescaled (the comm check brings
    each launch to one load level before pooling): the raw ratio and raw p, which the holds read,
    are then against these; ``process_spread``: how far the baseline's processes' levels alone move the
    metric (half their range, relative), the margin past the threshold a change needs."""
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
    d = Decision(metric, verdict, direction, ratio, cal, kr, p, threshold, alpha, len(cur), len(base), why,
                 stats.mann_whitney_u(cur, base, "greater" if worse_up else "less").p_value, baseline_runs)
    raw = [float(v) for v in raw_baseline if math.isfinite(v)] if raw_baseline is not None else []
    if raw:
        d.ratio = m_cur / stats.summarize(raw).median
        d.raw_p_value = stats.mann_whitney_u(cur, raw, "greater" if worse_up else "less").p_value
    if verdict == "regression":
        _hold(d, kernel_spread, thin_margin, process_spread)
    return d


def _hold(d: Decision, kernel_spread: float | None, thin_margin: float | None,
          process_spread: float | None = None) -> None:
    """A regression by the rule turned ``noisy`` or ``thin-baseline`` where the raw samples, the
    calibration or the baseline cannot back it (module docstring)."""
    raw = d.ratio - 1 if d.direction == "lower" else 1 - d.ratio  # > 0: the raw samples are worse
    said = f"calibrated {d.change:+.1%} (p={d.p_value:.2g}, kernel ratio {d.kernel_ratio:.3f})"
    # the change rests on the calibration: a kernel noisier than the threshold and a raw change within it
    leans = kernel_spread is not None and kernel_spread > d.threshold and raw <= d.threshold
    if raw <= 0 or not d.raw_p_value < 0.5:
        d.verdict = "noisy"
        d.held_by = "raw"
        d.why = (f"too noisy to judge: {said} but the raw median is {d.ratio - 1:+.1%} (p={d.raw_p_value:.2g}): "
                 "only the calibration makes it worse; not a regression")
        return
    if leans and abs(d.change) <= d.threshold + kernel_spread:
        d.verdict = "noisy"
        d.held_by = "spread"
        d.why = (f"too noisy to judge: {said} rests on a calibration kernel spread {kernel_spread:.0%} "
                 f"(IQR / median) wider than the {d.threshold:.0%} threshold, raw {d.ratio - 1:+.1%}, and is "
                 f"not past threshold + spread ({d.threshold + kernel_spread:.1%})")
        return
    if process_spread is not None and abs(d.change) <= d.threshold + process_spread:
        d.verdict = "noisy"
        d.held_by = "process"
        d.why = (f"too noisy to judge: {said} is within the {d.threshold:.0%} threshold + the "
                 f"{process_spread:.1%} by which the baseline's {d.baseline_runs or 'several'} processes' levels "
                 "differ (half their range): one process's level can make it; not a regression")
        return
    if leans:
        d.why += (f"; past threshold + the calibration kernel's spread {kernel_spread:.1%} "
                  f"(raw {d.ratio - 1:+.1%})")
    if d.baseline_runs is not None and d.baseline_runs < 2 and thin_margin is not None:
        if abs(d.change) <= thin_margin:
            d.verdict = "thin-baseline"
            d.held_by = "thin"
            d.why = (f"baseline too thin: {said} against samples of one process, whose level alone can be off "
                     f"by up to {thin_margin:.0%}; pool several runs (harness baseline update DIR1 DIR2 ..., or "
                     "--append); not a regression")
        else:
            d.why += f"; beyond the {thin_margin:.0%} margin of a one-process baseline"
