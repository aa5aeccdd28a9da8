"""A disk that fills during `harness run`: the run ends with a readable, consistent partial result
(run.json ``incomplete`` with the reason, summary.json, junit.xml, whole journal lines), one
error line and a non-zero exit code, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests_support import REPO_SUITES, TINY_PRUNE

TESTS = Path(__file__).resolve().parent.parent

# Injected in the `harness run` process when no tmpfs can be mounted (not root): the journal's
# fsync after N whole lines fails as a full disk makes it fail, once; the reserve is then what the
# summaries are written into, as on a real full disk.
SITECUSTOMIZE = '''
import errno, os, time
_after = int(os.environ.get("INJECT_ENOSPC_AFTER", "0"))
_pause = os.environ.get("PAUSE_AFTER_JOURNAL_IN", "")
_real, _seen = os.fsync, [0]
def _fsync(fd):
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = ""
    if name.endswith("journal.jsonl"):
        _seen[0] += 1
        if _after and _seen[0] == _after + 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        if _pause and _seen[0] == 1:  # the first item journaled: let the other writer fill the disk now
            out = _real(fd)
            open(os.path.join(_pause, "journaled"), "w").close()
            for _ in range(600):
                if os.path.exists(os.path.join(_pause, "filled")):
                    break
                time.sleep(0.1)
            return out
    return _real(fd)
if _after or _pause:
    os.fsync = _fsync
'''


def _suite(adapter: str | None = None) -> str:
    model = '[model]\nconfig = "configs/Llama-3.1-8B.json"\n'
    if adapter:
        model += f'adapter = "faulty_models:{adapter}"\n'
    return 'backends = ["cpu"]\ndtypes = ["float32"]\n' + model + TINY_PRUNE + "\n[checks.smoke]\ngenerate_tokens = 2\n"


def _project(tmp_path: Path, n: int) -> Path:
    import shutil

    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    for i in range(n):
        (tmp_path / "suites" / f"s{i}.toml").write_text(_suite())
    return tmp_path


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


def _fill_when_journaled(results: Path, signals: Path, stop: threading.Event) -> None:
    """Another job fills the disk once the first item is journaled. The run waits for it there
    (PAUSE_AFTER_JOURNAL_IN): watched from outside, the run's 3 other items (0.03 s each) and its
    summaries were sometimes all written before the filler woke (a full test run, 2 workers)."""
    while not stop.is_set():
        if (signals / "journaled").exists():
            with open(results.parent / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 2**20)
                        f.flush()
                        os.fsync(f.fileno())
                except OSError:
                    (signals / "filled").touch()  # outside the full file system
                    return
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_a_disk_that_fills_mid_run_leaves_an_incomplete_readable_run(tmp_path, how):
    """tmpfs: a real 72 MiB file system that another writer fills once the first item is journaled
    (the run then meets ENOSPC at its next write that needs a block: a journal append or the
    summaries); injected: the journal append after the first item fails, so items are left."""
    project = _project(tmp_path, 4)
    disk = tmp_path / "disk"
    # 64 MiB must be free at the start (results.MIN_FREE_BYTES)
    mounted = how == "tmpfs" and _mount_tmpfs(disk, "72m")
    if how == "tmpfs" and not mounted:
        pytest.skip("cannot mount a tmpfs here (not root); the injected case covers the same path")
    results = disk / "results"
    env = _run_env(tmp_path, inject_enospc=not mounted, pause_in=tmp_path if mounted else None)
    stop = threading.Event()
    filler = threading.Thread(target=_fill_when_journaled, args=(results, tmp_path, stop), daemon=True)
    if mounted:
        filler.start()
    try:
        exe = Path(sys.executable).with_name("harness")
        r = subprocess.run([str(exe), "run", "--check", "smoke", "--no-isolate", "--results", str(results)],
                           cwd=project, env=env, capture_output=True, text=True, timeout=240)
        stop.set()
        assert not mounted or (tmp_path / "filled").exists(), r.stdout + r.stderr  # the disk was full meanwhile
        _assert_one_error_line(r)
        _assert_incomplete_results(results, how)
    finally:
        stop.set()
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _run_env(tmp_path: Path, inject_enospc: bool, pause_in: Path | None = None) -> dict[str, str]:
    """The `harness run` environment; with ``inject_enospc`` the journal's fsync after one whole
    line fails as a full disk makes it fail; with ``pause_in`` the run waits after its first journal
    line until the disk is full (SITECUSTOMIZE)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "250",
                        "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if inject_enospc or pause_in:
        inject = tmp_path / "inject"
        inject.mkdir()
        (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env |= {"PYTHONPATH": f"{inject}{os.pathsep}{env['PYTHONPATH']}"}
        env |= {"INJECT_ENOSPC_AFTER": "1"} if inject_enospc else {"PAUSE_AFTER_JOURNAL_IN": str(pause_in)}
    return env


def _assert_one_error_line(r: subprocess.CompletedProcess) -> None:
    """A non-zero exit with one error line naming ENOSPC, never a traceback."""
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "Traceback" not in out and "OSError" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error: run incomplete: ")]
    assert len(errors) == 1 and "No space left on device (ENOSPC)" in errors[0], out


def _assert_incomplete_results(results: Path, how: str) -> None:
    """run.json, summary.json, junit.xml and summary.txt agree that the run is incomplete and why;
    the journal holds whole lines of finished items only; the reserve file is gone."""
    run = json.loads((results / "run.json").read_text())
    assert run["status"] == "incomplete", run
    assert re.search(r"cannot write results: [\w.-]+: No space left on device \(ENOSPC\)", run["reason"]), run
    summary = json.loads((results / "summary.json").read_text())
    assert summary["status"] == "incomplete" and summary["reason"] == run["reason"]
    finished = {i["nodeid"] for i in summary["items"]}
    assert finished and len(finished) + len(summary["not_run"]) == 4
    if how == "injected":  # the run stopped at once: the rest is listed as not run, never as passed
        assert "journal.jsonl: No space left on device (ENOSPC) after 2 item(s)" in run["reason"], run
        assert len(finished) == 2 and len(summary["not_run"]) == 2, summary
    root = ET.parse(results / "junit.xml").getroot()
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["harness.run.status"] == "incomplete"
    assert len(root.findall(".//skipped[@type='harness.not-run']")) == len(summary["not_run"])
    # the journal holds whole lines only, each a finished item the summary also lists
    lines = (results / "journal.jsonl").read_text().splitlines()
    assert {json.loads(line)["nodeid"] for line in lines} <= finished
    assert "incomplete" in (results / "summary.txt").read_text()
    assert not (results / ".harness-reserve").exists()


@pytest.mark.parametrize("how", ["plugin"])
def test_plain_pytest_with_harness_results_exits_non_zero_when_results_are_lost(tmp_path, how):
    """`pytest --harness-results DIR` (no harness command): the same incomplete run, and pytest's
    exit status is not 0 although every item passed."""
    project = _project(tmp_path, 2)
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "INJECT_ENOSPC_AFTER": "1",
                        "PYTHONPATH": f"{inject}{os.pathsep}{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    results = tmp_path / "res"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "suites",
                        "--harness-check=smoke", "--harness-isolate=off", f"--harness-results={results}"],
                       cwd=project, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode != 0, r.stdout + r.stderr
    run = json.loads((results / "run.json").read_text())
    assert run["status"] == "incomplete" and "ENOSPC" in run["reason"]
    assert json.loads((results / "summary.json").read_text())["status"] == "incomplete"
