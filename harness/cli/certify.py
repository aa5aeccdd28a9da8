"""`harness certify --backend NAME`: known kernel faults on that backend's own dispatch key, one at a
time, and a table of caught / missed with the module each check named (docs/backends.md,
"Certifying a backend: harness certify"). Exit status 0: every fault caught; 1: one missed or not
judged, or the backend not green without a fault; 2: usage."""

from __future__ import annotations

import sys

from harness.numbers import DAY_S, amount

DEFAULT_SUITE = "llama-3.1-8b"  # small, dense, every fault's op on its path


def register(sub) -> None:
    p = sub.add_parser("certify", help="inject known kernel faults on a backend's dispatch key; caught or missed",
                       description="Register known wrong kernels (a scaled softmax, an activation slope error, a "
                       "bfloat16 matmul in a float32 run, a NaN in one op, a wrong backward) on the backend's "
                       "own dispatch key, one at a time, run the check that should catch each, and print "
                       "caught / missed with the module named. A clean run comes first.")
    p.add_argument("--backend", "-b", help="the backend to certify (harness backends)")
    p.add_argument("--suite", default=DEFAULT_SUITE, help=f"suite to run the faults on (default {DEFAULT_SUITE})")
    p.add_argument("--fault", "-f", action="append", default=[], help="only this fault (repeatable; --list)")
    p.add_argument("--check", "-c", default=None,
                   help="run this check for every fault instead of each fault's own (which checks see what)")
    p.add_argument("--list", action="store_true", help="the fault catalogue; runs nothing")
    p.add_argument("--results", default=None, help="where each run's results are kept: DIR/baseline, DIR/<fault> (default: the results directory's certify/)")
    p.add_argument("--timeout", type=amount(0, 7 * DAY_S, low_open=True), default=None, metavar="SECONDS", help="time limit of one item")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=main)


def _usage(msg: str) -> int:
    print(f"harness certify: error: {msg}", file=sys.stderr)
    return 2


def main(args) -> int:
    import json
    from pathlib import Path

    from harness.backends.faults import CATALOGUE

    if args.list:
        return _list(args.json)
    unknown = [f for f in args.fault if f not in CATALOGUE]
    if unknown:
        return _usage(f"unknown fault(s) {', '.join(unknown)} (known: {', '.join(CATALOGUE)})")
    if not args.backend:
        return _usage("--backend is required (harness backends lists them)")
    from harness.backends import registry
    from harness.checks import registry as check_registry

    reg = registry()
    if args.backend not in reg:
        return _usage(f"unknown backend {args.backend} (registered: {', '.join(reg.names())})")
    if args.check and args.check not in check_registry().names():
        return _usage(f"unknown check {args.check} (registered: {', '.join(check_registry().names())})")
    backend = reg.get(args.backend)
    if not backend.dispatch_key:
        return _usage(f"backend {backend.name} declares no dispatch_key: nowhere to install a fault")
    ok, why = backend.availability()
    if not ok:
        return _usage(f"backend {backend.name} is not available here: {why}")
    from harness.settings import load_settings
    from harness.suite.loader import SuiteError, load_suite, resolve_names

    try:
        (suite,) = resolve_names([args.suite], load_settings().suites_dir)
        load_suite(suite)  # a file that is no suite is the input's problem, never the backend's (issue #49)
    except SuiteError as e:
        lines = str(e).splitlines() or [""]
        more = f" (and {len(lines) - 1} more: harness validate {args.suite})" if len(lines) > 1 else ""
        return _usage(f"--suite: {lines[0]}{more}")
    from harness.run.certify import certify

    faults = [CATALOGUE[n] for n in dict.fromkeys(args.fault)] or list(CATALOGUE.values())
    report = certify(backend, faults, str(suite), check=args.check,
                     results=Path(args.results) if args.results else None, timeout=args.timeout,
                     say=lambda s: print(f"certify: {s}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        _print(report)
    return report.exit_code()


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 250)


def _list(as_json: bool) -> int:
    from harness.backends.faults import CATALOGUE

    rows = [{"fault": f.name, "what": f.summary, "ops": list(f.ops), "check": f.check, "why": f.why}
            for f in CATALOGUE.values()]
    if as_json:
        import json

        print(json.dumps(rows, indent=1))
        return 0
    from rich.table import Table

    t = Table(title="harness certify: the faults")
    for c in ("fault", "what it does", "aten ops replaced", "check", "why that check"):
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(r["fault"], r["what"], " ".join(r["ops"]), r["check"], r["why"])
    _console().print(t)
    return 0


def _print(report) -> None:
    from rich.table import Table
    from rich.text import Text

    say = dict(markup=False, highlight=False)
    con = _console()
    head = f"{report.backend} (dispatch key {report.dispatch_key}), {report.suite}, {report.dtype}"
    if not report.green:
        bad = [i for i in report.baseline if i.outcome != "passed"]
        con.print(f"not certified: {report.backend} is not green without a fault; fix that first", style="red", **say)
        for i in bad:
            con.print(f"  {i.check}: {i.outcome}" + (f": {i.message}" if i.message else ""), **say)
        return
    t = Table(title=f"harness certify: {head}")
    for c in ("fault", "kernels that ran", "check", "outcome", "verdict", "module named", "message"):
        t.add_column(c, overflow="fold")
    colour = {"caught": "green", "missed": "red", "error": "yellow"}
    for r in report.faults:
        t.add_row(Text(r.fault), Text(" ".join(r.ran) or "(none)"), Text(r.check), Text(r.outcome),
                  Text(r.verdict, style=colour.get(r.verdict, "")), Text(r.module or "-"), Text(r.message[:160]))
    con.print(t)
    c = report.counts()
    con.print(f"{c['caught']}/{len(report.faults)} caught, {c['missed']} missed, {c['error']} not judged", **say)
    for r in report.faults:
        if r.verdict != "caught":
            con.print(f"  reproduce {r.fault}: {r.reproduce}", **say)
