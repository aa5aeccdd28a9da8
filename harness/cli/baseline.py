"""`harness baseline update RESULTS` / `harness baseline show [SUITE...]`: perf baselines (docs/perf.md).

``update`` takes a reviewed run's perf samples (the sidecars under ``RESULTS/perf/``) as the new
baselines of their suites on their machine class (``golden/perf/<suite>/<class>.json``); items of
the run replace the same items, others stay.
"""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("baseline", help="perf baselines: take a reviewed run as the new baseline, show them")
    bs = p.add_subparsers(dest="baseline_command", metavar="ACTION")
    u = bs.add_parser("update", help="take a reviewed run's perf samples as the new baselines")
    u.add_argument("results", nargs="+", help="results directory of the run (the one holding perf/); several: "
                   "their samples pooled into one baseline of several processes")
    u.add_argument("--suite", action="append", default=[], help="only these suites (repeatable)")
    u.add_argument("--golden-dir", default=None, help="golden root (default: harness.toml golden_dir)")
    u.add_argument("--append", action="store_true",
                   help="pool the run's samples with the stored baseline's (a baseline of several runs)")
    u.set_defaults(func=update)
    s = bs.add_parser("show", help="list stored perf baselines")
    s.add_argument("suites", nargs="*")
    s.add_argument("--golden-dir", default=None)
    s.set_defaults(func=show)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def update(args) -> int:
    from harness.files.atomic import check_writable
    from harness.perf.baseline import BaselineError, perf_golden_root
    from harness.perf.baseline import update as do_update

    try:
        # before reading anything: a read-only golden folder is one line now, not a traceback later
        check_writable(perf_golden_root(args.golden_dir), "perf baseline directory")
        written = do_update(list(args.results), args.golden_dir, args.suite or None, append=args.append)
    except (BaselineError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not written:
        print(f"error: no perf samples under {' '.join(args.results)} (run the perf check first: harness run "
              "--scope nightly --check perf)", file=sys.stderr)
        return 2
    code = 0
    for path, took, refused in written:
        if took:
            print(f"{path}: {len(took)} item(s) from {' '.join(args.results)}: {', '.join(sorted(took))}")
        for r in refused:
            print(f"{path}: refused {r}", file=sys.stderr)
            code = 1
    return code


def show(args) -> int:
    import json

    from harness.perf.baseline import perf_golden_root

    root = perf_golden_root(args.golden_dir)
    files = sorted(root.glob("*/*.json"))
    files = [f for f in files if not args.suites or f.parent.name in args.suites]
    if not files:
        print(f"no perf baselines under {root}")
        return 0
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            print(f"{f}: unreadable ({e})")
            continue
        for key, item in sorted(data.get("items", {}).items()):
            meds = {m: s.get("median") for m, s in (item.get("summary") or {}).items()}
            figures = ", ".join(f"{m} {v * 1e3:.4g} ms" for m, v in meds.items() if isinstance(v, float)
                                and not m.endswith("_remeasured"))
            print(f"{f.parent.name} {f.stem} {key}: {figures}")
    return 0
