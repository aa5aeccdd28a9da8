"""Run integrity with real processes: a hanging, an aborting and a leaking forward, each in a suite
run together with a healthy suite, with and without pytest-xdist; SIGTERM/SIGINT mid-run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests_support import REPO, REPO_SUITES, TINY_PRUNE

TESTS = Path(__file__).resolve().parent.parent  # tests/: faulty_models.py, tests_support.py
# seconds per item in these runs, counted from the worker's "ready" (its start is not charged): the
# hang waits all of it. A healthy, leaking or aborting tiny item (build + check) took at most 2.1 s
# on a loaded 2-core machine, in one worker and with -n 2: 12 s is ~6x that, ~4x on a CI machine 25 %
# slower under its other pytest worker (20 s cost 20 s per run).
TIMEOUT = 12


def suite(adapter: str | None = None, extra: str = "") -> str:
    head = 'backends = ["cpu"]\ndtypes = ["float32"]\n' + extra
    model = '[model]\nconfig = "configs/Llama-3.1-8B.json"\n'
    if adapter:
        model += f'adapter = "faulty_models:{adapter}"\n'
    return head + model + TINY_PRUNE + "\n[checks.smoke]\ngenerate_tokens = 2\n"


@pytest.fixture
def project(tmp_path) -> Path:
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    return tmp_path


def harness_cmd(*args) -> tuple[list[str], dict]:
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "250",
                        "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return [str(exe), *args], env


def items(results: Path) -> dict[str, dict]:
    summary = json.loads((results / "summary.json").read_text())
    return {r["nodeid"].split("/")[-1]: r for r in summary["items"]}


def metric(row: dict, name: str) -> float:
    return float(row["props"][f"metric.{name}"])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [None, "2"], ids=["in-one-worker", "xdist-2"])
def test_hang_abort_and_leak_cost_only_their_own_items(project, workers):
    s = project / "suites"
    (s / "a-leaks.toml").write_text(suite("leak"))
    (s / "b-healthy.toml").write_text(suite())
    (s / "c-aborts.toml").write_text(suite("abort"))
    (s / "d-hangs.toml").write_text(suite("hang"))
    (s / "e-healthy.toml").write_text(suite())
    cmd, env = harness_cmd("run", "--check", "smoke", "--timeout", str(TIMEOUT), "--results", "res",
                           *(["-n", workers] if workers else []))
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    rows = items(project / "res")
    assert set(rows) == {f"{n}.toml::smoke[cpu-float32]" for n in
                         ("a-leaks", "b-healthy", "c-aborts", "d-hangs", "e-healthy")}, out
    # the healthy suites: complete and correct
    for n in ("b-healthy", "e-healthy"):
        row = rows[f"{n}.toml::smoke[cpu-float32]"]
        assert row["outcome"] == "passed", row
        assert metric(row, "loss_final") < metric(row, "loss_initial")
    # the hang: killed at the limit, an error that names the phase and the module it hung in
    hang = rows["d-hangs.toml::smoke[cpu-float32]"]
    assert hang["outcome"] == "error"
    assert hang["message"].startswith(f"hung: no result within the {TIMEOUT} s time limit, killed in forward "
                                      "(last module entered: model.layers.1.mlp)"), hang["message"]
    assert TIMEOUT <= metric(hang, "wall_time_s") < TIMEOUT + 15
    # the abort: an error with its signal and where it happened, not a dead run or a platform string
    crash = rows["c-aborts.toml::smoke[cpu-float32]"]
    assert crash["outcome"] == "error"
    assert crash["message"].startswith("crashed with SIGABRT in forward (last module entered: "
                                       "model.layers.0.self_attn)"), crash["message"]
    # the leak: its own item carries it; the worker was replaced, so nobody else is charged
    leak = rows["a-leaks.toml::smoke[cpu-float32]"]
    assert leak["outcome"] == "passed", (leak, out)
    leaked = metric(leak, "leaked_bytes")
    assert leaked > 512 * 2**20
    assert metric(leak, "peak_memory_bytes") > leaked
    for n in ("b-healthy", "e-healthy"):
        assert metric(rows[f"{n}.toml::smoke[cpu-float32]"], "peak_memory_bytes") < metric(leak, "peak_memory_bytes") - leaked / 2
    # the table and the CI log show the messages, not pytest internals
    assert "killed in forward" in r.stdout and "crashed with SIGABRT" in r.stdout
    assert "_pytest/runner.py" not in r.stdout and "Traceback" not in r.stdout
    # the run ended within the hang's limit plus the healthy work, not at the CI job's timeout
    assert elapsed < TIMEOUT + 240, elapsed


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        for c in _children(todo.pop()):
            seen.append(c)
            todo.append(c)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_run_keeps_what_finished_and_marks_the_run_interrupted(project, sig):
    s = project / "suites"
    (s / "a-healthy.toml").write_text(suite())
    (s / "b-hangs.toml").write_text(suite("hang"))
    (s / "c-healthy.toml").write_text(suite())
    res = project / "res"
    res.mkdir()
    # a previous run's files must never survive looking current
    (res / "summary.json").write_text(json.dumps({"counts": {"passed": 144}, "items": []}))
    (res / "junit.xml").write_text("<testsuites><testsuite tests='144'/></testsuites>")
    cmd, env = harness_cmd("run", "--check", "smoke", "--timeout", "600", "--results", "res")
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        journal = res / "journal.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # wait until the first item finished and the hang began
            if journal.exists() and journal.read_text().count("\n") >= 1:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        else:
            pytest.fail("the healthy item never finished")
        assert not (res / "summary.json").exists()  # the stale one is gone as soon as the run starts
        time.sleep(3)
        kids = _descendants(proc.pid)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    summary = json.loads((res / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["reason"] == f"{sig.name} received"
    assert [r["nodeid"] for r in summary["items"]] == ["suites/a-healthy.toml::smoke[cpu-float32]"]
    assert summary["items"][0]["outcome"] == "passed"
    # the item in flight is not run, never "passed"; the one after it too
    assert summary["not_run"] == ["suites/b-hangs.toml::smoke[cpu-float32]",
                                  "suites/c-healthy.toml::smoke[cpu-float32]"]
    junit = (res / "junit.xml").read_text()
    assert 'name="harness.run.status" value="interrupted"' in junit
    assert junit.count("<testcase") == 3 and junit.count('type="harness.not-run"') == 2
    # the stale file's suite (tests='144') is gone; a bare "144" could be any figure (a duration)
    assert "tests='144'" not in junit and not re.search(r'tests="144"', junit)
    assert json.loads((res / "run.json").read_text())["status"] == "interrupted"
    assert "run interrupted" in (res / "summary.txt").read_text()
    time.sleep(1)
    assert not [k for k in kids if Path(f"/proc/{k}").exists()], "the isolated worker outlived the run"


def test_unwritable_results_directory_fails_before_any_model_is_built(project, capsys, monkeypatch):
    from harness.cli import main

    (project / "suites" / "tiny.toml").write_text(suite())
    (project / "res").write_text("a file where the results directory should be")
    monkeypatch.chdir(project)
    monkeypatch.delenv("HARNESS_RESULTS_DIR", raising=False)
    t0 = time.monotonic()
    code = main(["run", "--check", "smoke", "--results", "res/inner"])
    out = capsys.readouterr().out
    assert code == 2 and "results directory res/inner is not writable" in out
    assert time.monotonic() - t0 < 5  # nothing was built
    # nor left behind for the next command of this process (it once pointed a later harness certify there)
    assert "HARNESS_RESULTS_DIR" not in os.environ


# (the full-disk atomic-write test moved to tests/files/test_atomic.py with the helper)


def test_bad_harness_config_is_one_line_in_every_command(project, tmp_path):
    bad = tmp_path / "harness.toml"
    bad.write_text("[[backends]]\nname = 1\n")
    for args in (["run"], ["backends"], ["validate"]):
        cmd, env = harness_cmd(*args)
        r = subprocess.run(cmd, cwd=project, env=env | {"HARNESS_CONFIG": str(bad)}, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stdout + r.stderr
        assert f"{bad}: backends.0.name: Input should be a valid string" in r.stdout + r.stderr


def test_setup_problems_are_errors_with_their_own_message(project):
    s = project / "suites"
    (s / "a-adapter.toml").write_text(suite("missing_module"))
    (s / "b-arch.toml").write_text(suite().replace('[model]\n', '[model]\narchitecture = "NoSuchForCausalLM"\n'))
    weights = project / "weights-dir"
    weights.mkdir()
    (weights / "model.bin").write_bytes(b"not a safetensors file")
    (s / "c-weights.toml").write_text(suite().replace('[model]\n', '[model]\nweights = "../weights-dir"\n'))
    (s / "d-healthy.toml").write_text(suite())
    cmd, env = harness_cmd("run", "--check", "smoke", "--results", "res")
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=900)
    rows = items(project / "res")
    assert rows["d-healthy.toml::smoke[cpu-float32]"]["outcome"] == "passed"
    for name, words in (("a-adapter", "No module named 'harness_no_such_vendor_module'"),
                        ("b-arch", "NoSuchForCausalLM"), ("c-weights", "safetensors")):
        row = rows[f"{name}.toml::smoke[cpu-float32]"]
        assert row["outcome"] == "error", row
        assert row["message"].startswith("could not run (build)") and words in row["message"], row["message"]
        assert "_pytest" not in row["message"]
    assert "_pytest/runner.py" not in r.stdout
    assert REPO.exists()


# The config and the encoding damage share one collection and one run (each costs only its own suite
# there, beside the other): two pytest processes fewer than a parameter each.
@pytest.mark.parametrize("damage", ["config-and-encoding", "cache"])
def test_one_bad_file_costs_only_its_own_suite(project, damage, tmp_path, monkeypatch):
    """A config.json whose top level is not an object, a suite file that is not UTF-8, a corrupt
    op-inventory cache: the other suites are still collected (and the cache is rebuilt)."""
    from harness.inspect import trace

    s = project / "suites"
    (s / "good.toml").write_text(suite())
    cache = tmp_path / "cache"
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(cache))
    if damage == "config-and-encoding":
        (s / "configs" / "list.json").write_text("[1, 2, 3]")
        (s / "bad-config.toml").write_text(suite().replace("configs/Llama-3.1-8B.json", "configs/list.json"))
        (s / "bad-encoding.toml").write_bytes(suite().replace('dtypes', '# caf\xe9\ndtypes').encode("latin-1"))
        want = {"bad-config": "model.config: suites/configs/list.json is not a valid config.json: top level is "
                              "not a JSON object",
                "bad-encoding": "not UTF-8 text"}
    else:
        (s / "bad.toml").write_text(suite() + "[checks.ops]\nenabled = true\nvariants = ['aten.mm.default']\n")
        from harness.suite.loader import load_suite

        ls = load_suite(s / "bad.toml")
        path = cache / "ops" / f"bad-float32-{trace.suite_key(ls, 'float32', '2x16')}.json"
        path.parent.mkdir(parents=True)
        path.write_text('[["not", "an", "op", "list"]]')
        want = {}
    monkeypatch.chdir(project)
    r = subprocess.run([sys.executable, "-m", "pytest", "suites", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "--harness-check=smoke,ops"], capture_output=True, text=True, timeout=300,
                       env=os.environ | {"HARNESS_CACHE_DIR": str(cache)})
    assert "suites/good.toml::smoke[cpu-float32]" in r.stdout, r.stdout + r.stderr
    if want:
        for name in want:
            assert f"suites/{name}.toml::load" in r.stdout, r.stdout
        run = subprocess.run([sys.executable, "-m", "pytest", *(f"suites/{name}.toml" for name in want), "-q",
                              "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=300)
        for words in want.values():
            assert words in run.stdout, run.stdout
    else:  # the corrupt cache was rebuilt, and the op item exists
        assert "suites/bad.toml::ops[cpu-float32-aten.mm.default]" in r.stdout, r.stdout
        assert isinstance(json.loads(path.read_text())["ops"], list)


@pytest.mark.slow
def test_memory_limit_kills_the_item_and_names_the_figures(project):
    s = project / "suites"
    # the balloon last: its killed worker is not replaced only to run the healthy item (that the item
    # after a killed worker still runs is test_hang_abort_and_leak_cost_only_their_own_items's)
    (s / "a-healthy.toml").write_text(suite())
    (s / "b-balloon.toml").write_text(suite("balloon"))
    cmd, env = harness_cmd("run", "--check", "smoke", "--memory-limit", "1.5", "--results", "res")
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=900)
    rows = items(project / "res")
    leak = rows["b-balloon.toml::smoke[cpu-float32]"]
    assert leak["outcome"] == "error", leak
    assert "exceeded the memory limit" in leak["message"] and "> 1.50 GiB) and was killed in forward" in leak["message"]
    assert rows["a-healthy.toml::smoke[cpu-float32]"]["outcome"] == "passed", r.stdout[-3000:]


def test_the_status_hook_of_an_isolated_item_is_no_graph_break(tmp_path):
    """Every module entered is written to the status file (the module a hang is reported in); inside a
    graph torch.compile traces that write would break the graph at every module (the compile check
    counted 23 breaks on llama-3.1-8b under `harness run`), so it is skipped there: fullgraph holds."""
    import torch

    from harness.run.isolation import STATUS_BYTES, _Status

    path = tmp_path / "status"
    path.write_bytes(b" " * STATUS_BYTES)
    status = _Status(str(path))
    handle = torch.nn.modules.module.register_module_forward_pre_hook(status.enter)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU(), torch.nn.Linear(4, 2))
        model(torch.ones(1, 4))  # eager: the status names the module entered
        assert "\t" in path.read_text() and path.read_text().split("\t")[1].strip() in ("0", "1", "2")
        torch._dynamo.reset()
        out = torch.compile(model, backend="eager", fullgraph=True)(torch.ones(1, 4))
        assert out.shape == (1, 2)
    finally:
        handle.remove()
        torch._dynamo.reset()


def test_the_status_hook_adds_no_warning_to_a_compiled_items_record(tmp_path):
    """torch.compile(module) warns at each compiled call while a global module hook exists; in an
    isolated item the status hook is always one, so the warning was counted with every compile item
    (26 in a Llama-4-Scout item). Installed by the child's own ``status_hook``, it is not; the same
    compile with a global hook of someone else's is still recorded."""
    import warnings

    import torch

    from harness.run.execute import LibraryWarnings
    from harness.run.isolation import STATUS_BYTES, _Status, status_hook

    path = tmp_path / "status"
    path.write_bytes(b" " * STATUS_BYTES)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU())

    def compiled_call_warnings() -> list[str]:
        torch._dynamo.reset()
        with LibraryWarnings() as lw:
            torch.compile(model, backend="eager")(torch.ones(1, 4))
        return [r["message"] for r in lw.records() if "global hooks" in r["message"]]

    with warnings.catch_warnings():
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
        try:
            assert compiled_call_warnings(), "torch no longer warns: the ignore is no longer needed"
        finally:
            handle.remove()
        handle = status_hook(_Status(str(path)))
        try:
            assert compiled_call_warnings() == []
        finally:
            handle.remove()
            torch._dynamo.reset()


