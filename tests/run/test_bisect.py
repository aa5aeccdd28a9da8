"""`harness bisect` (issue #31 item 3) on a scratch repository of 32 commits, one of which breaks a
suite's model config: found in at most 6 runs, each running only the failing item."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.run.bisect import _selection, read_verdicts
from tests_support import REPO_SUITES, TINY_PRUNE

SUITE = '[model]\nconfig = "configs/{config}"\n' + TINY_PRUNE


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"})


def _history(repo, n: int, bad: int) -> list[str]:
    """A project (two suites on two copies of a real config) and ``n`` commits; commit ``bad`` (1-based)
    puts a typo into tiny's config (its activation: the model cannot be built)."""
    (repo / "suites" / "configs").mkdir(parents=True)
    cfg = (REPO_SUITES / "configs" / "Llama-3.1-8B.json").read_text()
    (repo / "suites" / "configs" / "tiny.json").write_text(cfg)
    (repo / "suites" / "configs" / "other.json").write_text(cfg)
    (repo / "suites" / "tiny.toml").write_text(SUITE.format(config="tiny.json"))
    (repo / "suites" / "other.toml").write_text(SUITE.format(config="other.json"))
    (repo / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\nresults_dir = "results"\n')
    _git(repo, "init", "-q", "-b", "main")
    shas = []
    for k in range(n):
        if k:
            with open(repo / "NOTES.md", "a") as f:
                f.write(f"change {k}\n")
        if k == bad:
            p = repo / "suites" / "configs" / "tiny.json"
            d = json.loads(p.read_text())
            d["hidden_act"] = "silu_typo"
            p.write_text(json.dumps(d, indent=2))
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"commit {k}" + (" (the bad one)" if k == bad else ""))
        shas.append(subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                                   text=True, check=True).stdout.strip())
    return shas


def test_selection_names_each_item_by_its_suite_file_and_name():
    suites, expr = _selection(["tiny::smoke[cpu-float32]", "other::ops[cpu-bfloat16]"])
    assert suites == ["other", "tiny"]
    assert expr == "(other.toml and ops[cpu-bfloat16]) or (tiny.toml and smoke[cpu-float32])"


