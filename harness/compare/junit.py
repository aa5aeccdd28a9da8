"""Read the JUnit XML of every shard (as pytest's ``--junitxml`` writes it) and merge them.

Bad input never raises: a missing shard, a file that is not XML, or a file cut off mid-write (a
runner killed by the OOM killer) each add a plain-language line to ``Results.problems`` and the
test cases that could be read are kept, so the report is partial rather than absent.

A test's identity (suite, check, backend, dtype, variant, device) comes from the ``harness.*``
JUnit properties every harness item records at setup, before any skip. Only old XML without them
falls back to reading the test id (``suites.<suite>.toml::<check>[<backend>-<dtype>]``); the dtype
is the part after the *last* hyphen, so a backend named ``my-npu`` survives that too.

What each metric means (unit, direction) comes from the files too: the ``harness.meaning.*``
testsuite properties the run wrote (``Results.meanings``), so no check needs importing to judge it.
Shards that disagree, or a meaning that does not parse, are warnings.

Text from a run (failure messages, logs, captured output) is scrubbed of secrets *before* it is
cut to size: a cut must never leave the tail of a token behind.

The same test id may appear several times: pytest-rerunfailures, a retried CI attempt, or two
attempt folders passed together. Mixed outcomes make the test *flaky*; its final outcome is
``passed`` if any attempt passed.

A ``metric.*`` or ``tolerance.*`` property whose value is not a number (``"abc"``, empty) is left
out of that case and named in ``Results.warnings`` (file, test, property, value): a warning, not a
problem, because the rest of the file was read whole and the shard is not partial. It is never
compared as NaN (``"nan"`` and ``"inf"`` themselves are numbers: a check may record them).
"""

from __future__ import annotations

import gc
import glob
import hashlib
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from junitparser import JUnitXml, JUnitXmlError, TestCase, TestSuite

from harness.compare.scrub import scrub
from harness.metrics import (
    PREFIX_MEANING,
    PREFIX_METRIC,
    PREFIX_TOLERANCE,
    MetricSpec,
    parse_meaning,
    parse_properties,
)

# Surefire-style rerun children (pytest-rerunfailures and others use them): the case was retried.
_RERUN_TAGS = {"rerunFailure", "rerunError", "flakyFailure", "flakyError"}
_RESULT_RANK = {"skipped": 1, "failure": 2, "error": 3}  # an error outranks a failure
_OUTCOME = {"skipped": "skipped", "failure": "failed", "error": "error"}
_LOG_LIMIT = 4000  # characters of failure text kept per case; the issue body shows excerpts


@dataclass(slots=True)
class Case:
    key: str  # "<classname>::<name>", unique across the run
    name: str
    classname: str
    outcome: str  # passed | failed | error | skipped
    suite: str
    check: str
    backend: str
    dtype: str
    device: str
    variant: str
    metrics: dict[str, float]
    tolerances: dict[str, float]
    details: dict[str, str]
    message: str = ""
    log: str = ""
    time: float = 0.0
    flaky: bool = False
    attempts: int = 1
    # property name -> its value, for metric./tolerance. properties that are not numbers: left out
    # of ``metrics``/``tolerances`` and reported as a warning by the reader.
    invalid: dict[str, str] = field(default_factory=dict)
    # the item's <system-err> (its captured library warnings), scrubbed and cut: `harness report` shows it
    stderr: str = ""


@dataclass
class Results:
    cases: dict[str, Case] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    # True when some input could not be read whole (a shard missing, cut off, not JUnit, fewer
    # files than expected): a test absent from this run then counts as not run, never as vanished.
    partial: bool = False
    # the stack each file was run with (``harness.stack.<package>`` testsuite properties): package ->
    # the versions seen (one, unless shards ran different installs)
    stack: dict[str, set[str]] = field(default_factory=dict)
    # files whose run did not finish (``harness.run.status`` interrupted / incomplete: the job's time
    # limit, a cancelled or lost runner, a full disk): (file, status, reason, items not run, backends)
    cut_off: list[tuple[str, str, str, int, list[str]]] = field(default_factory=list)
    # Input that was read but is wrong in one place (a metric that is not a number): named, shown
    # in the summary, and *not* a reason to call the input partial.
    warnings: list[str] = field(default_factory=list)
    # what each metric means (unit, direction), as the run that measured it wrote it into its files
    # (``harness.meaning.*`` testsuite properties, harness/metrics.py); empty for older XML
    meanings: dict[str, MetricSpec] = field(default_factory=dict)

    def suites(self) -> set[str]:
        return {c.suite for c in self.cases.values()}

    def groups_present(self) -> set[tuple[str, str]]:
        return {(c.suite, c.backend) for c in self.cases.values()}


