"""Classify the current run against the baseline run and the history of earlier runs.

Categories (``Finding.category``) and the issue kind each one files under (``Finding.kind``):

=================  ==================================================================  ============
category           meaning                                                             kind
=================  ==================================================================  ============
new_failure        fails now, passed (or did not exist) in the baseline / last run     failure, error
                                                                                       or precision
still_failing      failed before too                                                   (same)
fixed              passes now, failed before                                           info
flaky              failed in one attempt, passed in another (or on a rerun)            flaky
quarantined        in the quarantine (harness.compare.quarantine): reported, and it    flaky
                   keeps its flaky issue open, never a failure
infrastructure     failed in every attempt for the runner's reasons, not the model's   infrastructure
                   (harness.run.confirm: killed from outside, device lost, disk full)
new_test           not in the baseline nor the last run                                info
vanished           in the baseline but not now, while its suite x backend did run      vanished
dropped            vanished, but no longer collected (``collected``): the suite dropped it  info
not_run            absent now, and its suite x backend has no results or part of the   info
                   input could not be read (a shard missing, cut off, not JUnit)
precision_drift    a metric with a tolerance used up ``drift_fraction`` of its          precision
                   headroom to the tolerance, against the baseline
metric_regression  past the threshold the wrong way vs the baseline, or a change point  performance
                   (or the perf check's own verdict said ``regression``)
improvement        the same the good way: time to update the golden / baseline         improvement
perf_not_compared  the perf check had no baseline of this machine class (or an         info
                   incomparable one): nothing was decided
=================  ==================================================================  ============

``error`` (the test could not run: setup crash, import error) is kept apart from ``failure`` (it
ran and an assertion said no). Metric findings are only ``confirmed`` once ``min_bad_runs`` runs in
a row are bad; an unconfirmed one is reported as *suspected* and never files an issue.

An item that carries the perf check's verdict (``harness.detail.perf_verdict``) is judged by that
verdict for its timings, never by the generic threshold (:mod:`harness.compare.perfverdict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

from harness.compare import changepoint as cpt
from harness.compare import perfverdict
from harness.compare.history import History, SeriesView
from harness.compare.junit import Case, Results, attempt_counts
from harness.metrics import Meanings

REGRESSIONS = {"new_failure", "still_failing", "vanished", "precision_drift", "metric_regression"}
_BAD = ("failed", "error")


@dataclass
class Config:
    threshold: float = 0.10  # relative, for metrics with no specific threshold
    thresholds: dict[str, float] = field(default_factory=dict)  # "metric" or "suite:metric"
    drift_fraction: float = 0.5
    min_bad_runs: int = 2
    history_window: int = 30
    collected: set[str] | None = None  # test ids the suites still define, when known
    time_floor_s: float = 0.05  # timing changes smaller than this are scheduler noise, never findings

    def threshold_for(self, suite: str, metric: str) -> float:
        if not self.thresholds:
            return self.threshold
        return self.thresholds.get(f"{suite}:{metric}", self.thresholds.get(metric, self.threshold))


@dataclass
class Finding:
    category: str
    kind: str
    key: str
    suite: str
    backend: str
    case: Case | None = None
    metric: str = ""
    baseline: float | None = None
    current: float | None = None
    change: float | None = None  # relative change
    threshold: str = ""
    confirmed: bool = True
    bad_runs: int = 1
    note: str = ""
    perf: perfverdict.Figures | None = None  # the perf check's figures, when it decided this
    stack: str = ""  # upstream canary: the package versions that changed against the pinned run

    @property
    def regression(self) -> bool:
        return self.category in REGRESSIONS

    @property
    def item_id(self) -> str:
        """Identifies the finding across runs (for 'what changed' comments)."""
        return f"{self.key}|{self.metric}" if self.metric else self.key


@dataclass
class Classification:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # named input mistakes; the input is not partial

    def by_category(self, category: str) -> list[Finding]:
        return [f for f in self.findings if f.category == category]


def classify(current: Results, baseline: Results | None, history: History | None,
             config: Config, run_key: str | None = None) -> Classification:
    out = Classification()
    base = _usable_baseline(current, baseline, out.notes)
    runs = history.runs(config.history_window, exclude_key=run_key) if history else []
    prev = history.outcomes(runs[-1].id) if runs else {}
    series = history.metric_series([r.id for r in runs]) if runs else SeriesView({}, {})
    ref_keys = set(base) | set(prev)
    # how often each flaky item flaked before (the history keeps every run's reruns)
    flaky_now = [k for k, c in current.cases.items() if c.flaky or c.details.get("confirm") == "flaky"]
    flaked = history.flaky_runs([r.id for r in runs]) if history and runs and flaky_now else {}
    # each metric judged by what the run that measured it declared (its results say), never by
    # which checks this process imported; older XML falls back, in one warning line
    meanings = Meanings(current.meanings, baseline.meanings if baseline is not None else {})
    for key, case in current.cases.items():
        verdict, why = perfverdict.read(case.details) if "perf_verdict" in case.details else (None, "")
        if why:
            out.warnings.append(f"{key}: {why}; its metrics are compared as for any item")
        by_verdict = verdict is not None and perfverdict.caused_failure(case, verdict)
        _outcome_findings(out, case, base.get(key), prev.get(key, ("",))[0], bool(ref_keys), by_verdict,
                          f"; flaky in {1 + flaked.get(key, 0)} of the last {len(runs) + 1} runs" if runs else "")
        if case.outcome == "passed" or by_verdict:
            _metric_findings(out, case, base.get(key), series, config,
                             perfverdict.SKIPPED if verdict is not None else frozenset(), meanings)
        if verdict is not None:
            _verdict_findings(out, case, verdict)
    _missing_findings(out, current, base, prev, config)
    for path, status, reason, n, backends in current.cut_off:
        # the run itself was cut off (the job's time limit, a lost runner, a full disk): the runner's
        # problem, one finding per backend it cost; its missing items are "not run", never fixed
        for backend in backends or ["unknown"]:
            out.findings.append(Finding("infrastructure", "infrastructure", f"run:{path}", "*", backend,
                                        note=f"the run was {status}" + (f" ({reason})" if reason else "")
                                        + f": {n} item(s) not run ({path})"))
    if meanings.fallback_note():
        out.warnings.append(meanings.fallback_note())
    return out


def _usable_baseline(current: Results, baseline: Results | None, notes: list[str]) -> dict[str, Case]:
    if baseline is None:
        return {}
    cur, old = current.suites(), baseline.suites()
    common = cur & old
    if not baseline.cases:
        notes.append("the baseline has no readable test cases; compared with the history only")
        return {}
    if not common:
        notes.append(f"the baseline covers suites {sorted(old)} but this run covers {sorted(cur)}: "
                     "different suite sets, so nothing was compared against the baseline "
                     "(history only)")
        return {}
    if old - cur:
        notes.append(f"baseline suites not in this run, ignored: {sorted(old - cur)}")
    return {k: c for k, c in baseline.cases.items() if c.suite in common}


def _failure_kind(case: Case) -> str:
    if case.outcome == "error":
        return "error"
    if case.check == "precision" or "first_divergent_module" in case.details:
        return "precision"
    return "failure"


def _outcome_findings(out: Classification, case: Case, base: Case | None, prev: str,
                      have_ref: bool, by_verdict: bool = False, flake_rate: str = "") -> None:
    """``by_verdict``: the item failed because the perf check confirmed a regression; that is a
    performance finding (:func:`_verdict_findings`), neither a failure nor, next time, a fix of one."""
    def add(category: str, kind: str, **kw) -> None:
        out.findings.append(Finding(category, kind, case.key, case.suite, case.backend, case, **kw))

    was_bad = (base is not None and base.outcome in _BAD) or prev in _BAD
    confirmed = case.details.get("confirm", "")
    if case.details.get("quarantined"):
        if case.outcome in _BAD or case.flaky:  # a clean run counts towards re-enabling it instead
            add("quarantined", "flaky", note=(_attempts_note(case) or "failed while quarantined")
                + (flake_rate if case.flaky else ""))
        return
    if case.flaky:
        add("flaky", "flaky", note=(_attempts_note(case) or f"{case.attempts} attempts") + flake_rate)
    if by_verdict:
        pass
    elif case.outcome in _BAD and confirmed == "infrastructure":
        add("infrastructure", "infrastructure", note=_attempts_note(case))
    elif case.outcome in _BAD:
        add("still_failing" if was_bad else "new_failure", _failure_kind(case), note=_attempts_note(case))
    elif case.outcome == "passed" and was_bad:
        add("fixed", "info")
    if have_ref and base is None and not prev:
        add("new_test", "info")


def _attempts_note(case: Case) -> str:
    """'deterministic: failed 3 of 3 attempts' from harness's confirming reruns (harness.run.confirm),
    or the JUnit rerun count; '' for an item run once."""
    failed, n = attempt_counts(case)
    if n <= 1:
        return ""
    kind = case.details.get("confirm") or ("flaky" if case.outcome == "passed" else "")
    return f"{kind + ': ' if kind else ''}failed {failed} of {n} attempts"


def _verdict_findings(out: Classification, case: Case, verdict: perfverdict.Verdict) -> None:
    """The perf check's decisions as findings, with its figures; confirmed at once (the check
    re-measured a suspected regression in the same item before calling it one)."""
    if verdict.status in ("no-baseline", "incomparable"):
        out.findings.append(Finding("perf_not_compared", "info", case.key, case.suite, case.backend, case,
                                    note=f"perf check: {verdict.status}: {verdict.baseline}"))
        return
    for name, fig in sorted(verdict.metrics.items()):
        if fig.verdict == "unchanged":
            continue  # within the check's noise band: no finding, the group may count as clean
        regression = fig.verdict == "regression"
        out.findings.append(Finding(
            "metric_regression" if regression else "improvement", "performance" if regression else "improvement",
            case.key, case.suite, case.backend, case, metric=name, baseline=fig.baseline, current=fig.measured,
            change=fig.change, threshold=fig.band, confirmed=True, bad_runs=1,
            note=f"perf check: {fig.why}", perf=fig))


def _metric_findings(out: Classification, case: Case, base: Case | None, series: SeriesView,
                     config: Config, skip: frozenset[str] = frozenset(), meanings: Meanings | None = None) -> None:
    """``skip``: metrics another judge decided (the perf check's timings). ``meanings``: each
    metric's unit and direction (:class:`harness.metrics.Meanings`)."""
    meanings = meanings if meanings is not None else Meanings()
    for name, value in case.metrics.items():
        if name in skip:
            continue
        d = meanings.direction(name)  # before the finite test: it records a metric with no meaning
        if not math.isfinite(value):
            _non_finite(out, case, base, series, name, value, config, meanings.is_time(name))
            continue
        if d == "none":
            continue
        if f"tolerance.{name}" in case.invalid:
            continue  # its tolerance is not a number (an input warning): it cannot be judged
        base_v = base.metrics.get(name) if base is not None else None
        if name in case.tolerances and base_v is not None:
            # Precision metrics are judged against their tolerance, not a relative threshold.
            finding = _precision_drift(case, series, name, value, base_v, d, config)
        else:
            floor = config.time_floor_s if meanings.is_time(name) else 0.0
            thr = config.threshold_for(case.suite, name)
            finding = _against_baseline(case, series, name, value, base_v, d, thr, floor, config)
            if finding is None:
                # In line with the baseline (or none): let the history speak.
                finding = _history_change(case, series, name, value, d, thr, floor, config)
        if finding is not None:
            out.findings.append(finding)


def _precision_drift(case: Case, series: SeriesView, name: str, value: float, base_v: float, d: str,
                     config: Config) -> Finding | None:
    """Drift past ``drift_fraction`` of the headroom between the baseline and the tolerance."""
    tol = case.tolerances[name]
    limit = config.drift_fraction * abs(tol - base_v)
    if not _drifted(value, base_v, d, limit):
        return None
    bad = partial(_drifted, base=base_v, direction=d, limit=limit)
    return _finding(case, "precision_drift", "precision", name, value, base_v,
                    _streak(series.get((case.key, name), []), bad),
                    f"{config.drift_fraction:.0%} of headroom to tol {tol:g}", config)


def _against_baseline(case: Case, series: SeriesView, name: str, value: float, base_v: float | None, d: str,
                      thr: float, floor: float, config: Config) -> Finding | None:
    """A regression or improvement past the relative threshold against the baseline; None when
    there is no baseline or the value is in line with it (the history may still speak)."""
    if base_v is None or abs(value - base_v) < floor:
        return None  # below the timing noise floor: never a finding, whatever the history
    if cpt.is_worse(base_v, value, d, thr):
        category, kind, test = "metric_regression", "performance", cpt.is_worse
    elif cpt.is_better(base_v, value, d, thr):
        category, kind, test = "improvement", "improvement", cpt.is_better
    else:
        return None
    bad = partial(_against, test, base_v, direction=d, threshold=thr, floor=floor)
    sign = "+" if d == "lower" else "-"
    return _finding(case, category, kind, name, value, base_v, _streak(series.get((case.key, name), []), bad),
                    f"{sign}{thr:.0%}", config)


def _history_change(case: Case, series: SeriesView, name: str, value: float, d: str, thr: float,
                    floor: float, config: Config) -> Finding | None:
    """A change point in the metric's history ending at today's value. Only fetches the series
    when its range says a change is possible at all (most metrics are flat)."""
    lo, hi, n = series.bounds((case.key, name))
    if n < 2 + config.min_bad_runs or not _may_change(lo, hi, value, d, thr, floor):  # 3 before + bad runs
        return None
    cp = cpt.detect(series.get((case.key, name), []) + [value], d, thr, config.min_bad_runs)
    if not (cp is not None and abs(cp.after - cp.before) >= floor and abs(value - cp.before) >= floor):
        return None  # written as the test it negates: a NaN compares false both ways
    regression = cp.regression
    sign = "+" if d == "lower" else "-"
    return _finding(
        case, "metric_regression" if regression else "improvement",
        "performance" if regression else "improvement", name, value, cp.before, cp.runs_after,
        f"{sign}{thr:.0%}", config, note=f"change point {cp.runs_after} runs ago (t={cp.t:.1f})")


def _non_finite(out: Classification, case: Case, base: Case | None, series: SeriesView, name: str,
                value: float, config: Config, is_time: bool) -> None:
    """A metric that was a number and now is NaN or inf is a change whatever its direction (a NaN
    compares false with everything, so the threshold tests would call it "unchanged")."""
    base_v = base.metrics.get(name) if base is not None else None
    earlier = [v for v in series.get((case.key, name), []) if math.isfinite(v)]
    old = base_v if base_v is not None and math.isfinite(base_v) else (earlier[-1] if earlier else None)
    if old is None:
        return  # never a number: nothing turned (a check may record NaN on purpose)
    out.findings.append(Finding("metric_regression", "performance" if is_time else "precision",
                                case.key, case.suite, case.backend, case, metric=name, baseline=old,
                                current=value, change=math.inf, threshold="finite", confirmed=True,
                                bad_runs=max(config.min_bad_runs, 1),
                                note=f"{name} turned non-finite ({value}) from {old:g}"))


def _finding(case: Case, category: str, kind: str, name: str, value: float, old: float, bad_runs: int,
             threshold: str, config: Config, note: str = "") -> Finding:
    return Finding(category, kind, case.key, case.suite, case.backend, case, metric=name, baseline=old,
                   current=value, change=cpt.rel_change(old, value), threshold=threshold,
                   confirmed=bad_runs >= config.min_bad_runs, bad_runs=bad_runs, note=note)


def _may_change(lo: float, hi: float, value: float, d: str, thr: float, floor: float) -> bool:
    """Past the threshold (and the noise floor) against the best or the worst earlier value:
    necessary for any split."""
    best, worst = (lo, hi) if d == "lower" else (hi, lo)
    return ((cpt.is_worse(best, value, d, thr) and abs(value - best) >= floor)
            or (cpt.is_better(worst, value, d, thr) and abs(value - worst) >= floor))


def _drifted(v: float, base: float, direction: str, limit: float) -> bool:
    return limit > 0 and ((v - base) if direction == "lower" else (base - v)) > limit


def _against(test, base: float, v: float, direction: str, threshold: float, floor: float = 0.0) -> bool:
    """An earlier run counts towards the streak only if it too was past the threshold *and* the
    timing floor: a history of noise must not confirm today's noise."""
    return abs(v - base) >= floor and test(base, v, direction, threshold)


def _streak(earlier: list[float], bad) -> int:
    """1 (this run) + how many of the latest earlier runs in a row were also bad."""
    n = 1
    for v in reversed(earlier):
        if not bad(v):
            break
        n += 1
    return n


def _missing_findings(out: Classification, current: Results, base: dict[str, Case],
                      prev: dict[str, tuple[str, str, str]], config: Config) -> None:
    present = current.groups_present()
    ref = {k: (c.suite, c.backend) for k, c in base.items()} if base else {
        k: (s, b) for k, (_o, s, b) in prev.items()}
    absent: dict[tuple[str, str], int] = {}
    for key, (suite, backend) in ref.items():
        if key in current.cases:
            continue
        # Partial input (a shard missing or cut off): an absent test may simply be in the part
        # that could not be read. It is "not run", never "vanished".
        if current.partial or (suite, backend) not in present:
            absent[(suite, backend)] = absent.get((suite, backend), 0) + 1
            continue
        dropped = config.collected is not None and key not in config.collected
        out.findings.append(Finding("dropped" if dropped else "vanished",
                                    "info" if dropped else "vanished", key, suite, backend,
                                    base.get(key)))
    for (suite, backend), n in sorted(absent.items()):
        why = "part of the input could not be read" if current.partial else "a shard may be missing"
        out.notes.append(f"{suite} on {backend}: no results in this run for {n} tests that the "
                         f"reference run had ({why}); they count as not run")
        out.findings.append(Finding("not_run", "info", f"{suite}/{backend}", suite, backend,
                                    note=f"{n} tests"))
