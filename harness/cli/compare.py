"""``harness compare RESULTS...``: classify the shards' JUnit XML, file/update/close issues.

Exit status: 0 when the comparison ran (even with regressions: the issues are the signal),
1 with ``--fail-on-regression`` when a confirmed regression was found, 2 when no test case could
be read at all.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from harness.compare.issues import FILED_KINDS, GROUP_BY
from harness.numbers import DAY_S, amount, count, pull_request

if TYPE_CHECKING:
    from harness.compare.classify import Config

DEFAULT_HISTORY = "harness-history.sqlite"
DEFAULT_MUTES = "harness-mutes.toml"


def add_common(p: argparse.ArgumentParser) -> None:
    """Options shared with ``harness report``."""
    p.add_argument("results", nargs="+", metavar="RESULTS",
                   help="JUnit XML files, folders of them, or globs (one per shard)")
    p.add_argument("--baseline", action="append", metavar="B",
                   help="JUnit XML of the baseline run (file, folder or glob; repeatable)")
    p.add_argument("--history", default=DEFAULT_HISTORY, metavar="DB",
                   help=f"SQLite history of earlier runs (default {DEFAULT_HISTORY}; '' for none)")
    p.add_argument("--threshold", type=amount(0, 1e6), default=0.10,
                   help="relative change that counts as a metric regression (default 0.10)")
    p.add_argument("--metric-threshold", action="append", default=[], metavar="[SUITE:]METRIC=REL",
                   help="a suite's or metric's own threshold, e.g. kimi-k2:wall_time_s=0.25")
    p.add_argument("--drift-fraction", type=amount(0, 1), default=0.5,
                   help="precision drift: share of the baseline's headroom to the tolerance used up")
    p.add_argument("--time-floor", type=amount(0, DAY_S), default=0.05, metavar="SECONDS",
                   help="changes of timing metrics smaller than this are noise, never findings (default 0.05)")
    p.add_argument("--min-bad-runs", type=count(1, 1000), default=2,
                   help="consecutive bad runs before a metric regression is confirmed (default 2)")
    p.add_argument("--collected", metavar="FILE",
                   help="test ids the suites define now (pytest --collect-only -q); a vanished "
                        "test missing from it was dropped on purpose")
    p.add_argument("--expect-shards", type=count(1, 100000), help="number of shard files expected")


def junit_key(nodeid: str) -> str:
    """pytest node id (``<folder>/<file>::<check>[<params>]``, harness/run/plugin.py) -> the
    ``classname::name`` key pytest's junitxml writes for it.

    pytest decides that key, so its own function makes it (``mangle_test_address``: only the path
    before the first ``::`` becomes dotted; the ``[...]`` params stay one opaque name even when a
    variant holds ``::`` or ``/``, e.g. an op ``aten::mm`` or a named parallel layout)."""
    from _pytest.junitxml import mangle_test_address  # pytest's junitxml; pytest is a dependency

    names = mangle_test_address(nodeid.strip())
    return ".".join(names[:-1]) + "::" + names[-1]


def junit_keys(nodeid: str) -> set[str]:
    """:func:`junit_key`, and the key harness's own results writer gave the same item before it used
    pytest's mangling too (it split at every ``::``), so ``--collected`` still matches JUnit XML
    written by older runs. They differ only for params holding ``::``."""
    legacy = nodeid.strip().split("::")
    legacy[0] = legacy[0].replace("/", ".").removesuffix(".py")
    return {junit_key(nodeid), ".".join(legacy[:-1]) + "::" + legacy[-1]}


def suite_thresholds() -> dict[str, float]:
    """``suite:metric`` -> threshold from each suite file's ``thresholds`` table (suites are local
    data; a suite that does not load is skipped here - `harness validate` reports it)."""
    from harness.settings import load_settings
    from harness.suite.loader import SuiteError, discover, load_suite

    out = {}
    for path in discover(load_settings().suites_dir):
        try:
            ls = load_suite(path)
        except SuiteError:
            continue
        out.update({f"{ls.name}:{m}": v for m, v in ls.suite.thresholds.items()})
    return out


def config_from(args: argparse.Namespace) -> Config:
    from harness.compare.classify import Config

    thresholds = suite_thresholds()  # the command line wins over the suites
    for item in args.metric_threshold:
        key, _, value = item.partition("=")
        thresholds[key.strip()] = float(value)
    collected = None
    if args.collected:
        with open(args.collected, encoding="utf-8") as f:
            collected = {k for line in f if "::" in line for k in junit_keys(line)}
    return Config(threshold=args.threshold, thresholds=thresholds, drift_fraction=args.drift_fraction,
                  min_bad_runs=args.min_bad_runs, collected=collected, time_floor_s=args.time_floor)


def register(subparsers) -> None:
    p = subparsers.add_parser("compare", help="compare results with baseline and history; file issues",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.add_argument("--sink", default="stdout", metavar="NAME",
                   help="where issue actions go: a registered sink (github, file, stdout, or one a package "
                   "adds through the harness.sinks entry point); default stdout")
    p.add_argument("--out-dir", default="harness-issues", help="folder of the file sink")
    p.add_argument("--dry-run", action="store_true", help="print the planned issue actions only")
    p.add_argument("--repo", help="OWNER/NAME (default: $GITHUB_REPOSITORY)")
    p.add_argument("--api-url", help="REST API root (default: from --github-url, else $GITHUB_API_URL, "
                                     "else api.github.com)")
    p.add_argument("--github-url", help="GitHub Enterprise base URL, e.g. https://ghe.example.com")
    p.add_argument("--max-api-calls", type=count(1, 1000000), default=100)
    p.add_argument("--run-id", help="key of this run in the history (default from GitHub Actions)")
    p.add_argument("--commit", default="", help="commit under test (default: $GITHUB_SHA)")
    p.add_argument("--baseline-commit", default="")
    p.add_argument("--run-url", default="", help="default: built from GitHub Actions' environment")
    p.add_argument("--mute-file", default=DEFAULT_MUTES, help=f"default {DEFAULT_MUTES} if present")
    p.add_argument("--close-after", type=count(1, 1000), default=2, help="clean runs before an issue closes")
    p.add_argument("--quarantine", metavar="FILE", default=None,
                   help="maintain this quarantine file: flaky items go in, and come out after enough clean runs "
                        "in a row to bound their flake rate, at least --reenable-after (harness run reads the same "
                        "file; docs/comparator.md)")
    p.add_argument("--reenable-after", type=count(1, 1000), default=3, metavar="K",
                   help="the fewest clean runs in a row before a quarantined item counts again (default 3; "
                        "more when its flake record asks)")
    p.add_argument("--file-kinds", default=",".join(FILED_KINDS),
                   help="kinds that open issues (also: flaky, improvement)")
    p.add_argument("--group-by", default=",".join(GROUP_BY),
                   help="fields that make one issue (suite, backend, kind, dtype, check, device)")
    p.add_argument("--summary", help="also write the markdown summary here "
                                     "(it always goes to $GITHUB_STEP_SUMMARY when set)")
    p.add_argument("--upstream", action="store_true",
                   help="the upstream canary: RESULTS ran the next stack (pre-release torch / transformers), "
                        "--baseline the pinned one; regressions are filed as kind 'upstream' naming the "
                        "package versions that changed")
    p.add_argument("--pr-comment", default=None, type=pull_request, metavar="N|auto",
                   help="keep one comment on pull request N ('auto': the one this GitHub Actions run is for) "
                        "saying whose each failure is: new in the change, already failing on main, flaky, "
                        "the runner's (needs GITHUB_TOKEN with pull-requests: write; without, one line and "
                        "the job summary only)")
    p.add_argument("--fail-on-regression", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from harness.compare.sinks import registry as sink_registry

    if args.reenable_after < 1:
        print(f"harness compare: --reenable-after: {args.reenable_after} is not a number of runs (1 or more)",
              file=sys.stderr)
        return 2
    if args.sink not in sink_registry():
        print(f"harness compare: --sink: unknown issue sink {args.sink!r} "
              f"(registered: {', '.join(sink_registry().names())})", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.markdown import Markdown

    from harness.compare.pipeline import Options, run_compare
    from harness.compare.report import summary_markdown, write_step_summary

    opts = Options(
        results=args.results, baseline=args.baseline, history=args.history or None, sink=args.sink,
        out_dir=args.out_dir, dry_run=args.dry_run, repo=args.repo, api_url=args.api_url,
        enterprise_url=args.github_url, max_api_calls=args.max_api_calls, run_key=args.run_id,
        commit=args.commit, baseline_commit=args.baseline_commit, run_url=args.run_url,
        mute_file=args.mute_file, close_after=args.close_after, quarantine_file=args.quarantine,
        reenable_after=args.reenable_after, upstream=args.upstream,
        filed_kinds=tuple(k for k in args.file_kinds.split(",") if k),
        group_by=tuple(k for k in args.group_by.split(",") if k),
        expect_shards=args.expect_shards, config=config_from(args))
    outcome = run_compare(opts)
    text = summary_markdown(outcome, check_headlines())
    for p in outcome.problems:
        print(f"harness compare: {p}", file=sys.stderr)
    for w in outcome.warnings:
        print(f"harness compare: warning: {w}", file=sys.stderr)
    # rich renders the summary's tables for the terminal (plain text in CI logs)
    Console(width=None if sys.stdout.isatty() else 160).print(Markdown(text))
    if args.summary:
        from harness.files import atomic

        atomic.write_text(args.summary, text)
    from harness.compare.body import RunContext

    write_step_summary(text, RunContext.from_env(run_url=args.run_url or "").run_url)
    if args.pr_comment:
        _pr_comment(args, outcome)
    if not outcome.current.cases:
        print("harness compare: no test case could be read", file=sys.stderr)
        return 2
    if args.fail_on_regression and any(f.regression and f.confirmed for f in
                                       outcome.classification.findings):
        return 1
    return 0


def check_headlines() -> dict[str, tuple[str, ...]]:
    """Check name -> the metrics its ``headline`` names (what ``harness run``'s table shows), for the
    reports' matrix: the comparator's layer cannot import the checks. A registry that cannot load
    (a vendor's broken entry point) costs the headlines only: the reports fall back to budget use."""
    try:
        from harness import checks

        reg = checks.registry()
        return {n: tuple(reg.get(n).headline) for n in reg.names()}
    except Exception:
        return {}


def _pr_comment(args, outcome) -> None:
    """The pull request's one triage comment, created or edited; a token that cannot (a fork's
    read-only one) or no pull request costs one line, never the comparison."""
    from harness.compare import triage
    from harness.compare.errors import SinkError
    from harness.compare.github_client import GitHubClient

    number = triage.pull_request_number() if args.pr_comment == "auto" else \
        (int(args.pr_comment) if args.pr_comment.isdigit() else None)
    if number is None:
        print(f"harness compare: --pr-comment {args.pr_comment}: no pull request "
              + ("in this run's event" if args.pr_comment == "auto" else "number"), file=sys.stderr)
        return
    body = triage.comment_body(outcome.triage, outcome.context.run_line())
    try:
        client = GitHubClient.from_env(args.repo, api_url=args.api_url, enterprise_url=args.github_url,
                                       max_calls=args.max_api_calls)
        done = client.upsert_comment(number, triage.MARKER, body)
    except SinkError as e:
        print(f"harness compare: could not comment on pull request #{number}: {e}", file=sys.stderr)
        return
    print(f"harness compare: pull request #{number}: triage comment {done}")