def test_a_vendor_module_gets_a_child_that_ran_nothing_without_it(tmp_path):
    """torch's autograd engine sizes its device queues at the first backward: a PrivateUse1 module
    imported by a child after a CPU item's backward fails every backward on its device. A request
    naming a module the child has not imported, after items without it, gets a fresh child; one
    whose module it already imported, or none, keeps it. (The items here are setup errors: a missing
    suite file, which the child answers without building a model.)"""
    from harness.files import scratch
    from harness.run.isolation import Limits, Worker

    req = {"suite": str(tmp_path / "absent.toml"), "check": "smoke", "backend": "cpu", "dtype": "float32",
           "variant": None}
    w = Worker()
    pids = []
    try:
        for module in (None, None, "vendor_a", "vendor_a", None, "vendor_b", "vendor_a"):
            r, _ = w.run(dict(req, module=module), Limits(timeout_s=120))
            assert r.outcome == "error" and "could not run in the isolated worker" in r.message, r.message
            pids.append(w.proc.pid)
            # the children's status files live in this process's scratch folder (swept by the next parent if
            # this one is SIGKILLed), which outlives every child that ended meanwhile
            folder = Path(w.status_path).parent
            assert folder.name.startswith("harness-isolation-") and Path(w.status_path).exists()
            assert (folder / scratch.OWNER).read_text() == scratch.owner_record()
        status = w.status_path
    finally:
        w.close()
    assert not os.path.exists(status)
    # a new child for vendor_a (after two items without it), for vendor_b, and for vendor_a again
    # (that child never imported it)
    assert [pids[i] == pids[i - 1] for i in range(1, len(pids))] == [True, False, True, True, False, False]
    assert w.restarts_for_module == 3


