"""`harness run [SUITE...] [--backend B] [--dtype D] [--check C]`: the main job."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.settings import load_settings
from harness.suite.schema import DTYPES


def register(sub) -> None:
    p = sub.add_parser("run", help="run suites through pytest; progress, summary table, results/",
                       epilog="Arguments after -- go to pytest, e.g. harness run kimi-k2 -- -x --maxfail 1.",
                       description="Run suites (default: all) on backends (default: every available one).")
    p.add_argument("suites", nargs="*", help="suite names (kimi-k2) or paths; default: every suite")
    p.add_argument("--backend", "-b", action="append", default=[], help="backend (repeatable)")
    p.add_argument("--dtype", "-d", action="append", default=[], choices=list(DTYPES),
                   help="dtype (repeatable); replaces the suites' own dtype lists")
    p.add_argument("--check", "-c", action="append", default=[], help="check (repeatable)")
    p.add_argument("--workers", "-n", default=None,
                   help="pytest-xdist workers (a number or 'auto'; 0: one process). Default: one per core (at "
                        "most 4) when the chosen suites' recorded durations add up to a minute or more, else one")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--results", type=Path, default=None, help="results directory (default: results/)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="wall-clock limit of one item, the backstop for what keeps spinning (default: the "
                        "suite's timeout_s, else 30x its recorded duration and >= 900 s, else 1800 s); an item that "
                        "makes no progress (no CPU, no module entered) for the suite's stall_s (60 s) is hung and "
                        "killed whatever this says")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="host RSS limit of one item (default: the suite's memory_limit_gib, else none)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="run only shard I of N (1-based), balanced by recorded durations (harness durations)")
    p.add_argument("--scope", choices=("commit", "nightly"), default="commit",
                   help="commit (default): what every commit runs; nightly: plus real weights, full-size "
                        "shapes and the full parallel matrix")
    p.add_argument("--confirm", type=int, default=None, metavar="N",
                   help="rerun a failed item N more times in fresh workers and classify it deterministic / flaky / "
                        "infrastructure before reporting (default: confirm_reruns in harness.toml, else 0)")
    p.add_argument("--quarantine", default=None, metavar="FILE",
                   help="quarantine file: its items run and report but do not fail the run "
                        "(default: quarantine_file in harness.toml, quarantine.json)")
    p.add_argument("--selection", default=None, metavar="FILE",
                   help="run only what `harness select --json FILE` selected (a pull request's change); a "
                        "missing FILE: every item, said in one line")
    p.add_argument("--no-isolate", action="store_true",
                   help="run items in this process (faster on trusted CPU runs; a hang or crash then costs "
                        "the run; device backends stay isolated)")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.run import driver

    settings = load_settings()
    args.workers = _workers(args, settings)
    early = None
    if driver.wants_early_worker(not args.no_isolate, args.workers, args.passthrough):
        # first thing: its imports overlap with ours below (the checks, torch) and with collection
        early = driver.start_worker(args.results or Path(settings.results_dir))
    driver.later_workers_start_fresh()
    try:
        return _main(args, settings, early)
    finally:
        if early is not None:
            early.close()  # closed already unless the run stopped before pytest took it


def _main(args, settings, early) -> int:
    from rich.console import Console

    from harness.backends import registry
    from harness.run import driver
    from harness.suite.loader import SuiteError, discover, resolve_names

    # Not a terminal (CI logs): rich would wrap the table at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        suites = resolve_names(args.suites, settings.suites_dir) if args.suites else discover(settings.suites_dir)
    except SuiteError as e:
        console.print(f"{e}", style="red", markup=False)
        return 2
    if not suites:
        console.print(f"no suites found in {settings.suites_dir}/", style="red", markup=False)
        return 2
    reg = registry()
    unknown = [b for b in args.backend if b not in reg]
    if unknown:
        console.print(f"unknown backend(s) {', '.join(unknown)} (registered: {', '.join(reg.names())})", style="red", markup=False)
        return 2
    from harness.checks import registry as check_registry

    checks = check_registry().names()
    unknown = [c for c in args.check if c not in checks]
    if unknown:  # a typo would otherwise select nothing and exit 0
        console.print(f"unknown check(s) {', '.join(unknown)} (registered: {', '.join(checks)})", style="red", markup=False)
        return 2
    selected = False
    if args.selection:
        picked = _selection(args, suites, console)
        if isinstance(picked, int):
            return picked
        if picked is not None:
            suites, selected = picked, True
    backends = args.backend or [b.name for b in reg if b.available()]
    extra = list(args.passthrough)
    if args.shard:
        from harness.run import shard

        try:
            shard.parse(args.shard)
        except ValueError as e:
            console.print(f"{e}", style="red", markup=False)
            return 2
        extra += [f"--harness-shard={args.shard}"]
    extra += [f"--harness-scope={args.scope}"]
    if args.confirm is not None:
        if args.confirm < 0:
            console.print(f"--confirm: {args.confirm} is not a number of reruns (0 or more)", style="red", markup=False)
            return 2
        extra += [f"--harness-confirm={args.confirm}"]
    if args.quarantine:
        extra += [f"--harness-quarantine={args.quarantine}"]
    code = driver.run(suites, backends=backends, dtypes=args.dtype, checks=args.check,
                      results=args.results or Path(settings.results_dir), workers=args.workers,
                      keyword=args.keyword, extra=extra, console=console, isolate=not args.no_isolate,
                      timeout=args.timeout, memory_limit_gib=args.memory_limit, early=early)
    if selected and code == 5:  # pytest's "no tests collected": the selection's items are in other shards
        console.print("selection: no selected item in this run (other shards run them)", markup=False)
        return 0
    return code


def _workers(args, settings):
    """-n as given (0: one process, as xdist reads it), else the default from the recorded durations
    (harness.run.schedule.default_workers). Decided before anything starts: the early isolated worker
    is for a one-process run only. Cheap: suite paths and a JSON file, no torch."""
    if args.workers is not None:
        return None if str(args.workers) == "0" else args.workers
    if {"-n", "--numprocesses"} & {a.split("=")[0] for a in args.passthrough}:
        return None  # pytest's own -n after --
    from harness.run import durations
    from harness.run.schedule import default_workers
    from harness.suite.loader import SuiteError, discover, resolve_names

    try:
        suites = resolve_names(args.suites, settings.suites_dir) if args.suites else discover(settings.suites_dir)
    except SuiteError:
        return None  # _main says why
    return default_workers(suites, args.backend, durations.load(settings.durations_file))


def _selection(args, suites: list[Path], console):
    """The suite files to run under ``--selection FILE`` (None: every item), or an exit code: 2 for a
    file that is not a selection, 0 after writing empty results when the change selects nothing."""
    from harness.run.select import SelectError, read_selection

    try:
        data = read_selection(args.selection)
    except SelectError as e:
        console.print(f"error: {e}", style="red", markup=False)
        return 2
    if data is None:
        console.print(f"selection: {args.selection} not found: every item", markup=False)
        return None
    run_args = data["run_arguments"]
    if run_args is None:  # nothing can be affected: say so, and leave empty results for the comparison
        console.print(f"selection: nothing to run: no changed path can affect an item "
                      f"({', '.join(data.get('ignored', [])[:5])})", markup=False)
        return _empty_results(args, console)
    if not run_args:
        console.print("selection: every item (" + "; ".join(data.get("everything", [])[:3]) + ")", markup=False)
        return None
    if run_args[0] == "--check":
        args.check += [c for c in run_args[1::2] if c not in args.check]
        console.print(f"selection: checks {', '.join(run_args[1::2])} of every suite", markup=False)
        return None
    files = data.get("files") or {}
    keep = {Path(files[n]).resolve() for n in run_args if n in files}
    chosen = [p for p in suites if p.resolve() in keep or p.stem in run_args]
    if not chosen:
        console.print(f"selection: its suites ({', '.join(run_args)}) are not among this run's", markup=False)
        return _empty_results(args, console)
    console.print(f"selection: {len(chosen)} suite(s): " + "; ".join(
        f"{n} ({'; '.join(data['suites'].get(n, [])[:2])})" for n in run_args), markup=False)
    return chosen


def _empty_results(args, console) -> int:
    """A run of nothing that still leaves complete (empty) results: the comparison reads every shard."""
    from harness.run.results import ResultsError, ResultsWriter
    from harness.settings import load_settings

    writer = ResultsWriter(args.results or Path(load_settings().results_dir))
    try:
        writer.open()
    except ResultsError as e:
        console.print(f"error: {e}", style="red", markup=False)
        return 2
    writer.status = "complete"
    writer.finish()
    writer.close()
    return 0
