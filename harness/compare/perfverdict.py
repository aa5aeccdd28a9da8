"""The perf check's own verdict, read from ``harness.detail.perf_verdict`` (docs/perf.md).

The ``perf`` check decides regressions itself: against a pooled baseline of the same machine
class, a calibrated ratio past its threshold *and* a one-sided Mann-Whitney p below alpha, a
suspected regression re-measured once in the same item (harness/perf/decide.py). Judging the same
timings again with the comparator's generic relative threshold would decide twice: wall-clock noise
of a loaded runner becomes a false alarm the check had ruled out, and a confirmed regression comes
out twice (as the item's failure and as a metric finding) or not at all. So, for an item that
carries the verdict:

* the verdict's metrics *and* the figures computed from the same timings (their CPU-clock twins,
  tokens per second, roofline fractions, p values and changes: :data:`TIMING_FAMILY`) are never
  compared by the comparator, neither against the baseline run nor over the history;
* each metric the check called a ``regression`` is one confirmed ``performance`` finding, and each
  ``improvement`` one improvement finding, with the check's figures (:class:`Figures`). Confirmed
  at once: the check's re-measurement is its second look, and waiting for the comparator's
  ``--min-bad-runs`` would hold a decided regression back;
* ``unchanged`` (within noise) is no finding, so a group that regressed counts as clean again;
* ``no-baseline`` and ``incomparable`` are no finding either (nothing was compared), only noted;
* the item's failure that the verdict caused (``fail_on_regression``) is that regression, not a
  second ``failure`` finding.

Everything else of such an item (peak memory, its outcome when the check could not run) is compared
as for any item; not the item's wall time (:data:`SKIPPED`). An item without the verdict is untouched.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# The timings the check decides (harness/checks/perf.py ``TIMED``) and, per timing, what the check
# derives from it. Kept here rather than imported: the comparator must not import torch.
# tests/compare/test_perf_verdict.py checks this against the metrics the check declares.
TIMED = {"prefill_s": "prefill", "ttft_s": "prefill", "decode_token_s": "decode", "train_step_s": "train"}
DERIVED = {
    "prefill": ("prefill_tokens_per_s", "prefill_mfu"),
    "decode": ("decode_tokens_per_s", "decode_mfu", "decode_mbu"),
    "train": ("train_tokens_per_s", "train_mfu"),
}
ROOFLINE = {"prefill_s": "prefill_mfu", "ttft_s": "prefill_mfu", "decode_token_s": "decode_mbu",
            "train_step_s": "train_mfu"}


def cpu_key(metric: str) -> str:
    """``prefill_s`` -> ``prefill_cpu_s`` (harness/perf/timing.py): the CPU-clock twin."""
    return metric[:-2] + "_cpu_s"


TIMING_FAMILY = frozenset(
    [m for m in TIMED]
    + [cpu_key(m) for m in TIMED]
    + [f"{m}_{s}" for m in TIMED for s in ("p_value", "change")]
    + [d for ds in DERIVED.values() for d in ds]
    # the exact tensor-memory peaks: the check judges them against the baseline's profile (memory_threshold)
    + [f"{ph}_tensor_peak_bytes" for ph in DERIVED])

# What the comparator leaves to the check for an item with a verdict: its timings and, beside them,
# the item's own wall time, which is the check's repeat budget (counted in CPU time) stretched by
# whatever else the runner does: a loaded runner doubles it while the CPU time the check decides on
# holds, and the generic 10% threshold would call that a regression the check ruled out.
SKIPPED = TIMING_FAMILY | {"wall_time_s"}

_STATUSES = ("regression", "improvement", "unchanged", "no-baseline", "incomparable")


@dataclass
class Figures:
    """What the issue body shows for one metric the check decided."""
    metric: str
    verdict: str  # regression | improvement | unchanged
    clock: str  # cpu | wall: the clock the decision was made on
    baseline: float | None  # median of the baseline's samples (decision clock)
    measured: float | None  # median of the samples decided on (decision clock)
    q1: float | None
    q3: float | None
    ci_low: float | None
    ci_high: float | None
    n_current: int | None
    n_baseline: int | None
    change: float | None  # calibrated relative change
    kernel_ratio: float | None
    threshold: float | None
    alpha: float | None
    p_value: float | None
    why: str
    remeasured: bool
    first_why: str
    roofline: tuple[str, float] | None  # (fraction name, value)
    baseline_file: str
    machine_class: str
    where: dict | None = None  # the check's profile comparison (harness.perf.profile.explain), on a regression

    @property
    def band(self) -> str:
        """The check's noise band: the size it ignores and the evidence it asks for."""
        thr = f"±{self.threshold:.0%}" if self.threshold is not None else "?"
        alpha = f"{self.alpha:g}" if self.alpha is not None else "?"
        return f"{thr} calibrated, p < {alpha}"


