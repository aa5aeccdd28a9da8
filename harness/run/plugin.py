"""harness's pytest plugin (registered through the ``pytest11`` entry point): all hooks live here.

Suite files become test items with the "non-python test files" pattern: a ``SuiteFile`` per suite
TOML yields one ``HarnessItem`` per check x backend x dtype (x variant). A ``.toml`` file is a
suite when it sits in a directory named ``suites`` or is named on the command line.

Options narrow what is generated (``--harness-backend cpu --harness-dtype float32``); ``-k`` works
as usual on ids like ``smoke[cpu-float32]``. Every item writes its identity (suite, check,
backend, dtype, variant) as JUnit properties at setup, before anything can skip, and its metrics
after the run (naming convention: harness/metrics.py), so nothing downstream parses the test id.

Checks never raise pytest exceptions: ``harness.run.execute`` turns what a check did into an
``ItemResult`` and :meth:`HarnessItem.runtest` is the one place that maps it to pytest
(passed / failed / xfailed / skipped / error).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from harness import checks
from harness.backends import registry as backend_registry
from harness.run.execute import ItemResult, execute, identity_properties
from harness.settings import set_env
from harness.suite.loader import LoadedSuite, SuiteError, load_suite


def _split(values: list[str] | None) -> set[str] | None:
    if not values:
        return None
    return {v.strip() for vs in values for v in vs.split(",") if v.strip()}


def pytest_addoption(parser: pytest.Parser) -> None:
    # Declared once with `harness run`'s own flags (harness/run/options.py): one help text, one default.
    from harness.run.options import add_to_pytest

    add_to_pytest(parser.getgroup("harness", "model bring-up harness"))


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        # pytest-xdist: N workers x default torch threads oversubscribe the cores, and small
        # kernels then spend their time spinning. Share the cores out instead.
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(config.workerinput["workercount"])))
    for name in checks.registry().names():
        config.addinivalue_line("markers", f"{name}: harness '{name}' check items")
    _validate_options(config)
    _load_quarantine(config)
    results = config.getoption("harness_results", None)
    if results and not hasattr(config, "workerinput") and not config.pluginmanager.has_plugin("harness-results"):
        from harness.run.results import ResultsError, ResultsWriter

        writer = ResultsWriter(Path(results))
        try:
            writer.open()
        except ResultsError as e:
            raise pytest.UsageError(str(e)) from None
        config.pluginmanager.register(writer, "harness-results")
        set_env("HARNESS_RESULTS_DIR", Path(results).resolve())  # where checks put their files
        config.stash[_WRITER] = writer


def pytest_terminal_summary(terminalreporter) -> None:
    """A plugin (check, backend, model builder, sink) whose entry point did not load: one line each."""
    from harness.registry import broken_entry_points

    broken = broken_entry_points()
    if broken:
        terminalreporter.section("harness: broken entry points", sep="=", red=True)
        for line in broken:
            terminalreporter.line(line, red=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from harness.registry import broken_entry_points

    if broken_entry_points() and exitstatus == 0 and not hasattr(session.config, "workerinput"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # the rest ran; the run is still not clean


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep what exists after collection (torch, transformers, pytest, the suites: ~380,000 objects
    that live to the end) out of every later walk of the cycle collector. A full collection over
    them costs ~85 ms here, and pytest's own end of session runs several (its unraisable-exception
    check): 0.23 s of a 0.9 s in-process smoke session, measured, against ~0 frozen. Objects the
    items create are collected as before; the isolated child does the same after its imports."""
    import gc

    gc.freeze()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Scope first, then the shard: the same in every process (xdist workers included)."""
    scope = config.getoption("harness_scope")
    if scope == "commit":
        keep = [i for i in items if getattr(i, "scope", "commit") == "commit"]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if getattr(i, "scope", "commit") != "commit"])
            items[:] = keep
    spec = config.getoption("harness_shard")
    if not spec:
        return
    from harness.run import shard

    k, n = shard.parse(spec)
    recorded = _recorded(config)
    expected = shard.expected(((i.nodeid, _check_name(i), _size(i)) for i in items), recorded)
    where = shard.assign(expected, n)
    keep = [i for i in items if where[i.nodeid] == k]
    config.hook.pytest_deselected(items=[i for i in items if where[i.nodeid] != k])
    items[:] = keep


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``-n N`` (xdist's ``load`` distribution): the longest expected items first, one per worker
    (harness/run/schedule.py); any other ``--dist`` is the user's choice and stays xdist's."""
    if config.getoption("dist", "load") != "load":
        return None
    from harness.run import schedule

    return schedule.LongestFirst(config, log, lambda ids: schedule.expected_of(ids, _recorded(config)))


