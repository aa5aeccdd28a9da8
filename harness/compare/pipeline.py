"""One comparison run, start to end: read, classify, record, plan, apply, summarise.

The CLI (:mod:`harness.cli.compare`) only turns arguments into :class:`Options`.

Order matters for correctness:

1. the history is opened (and locked: one comparison at a time) before anything reads it;
2. the open issues are listed *before* the run is recorded, because whether a group is clean
   depends on them: a group is clean only when every item its open issue lists ran in this run
   (a missing or truncated shard makes it *not known*, and not-known runs never count towards
   closing);
3. comments owed by earlier runs are posted before the plan is applied (:mod:`harness.compare.sinks`).

The same XML compared twice (a re-run of the compare job, or ``harness report`` after
``harness compare``) is one run, not two: it replaces the latest record when its digest matches.
"""

from __future__ import annotations

import gc
import os
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from harness.compare import body, mutes, prefetch, quarantine, sinks, triage
from harness.compare.classify import Classification, Config, Finding, classify
from harness.compare.history import History, HistoryDamaged, move_aside
from harness.compare.issues import (
    FILED_KINDS,
    GROUP_BY,
    LABEL,
    Action,
    IssueRef,
    build_groups,
    plan,
    read_state,
)
from harness.compare.junit import Results, digest, read_results
from harness.compare.scrub import scrub
from harness.compare.sinks import SinkError, execute


@dataclass
class Options:
    results: list[str]
    baseline: list[str] | None = None
    history: str | None = None
    sink: str = "stdout"  # a registered sink: github | file | stdout | a vendor's
    out_dir: str = "harness-issues"
    dry_run: bool = False
    repo: str | None = None
    api_url: str | None = None
    enterprise_url: str | None = None
    max_api_calls: int = 100
    run_key: str | None = None
    commit: str = ""
    baseline_commit: str = ""
    run_url: str = ""
    mute_file: str | None = None
    quarantine_file: str | None = None  # maintained here (harness.compare.quarantine); None: not used
    upstream: bool = False  # the canary: regressions against the pinned run are the next stack's (kind upstream)
    reenable_after: int = quarantine.REENABLE_AFTER
    close_after: int = 2
    filed_kinds: tuple[str, ...] = FILED_KINDS
    group_by: tuple[str, ...] = GROUP_BY
    expect_shards: int | None = None
    config: Config = field(default_factory=Config)


@dataclass
class Outcome:
    current: Results
    baseline: Results | None
    classification: Classification
    groups: dict
    status: dict[str, bool]
    actions: list[Action]
    log: list[dict]
    api_calls: int
    problems: list[str]
    muted: list
    context: body.RunContext
    timings: dict[str, float]
    run_key: str = ""  # this run's key in the history (an earlier key when the same XML came again)
    # Named mistakes in input that was read whole (a metric that is not a number): shown as
    # warnings, never a reason to call the report partial.
    warnings: list[str] = field(default_factory=list)
    quarantine: list[quarantine.Change] = field(default_factory=list)
    triage: list[triage.Triage] = field(default_factory=list)  # whose each failure is (new / main's / flaky)


def default_run_key() -> str:
    env = os.environ
    if env.get("GITHUB_RUN_ID"):
        return f"gha-{env['GITHUB_RUN_ID']}-{env.get('GITHUB_RUN_ATTEMPT', '1')}"
    return f"local-{time.time():.6f}"


def make_sink(opts: Options, out: TextIO):
    """The registered sink ``opts.sink`` names (harness.compare.sinks: github, file, stdout, a vendor's)."""
    return sinks.make(opts.sink, opts, out)


def _start_baseline(opts: Options, history: History | None):
    """Either the baseline as cached in the history the last time these very files were the
    baseline (a PR pipeline compares against the same main results many times), or a child
    process parsing it into that cache right now (:mod:`harness.compare.prefetch`), or nothing."""
    if not opts.baseline or history is None:
        return "", None, None
    key = digest(opts.baseline)
    cached = history.cached_baseline(key) if key else None
    child = prefetch.start(opts.baseline, history.path, key) if key and cached is None \
        and not opts.dry_run else None
    return key, cached, child