@dataclass
class Verdict:
    status: str
    baseline: str  # the baseline file, or why none was used
    machine_class: str
    metrics: dict[str, Figures]


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _int(v) -> int | None:
    f = _num(v)
    return int(f) if f is not None else None


def read(details: dict[str, str]) -> tuple[Verdict | None, str]:
    """``(verdict, "")`` for an item that carries a readable verdict, ``(None, "")`` for one that
    carries none, ``(None, why)`` for one whose verdict cannot be read (then it is compared as an
    item without one, and ``why`` becomes an input warning)."""
    text = details.get("perf_verdict")
    if text is None:
        return None, ""
    try:
        raw = json.loads(text)
    except ValueError as e:
        return None, f"perf_verdict is not JSON ({e})"
    if not isinstance(raw, dict) or raw.get("status") not in _STATUSES or not isinstance(raw.get("metrics", {}), dict):
        return None, f"perf_verdict has no known status ({str(raw)[:80]})"
    clock = details.get("perf_clock") or "wall"
    try:
        summaries = json.loads(details.get("perf_summary") or "{}")
    except ValueError:
        summaries = {}
    summaries = summaries if isinstance(summaries, dict) else {}
    roof = raw.get("roofline") if isinstance(raw.get("roofline"), dict) else {}
    try:
        where = json.loads(details.get("perf_where") or "null")
    except ValueError:
        where = None
    where = where if isinstance(where, dict) else None
    out: dict[str, Figures] = {}
    for m, e in raw.get("metrics", {}).items():
        if not isinstance(e, dict) or e.get("verdict") not in ("regression", "improvement", "unchanged"):
            continue
        out[m] = _figures(m, e, clock, summaries, roof, str(raw.get("baseline", "")), str(raw.get("class", "")))
        if where is not None and e.get("verdict") == "regression":
            out[m].where = where
    return Verdict(raw["status"], str(raw.get("baseline", "")), str(raw.get("class", "")), out), ""


def _figures(m: str, e: dict, clock: str, summaries: dict, roof: dict, base_file: str, cls: str) -> Figures:
    # The samples decided on: the CPU-clock twin on the cpu clock, the re-measured ones when the
    # check measured again (checks/perf.py ``_remeasure``). Their median over the raw ratio is the
    # baseline's median, exactly: decide() computes ratio = median(now) / median(baseline).
    key = cpu_key(m) if clock == "cpu" and m.endswith("_s") else m
    first = e.get("first") if isinstance(e.get("first"), dict) else None
    if first is not None:
        key += "_remeasured"
    s = summaries.get(key)
    if not isinstance(s, dict) and key == m and isinstance(e.get("summary"), dict):
        s = e["summary"]  # the verdict's own summary is of the wall-clock samples
    s = s if isinstance(s, dict) else {}
    measured, ratio = _num(s.get("median")), _num(e.get("ratio"))
    baseline = measured / ratio if measured is not None and ratio else None
    dec = e.get("decided") if isinstance(e.get("decided"), dict) else {}
    if isinstance(dec.get("now"), dict) and isinstance(dec.get("baseline"), dict):
        # Newer checks say what they decided on, both sides, on the decision's clock.
        s = dec["now"]
        measured, baseline = _num(s.get("median")), _num(dec["baseline"].get("median"))
    frac = ROOFLINE.get(m)
    fval = _num(roof.get(frac)) if frac else None
    return Figures(
        metric=m, verdict=e["verdict"], clock=clock, baseline=baseline, measured=measured,
        q1=_num(s.get("q1")), q3=_num(s.get("q3")), ci_low=_num(s.get("ci_low")), ci_high=_num(s.get("ci_high")),
        n_current=_int(e.get("n_current")), n_baseline=_int(e.get("n_baseline")), change=_num(e.get("change")),
        kernel_ratio=_num(e.get("kernel_ratio")), threshold=_num(e.get("threshold")), alpha=_num(e.get("alpha")),
        p_value=_num(e.get("p_value")), why=str(e.get("why", "")), remeasured=first is not None,
        first_why=str(first.get("why", "")) if first else "",
        roofline=(frac, fval) if fval is not None else None, baseline_file=base_file, machine_class=cls)


def caused_failure(case, verdict: Verdict) -> bool:
    """The item failed because the check confirmed a regression (``fail_on_regression``): its
    failure *is* the regression, filed as ``performance`` with the figures, not as a failure.
    The verdict step runs after the one that records the verdict, so an item with a recorded
    verdict of ``regression`` that failed (not errored) failed there."""
    return case.outcome == "failed" and verdict.status == "regression" and any(
        f.verdict == "regression" for f in verdict.metrics.values())
