"""`harness precision check|bisect SUITE --backend B --dtype D`: layer table and precision bisection."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("precision", help="layer-by-layer comparison with the golden; precision bisection")
    ps = p.add_subparsers(dest="precision_command", metavar="ACTION")
    for name, helptext in (("check", "compare with the golden and print the layer table (always)"),
                           ("bisect", "find the modules (or ops) that bring the output back within tolerance")):
        a = ps.add_parser(name, help=helptext)
        a.add_argument("suite")
        a.add_argument("--backend", "-b", default="cpu")
        a.add_argument("--dtype", "-d", default="bfloat16")
        a.add_argument("--golden-dir", default=None)
        if name == "bisect":
            a.add_argument("--mode", choices=("module", "op"), default="module",
                           help="module: substitute modules; op: forced CPU float64 fallback of aten ops")
            a.add_argument("--with", dest="with_", choices=("reference", "float32"), default="reference",
                           help="module mode: run candidates on the reference backend/dtype or in float32")
            a.add_argument("--candidates", default=None,
                           help="comma-separated module names (module mode) or aten ops like aten.mm (op mode)")
            a.set_defaults(func=bisect)
        else:
            a.set_defaults(func=check)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _setup(args):
    from harness.backends import get
    from harness.golden.store import load_golden
    from harness.settings import load_settings
    from harness.suite.loader import load_suite, resolve_names

    ls = load_suite(resolve_names([args.suite], load_settings().suites_dir)[0])
    be = get(args.backend)
    ok, why = be.availability()
    if not ok:
        raise RuntimeError(why)
    return ls, be, load_golden(ls, args.golden_dir)


def _errors():
    from harness.golden.store import GoldenError
    from harness.suite.loader import SuiteError

    return (GoldenError, SuiteError, RuntimeError, KeyError, ValueError)


def check(args) -> int:
    from harness.checks import CheckContext, CheckFailure
    from harness.checks.precision import run_precision
    from harness.precision import align

    try:
        ls, be, _ = _setup(args)
        ctx = CheckContext(ls, be, args.dtype)
        try:
            res = run_precision(ctx, golden_root=args.golden_dir, force_report=True)
        except CheckFailure as f:
            print(f.report(f"precision check failed for {ls.name} on {be.name} in {args.dtype}"))
            return 1
    except _errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from harness.precision.runner import tolerances_for

    print(align.render(res, tolerances_for(ls, be, args.dtype)[0]))
    plot = dict(ctx.properties).get("harness.detail.error_plot")
    print(f"precision ok for {ls.name} on {be.name} in {args.dtype}" + (f"; plot: {plot}" if plot else ""))
    return 0


def bisect(args) -> int:
    from harness.precision.bisect import bisect_modules, bisect_ops

    try:
        ls, be, g = _setup(args)
        cands = [c.strip() for c in args.candidates.split(",")] if args.candidates else None
        if args.mode == "op":
            res = bisect_ops(ls, g, be, args.dtype, ops=cands)
        else:
            res = bisect_modules(ls, g, be, args.dtype, with_=args.with_, candidates=cands)
    except _errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = "ops" if res.mode == "op" else "modules"
    if res.baseline_ok:
        print(f"{ls.name} on {be.name} in {args.dtype} is already within tolerance; nothing to bisect")
        return 0
    if res.found is None:
        print(f"no set of the {len(res.candidates)} candidate {what} brings the output back within tolerance "
              f"({res.tests} runs)")
        return 1
    how = "forced CPU float64 fallback" if res.mode == "op" else f"run with {args.with_}"
    print(f"{len(res.found)} {what} ({how}) bring {ls.name} on {be.name} in {args.dtype} back within tolerance "
          f"({res.tests} runs over {len(res.candidates)} candidates):")
    for n in res.found:
        print(f"  {n}")
    return 0