@pytest.mark.slow
def test_32_commits_one_bad_found_in_at_most_6_runs_of_only_the_failing_item(tmp_path):
    repo = tmp_path / "project"
    shas = _history(repo, 32, bad=19)
    out = tmp_path / "bisect.json"
    r = subprocess.run([sys.executable, "-m", "harness", "bisect", "--good", shas[0], "--bad", "HEAD",
                        "tiny::smoke[cpu-float32]", "other::smoke[cpu-float32]", "--json", str(out),
                        "--", "--backend", "cpu", "--dtype", "float32", "--check", "smoke", "--no-isolate"],
                       cwd=repo, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["first_bad"] == shas[19], r.stdout
    assert "first bad commit: " in r.stdout and "commit 19 (the bad one)" in r.stdout
    assert "passed at the bad end, not bisected: other::smoke[cpu-float32]" in r.stdout
    steps = res["steps"]
    assert len(steps) <= 6, r.stdout
    assert steps[0]["items"] == {"tiny::smoke[cpu-float32]": "error", "other::smoke[cpu-float32]": "passed"}
    assert "silu_typo" in steps[0]["messages"]["tiny::smoke[cpu-float32]"]  # why it is bad, at each bad step
    for s in steps[1:]:  # only the failing item, at every step
        assert list(s["items"]) == ["tiny::smoke[cpu-float32]"], s
        assert s["verdict"] == ("bad" if shas.index(s["commit"]) >= 19 else "good"), s
    # the scratch repository is left as it was: no worktree behind
    wt = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
    assert len(wt.strip().splitlines()) == 1, wt


def test_not_an_ancestor_and_a_bad_item_are_one_line_errors(tmp_path):
    repo = tmp_path / "project"
    shas = _history(repo, 2, bad=99)
    def harness(*args):
        return subprocess.run([sys.executable, "-m", "harness", "bisect", *args], cwd=repo, capture_output=True,
                              text=True, timeout=120)
    r = harness("--good", shas[1], "--bad", shas[0])
    assert r.returncode == 2 and "is not an ancestor of" in r.stderr and "Traceback" not in r.stderr
    r = harness("--good", shas[0], "smoke")
    assert r.returncode == 2 and "items are SUITE::NAME" in r.stderr
    r = harness("--good", "no-such-ref")
    assert r.returncode == 2 and "harness bisect: git rev-parse" in r.stderr


def test_read_verdicts_from_a_results_junit(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite name="harness">'
                     '<testcase classname="suites.tiny.toml" name="smoke[cpu-float32]"><properties>'
                     '<property name="harness.suite" value="tiny" /></properties><failure message="x" /></testcase>'
                     '<testcase classname="suites.other.toml" name="ops[cpu-float32]" />'
                     '</testsuite></testsuites>')
    msgs: dict = {}
    assert read_verdicts(junit, msgs) == {"tiny::smoke[cpu-float32]": "failed", "other::ops[cpu-float32]": "passed"}
    assert msgs == {"tiny::smoke[cpu-float32]": "x"}


def _wheel(folder, name: str, version: str, body: str) -> None:
    """A pure-Python wheel (what a package index serves), written as the format defines it."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name}-{version}"
    files = {f"{name}.py": body, f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: harness-tests\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = []
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{n},sha256={digest},{len(text.encode())}")
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n")


ADAPTER = '''
from transformers import LlamaForCausalLM

import harness_kernels


def build(config, dtype, device):
    m = LlamaForCausalLM(config)
    if harness_kernels.BROKEN:  # this build of the kernel package corrupts layer 0's MLP
        m.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out * float("nan"))
    return m
'''


@pytest.mark.slow
def test_between_packages_finds_the_first_bad_nightly(tmp_path):
    """`--between-packages`: 32 nightly wheels of a (pure-Python stand-in for a) vendor's kernel
    package in a local index, the 20th and every later one breaks layer 0; the first bad version is
    found in at most 6 runs of only the failing item, each with that version over the environment."""
    index = tmp_path / "index"
    index.mkdir()
    versions = [f"1.0.0.dev{n}" for n in range(20261201, 20261233)]  # 32 nightly builds
    for i, v in enumerate(versions):
        _wheel(index, "harness_kernels", v, f"BROKEN = {i >= 19}\n")
    project = tmp_path / "project"
    (project / "suites" / "configs").mkdir(parents=True)
    (project / "suites" / "configs" / "tiny.json").write_text(
        (REPO_SUITES / "configs" / "Llama-3.1-8B.json").read_text())
    (project / "suites" / "tiny.toml").write_text(
        '[model]\nconfig = "configs/tiny.json"\nadapter = "project_model:build"\n' + TINY_PRUNE)
    (project / "project_model.py").write_text(ADAPTER)
    (project / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\n')
    out = tmp_path / "bisect.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(project),
           "HARNESS_CONFIG": str(project / "harness.toml")}
    r = subprocess.run([sys.executable, "-m", "harness", "bisect", "--between-packages",
                        "--good", f"harness_kernels=={versions[0]}", "--bad", f"harness_kernels=={versions[-1]}",
                        "--pip-arg=--no-index", f"--pip-arg=--find-links={index}", "--json", str(out),
                        "--", "--backend", "cpu", "--dtype", "float32", "--check", "smoke", "--no-isolate"],
                       cwd=project, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["first_bad"] == versions[19], r.stdout
    assert f"first bad version: harness_kernels=={versions[19]}" in r.stdout
    steps = res["steps"]
    assert len(steps) <= 6 and steps[0]["items"] == {"tiny::smoke[cpu-float32]": "failed"}, r.stdout
    for s in steps:  # each step ran the failing item alone, with its version
        assert list(s["items"]) == ["tiny::smoke[cpu-float32]"]
        assert s["verdict"] == ("bad" if versions.index(s["commit"]) >= 19 else "good"), s
    # nothing stays installed: the environment's own package list is unchanged
    assert "harness_kernels" not in subprocess.run([sys.executable, "-m", "pip", "list"], capture_output=True,
                                                   text=True).stdout


def test_between_packages_bad_input_is_one_line(tmp_path):
    for good, bad, why in (("torch", "torch==2", "expected NAME==VERSION"),
                           ("torch==2.1", "numpy==2.2", "different packages")):
        r = subprocess.run([sys.executable, "-m", "harness", "bisect", "--between-packages", "--good", good,
                            "--bad", bad], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_answer_is_commented_on_the_issue_that_asked(monkeypatch, capsys):
    """The bisect workflow's last step: `--comment-issue N` posts the answer and every step on issue N
    (the local GitHub server); a refused post is one line, never the answer lost."""
    from types import SimpleNamespace

    from compare.github_server import TOKEN, GitHubServer  # tests/compare (tests/ is on sys.path)

    from harness.cli.bisect import post_answer
    from harness.run.bisect import Bisection, Step

    res = Bisection(["tiny::smoke[cpu-float32]"], [
        Step("bad end", "a" * 40, "commit 31", {"tiny::smoke[cpu-float32]": "error"}, "bad"),
        Step("step 1", "b" * 40, "commit 15", {"tiny::smoke[cpu-float32]": "passed"}, "good")],
        "b" * 40, "first bad commit: bbbbbbb commit 19 (the bad one) (6 runs over 31 commits)")
    args = SimpleNamespace(good="v1", bad="HEAD")
    with GitHubServer() as gh:
        gh.state.issues[4] = {"title": "[harness] error regression: tiny on cpu", "body": "", "labels": ["harness"],
                              "state": "open", "comments": [], "changes": []}
        monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
        monkeypatch.setenv("GITHUB_REPOSITORY", "acme/models")
        monkeypatch.setenv("GITHUB_API_URL", gh.url)
        assert post_answer("4", res, args)
        (c,) = gh.state.issues[4]["comments"]
        assert "first bad commit: bbbbbbb commit 19" in c["body"] and "step 1" in c["body"]
        gh.state.fail_next(403, message="Resource not accessible by integration")
        assert not post_answer("4", res, args)
        assert "could not comment on issue #4" in capsys.readouterr().err
    assert not post_answer("four", res, args)


def test_sigterm_stops_the_step_run_and_removes_its_worktree(tmp_path):
    # issue #49: a SIGTERM to `harness bisect` left its step's `harness run` going and its worktree
    # registered. The step's run is made slow (a `sleep` run through the pass-through pytest args is not
    # possible: the run is held by a conftest that sleeps), the bisect is stopped while it runs.
    import signal
    import time

    import psutil

    repo = tmp_path / "project"
    shas = _history(repo, 4, bad=2)
    (repo / "conftest.py").write_text("import time\n\ndef pytest_collection_modifyitems(items):\n    time.sleep(600)\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "a run that takes its time")
    p = subprocess.Popen([sys.executable, "-m", "harness", "bisect", "--good", shas[0], "--bad", "HEAD",
                          "tiny::smoke[cpu-float32]", "--", "--backend", "cpu", "--check", "smoke", "--no-isolate"],
                         cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 120
    runs = []
    while time.monotonic() < deadline and not runs:
        time.sleep(0.5)
        runs = [c for c in psutil.Process(p.pid).children(recursive=True) if "run" in c.cmdline()]
    assert runs, "the step's harness run never started"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (out[-2000:], err[-2000:])
    assert "Traceback" not in err and "stopped (SIGTERM)" in err, err[-2000:]
    time.sleep(0.5)
    assert [c for c in runs if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    wt = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
    assert len(wt.strip().splitlines()) == 1, wt


def test_a_skipped_step_says_why():
    # issue #49: bisect with a suite in its run arguments skipped every step without showing why
    from harness.run.bisect import _judge

    s = _judge("step 1", "a" * 40, "subject", ["tiny::smoke[cpu-float32]"], {"other::smoke[cpu-float32]": "passed"},
               "1 passed, 0 failed", {})
    assert s.verdict == "skip"
    assert "skipped: tiny::smoke[cpu-float32] not in the run's results (do the run arguments after `--` select" \
        in s.line() and "the run said: 1 passed, 0 failed" in s.line(), s.line()
    s = _judge("step 2", "b" * 40, "subject", ["tiny::smoke[cpu-float32]"], None, "error: no such suite", {})
    assert s.line().endswith("skipped: the run left no results: error: no such suite"), s.line()
    # the bad end (no items named yet) of a run whose pytest stopped before any item, its junit.xml empty: it
    # read as "every item passed; nothing to bisect" (a PYTEST_ADDOPTS plugin the run's path did not have)
    s = _judge("bad end", "c" * 40, "subject", None, {}, "error: the run did not start (pytest exit 4 before any item)", {})
    assert s.verdict == "skip" and s.line().endswith("the run did not start (pytest exit 4 before any item)"), s.line()
