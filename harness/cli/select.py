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


def register(sub) -> None:
    p = sub.add_parser("select", help="the suites and checks a change (BASE...HEAD) can affect",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the pull request's base (a ref or commit: origin/main)")
    p.add_argument("--head", default="HEAD", help="the change's tip (default HEAD)")
    p.add_argument("--format", choices=("text", "args"), default="text")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the selection as JSON")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.files import atomic
    from harness.inspect.trace import suite_op_names
    from harness.run.select import SelectError, changed_paths, select
    from harness.settings import load_settings
    from harness.suite.loader import SuiteError, discover, load_suite

    settings = load_settings()
    try:
        changed = changed_paths(args.base, args.head)
        root = Path(_toplevel())
    except SelectError as e:
        print(f"harness select: {e}", file=sys.stderr)
        return 2
    suites, broken = [], []
    for path in discover(settings.suites_dir):
        try:
            suites.append(load_suite(path))
        except SuiteError as e:
            broken.append(f"{path}: {str(e).splitlines()[0]}")

    def ops(ls) -> set[str]:
        names = suite_op_names(ls, list(ls.suite.dtypes), realistic=ls.suite.checks.ops.realistic)
        return {op for v in names.values() for op in v}

    sel = select(changed, settings, root, suites, ops)
    for b in broken:  # a suite that does not load is run (its load item reports the problem)
        name = Path(b.split(":", 1)[0]).stem
        sel.suites.setdefault(name, []).append("it does not load here: its run says why")
    if args.json:
        atomic.write_text(args.json, json.dumps(sel.to_json(), indent=1))
    if args.format == "args":
        a = sel.run_arguments()
        print("none" if a is None else " ".join(a))
        return 0
    print(f"{len(changed)} changed path(s) between {args.base} and {args.head}")
    if sel.everything:
        print("every item: " + "; ".join(sel.everything[:5]) + (" ..." if len(sel.everything) > 5 else ""))
    for s, why in sorted(sel.suites.items()):
        print(f"suite {s}: {'; '.join(why)}")
    for c, why in sorted(sel.checks.items()):
        print(f"check {c} (every suite): {'; '.join(why)}")
    if sel.empty:
        print("nothing: no changed path can affect an item"
              + (f" ({', '.join(sel.ignored[:5])} ignored)" if sel.ignored else ""))
    return 0


def _toplevel() -> str:
    import subprocess

    from harness.run.select import SelectError

    r = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise SelectError("not inside a git repository")
    return r.stdout.strip()
