"""Results that survive: a journal written as items finish, and summaries written atomically from it.

``ResultsWriter`` is a pytest plugin (enabled by ``--harness-results DIR``, which ``harness run``
passes; only in the controlling process under pytest-xdist, which receives every worker's reports):

* before anything is collected it checks that the directory is writable and has free space, and
  removes the previous run's files, so a stale ``summary.json`` never looks current; ``run.json``
  says ``running`` from then on;
* each finished item is appended to ``journal.jsonl`` and fsync'd as it completes (a SIGKILL
  loses at most the item in flight);
* ``junit.xml`` (pytest's JUnit layout: classname/name, properties, failure/error/skipped),
  ``summary.json`` and ``summary.txt`` are written from the journal atomically (temp file, fsync,
  rename) at the end, and also on SIGTERM/SIGINT, with the run marked ``interrupted`` and the items
  that never finished listed as not run (in the JUnit XML as skipped with type ``harness.not-run``,
  so a comparator never mistakes them for vanished tests).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

from harness.run.rows import Row, counts
from harness.run.table import render_table

FILES = ("junit.xml", "summary.json", "summary.txt", "journal.jsonl", "run.json")
MIN_FREE_BYTES = 64 * 2**20


def results_root(results_dir: str | Path | None = None) -> Path:
    """Where a check puts its files: the explicit directory, else this run's (HARNESS_RESULTS_DIR,
    set by `harness run` / --harness-results), else the configured results_dir."""
    if results_dir is not None:
        return Path(results_dir)
    from harness.settings import env

    if env("HARNESS_RESULTS_DIR"):
        return env("HARNESS_RESULTS_DIR")
    from harness.settings import load_settings

    return Path(load_settings().results_dir)


class ResultsError(Exception):
    """The results directory cannot take this run's results (one-line message)."""


def check_writable(path: Path, what: str = "results directory") -> None:
    """Fail before any model is built: a read-only or full directory would otherwise cost the run."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".harness-write-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise ResultsError(f"{what} {path} is not writable: {e.strerror or e}") from None
    free = shutil.disk_usage(path).free
    if free < MIN_FREE_BYTES:
        raise ResultsError(f"{what} {path} has only {free / 2**20:.0f} MiB free "
                           f"(need at least {MIN_FREE_BYTES // 2**20} MiB for results)")


def atomic_write(path: Path, data: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def junit_names(nodeid: str) -> tuple[str, str]:
    """pytest's own junitxml mangling (``_pytest.junitxml.mangle_test_address``, what ``--junitxml``
    writes): ``suites/x.toml::smoke[cpu-float32]`` -> (``suites.x.toml``, ``smoke[cpu-float32]``); a
    parameter holding ``::`` (``ops[cpu-float32-aten::mm.default]``) stays whole, so this file and
    pytest's name every item alike (and history keys agree)."""
    from _pytest.junitxml import mangle_test_address

    names = mangle_test_address(nodeid)
    return ".".join(names[:-1]), names[-1]


def _first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


