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

import errno
import io
import json
import os
import shutil
import signal
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

from harness.files import atomic
from harness.messages import first_line
from harness.run.rows import Row, counts, warning_line
from harness.run.table import render_table, warnings_block
from harness.settings import results_root  # noqa: F401 - where a run's files go (re-exported)

QUARANTINED = "harness.detail.quarantined"  # the item is in the quarantine (harness.compare.quarantine)
FILES = ("junit.xml", "summary.json", "summary.txt", "journal.jsonl", "run.json")
MIN_FREE_BYTES = 64 * 2**20
# Space set aside at the start and given back when a write fails for lack of it, so that a disk that
# fills during the run (another job, a check's own files) still takes run.json and the summaries.
RESERVE = ".harness-reserve"
RESERVE_BYTES = 8 * 2**20


class ResultsError(Exception):
    """The results directory cannot take this run's results (one-line message)."""


def check_writable(path: Path, what: str = "results directory") -> None:
    """Fail before any model is built: a read-only or full directory would otherwise cost the run."""
    try:
        atomic.check_writable(path, what)
    except OSError as e:
        raise ResultsError(str(e)) from None
    free = shutil.disk_usage(path).free
    if free < MIN_FREE_BYTES:
        raise ResultsError(f"{what} {path} has only {free / 2**20:.0f} MiB free "
                           f"(need at least {MIN_FREE_BYTES // 2**20} MiB for results)")


def _why(e: OSError) -> str:
    """``journal.jsonl: No space left on device (ENOSPC)``: one line, whatever the OSError."""
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    where = Path(e.filename).name if getattr(e, "filename", None) else ""
    text = e.strerror or str(e) or type(e).__name__
    return (f"{where}: " if where else "") + text + (f" ({code})" if code else "")


def junit_names(nodeid: str) -> tuple[str, str]:
    """pytest's own junitxml mangling (``_pytest.junitxml.mangle_test_address``, what ``--junitxml``
    writes): ``suites/x.toml::smoke[cpu-float32]`` -> (``suites.x.toml``, ``smoke[cpu-float32]``); a
    parameter holding ``::`` (``ops[cpu-float32-aten::mm.default]``) stays whole, so this file and
    pytest's name every item alike (and history keys agree)."""
    from _pytest.junitxml import mangle_test_address

    names = mangle_test_address(nodeid)
    return ".".join(names[:-1]), names[-1]


def scrub_row(row: Row) -> None:
    """Credentials a failing test echoed (an ``hf_`` token in a download error) are cut from every
    text the row carries, once, before it is journaled, summarised or printed."""
    from harness.compare.scrub import scrub_secrets

    row.message, row.longrepr = scrub_secrets(row.message), scrub_secrets(row.longrepr)
    row.props = {k: scrub_secrets(v) if isinstance(v, str) else v for k, v in row.props.items()}
    row.warnings = [{**w, "message": scrub_secrets(str(w.get("message", ""))),
                     "source": scrub_secrets(str(w.get("source", "")))} for w in row.warnings]




