"""One comparison run, start to end: read, classify, record, plan, apply, summarise.

The CLI (:mod:`harness.cli.compare`) only turns arguments into :class:`Options`; tests and the
benchmark call :func:`run_compare` directly.
"""

from __future__ import annotations

import gc
import os
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from harness.compare import body, mutes, prefetch
from harness.compare.classify import Classification, Config, classify
from harness.compare.history import History
from harness.compare.issues import FILED_KINDS, GROUP_BY, LABEL, Action, build_groups, plan
from harness.compare.junit import Results, digest, read_results
from harness.compare.sinks import FileSink, StdoutSink, execute


@dataclass
class Options:
    results: list[str]
    baseline: list[str] | None = None
    history: str | None = None
    sink: str = "stdout"  # github | file | stdout
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


def default_run_key() -> str:
    env = os.environ
    if env.get("GITHUB_RUN_ID"):
        return f"gha-{env['GITHUB_RUN_ID']}-{env.get('GITHUB_RUN_ATTEMPT', '1')}"
    return f"local-{time.time():.6f}"


def make_sink(opts: Options, out: TextIO):
    if opts.sink == "github":
        from harness.github_client import GitHubClient  # the only networked module
        return GitHubClient.from_env(opts.repo, api_url=opts.api_url or None,
                                     enterprise_url=opts.enterprise_url, max_calls=opts.max_api_calls)
    if opts.sink == "file":
        return FileSink(opts.out_dir)
    return StdoutSink(out)


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
    if key and not baseline.problems and baseline.cases and not opts.dry_run:
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


def _run(opts: Options, sink, out: TextIO) -> Outcome:
    t = {"start": time.perf_counter()}
    problems: list[str] = []
    history = None
    if opts.history:
        try:
            history = History(opts.history)
        except (sqlite3.Error, ValueError) as e:
            problems.append(f"history {opts.history} unusable, compared without it: {e}")
    key, cached, child = _start_baseline(opts, history)
    current = read_results(opts.results, opts.expect_shards)  # meanwhile the child parses the baseline
    problems = current.problems + problems
    baseline = _finish_baseline(opts, history, key, cached, child)
    problems += [f"baseline: {p}" for p in (baseline.problems if baseline else [])]
    t["read"] = time.perf_counter()
    run_key = opts.run_key or default_run_key()
    cls = classify(current, baseline, history, opts.config, run_key)
    active, mute_notes = mutes.load(opts.mute_file)
    kept, muted = mutes.apply(cls.findings, active)
    problems += cls.notes + mute_notes
    groups, status = build_groups(Classification(kept, cls.notes), current, opts.filed_kinds,
                                  opts.group_by)
    ctx = body.RunContext.from_env(opts.commit, opts.baseline_commit, opts.run_url)
    t["classify"] = time.perf_counter()
    record = history is not None and not opts.dry_run and bool(current.cases)
    if record:
        try:
            history.record(run_key, current, status, ctx.commit, ctx.run_url, ctx.machine)
        except sqlite3.Error as e:  # a full disk must not cost the report
            problems.append(f"could not record this run in the history: {e}")
            record = False
    t["history"] = time.perf_counter()
    actions: list[Action] = []
    log: list[dict] = []
    usable = False
    try:
        sink = sink if sink is not None else make_sink(opts, out)
        existing = sink.list_issues(LABEL, "open")
        usable = True
    except Exception as e:  # noqa: BLE001 - no sink means no issues, never no report
        problems.append(f"issue sink unavailable, no issue actions this run: {type(e).__name__}: {e}")
        existing = []
    if usable:
        known = history.issues() if history else {}
        open_fps = {i.fingerprint for i in existing if i.fingerprint}
        if record:
            for i in existing:
                if i.fingerprint:
                    history.set_issue(i.fingerprint, i.number, "open")
        known_closed = {fp: n for fp, (n, _s) in known.items() if fp not in open_fps}
        streaks = {}
        for fp in open_fps:  # only an open issue can be closed
            if status.get(fp) is False and history is not None:
                # the current run is in the table unless it was not recorded (dry run)
                streaks[fp] = history.clean_streak(fp) + (0 if record else 1)
        actions = plan(groups, status, existing, lambda g, reopened: body.render(g, ctx, reopened),
                       ctx.run_line(), known_closed, streaks, opts.close_after)
        keep_numbers = record and getattr(sink, "persistent", True)
        on_issue = (lambda fp, n, s: history.set_issue(fp, n, s)) if keep_numbers else None
        log = execute(actions, sink, opts.dry_run, out, on_issue)
    t["issues"] = time.perf_counter()
    if history is not None:
        history.close()
    timings = {k: t[k] - t["start"] for k in t if k != "start"}
    return Outcome(current, baseline, cls, groups, status, actions, log,
                   getattr(sink, "calls", 0) if sink is not None else 0, problems, muted, ctx, timings)
