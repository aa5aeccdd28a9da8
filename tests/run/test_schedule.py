"""Items over xdist workers (harness/run/schedule.py): the longest expected start first, one per worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness.run import schedule
from tests_support import REPO

# Where each item starts: a real pytest plugin, loaded by `-p` in every xdist worker.
START_LOG_PLUGIN = '''
import os

def pytest_runtest_setup(item):
    with open(os.environ["START_LOG"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {item.nodeid}\\n")
'''


def test_check_of_an_item_id():
    assert schedule.check_of("new/dsv4.toml::compile[cpu-float32-frontend]") == "compile"
    assert schedule.check_of("suites/kimi-k2.toml::smoke") == "smoke"
    assert schedule.check_of("tests/x.py") == ""
    # recorded beats the check's scale; unrecorded compile items are expected longer than smoke ones
    e = schedule.expected_of(["a.toml::compile[x]", "a.toml::smoke[x]", "a.toml::ops[x]"], {"a.toml::ops[x]": 99.0})
    assert e["a.toml::ops[x]"] == 99.0 and e["a.toml::compile[x]"] > e["a.toml::smoke[x]"]


def test_longest_expected_items_start_first_on_different_workers(tmp_path):
    """Two long items next to each other, collected late: xdist's own `load` scheduler gives the
    first workers the first items of the collection (here: llama's), so the long pair would start
    late and could share a worker; recorded as 100 s each, they start first, one on each worker."""
    long = ["suites/qwen3-8b.toml::smoke[cpu-float32]", "suites/qwen3-8b.toml::smoke[cpu-bfloat16]"]
    every = [f"suites/{s}.toml::{c}[cpu-{d}]" for s in ("llama-3.1-8b", "qwen3-8b") for c in ("smoke", "precision")
             for d in ("float32", "bfloat16")]
    (tmp_path / "durations.json").write_text(json.dumps({"durations": {i: 100.0 if i in long else 0.5 for i in every}}))
    (tmp_path / "harness.toml").write_text(f'durations_file = "{tmp_path / "durations.json"}"\n')
    (tmp_path / "startlog.py").write_text(START_LOG_PLUGIN)
    log = tmp_path / "starts.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(tmp_path / "harness.toml"),
           "START_LOG": str(log), "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "harness", "run", "llama-3.1-8b", "qwen3-8b", "--backend", "cpu",
                        "--check", "smoke", "--check", "precision", "--dtype", "float32", "--dtype", "bfloat16",
                        "-n", "2", "--no-isolate", "--results", str(tmp_path / "results"), "--", "-p", "startlog"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    starts = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert len(starts) == 8, starts
    first = {}
    for worker, nodeid in starts:
        first.setdefault(worker, nodeid)
    assert sorted(first) == ["gw0", "gw1"] and sorted(first.values()) == sorted(long), starts


def test_a_run_without_n_uses_the_cores_only_when_the_recorded_work_is_worth_a_second_process(monkeypatch):
    """`harness run` on the bundled suites (minutes of recorded work) takes every core, up to 4; a
    short or unrecorded run (a test's, a new suite's) stays in one process; one core: one process."""
    from pathlib import Path

    from harness.run import schedule

    monkeypatch.setattr(schedule.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    rec = {"suites/a.toml::compile[cpu-float32]": 50.0, "suites/a.toml::smoke[cpu-float32]": 15.0,
           "suites/b.toml::smoke[cpu-float32]": 5.0, "suites/a.toml::smoke[cuda-float32]": 100.0}
    a, b = Path("suites/a.toml"), Path("suites/b.toml")
    assert schedule.default_workers([a, b], ["cpu"], rec) == 2  # 70 s on the cpu
    assert schedule.default_workers([b], ["cpu"], rec) is None  # 5 s: not worth a second process
    assert schedule.default_workers([Path("new.toml")], ["cpu"], rec) is None  # nothing recorded
    assert schedule.default_workers([b], [], rec) is None
    assert schedule.default_workers([a], [], rec) == 2  # no --backend: every backend's record counts
    assert schedule.default_workers([a, b], ["cpu"], rec, ["smoke"]) is None  # --check smoke: 20 s
    monkeypatch.setattr(schedule.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert schedule.default_workers([a], ["cpu"], rec) == schedule.MAX_DEFAULT_WORKERS
    monkeypatch.setattr(schedule.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert schedule.default_workers([a], ["cpu"], rec) is None
