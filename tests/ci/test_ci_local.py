"""`harness ci-local`: the rehearsal of ci.yml end to end, with real shards, a real comparison and
the file sink. A commit that breaks a model fails its shard and files an issue; the next two clean
runs close it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import REPO_SUITES, smoke_suite

# The model code of the rehearsal's project: a suite's adapter, the way a vendor's builder is one.
MODEL_OK = '''
from transformers import LlamaForCausalLM


def build(config, dtype, device):
    return LlamaForCausalLM(config)
'''

# The "commit that breaks a model": layer 0's MLP now returns NaN (a wrong kernel, a bad cast).
MODEL_BROKEN = '''
from transformers import LlamaForCausalLM


def build(config, dtype, device):
    m = LlamaForCausalLM(config)
    m.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out * float("nan"))
    return m
'''


suite = smoke_suite


@pytest.fixture
def project(tmp_path) -> Path:
    """Two tiny suites in a project of their own: `a-model` built by the project's model code,
    `b-healthy` by transformers."""
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\n')
    (tmp_path / "suites" / "a-model.toml").write_text(suite("project_model:build"))
    (tmp_path / "suites" / "b-healthy.toml").write_text(suite(None))
    (tmp_path / "project_model.py").write_text(MODEL_OK)
    return tmp_path


def ci_local(project: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200",
                        "HARNESS_CONFIG": str(project / "harness.toml"),
                        "PYTHONPATH": f"{project}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for k in [k for k in env if k.startswith("GITHUB_")]:  # not a GitHub Actions run, even inside one
        del env[k]
    # -n 0: no xdist workers inside a shard (two more torch imports per shard, on a 2-core machine)
    return subprocess.run([str(exe), "ci-local", "--shards", "2", "--parallel", "2", "-n", "0", "--check", "smoke",
                           "--out", "ci"], cwd=project, env=env, capture_output=True, text=True, timeout=600)


def issues(project: Path) -> dict:
    p = project / "ci" / "issues" / "issues.json"
    return json.loads(p.read_text()) if p.exists() else {}


@pytest.mark.slow
def test_a_breaking_commit_fails_its_shard_files_an_issue_and_two_clean_runs_close_it(project):
    # the commit that breaks the model
    (project / "project_model.py").write_text(MODEL_BROKEN)
    r = ci_local(project)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    # one shard failed, the other passed: the two suites went to different shards
    assert ("shard 1/2: passed" in out) != ("shard 2/2: passed" in out), out
    assert "1/2 shard(s) passed" in out, out
    failed_shard = 1 if "shard 1/2: FAILED" in out else 2
    journal = (project / "ci" / "results" / f"shard-{failed_shard}" / "summary.json").read_text()
    assert "a-model.toml::smoke[cpu-float32]" in journal
    # the merged report names the failure, and the file sink filed one issue for it
    assert "a-model" in out
    filed = issues(project)
    assert len(filed) == 1, out
    (number, issue), = filed.items()
    assert issue["state"] == "open"
    assert "suite:a-model" in issue["labels"] and "backend:cpu" in issue["labels"]
    assert "smoke" in issue["body"]
    assert (project / "ci" / "issues" / f"issue-{number}.md").exists()
    # the merged report (printed, and kept as summary.md) says what was filed
    actions = (project / "ci" / "summary.md").read_text().split("### Issue actions")[1]
    assert "create" in actions and "a-model" in actions and "b-healthy" not in actions
    # a failed run never becomes the baseline
    assert not (project / "ci" / "baseline").exists()

    # the fix; the first clean run leaves the issue open (one clean run is not enough)...
    (project / "project_model.py").write_text(MODEL_OK)
    r = ci_local(project)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2/2 shard(s) passed" in r.stdout
    assert issues(project)[number]["state"] == "open", r.stdout
    assert (project / "ci" / "baseline" / "shard-1" / "junit.xml").exists()

    # ...the second closes it, with one comment that says so
    r = ci_local(project)
    assert r.returncode == 0, r.stdout + r.stderr
    closed = issues(project)[number]
    assert closed["state"] == "closed", r.stdout
    assert len(issues(project)) == 1  # no duplicate was ever opened
    log = json.loads((project / "ci" / "issues" / "actions.json").read_text())
    assert [e["op"] for e in log if e["issue"] == int(number)].count("create") == 1
    assert any(e["op"] == "edit" and e["state"] == "closed" for e in log)


def test_bad_shard_count_is_one_line(tmp_path, capsys):
    import pytest

    from harness.cli import main

    with pytest.raises(SystemExit) as e:  # refused where it enters: argparse's one line (harness.numbers)
        main(["ci-local", "--shards", "0", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert "argument --shards: must be >= 1" in capsys.readouterr().err


def _flaky_suite(adapter: str | None) -> str:
    return suite(f"faulty_models:{adapter}" if adapter else None)


@pytest.mark.slow
def test_flaky_is_confirmed_quarantined_not_filed_and_reenabled_deterministic_filed_once(tmp_path):
    """Issue #31's rehearsal: `harness ci-local` against a GitHub server. One item fails one worker
    process in three (injected), another fails every time. The flaky one is confirmed flaky by its
    reruns, quarantined, filed only as a flaky issue (never a failure), and held while clean runs do not
    yet bound its flake rate; the deterministic one is filed once, its reruns in the body."""
    from compare.github_server import TOKEN, GitHubServer  # tests/compare (tests/ is on sys.path)

    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\n')
    (tmp_path / "suites" / "a-flaky.toml").write_text(_flaky_suite("flaky"))
    (tmp_path / "suites" / "b-broken.toml").write_text(_flaky_suite("nan"))
    tests_dir = Path(__file__).resolve().parent.parent
    with GitHubServer() as gh:
        def rehearse() -> subprocess.CompletedProcess:
            exe = Path(sys.executable).with_name("harness")
            env = {k: v for k, v in os.environ.items() if not k.startswith("GITHUB_")}
            env |= {"HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200",
                    "HARNESS_CONFIG": str(tmp_path / "harness.toml"), "GITHUB_TOKEN": TOKEN,
                    "HARNESS_TEST_FLAKY_COUNTER": str(tmp_path / "flaky.count"),
                    "PYTHONPATH": f"{tests_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            return subprocess.run(
                [str(exe), "ci-local", "--shards", "1", "-n", "0", "--check", "smoke", "--out", "ci",
                 "--reenable-after", "2", "--close-after", "1", "--sink", "github",
                 "--compare-arg=--repo=acme/models", f"--compare-arg=--api-url={gh.url}"],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

        def by_kind() -> dict[str, list[dict]]:
            out: dict[str, list[dict]] = {}
            for number, i in gh.state.issues.items():
                kind = next(lb.removeprefix("kind:") for lb in i["labels"] if lb.startswith("kind:"))
                out.setdefault(kind, []).append({**i, "number": number})
            return out

        q = tmp_path / "ci" / "quarantine.json"
        # run 1: the flaky item fails its first attempt and passes both reruns; the broken one fails all three
        r = rehearse()
        out = r.stdout + r.stderr
        assert r.returncode == 1, out  # the deterministic failure fails its shard
        issues = by_kind()
        assert set(issues) == {"failure", "flaky"}, issues
        (failure,) = issues["failure"]
        assert "b-broken" in failure["title"] and "deterministic: failed 3 of 3 attempts" in failure["body"]
        (flaky,) = issues["flaky"]
        assert "a-flaky" in flaky["title"] and "quarantined" in flaky["title"]
        assert "failed 1 of 3 attempts" in flaky["body"] and flaky["state"] == "open"
        assert not any("a-flaky" in i["title"] for i in issues["failure"])  # never filed as a failure
        held = json.loads(q.read_text())["items"]
        assert list(held) == ["suites.a-flaky.toml::smoke[cpu-float32]"] and held[list(held)[0]]["rate"] == 0.333
        assert "### Quarantine" in (tmp_path / "ci" / "summary.md").read_text()

        # the fixes land: both models healthy. run 2: one clean run of the quarantined item (1 of 2);
        # the failure's issue closes (close-after 1), the flaky one stays open while it is quarantined
        for name in ("a-flaky", "b-broken"):
            (tmp_path / "suites" / f"{name}.toml").write_text(_flaky_suite(None))
        r = rehearse()
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(q.read_text())["items"]["suites.a-flaky.toml::smoke[cpu-float32]"]["clean"] == 1
        assert gh.state.issues[failure["number"]]["state"] == "closed"
        assert gh.state.issues[flaky["number"]]["state"] == "open"

        # run 3: a second clean run. --reenable-after 2 is the minimum, not the rule: two clean runs
        # do not bound a flake rate seen at 1 in 3 (issue #49: a 25 % flake passes 3 clean runs with
        # probability 0.42), so it stays quarantined and its issue open; the re-enabling on evidence and
        # the issue closing with it are tests/compare/test_lifecycle.py's
        r = rehearse()
        assert r.returncode == 0, r.stdout + r.stderr
        held = json.loads(q.read_text())["items"]
        assert held["suites.a-flaky.toml::smoke[cpu-float32]"]["clean"] == 2, held
        assert gh.state.issues[flaky["number"]]["state"] == "open"
        assert len(gh.state.issues) == 2  # one issue each, never a duplicate
        creates = [r for r in gh.state.requests if r[0] == "POST" and r[1].endswith("/issues")]
        assert len(creates) == 2