def _finish_baseline(opts: Options, history: History | None, key: str, cached, child) -> Results | None:
    if not opts.baseline:
        return None
    if cached is not None:
        return cached
    if prefetch.finish(child):
        history.refresh()  # the child added tests and a cached run behind this connection's back
        cached = history.cached_baseline(key)
        if cached is not None:
            return cached
    baseline = read_results(opts.baseline)
    # a baseline with warnings is not cached: the cache keeps numbers only, and the warning must
    # be shown every time those files are the baseline
    if key and not baseline.problems and not baseline.warnings and baseline.cases and not opts.dry_run:
        try:
            history.record(f"baseline-{key[:16]}", baseline, {}, kind="baseline", inputs=key, keep=2)
        except sqlite3.Error:
            pass  # only a cache: the next run parses the XML again
    return baseline


def run_compare(opts: Options, sink=None, out: TextIO | None = None) -> Outcome:
    # Hundreds of thousands of small acyclic objects (cases, findings): the cyclic collector only
    # rescans them over and over, so it is paused for the run (reference counting still frees).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(opts, sink, out or sys.stdout)
    finally:
        if was_enabled:
            gc.enable()


def _coverage(status: dict[str, bool | None], existing: list[IssueRef], current: Results) -> None:
    """An open issue's group is clean only if every item it lists ran this run (outcome other than
    skipped); otherwise its status becomes None, *not known*."""
    ran = {k for k, c in current.cases.items() if c.outcome != "skipped"}
    for issue in existing:
        fp = issue.fingerprint
        if not fp or status.get(fp) is not False:
            continue
        state = read_state(issue.body)
        # "run:FILE" items stand for a cut-off run (infrastructure), not a test that has to run again
        items = [i.split("|", 1)[0] for i in state.get("items", []) if not i.startswith("run:")]
        truncated = state.get("n", len(items)) > len(items)
        if any(i not in ran for i in items) or (truncated and current.partial):
            status[fp] = None


def _run(opts: Options, sink, out: TextIO) -> Outcome:
    t = {"start": time.perf_counter()}
    problems: list[str] = []
    history = _open_history(opts, problems)
    try:
        return _compare(opts, sink, out, t, problems, history)
    finally:
        if history is not None:
            history.close()  # and the lock with it


def _open_history(opts: Options, problems: list[str]) -> History | None:
    if not opts.history:
        return None
    try:
        try:
            return History(opts.history)
        except HistoryDamaged as e:
            # kept, it would leave every later run without a history (and CI would cache it again):
            # moved aside for a person to look at, and a new history starts in its place
            aside = move_aside(opts.history)
            history = History(opts.history)
            history.note = f"{e}: moved aside to {aside}; a new history starts with this run"
            return history
    except (sqlite3.Error, ValueError, OSError) as e:
        problems.append(f"history {opts.history} unusable, compared without it: {e}")
        return None


def _compare(opts: Options, sink, out: TextIO, t: dict, problems: list[str],
             history: History | None) -> Outcome:
    current, baseline = _read(opts, history, problems)
    t["read"] = time.perf_counter()
    run_key, inputs = _run_identity(opts, history)
    cls = classify(current, baseline, history, opts.config, run_key)
    qchanges, held_before = _quarantine(opts, current, cls, problems, history, run_key)
    if opts.upstream:
        _upstream(cls, current, baseline)
    warnings = current.warnings + [f"baseline: {w}" for w in (baseline.warnings if baseline else [])] \
        + cls.warnings + ([history.note] if getattr(history, "note", "") else [])
    active, mute_notes = mutes.load(opts.mute_file)
    kept, muted = mutes.apply(cls.findings, active)
    problems += cls.notes + mute_notes
    groups, status = build_groups(Classification(kept, cls.notes), current, opts.filed_kinds,
                                  opts.group_by)
    ctx = body.RunContext.from_env(opts.commit, opts.baseline_commit, opts.run_url)
    t["classify"] = time.perf_counter()
    sink, existing, usable = _open_sink(opts, sink, out, problems)
    _coverage(status, existing, current)
    record = _record_run(opts, history, current, status, ctx, run_key, inputs, problems)
    t["history"] = time.perf_counter()
    actions: list[Action] = []
    log: list[dict] = []
    if usable:
        actions, log = _act_on_issues(opts, history, sink, out, existing, groups, status, ctx, record, run_key)
    t["issues"] = time.perf_counter()
    timings = {k: t[k] - t["start"] for k in t if k != "start"}
    whose = triage.triage(kept, history.issues() if history is not None else {}, opts.group_by, held_before)
    return Outcome(current, baseline, cls, groups, status, actions, log,
                   getattr(sink, "calls", 0) if sink is not None else 0,
                   [scrub(p) for p in problems], muted, ctx, timings, run_key, [scrub(w) for w in warnings],
                   qchanges, whose)


