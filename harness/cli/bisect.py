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


def register(sub) -> None:
    p = sub.add_parser("bisect", help="the first bad commit of failing items (a run per step, only those items)",
                       description=__doc__.split("\n\n")[0],
                       epilog="e.g. harness bisect --good v1.2 --bad HEAD tiny::smoke[cpu-float32] -- --backend cpu")
    p.add_argument("items", nargs="*", help="SUITE::NAME items (default: those failing at --bad)")
    p.add_argument("--good", required=True, help="a commit where the items pass")
    p.add_argument("--bad", default="HEAD", help="a commit where they fail (default HEAD)")
    p.add_argument("--repo", type=Path, default=Path("."), help="the repository (default: the current directory's)")
    p.add_argument("--step-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="time limit of one step's harness run (default 3600)")
    p.add_argument("--json", type=Path, default=None, help="also write the bisection (every step's verdicts) here")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.run.bisect import BisectError, bisect

    bad_items = [i for i in args.items if "::" not in i or not all(i.split("::", 1))]
    if bad_items:
        print(f"harness bisect: items are SUITE::NAME (e.g. tiny::smoke[cpu-float32]), got {bad_items[0]!r}",
              file=sys.stderr)
        return 2
    try:
        res = bisect(args.repo, args.good, args.bad, args.items, list(getattr(args, "passthrough", []) or []),
                     timeout=args.step_timeout, say=lambda line: print(line, flush=True))
    except BisectError as e:
        print(f"harness bisect: {e}", file=sys.stderr)
        return 2
    print("\n" + res.message)
    if args.json:
        from harness.files import atomic

        atomic.write_json(args.json, {"first_bad": res.first_bad, "items": res.items, "message": res.message,
                                      "steps": [{"label": s.label, "commit": s.commit, "subject": s.subject,
                                                 "verdict": s.verdict, "items": s.verdicts, "messages": s.messages}
                                                for s in res.steps]}, indent=2)
    return 0 if res.first_bad else 1
