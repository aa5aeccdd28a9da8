"""`harness run [SUITE...] [--backend B] [--dtype D] [--check C]`: the main job."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.run import options
from harness.settings import load_settings


def register(sub) -> None:
    p = sub.add_parser("run", help="run suites through pytest; progress, summary table, results/",
                       epilog="Arguments after -- go to pytest, e.g. harness run kimi-k2 -- -x --maxfail 1.",
                       description="Run suites (default: all) on backends (default: every available one).")
    p.add_argument("suites", nargs="*", help="suite names (kimi-k2) or paths; default: every suite")
    # The options are declared once, with their pytest flags (harness/run/options.py).
    options.add_to_argparse(p)
    p.set_defaults(func=main)


def main(args) -> int:
    if args.launcher == "slurm":  # the whole run becomes one sbatch job; inside it: --launcher srun
        from harness.cli.run_slurm import run_via_slurm

        return run_via_slurm(args)
    from harness.run import driver

    settings = load_settings()
    args.workers = _workers(args, settings)
    args.results = args.results or Path(settings.results_dir)
    early = None
    # The run's nodes reach its items' processes through the environment; the early worker starts
    # before pytest's plugin would set them, so set them first (without this, `--nodes 2` ran every
    # launch on one host).
    from harness.settings import set_env

    if args.nodes:
        set_env("HARNESS_NODES", args.nodes)
    if args.launcher:
        set_env("HARNESS_NODE_LAUNCHER", args.launcher)
    if args.engine:
        set_env("HARNESS_ENGINE", args.engine)
    if driver.wants_early_worker(args.isolate == "on", args.workers, args.passthrough):
        # first thing: its imports overlap with ours below (the checks, torch) and with collection
        early = driver.start_worker(args.results)
    driver.later_workers_start_fresh()
    try:
        return _main(args, settings, early)
    finally:
        if early is not None:
            early.close()  # closed already unless the run stopped before pytest took it


def _main(args, settings, early) -> int:
    """Named steps: the suites, the names asked for, the selection, the values pytest gets, the run.
    Each refusal is one red line and exit status 2."""
    from rich.console import Console

    from harness.run import driver

    # Not a terminal (CI logs): rich would wrap the table at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        suites = _suites(args, settings)
        backends = _backends(args)
        _checks(args)
        selected, suites = _select(args, suites, console)
        _values(args)
    except _Refused as e:
        if e.message:
            console.print(e.message, style="red", markup=False)
        return e.code
    code = driver.run(suites, options={**options.values(args), "backend": backends}, results=args.results,
                      extra=list(args.passthrough), console=console, early=early)
    if selected and code == 5:  # pytest's "no tests collected": the selection's items are in other shards
        console.print("selection: no selected item in this run (other shards run them)", markup=False)
        return 0
    return code


class _Refused(Exception):
    """A step of ``_main`` that ends the command: ``message`` (printed red; empty: said already), ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.message, self.code = message, code


def _suites(args, settings) -> list[Path]:
    from harness.suite.loader import SuiteError, discover, resolve_names

    try:
        suites = resolve_names(args.suites, settings.suites_dir) if args.suites else discover(settings.suites_dir)
    except SuiteError as e:
        raise _Refused(str(e)) from None
    if not suites:
        raise _Refused(f"no suites found in {settings.suites_dir}/")
    return suites


def _backends(args) -> list[str]:
    """The backends asked for, all known; none asked: every available one."""
    from harness.backends import registry

    reg = registry()
    unknown = [b for b in args.backend if b not in reg]
    if unknown:
        raise _Refused(f"unknown backend(s) {', '.join(unknown)} (registered: {', '.join(reg.names())})")
    return args.backend or [b.name for b in reg if b.available()]


def _checks(args) -> None:
    from harness.checks import registry as check_registry

    checks = check_registry().names()
    unknown = [c for c in args.check if c not in checks]
    if unknown:  # a typo would otherwise select nothing and exit 0
        raise _Refused(f"unknown check(s) {', '.join(unknown)} (registered: {', '.join(checks)})")


def _select(args, suites: list[Path], console) -> tuple[bool, list[Path]]:
    """(whether a selection chose the suites, the suites) under ``--selection``."""
    if not args.selection:
        return False, suites
    picked = _selection(args, suites, console)
    if isinstance(picked, int):
        raise _Refused("", picked)
    return (True, picked) if picked is not None else (False, suites)


def _values(args) -> None:
    """What argparse cannot check: the shard spec, a non-negative number of reruns."""
    if args.shard:
        from harness.run import shard

        try:
            shard.parse(args.shard)
        except ValueError as e:
            raise _Refused(str(e)) from None
    if args.confirm is not None and args.confirm < 0:
        raise _Refused(f"--confirm: {args.confirm} is not a number of reruns (0 or more)")


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
    return default_workers(suites, args.backend, durations.load(settings.durations_file), args.check)


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

    writer = ResultsWriter(args.results)  # main: the setting's folder unless given
    try:
        writer.open()
    except ResultsError as e:
        console.print(f"error: {e}", style="red", markup=False)
        return 2
    writer.status = "complete"
    writer.finish()
    writer.close()
    return 0