def _check_name(item) -> str:
    return item.check.name if isinstance(item, HarnessItem) else ("load" if isinstance(item, SuiteLoadItem) else "python")


def _size(item) -> float:
    if isinstance(item, HarnessItem):
        from harness.run.shard import size_factor

        return size_factor(item.suite.raw_config, item.suite.suite.prune)
    return 0.01 if isinstance(item, SuiteLoadItem) else 1.0


def _validate_options(config: pytest.Config) -> None:
    """A typo in --harness-check/--harness-backend/--harness-dtype would silently select nothing."""
    from harness.settings import check_environment
    from harness.suite.schema import DTYPES

    bad_env = check_environment()
    if bad_env:
        raise pytest.UsageError("; ".join(bad_env))
    known = {"--harness-check": checks.registry().names(), "--harness-dtype": list(DTYPES)}
    try:
        known["--harness-backend"] = backend_registry().names()
    except Exception as e:  # a bad harness.toml: say so once, in one line
        raise pytest.UsageError(str(e)) from None
    spec = config.getoption("harness_shard", None)
    if spec:
        from harness.run import shard

        try:
            shard.parse(spec)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    _validate_nodes(config)
    _validate_engine(config)
    for opt, names in known.items():
        asked = _split(config.getoption(opt.lstrip("-").replace("-", "_"), None)) or set()
        bad = sorted(asked - set(names))
        if bad:
            raise pytest.UsageError(f"{opt}: unknown {opt.split('-')[-1]} {', '.join(map(repr, bad))} "
                                    f"(known: {', '.join(names)})")


def _validate_engine(config: pytest.Config) -> None:
    """``--harness-engine``: an engine that is not declared is the run's usage error (not every serve
    item's); a declared engine without a build for an item's backend is that item's NotApplicable."""
    name = config.getoption("harness_engine", None)
    if not name:
        return
    from harness.serve import engine as eng

    known = {e.serves for e in eng.engines()} | {e.name for e in eng.engines()}
    if name not in known:
        raise pytest.UsageError(f"--engine: unknown engine {name!r} (declared: {', '.join(sorted(known))}; "
                                "harness engine show)")
    set_env("HARNESS_ENGINE", name)


def _validate_nodes(config: pytest.Config) -> None:
    """``--harness-nodes``/``--harness-launcher``: checked here, then handed to the run's workers (and
    their launches) through the environment."""
    nodes, launcher = config.getoption("harness_nodes", None), config.getoption("harness_launcher", None)
    if launcher == "slurm":
        raise pytest.UsageError("--launcher slurm submits the whole run as a Slurm job: `harness run --launcher "
                                "slurm`; inside the job the run uses --launcher srun")
    if nodes and nodes > 1 and not launcher:
        raise pytest.UsageError(f"--nodes {nodes} needs --launcher: netns (a rehearsal on this machine, root), "
                                "srun (inside a Slurm allocation) or agents (`harness node-agent` on each node)")
    if launcher == "agents" and nodes and nodes > 1 and not hasattr(config, "workerinput"):
        # the agents store, served for the whole run by its own process (harness/launch/agents.py)
        from harness.launch import agents
        from harness.settings import env

        try:
            config.add_cleanup(agents.ServedStore(env("HARNESS_AGENTS_PORT")).close)
        except agents.AgentError as e:
            raise pytest.UsageError(f"--launcher agents: {e}") from None
    if nodes:
        set_env("HARNESS_NODES", nodes)
    if launcher:
        set_env("HARNESS_NODE_LAUNCHER", launcher)


_QUARANTINE = pytest.StashKey["object"]()
_CONFIRM = pytest.StashKey[int]()