def _slow_start(tmp_path: Path, body: str) -> dict:
    """An environment whose isolated children (only they have HARNESS_ISOLATION_FDS) run ``body``
    at interpreter start, through a real ``sitecustomize`` on PYTHONPATH: a loaded runner's slow
    imports, or a child that cannot start."""
    site = tmp_path / "site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(f"import os, time\nif os.environ.get('HARNESS_ISOLATION_FDS'):\n    {body}\n")
    return os.environ | {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_a_slow_worker_start_is_not_charged_to_the_item(tmp_path):
    """The CI run of af3400b: under load a fresh child's imports ate the first item's 20 s, and a
    healthy item was reported hung. Its clock starts when the child says it is ready; a child that
    never becomes ready, or dies starting, is an error of its own that confirm calls the runner's."""
    from harness.run.confirm import infrastructure_cause
    from harness.run.isolation import Limits, Worker

    req = {"suite": str(tmp_path / "absent.toml"), "check": "smoke", "backend": "cpu", "dtype": "float32",
           "variant": None}
    w = Worker(env=_slow_start(tmp_path / "slow", "time.sleep(4)"))
    try:
        t0 = time.monotonic()
        r, _ = w.run(req, Limits(timeout_s=2))  # 4 s start + imports, then an item that answers at once
        assert time.monotonic() - t0 > 4
        assert r.outcome == "error" and r.message.startswith("could not run in the isolated worker"), r.message
    finally:
        w.close()

    w = Worker(env=_slow_start(tmp_path / "stuck", "time.sleep(60)"))
    try:
        r, facts = w.run(req, Limits(timeout_s=120, startup_s=2))
        assert r.message == "the isolated worker did not start within 2 s", r.message
        assert facts["replace"] and not w.alive()
        assert infrastructure_cause(r)
    finally:
        w.close()

    w = Worker(env=_slow_start(tmp_path / "dies", "os._exit(3)"))
    try:
        r, _ = w.run(req, Limits(timeout_s=120))
        assert r.outcome == "error" and r.message == "the isolated worker did not start: it exited with status 3"
        assert infrastructure_cause(r)
    finally:
        w.close()
