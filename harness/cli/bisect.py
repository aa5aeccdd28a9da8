"""`harness bisect --good REF --bad REF [ITEM ...] [-- RUN ARGS]`: the first commit at which items
went bad, in the repository harness runs in (harness.run.bisect).

ITEMs are ``SUITE::NAME`` as the summary and the issues show them (``tiny::smoke[cpu-float32]``);
without any, the items that fail at the bad commit. Arguments after ``--`` go to every ``harness
run`` (``--backend``, ``--dtype``, ``--scope``, ``--timeout`` ...). Exit status: 0 with a first bad
commit, 1 when the bad commit does not fail (nothing to bisect), 2 on bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.numbers import DAY_S, amount


def register(sub) -> None:
    p = sub.add_parser("bisect", help="the first bad commit of failing items (a run per step, only those items)",
                       description=__doc__.split("\n\n")[0],
                       epilog="e.g. harness bisect --good v1.2 --bad HEAD tiny::smoke[cpu-float32] -- --backend cpu")
    p.add_argument("items", nargs="*", help="SUITE::NAME items (default: those failing at --bad)")
    p.add_argument("--good", required=True, help="a commit where the items pass (--between-packages: NAME==VERSION)")
    p.add_argument("--bad", default="HEAD", help="a commit where they fail (default HEAD; --between-packages: "
                   "NAME==VERSION)")
    p.add_argument("--between-packages", action="store_true",
                   help="bisect the versions of one package the index has between --good and --bad (two nightly "
                        "wheels of a vendor's torch) instead of commits: each step installs one version over the "
                        "current environment, for its harness run only")
    p.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                   help="an argument for pip (repeatable): --pip-arg=--index-url=URL, --pip-arg=--find-links=DIR")
    p.add_argument("--repo", type=Path, default=Path("."), help="the repository (default: the current directory's)")
    p.add_argument("--step-timeout", type=amount(0, 7 * DAY_S, low_open=True), default=3600.0, metavar="SECONDS",
                   help="time limit of one step's harness run (default 3600)")
    p.add_argument("--json", type=Path, default=None, help="also write the bisection (every step's verdicts) here")
    p.add_argument("--items", dest="items_str", default="", metavar="'ITEM ...'",
                   help="the items as one space-separated string (a workflow input), added to ITEM arguments")
    p.add_argument("--comment-issue", default="", metavar="N",
                   help="post the answer as a comment on issue N (GITHUB_TOKEN, GITHUB_REPOSITORY; '' for none): "
                        "the bisect workflow's way of answering the issue that asked")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.run.bisect import BisectError, bisect

    args.items = [*args.items, *args.items_str.split()] if getattr(args, "items_str", "") else args.items
    bad_items = [i for i in args.items if "::" not in i or not all(i.split("::", 1))]
    if bad_items:
        print(f"harness bisect: items are SUITE::NAME (e.g. tiny::smoke[cpu-float32]), got {bad_items[0]!r}",
              file=sys.stderr)
        return 2
    run_args = list(getattr(args, "passthrough", []) or [])
    # SIGTERM (CI cancelling the job) unwinds like Ctrl-C: each step's `finally` removes its worktree and
    # its run's process group is killed; then one line, no traceback
    import signal

    def _stop(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = signal.signal(signal.SIGTERM, _stop)
    try:
        if args.between_packages:
            from harness.run.bisect import bisect_packages

            res = bisect_packages(args.good, "" if args.bad == "HEAD" else args.bad, args.items, run_args,
                                  pip_args=args.pip_arg, timeout=args.step_timeout,
                                  say=lambda line: print(line, flush=True))
        else:
            res = bisect(args.repo, args.good, args.bad, args.items, run_args,
                         timeout=args.step_timeout, say=lambda line: print(line, flush=True))
    except BisectError as e:
        print(f"harness bisect: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"harness bisect: stopped ({e or 'SIGINT'}); the step's run was killed and its worktree removed",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    print("\n" + res.message)
    if args.json:
        from harness.files import atomic

        atomic.write_json(args.json, {"first_bad": res.first_bad, "items": res.items, "message": res.message,
                                      "steps": [{"label": s.label, "commit": s.commit, "subject": s.subject,
                                                 "verdict": s.verdict, "items": s.verdicts, "messages": s.messages}
                                                for s in res.steps]}, indent=2)
    if args.comment_issue:
        post_answer(args.comment_issue, res, args)
    return 0 if res.first_bad else 1


def post_answer(issue: str, res, args) -> bool:
    """The answer and every step as one comment on the issue; a failure to post is one line (the
    answer is printed and in --json all the same)."""
    from harness.compare.errors import SinkError
    from harness.compare.github_client import GitHubClient
    from harness.compare.scrub import code_fence, scrub

    if not issue.isdigit():
        print(f"harness bisect: --comment-issue {issue!r}: not an issue number", file=sys.stderr)
        return False
    report = scrub(res.report())
    fence = code_fence(report)
    body = (f"**harness bisect** {scrub(args.good)} .. {scrub(args.bad)}: {scrub(res.message)}\n\n"
            f"{fence}\n{report}\n{fence}\n")
    try:
        GitHubClient.from_env().comment(int(issue), body)
    except SinkError as e:
        print(f"harness bisect: could not comment on issue #{issue}: {e}", file=sys.stderr)
        return False
    print(f"harness bisect: the answer is on issue #{issue}")
    return True