class ResultsWriter:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.rows: dict[str, Row] = {}
        self.collected: list[str] = []
        self.status = "running"
        self.reason = ""
        self.started = time.time()
        self.journal = None
        self._old_handlers: dict[int, object] = {}

    # --- life cycle -----------------------------------------------------------------------------
    def open(self) -> None:
        check_writable(self.dir)
        for name in FILES:  # never leave the previous run's files looking current
            try:
                (self.dir / name).unlink()
            except FileNotFoundError:
                pass
        self.journal = open(self.dir / "journal.jsonl", "a", encoding="utf-8")
        self._write_run()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.status == "running":
            self.status, self.reason = "interrupted", f"{name} received"
            try:  # write now: CI follows SIGTERM with SIGKILL after a grace period
                self.finish()
            except OSError:
                pass
        raise KeyboardInterrupt(f"{name} received")

    def close(self) -> None:
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        if self.journal:
            self.journal.close()
            self.journal = None

    # --- pytest hooks -------------------------------------------------------------------------
    def pytest_collection_finish(self, session) -> None:
        if not hasattr(session.config, "workerinput"):
            self.collected = [i.nodeid for i in session.items]

    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        if not self.collected:
            self.collected = list(ids)

    def pytest_collectreport(self, report) -> None:
        if report.failed:  # a suite that cannot be collected at all: still a row
            self._record(Row(report.nodeid or "collection", "error", message=_first_line(report.longreprtext),
                             longrepr=report.longreprtext))

    def pytest_runtest_logreport(self, report) -> None:
        row = self.rows.get(report.nodeid)
        if row is None or row.outcome == "running":
            row = self.rows.setdefault(report.nodeid, Row(report.nodeid, "running"))
        row.props.update(dict(report.user_properties))
        row.duration += report.duration
        if report.failed:
            row.outcome = "failed" if report.when == "call" else "error"
            row.longrepr = report.longreprtext
            row.message = getattr(report, "harness_message", None) or _first_line(report.longreprtext)
        elif report.skipped and row.outcome in ("running", "passed"):
            if hasattr(report, "wasxfail"):
                row.outcome, row.message = "xfailed", str(report.wasxfail)
            else:
                row.outcome = "skipped"
                msg = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                row.message = msg.removeprefix("Skipped: ")
        elif report.passed and report.when == "call" and row.outcome == "running":
            row.outcome = "passed"
        if report.when == "teardown":
            if row.outcome == "running":  # setup and call passed without a call report (should not happen)
                row.outcome = "passed"
            self._record(row)

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        import pytest

        if exitstatus == pytest.ExitCode.INTERRUPTED and self.status == "running":
            self.status, self.reason = "interrupted", "interrupted"
        if self.status == "running":
            self.status = "complete"
        self.finish()

    # --- writing --------------------------------------------------------------------------------
    def _record(self, row: Row) -> None:
        self.rows[row.nodeid] = row
        if self.journal:
            self.journal.write(json.dumps(asdict(row)) + "\n")
            self.journal.flush()
            os.fsync(self.journal.fileno())

    def finished_rows(self) -> list[Row]:
        return [r for r in self.rows.values() if r.outcome != "running"]

    def not_run(self) -> list[str]:
        done = {r.nodeid for r in self.finished_rows()}
        return [n for n in self.collected if n not in done]

    def _write_run(self) -> None:
        atomic_write(self.dir / "run.json", json.dumps({
            "status": self.status, "reason": self.reason, "started": self.started,
            "updated": time.time(), "pid": os.getpid()}, indent=1))

    def finish(self) -> None:
        """Write junit.xml, summary.json and summary.txt from what finished (idempotent)."""
        rows = self.finished_rows()
        not_run = self.not_run() if self.status != "complete" else []
        atomic_write(self.dir / "junit.xml", junit_xml(rows, not_run, self.status, time.time() - self.started))
        atomic_write(self.dir / "summary.json", json.dumps({
            "status": self.status, "reason": self.reason, "counts": counts(rows),
            "items": [asdict(r) for r in rows], "not_run": not_run}, indent=1))
        text = render_table(rows)
        if not_run:
            text += f"\nrun {self.status} ({self.reason}): {len(not_run)} item(s) not run\n"
        atomic_write(self.dir / "summary.txt", text)
        self._write_run()


def junit_xml(rows: list[Row], not_run: list[str], status: str, elapsed: float) -> str:
    """The JUnit XML pytest's junitxml writes (the comparator reads either), plus run status."""
    c = counts(rows)
    suite = ET.Element("testsuite", name="harness", tests=str(len(rows) + len(not_run)),
                       failures=str(c["failed"]), errors=str(c["error"]),
                       skipped=str(c["skipped"] + c.get("xfailed", 0) + len(not_run)), time=f"{elapsed:.3f}",
                       timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    sp = ET.SubElement(suite, "properties")
    ET.SubElement(sp, "property", name="harness.run.status", value=status)
    ET.SubElement(sp, "property", name="harness.run.not_run", value=str(len(not_run)))
    for r in rows:
        cls, name = junit_names(r.nodeid)
        tc = ET.SubElement(suite, "testcase", classname=cls, name=name, time=f"{r.duration:.3f}")
        if r.props:
            props = ET.SubElement(tc, "properties")
            for k, v in r.props.items():
                ET.SubElement(props, "property", name=str(k), value=str(v))
        if r.outcome == "failed":
            ET.SubElement(tc, "failure", message=r.message).text = r.longrepr
        elif r.outcome == "error":
            ET.SubElement(tc, "error", message=r.message).text = r.longrepr
        elif r.outcome == "skipped":
            ET.SubElement(tc, "skipped", type="pytest.skip", message=r.message).text = r.message
        elif r.outcome == "xfailed":
            ET.SubElement(tc, "skipped", type="pytest.xfail", message=r.message).text = r.message
    for nodeid in not_run:
        cls, name = junit_names(nodeid)
        tc = ET.SubElement(suite, "testcase", classname=cls, name=name, time="0")
        ET.SubElement(tc, "skipped", type="harness.not-run", message=f"not run: the run was {status}")
    root = ET.Element("testsuites")
    root.append(suite)
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="utf-8", xml_declaration=True)
    return buf.getvalue().decode("utf-8")
