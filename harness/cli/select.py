"""`harness select --base REF`: the suites and checks a change can affect (harness/run/select.py).

Prints one line per selected suite or check with why, or ``every item: ...``, or ``nothing:
...``; ``--format args`` prints the ``harness run`` arguments instead (an empty line: every item;
``none``: nothing to run), ``--json FILE`` writes everything. Exit 0, or 2 when the diff cannot be
computed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.numbers import count


def register(sub) -> None:
    p = sub.add_parser("select", help="the suites and checks a change (BASE...HEAD) can affect",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the pull request's base (a ref or commit: origin/main)")
    p.add_argument("--head", default="HEAD", help="the change's tip (default HEAD)")
    p.add_argument("--format", choices=("text", "args"), default="text")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the selection as JSON "
                   "(harness run --selection FILE runs it)")
    p.add_argument("--sample", type=count(0, 10**6), default=0, metavar="K",
                   help="add K suites the change did not select, rotating with --seed (default 0)")
    p.add_argument("--seed", default=None, help="the rotation's seed (default: the pull request number in "
                   "GitHub Actions, else the head commit)")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.files import atomic
    from harness.inspect.trace import suite_op_names
    from harness.run.select import SelectError, changed_paths, git, select
    from harness.settings import load_settings

    settings = load_settings()
    try:
        changed = changed_paths(args.base, args.head)
        root = Path(git("rev-parse", "--show-toplevel"))
    except SelectError as e:
        print(f"harness select: {e}", file=sys.stderr)
        return 2
    suites, broken = _load_suites(settings.suites_dir)

    def ops(ls) -> set[str]:
        names = suite_op_names(ls, list(ls.suite.dtypes), realistic=ls.suite.checks.ops.realistic)
        return {op for v in names.values() for op in v}

    sel = select(changed, settings, root, suites, ops)
    if args.sample:
        if args.sample < 0:
            print("harness select: --sample: a number of suites (0 or more)", file=sys.stderr)
            return 2
        from harness.compare.triage import pull_request_number

        seed = args.seed or str(pull_request_number() or git("rev-parse", args.head))
        sel.add_sample([ls.name for ls in suites], args.sample, seed)
    for b in broken:  # a suite that does not load is run (its load item reports the problem)
        name = Path(b.split(":", 1)[0]).stem
        sel.suites.setdefault(name, []).append("it does not load here: its run says why")
    if args.json:
        atomic.write_text(args.json, json.dumps(sel.to_json(), indent=1))
    from harness.compare.report import write_step_summary

    write_step_summary(sel.markdown())  # in GitHub Actions: the job summary says what runs and why
    if args.format == "args":
        a = sel.run_arguments()
        print("none" if a is None else " ".join(a))
        return 0
    _print_selection(sel, changed, args.base, args.head)
    return 0


def _load_suites(suites_dir) -> tuple[list, list[str]]:
    """The suites that load, and a line for each one that does not."""
    from harness.suite.loader import SuiteError, discover, load_suite

    suites, broken = [], []
    for path in discover(suites_dir):
        try:
            suites.append(load_suite(path))
        except SuiteError as e:
            broken.append(f"{path}: {str(e).splitlines()[0]}")
    return suites, broken


def _print_selection(sel, changed: list, base: str, head: str) -> None:
    print(f"{len(changed)} changed path(s) between {base} and {head}")
    if sel.everything:
        print("every item: " + "; ".join(sel.everything[:5]) + (" ..." if len(sel.everything) > 5 else ""))
    for s, why in sorted(sel.suites.items()):
        print(f"suite {s}: {'; '.join(why)}")
    for c, why in sorted(sel.checks.items()):
        print(f"check {c} (every suite): {'; '.join(why)}")
    if sel.empty:
        print("nothing: no changed path can affect an item"
              + (f" ({', '.join(sel.ignored[:5])} ignored)" if sel.ignored else ""))
