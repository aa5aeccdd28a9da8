"""``harness run``: the suites through pytest (same items, same JUnit XML), with a progress bar,
a summary table and ``results/``.

pytest does the work in-process; ``RunObserver`` is a small pytest plugin that follows the reports
(under pytest-xdist the controller receives every worker's reports, user_properties included).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness.run import options as run_options
from harness.run.rows import counts
from harness.run.table import summary_table, warnings_block
from harness.settings import set_env


class RunObserver:
    """Drives the progress bar; without a terminal (CI logs) it prints one line per finished item
    instead. The rows themselves are kept by ``harness.run.results.ResultsWriter``."""

    def __init__(self, console: Console, writer, show_progress: bool = True):
        self.console, self.writer = console, writer
        self.live, self.total, self.done = show_progress, 0, 0
        self.progress = Progress(TextColumn("[bold]harness"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}", markup=False),
                                 console=console, transient=True, disable=not show_progress)
        self.task = None

    def _start(self, total: int) -> None:
        self.total = self.total or total
        if self.task is None and self.live:
            self.progress.start()
            self.task = self.progress.add_task("", total=total)

    def pytest_collection_finish(self, session) -> None:
        if not hasattr(session.config, "workerinput"):
            self._start(len(session.items))

    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._start(len(ids))

    @pytest.hookimpl(trylast=True)  # after the writer has folded the report into its row
    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "teardown":
            return
        row = self.writer.rows.get(report.nodeid)
        if row is None:
            return
        self.done += 1
        if self.task is not None:
            self.progress.update(self.task, advance=1, description=report.nodeid.split("/")[-1][:60])
        elif not self.live:
            self.console.print(f"[{self.done}/{self.total}] {row.outcome:<7} {report.nodeid} ({row.duration:.2f} s)"
                               + (f"  {row.message}" if row.outcome in ("failed", "error") else ""),
                               highlight=False, markup=False)

    def pytest_warning_recorded(self, warning_message, when, nodeid, location) -> None:
        """harness's own warnings, which an item in this process (``--no-isolate``, or an xdist
        worker's, forwarded) hands to pytest's recorder: shown, as the isolated worker shows them
        on its stderr. Library warnings never get here from an item (execute counts them); pytest's
        and the imports' own are left to pytest, as before."""
        from harness.run.execute import is_harness_warning

        if is_harness_warning(warning_message.category, warning_message.filename):
            self.console.print(f"{warning_message.filename}:{warning_message.lineno}: "
                               f"{getattr(warning_message.category, '__name__', warning_message.category)}: "
                               f"{warning_message.message}",
                               style="yellow", markup=False, highlight=False)

    def pytest_sessionfinish(self) -> None:
        if self.task is not None:
            self.progress.stop()


def build_args(suites: list[Path], options: Mapping[str, Any], extra: list[str]) -> list[str]:
    """pytest's command line of a run: the suite files, then each option's pytest flags as declared
    in harness/run/options.py (``options``: name -> value; ``--harness-backend`` etc.: items of
    backends that are not asked for are not generated at all, not skipped), then ``extra``."""
    # The results plugin (harness.run.results) is registered by run(); JUnit XML comes from its journal.
    args = [str(p) for p in suites] + ["-p", "no:cacheprovider", "-p", "no:terminal"]
    return args + run_options.pytest_args(options) + extra


def wants_early_worker(isolate: bool, workers, extra: list[str] | None) -> bool:
    """Items run in this process's isolated worker (not in xdist workers, not a collection only)."""
    return isolate and not workers and not {"--collect-only", "--co"} & set(extra or [])


def later_workers_start_fresh() -> None:
    """Past this point this process may run models itself (``--no-isolate``, the items), so a
    worker started later is a new interpreter, never a fork of this process (``harness server``
    forks only the first one, started before anything ran: harness/run/isolation.py)."""
    from harness.run import isolation

    isolation.FORK_FIRST_WORKER = False


def start_worker(results: Path):
    """The isolated worker, started now: ``harness run`` calls this first thing, before it imports
    torch, the checks and pytest's plugins and collects, so that the child's own imports (2-4 s of
    torch and transformers) overlap with all of that instead of following it. It inherits the
    results folder (checks write their files beside the run's results) through its own environment:
    this process's is left alone (``run`` sets it once the results are open). None when the results
    folder cannot be written: ``run`` says so before anything is started."""
    from harness.run.isolation import Worker  # no torch in this import: the child starts first

    # Nothing created yet (a run refused for an unknown suite leaves no results folder): the nearest
    # existing folder on the way must be one we may write to, else no worker (``run`` says why).
    at = Path(results).resolve()
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir() or not os.access(at, os.W_OK | os.X_OK):
        return None
    env = dict(os.environ)
    set_env("HARNESS_RESULTS_DIR", Path(results).resolve(), env)
    worker = Worker(env=env)
    worker._start()
    return worker


