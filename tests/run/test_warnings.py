"""A quiet console: what libraries warn during an item is recorded with it (junit.xml's <system-err>,
the journal) and summarised once at the end of ``harness run``, never printed between the progress
lines; harness's own warnings stay on the console. Real runs of ``harness run`` in a subprocess, with
isolation and without, on a tiny suite whose model code (a module outside harness) warns."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.run.execute import HarnessWarning, LibraryWarnings
from harness.run.results import junit_xml, scrub_row
from harness.run.rows import ItemResult, Row
from harness.run.table import warnings_block
from tests_support import REPO_SUITES, smoke_suite

LIBRARY_TEXT = "attention mask not given; inferring it from the padding (library-style warning)"
LOG_TEXT = "guard on a global hook was dropped (library-style log record)"
OWN_TEXT = "harness-own warning: this item used a fallback path"

# The model code: a module outside harness, as a vendor's adapter or a library is. It warns 3 times from
# one line while building (one kind, counted 3), logs twice on a torch logger (which has its own stderr
# handler: nothing reaches the root logger) and raises one warning of harness's own class.
MODELS = f'''
import logging
import warnings

from transformers import LlamaForCausalLM

from harness.run.execute import HarnessWarning


def noisy(config, dtype, device):
    for _ in range(3):
        warnings.warn({LIBRARY_TEXT!r}, UserWarning)
    for _ in range(2):
        logging.getLogger("torch._dynamo.warny").warning({LOG_TEXT!r})
    warnings.warn({OWN_TEXT!r}, HarnessWarning)
    return LlamaForCausalLM(config)
'''
WARN_LINE = MODELS.splitlines().index(f"        warnings.warn({LIBRARY_TEXT!r}, UserWarning)") + 1


@pytest.fixture
def project(tmp_path) -> Path:
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "warny_models.py").write_text(MODELS)
    (tmp_path / "suites" / "noisy.toml").write_text(smoke_suite("warny_models:noisy"))
    return tmp_path


def harness_run(project: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "200",
                        "PYTHONPATH": f"{project}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([str(exe), "run", "--check", "smoke", "--results", "res", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("mode", [
    pytest.param([], id="isolated"),
    pytest.param(["--no-isolate"], id="in-process"),
    pytest.param(["-n", "2"], id="xdist-2", marks=pytest.mark.slow),
])
def test_library_warnings_are_recorded_with_the_item_and_summarised_once(project, mode):
    r = harness_run(project, *mode)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # the journal row carries them as data, counted: the smoke check builds its model more than once
    (row,) = [json.loads(line) for line in (project / "res" / "journal.jsonl").read_text().splitlines()]
    assert row["outcome"] == "passed"
    builds = row["warnings"][0]["count"] // 3
    assert builds >= 1 and row["warnings"] == [
        {"category": "UserWarning", "message": LIBRARY_TEXT, "source": f"warny_models.py:{WARN_LINE}",
         "count": 3 * builds},
        {"category": "logging.WARNING", "message": LOG_TEXT, "source": "torch._dynamo.warny", "count": 2 * builds}]
    assert OWN_TEXT not in json.dumps(row)
    # junit.xml: the testcase's <system-err>, one line per kind, with its count and where it came from
    case = ET.parse(project / "res" / "junit.xml").getroot().find(".//testcase")
    assert case.find("system-err").text.splitlines() == [
        f"{3 * builds} x UserWarning: {LIBRARY_TEXT} [warny_models.py:{WARN_LINE}]",
        f"{2 * builds} x logging.WARNING: {LOG_TEXT} [torch._dynamo.warny]"]
    # not printed while the item ran, on either stream: only the end's summary names it, once
    assert LIBRARY_TEXT not in r.stderr and LOG_TEXT not in r.stderr, r.stderr
    assert r.stdout.count(LIBRARY_TEXT) == 1 and r.stdout.count(LOG_TEXT) == 1, r.stdout
    lines = r.stdout.splitlines()
    head = lines.index(f"{5 * builds} library warnings in 1 item (2 kinds), recorded with each item in res/junit.xml:")
    assert head > max(i for i, line in enumerate(lines) if line.startswith("└")), r.stdout  # after the table
    width = len(str(3 * builds))
    assert lines[head + 1:head + 3] == [f"  {3 * builds:>{width}} x UserWarning: {LIBRARY_TEXT[:100]}",
                                        f"  {2 * builds:>{width}} x logging.WARNING: {LOG_TEXT[:100]}"], r.stdout
    assert lines[head + 3].startswith("1 passed"), r.stdout
    assert lines[head] in (project / "res" / "summary.txt").read_text()
    # harness's own warning stays on the console (the worker's stderr, or printed by harness run).
    # Not under xdist: an xdist worker's pytest captures its isolated child's stderr as the item's
    if "-n" not in mode:
        assert OWN_TEXT in out, out


# --- the pieces, in-process -----------------------------------------------------------------------


def _library_code(n: int) -> None:
    for _ in range(n):
        warnings.warn("from a library", FutureWarning, stacklevel=1)


def test_counted_by_kind_and_nothing_left_changed_afterwards():
    before = (list(warnings.filters), warnings.showwarning, logging.Logger.handle)
    log = logging.getLogger("torch._inductor.warny")
    with LibraryWarnings() as caught:
        _library_code(4)
        log.warning("once %s", "formatted")
        log.error("an error stays on the console")  # not counted: ERROR and above are shown
        with pytest.raises(ZeroDivisionError):  # a failing item still has its record
            raise ZeroDivisionError
    assert (list(warnings.filters), warnings.showwarning, logging.Logger.handle) == before
    got = caught.records()
    assert [(w["category"], w["message"], w["count"]) for w in got] == [
        ("FutureWarning", "from a library", 4), ("logging.WARNING", "once formatted", 1)]
    assert got[0]["source"].endswith(f"test_warnings.py:{_library_code.__code__.co_firstlineno + 2}")
    assert got[1]["source"] == "torch._inductor.warny"


def test_ignore_and_error_filters_keep_their_meaning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="quiet please")
        warnings.filterwarnings("error", category=RuntimeWarning)
        with LibraryWarnings() as caught:
            warnings.warn("quiet please", UserWarning, stacklevel=1)
            with pytest.raises(RuntimeWarning):
                warnings.warn("loud", RuntimeWarning, stacklevel=1)
    assert caught.records() == []


def test_harness_own_warnings_pass_through_once_per_item():
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        with LibraryWarnings() as caught:
            for _ in range(3):
                warnings.warn("ours", HarnessWarning, stacklevel=1)
    assert [str(w.message) for w in outer] == ["ours"]
    assert caught.records() == []


def test_a_warning_in_compiled_code_adds_no_graph_break():
    """The capture's hooks are Python frames dynamo sees when a compiled function warns: they must not
    change what the compile check counts (graph breaks, graphs)."""
    import torch
    from torch._dynamo.utils import counters

    def f(x):
        warnings.warn("inside a compiled region", stacklevel=1)
        logging.getLogger("torch._dynamo.warny").warning("logged inside a compiled region")
        return x * 2

    def compile_and_run(capture: bool):
        torch._dynamo.reset()
        counters.clear()
        g = torch.compile(f, backend="eager")
        with LibraryWarnings() if capture else warnings.catch_warnings(record=True) as caught:
            for _ in range(3):
                g(torch.ones(3))
        return dict(counters["graph_break"]), counters["stats"]["unique_graphs"], caught

    *counted, caught = compile_and_run(capture=True)
    assert [(w["message"], w["count"]) for w in caught.records()] == [
        ("inside a compiled region", 3), ("logged inside a compiled region", 3)]
    assert tuple(counted) == compile_and_run(capture=False)[:2]


def test_item_result_carries_them_over_the_workers_pipe():
    w = [{"category": "UserWarning", "message": "m", "source": "x.py:3", "count": 2}]
    r = ItemResult("passed", warnings=w)
    back = ItemResult.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and back.warnings == w
    assert ItemResult.from_json({"outcome": "passed"}).warnings == []  # a result without any


def test_system_err_lines_are_scrubbed_and_the_summary_keeps_the_top_five():
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345"
    rows = [Row(f"suites/s.toml::smoke[cpu-float32-{i}]", "passed", warnings=[
        {"category": "UserWarning", "message": f"kind {k}" + (f" token {token}" if k == 0 else ""),
         "source": "lib.py:1", "count": k + 1} for k in range(7)]) for i in range(2)]
    for row in rows:
        scrub_row(row)
    xml = junit_xml(rows, [], "complete", 1.0)
    assert token not in xml
    err = ET.fromstring(xml).find(".//testcase/system-err").text.splitlines()
    assert err[0] == "1 x UserWarning: kind 0 token *** [lib.py:1]" and len(err) == 7
    block = warnings_block(rows, "res/junit.xml")
    assert block[0] == "56 library warnings in 2 items (7 kinds), recorded with each item in res/junit.xml:"
    assert block[1:] == [f"  {2 * (k + 1):>2} x UserWarning: kind {k}" for k in (6, 5, 4, 3, 2)] + ["  ... and 2 more"]
    assert warnings_block([Row("a", "passed")], "j") == []
