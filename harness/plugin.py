"""harness's pytest plugin (registered through the ``pytest11`` entry point): all hooks live here.

Suite files become test items with the "non-python test files" pattern: a ``SuiteFile`` per suite
TOML yields one ``HarnessItem`` per check x backend x dtype (x variant). A ``.toml`` file is a
suite when it sits in a directory named ``suites`` or is named on the command line.

Options narrow what is generated (``--harness-backend cpu --harness-dtype float32``); ``-k`` works
as usual on ids like ``smoke[cpu-float32]``. Metrics go to ``user_properties`` and from there into
the JUnit XML (naming convention: harness/metrics.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harness import checks, metrics
from harness.backends import registry as backend_registry
from harness.checks import CheckContext, CheckFailure
from harness.suite.loader import LoadedSuite, SuiteError, load_suite


def _split(values: list[str] | None) -> set[str] | None:
    if not values:
        return None
    return {v.strip() for vs in values for v in vs.split(",") if v.strip()}


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("harness", "model bring-up harness")
    g.addoption("--harness-backend", action="append", metavar="NAME",
                help="only generate items for these backends (repeat or comma-separate)")
    g.addoption("--harness-dtype", action="append", metavar="DTYPE", help="only these dtypes")
    g.addoption("--harness-check", action="append", metavar="CHECK", help="only these checks")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        # pytest-xdist: N workers x default torch threads oversubscribe the cores, and small
        # kernels then spend their time spinning. Share the cores out instead.
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(config.workerinput["workercount"])))
    for name in checks.registry().names():
        config.addinivalue_line("markers", f"{name}: harness '{name}' check items")


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.suffix != ".toml":
        return None
    explicit = any(Path(str(a).split("::")[0]).resolve() == file_path.resolve() for a in parent.config.args)
    if explicit or file_path.parent.name == "suites":
        return SuiteFile.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # A malformed suite errors in setup, where pytest would print a traceback: the loader's
    # message (file: field: problem) is the whole story.
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, SuiteError):
        report.longrepr = str(call.excinfo.value)
    return report


class SuiteFile(pytest.File):
    def collect(self):
        try:
            ls = load_suite(self.path)
        except SuiteError as e:
            # One erroring item instead of a collection error: pytest would stop the whole session
            # on a collection error, and the other suites' results (and JUnit XML) would be lost.
            yield SuiteLoadItem.from_parent(self, name="load", error=e)
            return
        opt = self.config.getoption
        want_b, want_d, want_c = (_split(opt("harness_backend")), _split(opt("harness_dtype")),
                                  _split(opt("harness_check")))
        breg = backend_registry()
        names = breg.names() if "*" in ls.suite.backends else ls.suite.backends
        for check in checks.registry():
            if (want_c and check.name not in want_c) or not check.enabled(ls):
                continue
            for bname in names:
                if want_b and bname not in want_b:
                    continue
                backend = breg.get(bname) if bname in breg else None
                variants = check.variants(ls, backend) if backend and backend.available() else [None]
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

    def setup(self) -> None:
        raise self.error

    def runtest(self) -> None:  # never reached
        raise self.error

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::load"


class HarnessItem(pytest.Item):
    def __init__(self, *, suite: LoadedSuite, check, backend_name: str, dtype: str,
                 variant: str | None, **kw):
        super().__init__(**kw)
        self.suite, self.check, self.backend_name = suite, check, backend_name
        self.dtype, self.variant = dtype, variant
        self.ctx: CheckContext | None = None
        self.add_marker(getattr(pytest.mark, check.name))

    def setup(self) -> None:
        reg = backend_registry()
        if self.backend_name not in reg:
            pytest.skip(f"backend {self.backend_name!r} is not registered (registered: {', '.join(reg.names())})")
        self.backend = reg.get(self.backend_name)
        ok, why = self.backend.availability()
        if not ok:
            pytest.skip(why)
        ok, why = self.backend.supports(self.dtype)
        if not ok:
            pytest.skip(f"backend {self.backend_name} does not support {self.dtype}: {why}")

    def runtest(self) -> None:
        be = self.backend
        self.user_properties.extend(metrics.meta_properties(
            self.suite.name, self.check.name, self.backend_name, self.dtype, be.device_name(), self.variant))
        self.ctx = ctx = CheckContext(self.suite, be, self.dtype, self.variant)
        be.reset_peak_memory()
        t = time.perf_counter()
        try:
            self.check.run(ctx)
        finally:
            be.synchronize()
            ctx.metric("wall_time_s", time.perf_counter() - t)
            peak = be.peak_memory()
            if peak is not None:
                ctx.metric("peak_memory_bytes", peak)
            if ctx.notes:
                ctx.detail("notes", "; ".join(ctx.notes))
                self.add_report_section("call", "harness notes", "\n".join(ctx.notes))
            self.user_properties.extend(ctx.properties)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CheckFailure):
            return excinfo.value.report(f"{self.check.name} check failed for {self.suite.name} "
                                        f"on {self.backend_name} in {self.dtype}")
        return super().repr_failure(excinfo, style=style or "short")

    def reportinfo(self):
        return self.path, None, f"{self.suite.name}::{self.name}"