def _load_quarantine(config: pytest.Config) -> None:
    """The quarantine and the number of confirming reruns, once per process. An unreadable quarantine
    file stops the run in one line: read as empty, it would turn every quarantined flake red."""
    from harness.compare import quarantine
    from harness.settings import SettingsError, load_settings

    try:
        settings = load_settings()
    except SettingsError as e:
        raise pytest.UsageError(str(e)) from None
    path = config.getoption("harness_quarantine", None) or settings.quarantine_file
    try:
        config.stash[_QUARANTINE] = quarantine.load(path)
    except quarantine.QuarantineError as e:
        raise pytest.UsageError(str(e)) from None
    n = config.getoption("harness_confirm", None)
    n = settings.confirm_reruns if n is None else n
    if n < 0:
        raise pytest.UsageError(f"--harness-confirm: {n} is not a number of reruns (0 or more)")
    config.stash[_CONFIRM] = n


_WORKER = pytest.StashKey["object"]()
_WRITER = pytest.StashKey["object"]()
_DURATIONS = pytest.StashKey[dict]()


def pytest_unconfigure(config: pytest.Config) -> None:
    writer = config.stash.get(_WRITER, None)
    if writer is not None:
        writer.close()
    worker = config.stash.get(_WORKER, None)
    if worker is not None:
        worker.close()


class AdoptWorker:
    """A plugin handing pytest an isolated worker started before pytest itself (``harness run``
    starts it first thing: the child's imports, torch and transformers, then overlap with the
    parent's own imports and collection instead of following them)."""

    def __init__(self, worker):
        self.worker = worker

    def pytest_configure(self, config: pytest.Config) -> None:
        if (config.getoption("harness_isolate") == "on" and not config.option.collectonly
                and not _is_xdist_controller(config) and _WORKER not in config.stash):
            config.stash[_WORKER] = self.worker
        else:  # not wanted by this session: it would only idle
            self.worker.close()


def _prestart_worker(config: pytest.Config) -> None:
    """Start the isolated worker as soon as the first suite file is collected, so that its imports
    (torch, transformers: seconds) overlap with collection instead of delaying the first item."""
    if (config.getoption("harness_isolate") != "on" or config.option.collectonly
            or _is_xdist_controller(config)):
        return
    worker = _isolation_worker(config)
    if not worker.alive():
        import torch

        worker.env = dict(os.environ)
        set_env("HARNESS_NUM_THREADS", torch.get_num_threads(), worker.env)
        worker._start()


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def _isolation_worker(config: pytest.Config):
    from harness.run.isolation import Worker

    if _WORKER not in config.stash:
        config.stash[_WORKER] = Worker()
    return config.stash[_WORKER]


def _recorded(config: pytest.Config) -> dict:
    if _DURATIONS not in config.stash:
        from harness.run import durations
        from harness.settings import load_settings

        config.stash[_DURATIONS] = durations.load(load_settings().durations_file)
    return config.stash[_DURATIONS]


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.suffix != ".toml":
        return None
    explicit = any(Path(str(a).split("::")[0]).resolve() == file_path.resolve() for a in parent.config.args)
    if not (explicit or file_path.parent.name == "suites"):
        return None
    # The id is "<folder>/<file>" wherever the suite lives and wherever pytest puts its rootdir
    # (outside the rootdir pytest would give an empty id: "::smoke[cpu-float32]"), so the same suite
    # has the same item ids on every machine, in the JUnit XML and in the comparator's history.
    nodeid = f"{file_path.parent.name}/{file_path.name}"
    return SuiteFile.from_parent(parent, path=file_path, nodeid=nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, SuiteError):
        # A malformed suite errors in setup, where pytest would print a traceback: the loader's
        # message (file: field: problem) is the whole story.
        report.longrepr = str(exc)
    elif isinstance(exc, ItemError) and report.when == "call":
        # "Could not run" is an error, not a failure of the model: pytest and its JUnit writer call
        # a failed report an error when it is not the call phase's.
        report.when = "setup"
    result = getattr(item, "result", None)
    if result is not None and report.when in ("call", "setup") and result.message:
        # The one-line message for tables and CI logs (a plain attribute: xdist carries it over).
        report.harness_message = result.message
        if hasattr(report, "wasxfail") and result.report:
            report.harness_report = result.report  # a quarantined failure's full text, for the JUnit XML
    if result is not None and report.when == "call" and result.warnings:
        report.harness_warnings = result.warnings  # what libraries warned (plain JSON: xdist carries it)
    return report


_SEEN = pytest.StashKey[dict]()