_DEMOTED = ("new_failure", "still_failing", "flaky", "quarantined")
_UPSTREAM = ("failure", "error", "precision", "performance", "vanished")


def stack_change(current: Results, baseline: Results | None) -> str:
    """'torch 2.13.0 -> 2.14.0.dev20261203, transformers 5.24.0 -> 5.25.0.dev0': the packages whose
    versions differ between the baseline (the pinned run) and this run."""
    old = {p: sorted(v) for p, v in (baseline.stack if baseline is not None else {}).items()}
    parts = [f"{p} {'/'.join(old.get(p, ['?']))} -> {'/'.join(sorted(v))}"
             for p, v in sorted(current.stack.items()) if old.get(p) != sorted(v)]
    return ", ".join(parts) or "no package version differs from the pinned run"


def _upstream(cls: Classification, current: Results, baseline: Results | None) -> None:
    """The upstream canary (docs/ci.md): this run is the next stack, the baseline the pinned one. A
    regression of an item that passes on the pinned stack is the next stack's: kind ``upstream``,
    naming the versions that changed. One that fails on the pinned stack too is not upstream's (the
    pinned run's own comparison files it): reported, never filed here. One the pinned run lacks keeps
    its plain kind, as without --upstream."""
    change = stack_change(current, baseline)
    pinned = baseline.cases if baseline is not None else {}
    for f in cls.findings:
        if not (f.regression and f.kind in _UPSTREAM) or f.key not in pinned:
            continue
        if pinned[f.key].outcome == "passed":
            f.kind, f.stack = "upstream", change
        else:
            said = f.note or (f.case.message.strip().splitlines() or [""])[0][:200] if f.case is not None else f.note
            f.kind = "info"
            f.note = "; ".join(x for x in (said, f"{pinned[f.key].outcome} on the pinned stack too: "
                                           "not upstream's, filed by the pinned run's comparison") if x)


def _prior(history: History | None, current: Results, q: quarantine.Quarantine, window: int,
           run_key: str) -> dict[str, tuple[int, int]]:
    """``(runs, flakes)`` of each item flaky now and not yet quarantined, from the history's last runs:
    the record its flake rate is estimated from once it is quarantined."""
    keys = [k for k, c in current.cases.items() if k not in q.items and (c.flaky or c.details.get("confirm") == "flaky")]
    if history is None or not keys:
        return {}
    return history.item_record(keys, [r.id for r in history.runs(window, exclude_key=run_key)])


def _quarantine(opts: Options, current: Results, cls: Classification, problems: list[str],
                history: History | None = None, run_key: str = "") -> tuple[list, set]:
    """This run applied to the quarantine file (saved unless a dry run); the findings of every item
    quarantined before or by this run become one ``quarantined`` finding each (kind flaky): they file
    no failure, and they keep their suite x backend's flaky issue open until re-enabled. Returns the
    changes and the items that were quarantined before this run."""
    if not opts.quarantine_file:
        return [], set()
    try:
        q = quarantine.load(opts.quarantine_file)
    except quarantine.QuarantineError as e:
        problems.append(f"{e}; the quarantine was neither applied nor updated")
        return [], set()
    before = set(q.items)
    # as many earlier runs as the history keeps (60): a rare flake's rate needs a long record
    prior = _prior(history, current, q, max(opts.config.history_window, 60), run_key)
    changes = quarantine.update(q, current, opts.reenable_after, prior=prior)
    held = set(q.items)  # re-enabled ones left it (they ran clean); newly quarantined ones are in
    notes = {k: f"{e.reason}; clean runs {e.clean} of {quarantine.needed(e, opts.reenable_after)}"
             for k, e in q.items.items()}
    kept = [f for f in cls.findings if not (f.key in held and f.category in _DEMOTED)]
    for key in sorted(held):
        case = current.cases.get(key)
        if case is None or case.outcome == "skipped":
            continue
        kept.append(Finding("quarantined", "flaky", key, case.suite, case.backend, case, note=notes[key]))
    cls.findings[:] = kept
    if changes and not opts.dry_run:
        try:
            quarantine.save(opts.quarantine_file, q)
        except OSError as e:
            problems.append(f"could not write the quarantine file {opts.quarantine_file}: {e}")
    return changes, before


