"""``harness report RESULTS``: a static HTML page with the tables and the plots.

Reads the same inputs as ``harness compare`` (one run's results folder or many JUnit files, and the
history, read-only) and writes one self-contained HTML file: the suite x check x backend x dtype
matrix, every failure with its message and the module it names, the precision / training / decode
budget use as plots, the findings against the baseline, perf items against their baseline and
history, and each item's captured library warnings.
"""

from __future__ import annotations

import argparse
import io
import os
import sqlite3
import sys

from harness.cli.compare import add_common, check_headlines, config_from


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="write a static HTML report with tables and plots",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.add_argument("-o", "--output", default="harness-report.html")
    p.add_argument("--title", default="harness report")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from harness.compare.history import History
    from harness.compare.pipeline import Options, run_compare
    from harness.compare.report import html_report

    history = args.history if args.history and os.path.exists(args.history) else None
    # dry_run: read the history, never write it; the stdout sink with no issues prints nothing.
    opts = Options(results=args.results, baseline=args.baseline, history=history, dry_run=True,
                   config=config_from(args))
    outcome = run_compare(opts, sink=_NoIssues(), out=io.StringIO())
    series = None
    if history:
        try:
            h = History(history)
            # the runs before this one: if `harness compare` already recorded these very files,
            # that record is this run and must not be drawn twice
            runs = h.runs(opts.config.history_window, exclude_key=outcome.run_key)
            series = h.metric_series([r.id for r in runs])
            h.close()
        except (sqlite3.Error, ValueError):
            pass  # run_compare already listed the history among the problems

    from harness.files import atomic

    atomic.write_text(args.output, html_report(outcome, series, args.title, headlines=check_headlines()))
    for p in outcome.problems:
        print(f"harness report: {p}", file=sys.stderr)
    print(f"harness report: wrote {args.output} ({len(outcome.current.cases)} test cases)")
    return 0 if outcome.current.cases else 2


class _NoIssues:
    calls = 0

    def list_issues(self, label, state="open"):
        return []
