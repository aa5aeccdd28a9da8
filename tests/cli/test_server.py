"""``harness server``: commands run in forks of a warm process, with real processes throughout - the
command's status and streams, its settings read anew, its isolated worker a fork too, Ctrl-C and a
killed command, another environment meeting no server, stop and the idle end, the caller's limits
held inside, a source edit stopping the old server, a killed server leaving its run's results."""

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


def package_copy(dest: Path) -> Path:
    """A copy of harness's package (its compiled files too: mtimes are kept) for a folder put first
    on PYTHONPATH: the server's key hashes its sources, and another engineer's edit of the checkout
    while these tests run must neither change the key of their servers nor stop them as stale."""
    shutil.copytree(Path(__file__).resolve().parents[2] / "harness", dest / "harness")
    return dest


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
    pkg = package_copy(tmp_path_factory.mktemp("pkg"))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "250", "HARNESS_CONFIG": str(project / "harness.toml"),
                        "PYTHONPATH": os.pathsep.join([str(pkg), str(TESTS), os.environ.get("PYTHONPATH", "")]),
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


def served_count(env: dict, cwd: Path, **kw) -> int:
    r = harness(env, cwd, "server", "status", **kw)
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


def start_server(env: dict, cwd: Path, **kw) -> int:
    r = harness(env, cwd, "server", "start", "--idle", "10", **kw)
    assert r.returncode == 0 and "ready in" in r.stdout, r
    return int(r.stdout.split("pid ")[1].split(",")[0])


def running(pid: int) -> bool:
    """``pid`` runs (a killed server is a zombie until its new parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def end(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A pytest plugin (`harness run ... -- -p limits_probe`): pytest runs in the command's own process, so
# what it writes is what that process is subject to; run as a script, what a fresh process gets.
PROBE = '''import json, os, resource


def state():
    umask = os.umask(0)
    os.umask(umask)
    limits = {n: list(resource.getrlimit(getattr(resource, n))) for n in dir(resource) if n.startswith("RLIMIT_")}
    return limits | {"nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0)),
                     "umask": umask}


def pytest_configure(config):
    with open(os.environ["LIMITS_OUT"], "w") as f:
        json.dump(state(), f)


if __name__ == "__main__":
    print(json.dumps(state()))
'''


def _limited() -> None:
    """What `prlimit --as=64GiB --nofile=900:1000 nice -n 5 taskset -c <first> sh -c 'umask 027; ...'`
    sets: what a careful user of a shared machine puts around a run (preexec_fn: no util-linux needed)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (64 << 30, 64 << 30))
    resource.setrlimit(resource.RLIMIT_NOFILE, (900, 1000))
    os.nice(5)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    os.umask(0o027)


def test_the_callers_limits_niceness_and_affinity_hold_in_the_command(served, tmp_path):
    project, env, _ = served
    (tmp_path / "limits_probe.py").write_text(PROBE)
    inside = tmp_path / "inside.json"
    env = env | {"LIMITS_OUT": str(inside), "HARNESS_TEST_SERVER": uuid.uuid4().hex,
                 "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}
    expected = json.loads(subprocess.run([sys.executable, str(tmp_path / "limits_probe.py")], preexec_fn=_limited,
                                         capture_output=True, text=True, check=True).stdout)
    assert expected["RLIMIT_AS"] == [64 << 30, 64 << 30] and expected["nice"] == os.getpriority(os.PRIO_PROCESS, 0) + 5

    def run_limited() -> dict:
        inside.unlink(missing_ok=True)
        r = harness(env, project, "run", "a-healthy", "--check", "smoke", "--results", "res-limits",
                    "--", "-p", "limits_probe", preexec_fn=_limited)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(inside.read_text())

    plain = start_server(env, project)
    capped = None
    try:
        # a server started without them: the command meets none and runs as before, under its limits
        assert run_limited() == expected
        assert served_count(env, project) == 0
        # a server started under them has them, and so do its forks: the command runs there
        capped = start_server(env, project, preexec_fn=_limited)
        assert capped != plain
        assert run_limited() == expected
        assert served_count(env, project, preexec_fn=_limited) == 1
    finally:
        end(plain, *([capped] if capped else []))


def test_a_source_edit_stops_the_servers_of_the_old_sources(served, tmp_path):
    project, served_env, served_pid = served
    pkg = package_copy(tmp_path)  # its own package folder: editing it touches no other test's server
    env = served_env | {"HARNESS_TEST_SERVER": uuid.uuid4().hex,
                        "PYTHONPATH": os.pathsep.join([str(pkg), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    old = start_server(env, project)
    try:
        src = pkg / "harness" / "numbers.py"
        st = src.stat()
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # an edit, as far as any key can tell
        r = harness(env, project, "validate", "a-healthy")
        assert r.returncode == 0, r  # run here: no server has today's sources
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and running(old):
            time.sleep(0.1)
        assert not running(old), "the server of the old sources still runs, unreachable"
        # the module's server is another package folder's (reachable from there): not this edit's to stop
        assert running(served_pid)
        assert "none for this environment" in harness(env, project, "server", "status").stdout
    finally:
        end(old)


def test_a_killed_server_stops_its_run_which_keeps_the_results_of_what_finished(served):
    project, env, _ = served
    env = env | {"HARNESS_TEST_SERVER": uuid.uuid4().hex}
    pid = start_server(env, project)
    proc, kids = _start_hanging_run(project, env, "res-server-killed", pid)
    try:
        os.kill(pid, signal.SIGKILL)  # the OOM killer's way: nothing of the server's own runs
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        end(pid)
    assert proc.returncode != 0
    results = project / "res-server-killed"
    assert json.loads((results / "run.json").read_text())["status"] == "interrupted"  # was "running"
    summary = json.loads((results / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["reason"] == "SIGTERM received", summary
    assert [r["outcome"] for r in summary["items"]] == ["passed"]
    junit = (results / "junit.xml").read_text()
    assert junit.count("<testcase") == 2 and 'classname="suites.a-healthy.toml"' in junit
    assert 'message="not run: the run was interrupted"' in junit
    assert f"the server (pid {pid}) was killed while it ran this command" in out, out
    time.sleep(1)
    assert not [k for k in kids if running(k)], "the run outlived its server"