def run(suites: list[Path], *, options: Mapping[str, Any], results: Path, extra: list[str] | None = None,
        console: Console | None = None, early=None) -> int:
    """pytest over ``suites`` with ``options`` (name -> value of harness/run/options.py: backend, dtype,
    check, workers, isolate, timeout, ...; a missing name: pytest's default). ``early``: a worker from
    :func:`start_worker`, handed to pytest (its plugin closes it at the end)."""
    console = console or Console()
    writer = _open_results(results, console)
    if writer is None:
        return 2
    extra = extra or []
    isolate, workers = options.get("isolate", "on") == "on", options.get("workers")
    if early is None and wants_early_worker(isolate, workers, extra):
        early = start_worker(results)
    observer = RunObserver(console, writer, show_progress=console.is_terminal)
    code = _pytest_main(build_args(suites, options, extra), [writer, observer], writer, early)
    rows = writer.finished_rows()
    if writer.status == "running":
        # pytest stopped before its session (a usage error: a bad option, quarantine file or setting,
        # said above by pytest): no item ran. run.json says so, never "running" (issue #49), and no
        # empty table pretends a run took place.
        writer.status, writer.reason = "not started", f"pytest exit {int(code)} before any item: see the error above"
        writer.finish()
        console.print(f"error: the run did not start ({writer.reason}); results: {results}", style="red",
                      markup=False, highlight=False)
        return int(code) or 4
    _print_summary(console, rows, results)
    return _exit_code(console, writer, code, rows, results)


def _open_results(results: Path, console: Console):
    """The results writer, open: writable, enough space, previous run's files gone - before any model
    is built. None (said in one line) when the folder cannot take them."""
    from harness.run.results import ResultsError, ResultsWriter

    writer = ResultsWriter(results)
    try:
        writer.open()
    except ResultsError as e:
        console.print(f"error: {e}", style="red", markup=False, highlight=False)
        return None
    # Checks that write files (precision plots, perf samples) put them beside this run's results,
    # in this process and in the isolated workers, which inherit the environment.
    set_env("HARNESS_RESULTS_DIR", Path(results).resolve())
    return writer


def _pytest_main(args: list[str], plugins: list, writer, early) -> int:
    """pytest in this process; the results writer closed and the early worker released whatever happens."""
    if early is not None:
        from harness.run.plugin import AdoptWorker

        plugins = [*plugins, AdoptWorker(early)]
    try:
        return pytest.main(args, plugins=plugins)
    finally:
        writer.close()
        if early is not None:
            early.close()  # pytest_unconfigure closed it already unless pytest never configured


def _print_summary(console: Console, rows, results: Path) -> None:
    """The table, what libraries warned (once, here) and the counts line."""
    # Paths, reasons and messages come from the run: printed as text, never read as console markup.
    say = dict(markup=False, highlight=False)
    try:
        console.print(summary_table(rows))
        for text in warnings_block(rows, results / "junit.xml"):
            console.print(text, style="yellow" if text[:1] != " " else "", **say)
        c = counts(rows)
        line = (f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"
                + (f", {c['xfailed']} xfailed" if c.get("xfailed") else "")
                + (f", {c['quarantined']} quarantined (not failing the run)" if c.get("quarantined") else ""))
        flaky = sum(r.props.get("harness.detail.confirm") == "flaky" for r in rows)
        line += f", {flaky} flaky (passed on a rerun)" if flaky else ""
        console.print(line + f" -> {results / 'junit.xml'}", **say)
    except OSError:  # stdout itself on the full disk (a redirected log): the results still decide
        pass


def _exit_code(console: Console, writer, code, rows, results: Path) -> int:
    """pytest's exit status, unless the run did not finish (3: incomplete), said in one line."""
    say = dict(markup=False, highlight=False)
    if writer.status == "incomplete":
        console.print(f"error: run incomplete: {writer.reason}; {len(writer.not_run())} item(s) not run, the "
                      f"{len(rows)} finished item(s) are in {results}", style="red", **say)
        return int(code) or 3
    if writer.status != "complete":
        console.print(f"run {writer.status} ({writer.reason}): {len(writer.not_run())} item(s) not run; "
                      f"the results of the {len(rows)} finished item(s) are in {results}", style="red", **say)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        console.print("no items matched: check the suite names and --backend/--dtype/--check", style="red", **say)
    return int(code)
