"""`harness baseline update` and `harness durations update` check that their output folder takes
files before they read anything, and say so in one line (a read-only folder used to end in a
traceback at write time)."""

from __future__ import annotations

import json

from harness.cli import main
from tests_support import read_only


def _one_error_line(capsys, start: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(start), err


def test_baseline_update_into_a_read_only_golden_folder(tmp_path, capsys):
    with read_only(tmp_path / "golden") as ro:
        assert main(["baseline", "update", str(tmp_path / "results"), "--golden-dir", str(ro)]) == 2
    _one_error_line(capsys, f"error: perf baseline directory {ro / 'perf'} is not writable")


def test_durations_update_into_a_read_only_folder(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    (results / "summary.json").write_text(json.dumps({"items": [
        {"nodeid": "suites/x.toml::smoke[cpu-float32]", "outcome": "passed", "duration": 1.5}]}))
    with read_only(tmp_path / "ro") as ro:
        assert main(["durations", "update", str(results), "--file", str(ro / "durations.json")]) == 2
    _one_error_line(capsys, f"error: durations file's folder {ro} is not writable")
    # the same into a writable folder records it
    out = tmp_path / "ok" / "durations.json"
    assert main(["durations", "update", str(results), "--file", str(out)]) == 0
    assert json.loads(out.read_text())["durations"] == {"suites/x.toml::smoke[cpu-float32]": 1.5}