def expand(paths: list[str]) -> list[str]:
    """Directories become every ``*.xml`` below them (sorted); globs are expanded; a path that does
    not exist is kept so that :func:`read_results` reports it as a missing shard."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out.extend(sorted(glob.glob(os.path.join(p, "**", "*.xml"), recursive=True)))
        elif any(ch in p for ch in "*?["):
            out.extend(sorted(glob.glob(p)))
        else:
            out.append(p)
    return out


def digest(paths: list[str]) -> str:
    """Content digest of the files behind ``paths`` (order does not matter); '' if any is missing."""
    parts = []
    for path in expand(paths):
        try:
            with open(path, "rb") as f:
                parts.append(hashlib.file_digest(f, "sha256").hexdigest())
        except OSError:
            return ""
    return hashlib.sha256("".join(sorted(parts)).encode()).hexdigest() if parts else ""


def read_results(paths: list[str], expect_shards: int | None = None) -> Results:
    res = Results()
    files = expand(paths)
    # The objects built here hold no reference cycles, yet the cyclic collector keeps rescanning the
    # growing heap: pausing it cuts reading 100,000 cases by a third.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        _read_all(files, res)
    finally:
        if was_enabled:
            gc.enable()
    if not files:
        res.problems.append(f"no JUnit XML files found in {', '.join(paths) or '(nothing given)'}")
        res.partial = True
    read = [f for f in res.files if os.path.isfile(f)]  # a named but missing file is not a shard
    if expect_shards is not None and len(read) < expect_shards:
        res.problems.append(f"expected {expect_shards} shard files but found {len(read)}: "
                            "a shard is missing, its results are not in this report")
        res.partial = True
    return res


def _read_all(files: list[str], res: Results) -> None:
    for path in files:
        res.files.append(path)
        before = len(res.problems)
        run: dict[str, str] = {}
        meanings: dict[str, str] = {}
        cases = _read_file(path, res.problems, res.stack, run, meanings)
        _add_meanings(res, path, meanings)
        if run.get("status") in ("interrupted", "incomplete"):
            ran = {c.backend for c in cases if c.outcome != "skipped"}  # not-run items carry no identity
            res.cut_off.append((path, run["status"], run.get("reason", ""), int(run.get("not_run", "0") or 0),
                                sorted(ran or {c.backend for c in cases})))
        for case in cases:
            for prop, value in case.invalid.items():
                res.warnings.append(invalid_value_warning(path, case.key, prop, value))
            _merge(res.cases, case)
        res.partial |= len(res.problems) > before  # this file could not be read whole



def _read_file(path: str, problems: list[str], stack: dict[str, set[str]] | None = None,
               run: dict[str, str] | None = None, meanings: dict[str, str] | None = None) -> list[Case]:
    if not os.path.exists(path):
        problems.append(f"{path}: shard missing (file does not exist); its tests count as not run")
        return []
    try:
        xml = JUnitXml.fromfile(path)
    except ET.ParseError as e:
        cases = _salvage(path, meanings)
        problems.append(f"{path}: malformed or truncated XML ({e}); kept the {len(cases)} complete "
                        "test cases before the damage")
        return cases
    except JUnitXmlError:
        problems.append(f"{path}: well-formed XML but not JUnit (no <testsuites>/<testsuite> root)")
        return []
    except OSError as e:
        problems.append(f"{path}: cannot read ({e.strerror or e})")
        return []
    # junitparser wraps a lone <testsuite> root in <testsuites>, so one loop serves both shapes.
    suites = [s for s in xml if isinstance(s, TestSuite)]
    for s in suites:
        for p in s.properties():
            name = p.name or ""
            if stack is not None and name.startswith("harness.stack."):
                stack.setdefault(name.removeprefix("harness.stack."), set()).add(str(p.value))
            elif run is not None and name.startswith("harness.run."):
                run[name.removeprefix("harness.run.")] = str(p.value)
            elif meanings is not None and name.startswith(PREFIX_MEANING):
                meanings[name] = str(p.value)
    return [_case(tc) for s in suites for tc in s]


def _add_meanings(res: Results, path: str, raw: dict[str, str]) -> None:
    """The file's metric meanings into ``res.meanings``. The first file to declare a metric wins;
    shards that disagree (run by different harness versions) or a meaning that does not parse is
    one warning each, never a problem: every number in the file was still read."""
    for prop, value in raw.items():
        s = parse_meaning(prop, value)
        if isinstance(s, str):
            res.warnings.append(f"{path}: {scrub(s)}; judged as if the file said nothing about it")
            continue
        old = res.meanings.setdefault(s.name, s)
        if (old.unit, old.direction) != (s.unit, s.direction):
            res.warnings.append(f"{path}: metric '{s.name}' means {s.direction} ({s.unit or 'no unit'}) here but "
                                f"{old.direction} ({old.unit or 'no unit'}) in an earlier file; the earlier one is used")


def invalid_value_warning(path: str, key: str, prop: str, value: str) -> str:
    """One line naming a property value that is not a number. The value is scrubbed (it came from a
    run and may be anything, a token included), then cut, and quoted so an empty value is visible."""
    shown = scrub(value)
    shown = (shown if len(shown) <= 60 else shown[:60] + "...").replace("\r", "\\r").replace("\n", "\\n")
    what = "metric" if prop.startswith(PREFIX_METRIC) else "tolerance"
    return (f"{path}: {key}: {what} '{prop.split('.', 1)[1]}' is not a number ('{shown}'); "
            "left out of the comparison, the test's other metrics are compared")


def _salvage(path: str, meanings: dict[str, str] | None = None) -> list[Case]:
    """Keep every ``<testcase>`` that closed before the parse error (and the metric meanings, which
    the writer puts before them)."""
    out: list[Case] = []
    try:
        for _event, elem in ET.iterparse(path, events=("end",)):
            if elem.tag == "testcase":
                out.append(_case(TestCase.fromelem(elem)))
            elif meanings is not None and elem.tag == "property" and \
                    elem.get("name", "").startswith(PREFIX_MEANING):
                meanings[elem.get("name")] = elem.get("value", "")
    except ET.ParseError:
        pass
    return out


def _case(tc: TestCase) -> Case:
    # junitparser finds the test cases; their few children are read straight off the element
    # junitparser wraps (``_elem``): building a wrapper object per <property> and per result costs
    # more than the XML parse itself at 100,000 cases (see benchmarks/bench_compare.py).
    elem = tc._elem
    props: list[tuple[str, str]] = []
    outcome, message, log, output, reruns, err = "passed", "", "", "", 0, ""
    for child in elem:
        tag = child.tag
        if tag == "properties":
            props = [(p.get("name", ""), p.get("value", "")) for p in child]
        elif tag in _RESULT_RANK:
            if _RESULT_RANK[tag] > _RESULT_RANK.get(outcome, 0) or outcome == "passed":
                outcome = _OUTCOME[tag]
                message, log = child.get("message", ""), child.text or ""
        elif tag in _RERUN_TAGS:
            reruns += 1
        elif tag in ("system-out", "system-err") and child.text:
            output += child.text + "\n"  # pytest -o junit_logging=...
            if tag == "system-err":
                err += child.text
    parsed = parse_properties(props)
    invalid = _not_numbers(parsed, props)
    meta = parsed["meta"]
    classname, name = elem.get("classname", ""), elem.get("name", "")
    try:
        duration = float(elem.get("time", 0) or 0)
    except ValueError:
        duration = 0.0
    if outcome != "passed" or (reruns and (message or log)):
        text = log + ("\n--- captured output ---\n" + output if output and outcome != "passed" else "")
        message, text = scrub(message)[:_LOG_LIMIT], scrub(text)[-_LOG_LIMIT:]  # scrub, then cut
    else:
        message, text = "", ""
    ident = meta if "backend" in meta else {**_identity_from_id(classname, name), **meta}
    return Case(
        key=f"{classname}::{name}", name=name, classname=classname, outcome=outcome,
        suite=ident.get("suite") or "unknown", check=ident.get("check") or name.split("[", 1)[0],
        backend=ident.get("backend") or "unknown", dtype=ident.get("dtype", ""),
        device=ident.get("device", ""), variant=ident.get("variant", ""),
        metrics=parsed["metrics"], tolerances=parsed["tolerances"], details=parsed["details"],
        message=message, time=duration, log=text,
        flaky=reruns > 0 and outcome == "passed", attempts=1 + reruns, invalid=invalid,
        stderr=scrub(err)[:_LOG_LIMIT] if err.strip() else "",
    )


def _not_numbers(parsed: dict, props: list[tuple[str, str]]) -> dict[str, str]:
    """Take the ``metric.*``/``tolerance.*`` properties whose text ``float()`` refused (``"abc"``,
    ``""``; parse_properties made them NaN) out of ``parsed``; return them, name -> text. Only a
    NaN is looked at twice (a check may write ``nan`` on purpose), so 100,000 cases cost nothing."""
    out: dict[str, str] = {}
    raw = None
    for group, prefix in (("metrics", PREFIX_METRIC), ("tolerances", PREFIX_TOLERANCE)):
        values = parsed[group]
        for name in [n for n, v in values.items() if v != v]:
            raw = dict(props) if raw is None else raw  # the last of repeated names, as parsed
            text = raw.get(prefix + name, "")
            try:
                float(text)
            except (TypeError, ValueError):
                out[prefix + name] = text
                del values[name]  # never compare a NaN that was text
    return out


def _identity_from_id(classname: str, name: str) -> dict[str, str]:
    """Old XML without the identity properties: ``suites.<suite>.toml`` and
    ``<check>[<backend>-<dtype>]``. The dtype never has a hyphen, the backend may (``my-npu``)."""
    stem = classname[: -len(".toml")] if classname.endswith(".toml") else classname
    out = {"suite": (stem.split(".", 1)[1] if stem.startswith("suites.") else stem) or "unknown"}
    check, _, params = name.partition("[")
    out["check"] = check
    if params.endswith("]"):
        backend, _, dtype = params[:-1].rpartition("-")
        if backend:
            out["backend"], out["dtype"] = backend, dtype
    return out


def _merge(cases: dict[str, Case], new: Case) -> None:
    old = cases.get(new.key)
    if old is None:
        cases[new.key] = new
        return
    passed = [c for c in (old, new) if c.outcome == "passed"]
    bad = [c for c in (old, new) if c.outcome in ("failed", "error")]
    keep = passed[-1] if passed else new
    keep.attempts = old.attempts + new.attempts
    keep.flaky = old.flaky or new.flaky or bool(passed and bad)
    if keep.flaky and bad and not keep.log:
        keep.message, keep.log = bad[-1].message, bad[-1].log  # show what the failed attempt said
    cases[new.key] = keep


def attempt_counts(case: Case) -> tuple[int, int]:
    """(failed attempts, attempts) of a case: harness's own record of its confirming reruns
    (``harness.detail.confirm_attempts``, harness.run.confirm) where it has one, else its JUnit rerun
    children (pytest-rerunfailures) and final outcome."""
    import json

    try:
        rec = json.loads(case.details.get("confirm_attempts") or "[]")
    except ValueError:
        rec = []
    if isinstance(rec, list) and rec and all(isinstance(a, dict) for a in rec):
        return sum(a.get("outcome") in ("failed", "error") for a in rec), len(rec)
    return case.attempts - (1 if case.outcome == "passed" else 0), case.attempts