class ResultsWriter:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.rows: dict[str, Row] = {}
        self.collected: list[str] = []
        self.status = "running"
        self.reason = ""
        self.started = time.time()
        self.journal = None
        self.session = None
        self._old_handlers: dict[int, object] = {}

    # --- life cycle -----------------------------------------------------------------------------
    def open(self) -> None:
        check_writable(self.dir)
        for name in FILES:  # never leave the previous run's files looking current
            try:
                (self.dir / name).unlink()
            except FileNotFoundError:
                pass
        atomic.clean_leftovers(self.dir)
        try:
            self._reserve()
            # unbuffered: a failed append is undone by truncating to the last whole line, and no
            # buffered tail can be written half later, when the file is closed
            self.journal = open(self.dir / "journal.jsonl", "ab", buffering=0)
            self._journal_size = 0
            self._write_run()
        except OSError as e:
            raise ResultsError(f"results directory {self.dir}: {_why(e)}") from None
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass

    def _reserve(self) -> None:
        path = self.dir / RESERVE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:  # real blocks, not a sparse file: the space must exist to be given back
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            except (AttributeError, OSError):
                os.write(fd, b"\0" * RESERVE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _release(self) -> None:
        try:
            (self.dir / RESERVE).unlink()
        except FileNotFoundError:
            pass

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.status == "running":
            self.status, self.reason = "interrupted", f"{name} received"
            self.finish()  # write now: CI follows SIGTERM with SIGKILL after a grace period
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
        self._release()

    def fail(self, e: OSError) -> None:
        """A write of this run's results failed (full disk, read-only remount, I/O error): the run
        is ``incomplete`` from here, the items not yet run are listed as not run, and the run stops
        instead of building models whose results could not be kept."""
        if self.status in ("running", "complete"):
            self.status = "incomplete"
            self.reason = f"cannot write results: {_why(e)} after {len(self.finished_rows())} item(s)"
        self._release()  # the space set aside at the start is what the summaries are written into
        if self.session is not None:
            self.session.shouldstop = self.reason

    # --- pytest hooks -------------------------------------------------------------------------
    def pytest_sessionstart(self, session) -> None:
        self.session = session

    def pytest_collection_finish(self, session) -> None:
        if not hasattr(session.config, "workerinput"):
            self.collected = [i.nodeid for i in session.items]

    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        if not self.collected:
            self.collected = list(ids)

    def pytest_collectreport(self, report) -> None:
        if report.failed:  # a suite that cannot be collected at all: still a row
            self._record(Row(report.nodeid or "collection", "error", message=first_line(report.longreprtext),
                             longrepr=report.longreprtext))

    def pytest_runtest_logreport(self, report) -> None:
        row = self.rows.get(report.nodeid)
        if row is None or row.outcome == "running":
            row = self.rows.setdefault(report.nodeid, Row(report.nodeid, "running"))
        row.props.update(dict(report.user_properties))
        row.duration += report.duration
        if getattr(report, "harness_warnings", None):  # harness.run.plugin: what libraries warned
            row.warnings = list(report.harness_warnings)
        if report.failed:
            row.outcome = "failed" if report.when == "call" else "error"
            row.longrepr = report.longreprtext
            row.message = getattr(report, "harness_message", None) or first_line(report.longreprtext)
        elif report.skipped and row.outcome in ("running", "passed"):
            if hasattr(report, "wasxfail") and QUARANTINED in row.props:
                # failed, but in the quarantine: the real outcome in the XML, not in the exit status
                row.outcome, row.message = "quarantined", str(report.wasxfail).removeprefix("quarantined: ")
                row.longrepr = getattr(report, "harness_report", "") or row.message
            elif hasattr(report, "wasxfail"):
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
        if self.status == "incomplete" and session.exitstatus == pytest.ExitCode.OK:
            # pytest returns session.exitstatus: results that could not be written are never a pass
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR

    # --- writing --------------------------------------------------------------------------------
    def _record(self, row: Row) -> None:
        """Journal first: the row is on disk (fsync'd) before anything else is written about it.
        A write that fails keeps the row in memory, where the summaries still find it."""
        scrub_row(row)  # tokens never reach the journal, the summaries, junit.xml or the console
        self.rows[row.nodeid] = row
        if self.journal and self.status != "incomplete":
            line = (json.dumps(asdict(row)) + "\n").encode("utf-8")
            try:
                view = memoryview(line)
                while view:
                    view = view[self.journal.write(view):]
                os.fsync(self.journal.fileno())
                self._journal_size += len(line)
            except OSError as e:
                try:  # no torn last line: the journal stays whole lines, every one of them readable
                    os.ftruncate(self.journal.fileno(), self._journal_size)
                except OSError:
                    pass
                if not getattr(e, "filename", None):
                    e.filename = str(self.dir / "journal.jsonl")
                self.fail(e)

    def finished_rows(self) -> list[Row]:
        return [r for r in self.rows.values() if r.outcome != "running"]

    def not_run(self) -> list[str]:
        done = {r.nodeid for r in self.finished_rows()}
        return [n for n in self.collected if n not in done]

    def _write_run(self) -> None:
        atomic.write_json(self.dir / "run.json", {
            "status": self.status, "reason": self.reason, "started": self.started,
            "updated": time.time(), "pid": os.getpid()}, newline=False)

    def finish(self) -> None:
        """Write run.json, junit.xml, summary.json and summary.txt from what finished (idempotent).

        Never raises OSError: a file that cannot be written marks the run ``incomplete`` with the
        reason, gives back the reserved space and the others are still tried, run.json first (the
        smallest, and the one that says whether the rest can be trusted)."""
        for _attempt in (1, 2):
            failed = self._write_all()
            if failed is None:
                return
            self.fail(failed)  # incomplete, reserve given back: the second pass says so, in the space freed

    def _write_all(self) -> OSError | None:
        rows = self.finished_rows()
        not_run = self.not_run() if self.status != "complete" else []
        text = render_table(rows)
        text += "".join(line + "\n" for line in warnings_block(rows, self.dir / "junit.xml"))
        if self.status != "complete":  # also when every item ran: an incomplete run says so
            text += f"\nrun {self.status} ({self.reason}): {len(not_run)} item(s) not run\n"
        summary = {"status": self.status, "reason": self.reason, "counts": counts(rows),
                   "items": [asdict(r) for r in rows], "not_run": not_run}
        failed = None
        for name, make in (("run.json", None),
                           ("junit.xml", lambda: junit_xml(rows, not_run, self.status, time.time() - self.started,
                                                           self.reason)),
                           ("summary.json", lambda: json.dumps(summary, indent=1)),
                           ("summary.txt", lambda: text)):
            try:
                if make is None:
                    self._write_run()
                else:
                    atomic.write_text(self.dir / name, make())
            except OSError as e:
                failed = failed or e
        return failed


def junit_xml(rows: list[Row], not_run: list[str], status: str, elapsed: float, reason: str = "") -> str:
    """The JUnit XML pytest's junitxml writes (the comparator reads either), plus run status."""
    c = counts(rows)
    suite = ET.Element("testsuite", name="harness", tests=str(len(rows) + len(not_run)),
                       failures=str(c["failed"] + c.get("quarantined", 0)), errors=str(c["error"]),
                       skipped=str(c["skipped"] + c.get("xfailed", 0) + len(not_run)), time=f"{elapsed:.3f}",
                       timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    _suite_properties(suite, rows, len(not_run), status, reason)
    for r in rows:
        _testcase(suite, r)
    for nodeid in not_run:
        cls, name = junit_names(nodeid)
        tc = ET.SubElement(suite, "testcase", classname=cls, name=name, time="0")
        ET.SubElement(tc, "skipped", type="harness.not-run", message=f"not run: the run was {status}")
    root = ET.Element("testsuites")
    root.append(suite)
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="utf-8", xml_declaration=True)
    return buf.getvalue().decode("utf-8")


def _suite_properties(suite: ET.Element, rows: list[Row], not_run: int, status: str, reason: str) -> None:
    """The testsuite's <properties>: run status, the software stack, and what each metric means."""
    sp = ET.SubElement(suite, "properties")
    ET.SubElement(sp, "property", name="harness.run.status", value=status)
    ET.SubElement(sp, "property", name="harness.run.not_run", value=str(not_run))
    if reason:
        ET.SubElement(sp, "property", name="harness.run.reason", value=reason)
    for pkg, version in stack_versions().items():  # what the upstream canary compares (docs/ci.md)
        ET.SubElement(sp, "property", name=f"harness.stack.{pkg}", value=version)
    for name, value in meaning_properties(rows):  # what each metric means (harness/metrics.py)
        ET.SubElement(sp, "property", name=name, value=value)


def _testcase(suite: ET.Element, r: Row) -> None:
    """One finished item as a <testcase>: its properties, outcome element, reruns and warnings."""
    cls, name = junit_names(r.nodeid)
    tc = ET.SubElement(suite, "testcase", classname=cls, name=name, time=f"{r.duration:.3f}")
    if r.props:
        props = ET.SubElement(tc, "properties")
        for k, v in r.props.items():
            ET.SubElement(props, "property", name=str(k), value=str(v))
    _outcome_element(tc, r)
    _reruns(tc, r)
    if r.warnings:  # what libraries warned during the item, one line per kind (harness report shows it)
        ET.SubElement(tc, "system-err").text = "\n".join(warning_line(w) for w in r.warnings)


def _outcome_element(tc: ET.Element, r: Row) -> None:
    """<failure> / <error> / <skipped> as pytest's junitxml writes them; nothing for a pass."""
    if r.outcome == "failed":
        ET.SubElement(tc, "failure", message=r.message).text = r.longrepr
    elif r.outcome == "error":
        ET.SubElement(tc, "error", message=r.message).text = r.longrepr
    elif r.outcome == "quarantined":  # still a failure for anyone reading the XML
        tag = "error" if r.props.get("harness.detail.quarantined_outcome") == "error" else "failure"
        ET.SubElement(tc, tag, type="harness.quarantined", message=r.message).text = r.longrepr
    elif r.outcome == "skipped":
        ET.SubElement(tc, "skipped", type="pytest.skip", message=r.message).text = r.message
    elif r.outcome == "xfailed":
        ET.SubElement(tc, "skipped", type="pytest.xfail", message=r.message).text = r.message


def _reruns(tc: ET.Element, r: Row) -> None:
    """The failed attempts of an item harness reran (harness.run.confirm) as Surefire's rerun children
    (``rerunFailure`` / ``rerunError``, as pytest-rerunfailures' readers expect): every failed attempt
    but the one the case itself reports."""
    from harness.run.confirm import attempts_of

    failed = [a for a in attempts_of(r.props) if a.get("outcome") in ("failed", "error")]
    if r.outcome in ("failed", "error", "quarantined"):
        failed = failed[1:]  # the first failed attempt is the case's own <failure> / <error>
    for a in failed:
        tag = "rerunError" if a.get("outcome") == "error" else "rerunFailure"
        ET.SubElement(tc, tag, message=str(a.get("message", ""))).text = str(a.get("message", ""))


# Metric names no module declared (a check that builds names at run time) also get their guessed
# meaning, up to this many per file; past it they are left to the comparator's fallback (one note).
MAX_UNDECLARED_MEANINGS = 256


def meaning_properties(rows: list[Row]) -> list[tuple[str, str]]:
    """``harness.meaning.<metric>`` (unit, direction, description) for every metric the rows
    recorded, so the file alone says how to judge them (``harness compare`` run anywhere, with no
    check imported, reads the same regressions).

    Testsuite-level, one per distinct metric, not per test case: the meaning belongs to the metric,
    not to an item, and repeating it in each of 100,000 cases would add megabytes; this way the size
    is bounded by the declarations (plus :data:`MAX_UNDECLARED_MEANINGS`). Yet it is inside each
    shard's own file, never a sidecar that a merge or an artifact upload can lose."""
    from harness import metrics

    names = sorted({k[len(metrics.PREFIX_METRIC):] for r in rows for k in r.props
                    if isinstance(k, str) and k.startswith(metrics.PREFIX_METRIC)})
    if any(metrics.spec(n) is None for n in names):
        _load_declarations()
    out, undeclared = [], 0
    for n in names:
        if metrics.spec(n) is None:
            undeclared += 1
            if undeclared > MAX_UNDECLARED_MEANINGS:
                continue
        out.append(metrics.meaning_property(metrics.meaning_of(n)))
    return out


def _load_declarations() -> None:
    """Checks declare their metrics when imported. The controlling process has already loaded every
    check (the plugin lists them as options), so this is a lookup there; elsewhere (a caller of
    :func:`junit_xml` that never loaded them) it imports them, so no declared metric is written as
    a guess."""
    import harness.run.isolation  # noqa: F401 - declares leaked_bytes
    from harness.checks import registry

    registry()


STACK = ("torch", "transformers", "accelerate", "harness")


def stack_versions() -> dict[str, str]:
    """The installed versions of the stack under test (package metadata, nothing imported)."""
    from importlib import metadata

    out = {}
    for pkg in STACK:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out
