"""``harness server``: commands run in forks of a warm process, with real processes throughout - the
command's status and streams, its settings read anew, its isolated worker a fork too, Ctrl-C and a
killed command, another environment meeting no server, stop and the idle end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from harness.cli.server import VOLATILE_ENV, server_key
from tests_support import REPO_SUITES, TINY_PRUNE

TESTS = Path(__file__).resolve().parent.parent  # tests/: faulty_models.py
HARNESS = str(Path(sys.executable).with_name("harness"))


def suite(adapter: str | None = None) -> str:
    model = '[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + (f'adapter = "faulty_models:{adapter}"\n' if adapter else "")
    return 'backends = ["cpu"]\ndtypes = ["float32"]\n' + model + TINY_PRUNE + "\n[checks.smoke]\ngenerate_tokens = 2\n"


def harness(env: dict, cwd: Path, *args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([HARNESS, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kw)


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for t in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except OSError:
            pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A project (a healthy suite, a hanging one) and a server started for its environment; the
    environment carries a variable of its own, so no other test's commands meet this server."""
    project = tmp_path_factory.mktemp("served")
    shutil.copytree(REPO_SUITES / "configs", project / "suites" / "configs")
    (project / "suites" / "a-healthy.toml").write_text(suite())
    (project / "suites" / "b-hangs.toml").write_text(suite("hang"))
    (project / "harness.toml").write_text('results_dir = "out-a"\n')
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "250", "HARNESS_CONFIG": str(project / "harness.toml"),
                        "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                        "HARNESS_TEST_SERVER": uuid.uuid4().hex}
    r = harness(env, project, "server", "start", "--idle", "10")
    assert r.returncode == 0 and "ready in" in r.stdout, r
    pid = int(r.stdout.split("pid ")[1].split(",")[0])
    yield project, env, pid
    harness(env, project, "server", "stop")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def served_count(env: dict, cwd: Path) -> int:
    r = harness(env, cwd, "server", "status")
    assert r.returncode == 0, r
    return int(r.stdout.split(" command(s) served")[0].rsplit(" ", 1)[1])


def test_a_command_runs_in_the_server_with_its_status_streams_and_settings(served):
    project, env, _ = served
    before = served_count(env, project)
    r = harness(env, project, "run", "a-healthy", "--check", "smoke")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 0 failed" in r.stdout
    assert json.loads((project / "out-a" / "summary.json").read_text())["counts"]["passed"] == 1
    # harness.toml is read anew by every command, as by a fresh process
    (project / "harness.toml").write_text('results_dir = "out-b"\n')
    r = harness(env, project, "run", "a-healthy", "--check", "smoke")
    assert r.returncode == 0 and (project / "out-b" / "summary.json").exists(), r.stdout + r.stderr
    # a refusal: its status and its own stream
    r = harness(env, project, "run", "no-such-suite")
    assert r.returncode == 2 and "no-such-suite" in r.stdout + r.stderr, r
    r = harness(env, project, "no-such-command")  # argparse's exit, on standard error only
    assert r.returncode == 2 and "invalid choice: 'no-such-command'" in r.stderr and not r.stdout, r
    assert served_count(env, project) == before + 4


def test_another_environment_meets_no_server(served):
    project, env, _ = served
    before = served_count(env, project)
    other = env | {"OMP_NUM_THREADS": "7"}  # read at import: a server imported without it would not do
    r = harness(other, project, "server", "status")
    assert r.returncode == 1 and "none for this environment" in r.stdout
    assert harness(other, project, "validate", "a-healthy").returncode == 0  # ran here, not there
    # what a shell changes by itself is not part of the key
    assert harness(env | {"OLDPWD": "/elsewhere", "SHLVL": "7"}, project, "validate", "a-healthy").returncode == 0
    assert served_count(env, project) == before + 1


def _start_hanging_run(project: Path, env: dict, results: str, server_pid: int) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([HARNESS, "run", "--check", "smoke", "--timeout", "600", "--results", results],
                            cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    journal = project / results / "journal.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the healthy item done, the hanging one under way
        if journal.exists() and journal.read_text().count("\n") >= 1:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    else:
        pytest.fail("the healthy item never finished")
    time.sleep(1)
    command = _children(server_pid)
    assert len(command) == 1, command
    workers = _children(command[0])
    # the command's isolated worker is a fork of the server too, not a new interpreter
    assert workers and all("harness.cli.server" in _cmdline(w) for w in workers), [_cmdline(w) for w in workers]
    return proc, command + workers


def test_ctrl_c_reaches_the_command_and_its_run_ends_interrupted(served):
    project, env, server_pid = served
    proc, kids = _start_hanging_run(project, env, "res-int", server_pid)
    try:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    summary = json.loads((project / "res-int" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["reason"] == "SIGINT received"
    assert [r["outcome"] for r in summary["items"]] == ["passed"]
    time.sleep(1)
    assert not [k for k in kids if Path(f"/proc/{k}").exists()], "the command outlived its Ctrl-C"


def test_a_killed_command_takes_its_run_with_it(served):
    project, env, server_pid = served
    proc, kids = _start_hanging_run(project, env, "res-kill", server_pid)
    proc.kill()  # SIGKILL: nothing of the command's own runs
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and [k for k in kids if Path(f"/proc/{k}").exists()]:
        time.sleep(0.2)
    assert not [k for k in kids if Path(f"/proc/{k}").exists()], "the run outlived its command"
    assert "0 running" in harness(env, project, "server", "status").stdout


def test_stop_and_the_idle_end(tmp_path):
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HARNESS_TEST_SERVER": uuid.uuid4().hex}
    r = harness(env, tmp_path, "server", "start", "--idle", "0.03")  # 1.8 s
    assert r.returncode == 0, r
    assert "already running" in harness(env, tmp_path, "server", "start").stdout
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and harness(env, tmp_path, "server", "status").returncode == 0:
        time.sleep(0.5)
    assert "none for this environment" in harness(env, tmp_path, "server", "status").stdout
    assert harness(env, tmp_path, "server", "start").returncode == 0
    assert "stops" in harness(env, tmp_path, "server", "stop").stdout
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and harness(env, tmp_path, "server", "status").returncode == 0:
        time.sleep(0.2)
    assert "none for this environment" in harness(env, tmp_path, "server", "status").stdout


def test_the_key_follows_the_environment_but_not_what_a_shell_changes():
    env = {"PATH": "/usr/bin", "TORCH_LOGS": "dynamo"}
    key = server_key(env)
    assert server_key(dict(env)) == key
    assert server_key(env | {v: "anything" for v in VOLATILE_ENV}) == key
    assert server_key(env | {"TORCH_LOGS": "inductor"}) != key
    assert server_key({k: v for k, v in env.items() if k != "TORCH_LOGS"}) != key


def test_a_server_that_cannot_import_says_why(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('raise ImportError("this torch is broken on purpose")\n')
    env = os.environ | {"PYTHONPATH": str(tmp_path), "HARNESS_TEST_SERVER": uuid.uuid4().hex}
    r = harness(env, tmp_path, "server", "start")
    assert r.returncode == 1
    assert r.stderr.strip() == "harness server: did not start: ImportError: this torch is broken on purpose", r