class SuiteFile(pytest.File):
    def collect(self):
        _prestart_worker(self.config)
        try:
            ls = load_suite(self.path)
            self._unique(ls)
            items = list(self._items(ls))
        except SuiteError as e:
            # One erroring item instead of a collection error: pytest would stop the whole session
            # on a collection error, and the other suites' results (and JUnit XML) would be lost.
            yield SuiteLoadItem.from_parent(self, name="load", error=e)
            return
        except Exception as e:  # anything else while reading one suite costs that suite only
            err = SuiteError(self.path, [f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"])
            yield SuiteLoadItem.from_parent(self, name="load", error=err)
            return
        yield from items

    def _unique(self, ls: LoadedSuite) -> None:
        """Two suite files with one id or one suite name would mix their results and goldens."""
        seen = self.config.stash.setdefault(_SEEN, {})
        for key in (f"id {self.nodeid}", f"name {ls.name}"):
            other = seen.setdefault(key, self.path)
            if other != self.path:
                raise SuiteError(self.path, [f"suite {key.split(' ', 1)[0]} {key.split(' ', 1)[1]!r} is also "
                                             f"used by {other}; rename one of them (or set model.name)"])

    def _items(self, ls: LoadedSuite):
        opt = self.config.getoption
        want_b, want_d, want_c = (_split(opt("harness_backend")), _split(opt("harness_dtype")),
                                  _split(opt("harness_check")))
        from harness.checks import collection  # the same refusals `harness validate` makes

        breg = backend_registry()
        bad = collection.unknown_backends(ls)
        if bad:
            raise SuiteError(ls.path, [bad])
        names = collection.backend_names(ls)
        for check in checks.registry():
            if (want_c and check.name not in want_c) or not check.enabled(ls):
                continue
            wanted_variants = list(check.config(ls).variants)
            for bname in names:
                if want_b and bname not in want_b:
                    continue
                backend = breg.get(bname)
                variants = check.variants(ls, backend) if backend.available() else [None]
                if wanted_variants and variants != [None]:
                    bad = collection.unknown_variants(check, wanted_variants, variants)
                    if bad:
                        raise SuiteError(ls.path, [bad])
                    variants = [v for v in variants if v in wanted_variants]
                # --harness-dtype replaces the suite's dtypes (a vendor may need float16 where the
                # suite author only listed float32/bfloat16); backends and checks only filter.
                for dtype in sorted(want_d) if want_d else ls.suite.dtypes:
                    for variant in variants:
                        vid = f"-{variant}" if variant else ""
                        yield HarnessItem.from_parent(
                            self, name=f"{check.name}[{bname}-{dtype}{vid}]", suite=ls, check=check,
                            backend_name=bname, dtype=dtype, variant=variant)


class SuiteLoadItem(pytest.Item):
    """Stands for a suite file that does not load: errors in setup with the loader's message."""

    def __init__(self, *, error: SuiteError, **kw):
        super().__init__(**kw)
        self.error = error
        self.user_properties.extend(identity_properties(self.path.stem, "load", "", "", None))

    def setup(self) -> None:
        raise self.error

    def runtest(self) -> None:  # never reached
        raise self.error

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::load"


class ItemFailed(Exception):
    """The check ran and the model said no (a CheckFailure, or the model raised)."""

    def __init__(self, result: ItemResult):
        super().__init__(result.message)
        self.result = result


class ItemError(ItemFailed):
    """harness could not run the check (setup): reported as an error."""


class HarnessItem(pytest.Item):
    def __init__(self, *, suite: LoadedSuite, check, backend_name: str, dtype: str,
                 variant: str | None, **kw):
        super().__init__(**kw)
        self.suite, self.check, self.backend_name = suite, check, backend_name
        self.dtype, self.variant = dtype, variant
        self.result: ItemResult | None = None
        self.scope = check.scope(suite, variant)
        self.add_marker(getattr(pytest.mark, check.name))

    def setup(self) -> None:
        # Identity first: a skipped item is still one of this suite's, in the XML and the table.
        self.user_properties.extend(identity_properties(
            self.suite.name, self.check.name, self.backend_name, self.dtype, self.variant))
        self.backend = backend_registry().get(self.backend_name)
        ok, why = self.backend.availability()
        if not ok:
            pytest.skip(why)
        self.user_properties.append(("harness.device", self.backend.device_name()))
        ok, why = self.backend.supports(self.dtype)
        if not ok:
            pytest.skip(f"backend {self.backend_name} does not support {self.dtype}: {why}")

    def isolated(self) -> bool:
        return self.config.getoption("harness_isolate") == "on" or self.backend.device_type != "cpu"

    def runtest(self) -> None:
        from harness.run import exclusive
        from harness.run.results import results_root

        excl = self.check.exclusive
        # Other xdist workers' items must not run while a timing item measures (exclusive), and one
        # waits for the items running now; in one process items are sequential anyway.
        lock = exclusive.hold(results_root(), excl) if hasattr(self.config, "workerinput") \
            else contextlib.nullcontext(False)
        with lock as held:
            t = time.perf_counter()
            r = self._run_once()
            reruns = self.config.stash.get(_CONFIRM, 0)
            if r.outcome in ("failed", "error") and reruns:
                from harness.run.confirm import confirm

                r = confirm(r, time.perf_counter() - t, self._rerun, reruns,
                            device_available=lambda: self.backend.availability()[0],
                            statistical=self.check.statistical_verdict)
            self.result = r
        if excl and hasattr(self.config, "workerinput") and not held:
            r.notes.append("could not take the run lock: other items may have run during this measurement")
        entry = self._quarantined()
        if entry is not None:
            r.properties.append(("harness.detail.quarantined", f"since {entry.since}: {entry.reason}"))
            if r.outcome in ("failed", "error"):
                r.properties.append(("harness.detail.quarantined_outcome", r.outcome))
        self.user_properties.extend(r.properties)
        if r.notes:
            self.add_report_section("call", "harness notes", "\n".join(r.notes))
        _to_pytest(r, quarantined=entry is not None)

    def _run_once(self) -> ItemResult:
        if self.isolated():
            return self._run_isolated()
        return execute(self.suite, self.check.name, self.backend, self.dtype, self.variant)

    def _rerun(self) -> ItemResult:
        """One confirming attempt: a fresh isolated worker (nothing an earlier item left in the
        process decides it); in-process when isolation is off."""
        if self.isolated():
            _isolation_worker(self.config).close()
        return self._run_once()

    def _quarantined(self):
        from harness.compare.quarantine import key_of

        q = self.config.stash.get(_QUARANTINE, None)
        return q.get(key_of(self.nodeid)) if q is not None and q.items else None

    def _run_isolated(self) -> ItemResult:
        import torch

        from harness.run import durations
        from harness.run.isolation import Limits

        opt, suite = self.config.getoption, self.suite.suite
        timeout = durations.timeout_for(self.nodeid, _recorded(self.config),
                                        opt("harness_timeout") or suite.timeout_s)
        mem = opt("harness_memory_limit") or suite.memory_limit_gib
        limits = Limits(timeout_s=timeout, memory_bytes=int(mem * 2**30) if mem else None,
                        stall_s=suite.stall_s or durations.STALL_S)
        worker = _isolation_worker(self.config)
        worker.env = dict(os.environ)
        set_env("HARNESS_NUM_THREADS", torch.get_num_threads(), worker.env)
        request = {"suite": str(self.suite.path), "check": self.check.name, "backend": self.backend_name,
                   "dtype": self.dtype, "variant": self.variant, "module": self.backend.module}
        result, _facts = worker.run(request, limits)
        return result

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ItemFailed):
            return excinfo.value.result.report or excinfo.value.result.message
        return super().repr_failure(excinfo, style=style or "short")

    def reportinfo(self):
        return self.path, None, f"{self.suite.name}::{self.name}"


def _to_pytest(r: ItemResult, quarantined: bool = False) -> None:
    """The one place an item's outcome becomes a pytest outcome. A quarantined item's failure is an
    xfail to pytest (it does not fail the run); the results writer records it as ``quarantined``,
    a failure in the JUnit XML."""
    if r.outcome == "passed":
        return
    if quarantined and r.outcome in ("failed", "error"):
        pytest.xfail(f"quarantined: {r.message}")
    if r.outcome == "skipped":
        pytest.skip(r.message)
    if r.outcome == "xfailed":
        pytest.xfail(r.message)
    if r.outcome == "error":
        raise ItemError(r)
    raise ItemFailed(r)