def _read(opts: Options, history: History | None, problems: list[str]) -> tuple[Results, Results | None]:
    """(current, baseline) results; their problems go to ``problems`` (the current run's first)."""
    key, cached, child = _start_baseline(opts, history)
    try:
        current = read_results(opts.results, opts.expect_shards)  # meanwhile the child parses the baseline
    except BaseException:
        prefetch.stop(child)
        raise
    problems[:0] = current.problems
    baseline = _finish_baseline(opts, history, key, cached, child)
    problems += [f"baseline: {p}" for p in (baseline.problems if baseline else [])]
    return current, baseline


def _run_identity(opts: Options, history: History | None) -> tuple[str, str]:
    """(run key, digest of the results' files): the same files compared again are the same run."""
    run_key = opts.run_key or default_run_key()
    inputs = digest(opts.results) if history is not None else ""
    latest = history.latest() if history is not None else None
    if latest and inputs and latest[1] == inputs:
        run_key = latest[0]  # these very files were compared before: the same run, not a new one
    return run_key, inputs


def _open_sink(opts: Options, sink, out: TextIO, problems: list[str]) -> tuple[object, list[IssueRef], bool]:
    """(sink, its open harness issues, whether it answered): no sink means no issues, never no report."""
    try:
        sink = sink if sink is not None else make_sink(opts, out)
        return sink, sink.list_issues(LABEL, "open"), True
    except (SinkError, OSError) as e:
        problems.append(f"issue sink unavailable, no issue actions this run: {type(e).__name__}: {e}")
        return sink, [], False


def _record_run(opts: Options, history: History | None, current: Results, status: dict, ctx: body.RunContext,
                run_key: str, inputs: str, problems: list[str]) -> bool:
    """Record this run in the history (not on a dry run, nor an empty one); whether it was recorded."""
    record = history is not None and not opts.dry_run and bool(current.cases)
    if record:
        try:
            history.record(run_key, current, status, scrub(ctx.commit), scrub(ctx.run_url),
                           scrub(ctx.machine), inputs=inputs)
        except sqlite3.Error as e:  # a full disk must not cost the report
            problems.append(f"could not record this run in the history: {e}")
            record = False
    return record


def _act_on_issues(opts: Options, history: History | None, sink, out: TextIO, existing: list[IssueRef],
                   groups: dict, status: dict, ctx: body.RunContext, record: bool,
                   run_key: str) -> tuple[list[Action], list[dict]]:
    """(actions, log): the issue plan against the open issues and what the history remembers, applied."""
    known = history.issues() if history else {}
    open_fps = {i.fingerprint for i in existing if i.fingerprint}
    if record:
        for i in existing:
            if i.fingerprint:
                history.set_issue(i.fingerprint, i.number, "open")
    # "detached": a person removed the harness label; it is neither fetched nor patched again
    # (an open issue with the label back is listed, and so managed again). A closed issue
    # labelled harness:muted is looked at when its group is bad (unmuting it hands it back).
    leave_alone = frozenset(fp for fp, (_n, s) in known.items()
                            if s == "detached" and fp not in open_fps)
    known_closed = {fp: n for fp, (n, s) in known.items()
                    if fp not in open_fps and s in ("open", "closed", "muted")}
    streaks = {}
    for fp in open_fps:  # only an open issue can be closed
        if status.get(fp) is False and history is not None:
            # the current run is in the table unless it was not recorded (dry run)
            streaks[fp] = history.clean_streak(fp) + (0 if record else 1)
    actions = plan(groups, status, existing,
                   lambda g, reopened: body.full(g, ctx, reopened),
                   ctx.run_line(), known_closed, streaks, opts.close_after, run_key, leave_alone)
    keep_numbers = record and getattr(sink, "persistent", True)
    on_issue = (lambda fp, n, s: history.set_issue(fp, n, s)) if keep_numbers else None
    log = execute(actions, sink, opts.dry_run, out, on_issue, history if keep_numbers else None)
    return actions, log
