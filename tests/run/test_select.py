"""Selection by change (issue #31 item 4), through `harness select` in a scratch repository holding the
bundled suites: a change to one suite file selects only that suite; a change under a mapped kernel
path selects exactly the suites whose op inventory (the pruned model's real trace, as the ops check
takes it) has the mapped op; docs select nothing; an unmapped path selects everything; check code
selects that check in every suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import REPO_SUITES

BUNDLED = {"deepseek-v3", "kimi-k2", "llama-3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-8b"}
HARNESS_TOML = '''suites_dir = "suites"
golden_dir = "golden"

[[select.kernels]]
paths = ["csrc/moe/**"]
ops = ["aten::scatter_add"]

[[select.kernels]]
paths = ["csrc/gemm/grouped/*.cu"]
ops = ["aten::_grouped_mm"]
'''


def git(repo: Path, *args: str) -> str:
    env = os.environ | {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A vendor's repository: the bundled suites, a kernel source tree, docs; one base commit."""
    r = tmp_path_factory.mktemp("vendor")
    shutil.copytree(REPO_SUITES, r / "suites", ignore=shutil.ignore_patterns("__pycache__"))
    (r / "harness.toml").write_text(HARNESS_TOML)
    for f in ("csrc/moe/route.cu", "csrc/gemm/grouped/gemm.cu", "csrc/norm/rms.cu", "docs/kernels.md"):
        (r / f).parent.mkdir(parents=True, exist_ok=True)
        (r / f).write_text("// v1\n")
    git(r, "init", "-q", "-b", "main")
    git(r, "add", "-A")
    git(r, "commit", "-q", "-m", "base")
    return r


def select(repo: Path, *changes: str, args_line: bool = False) -> dict:
    """Commit ``changes`` (paths appended to) on a branch off main, `harness select --base main`
    (and with ``args_line`` its `--format args` line: one more process, ~3 s)."""
    git(repo, "checkout", "-q", "-B", "change", "main")
    for c in changes:
        with open(repo / c, "a") as f:
            f.write("# changed\n" if c.endswith((".toml", ".md")) else "// changed\n")
    git(repo, "commit", "-q", "-am", "change")
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(repo / "harness.toml")}
    r = subprocess.run([str(exe), "select", "--base", "main", "--json", "sel.json"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads((repo / "sel.json").read_text())
    out["text"] = r.stdout
    if args_line:
        args = subprocess.run([str(exe), "select", "--base", "main", "--format", "args"], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=600)
        out["args_line"] = args.stdout.strip()
    return out


def test_one_suite_file_selects_only_that_suite(repo):
    s = select(repo, "suites/qwen3-8b.toml", args_line=True)
    assert set(s["suites"]) == {"qwen3-8b"} and not s["everything"] and not s["checks"]
    assert s["suites"]["qwen3-8b"] == ["suite file suites/qwen3-8b.toml changed"]
    assert s["run_arguments"] == ["qwen3-8b"] and s["args_line"] == "qwen3-8b"
    # its model config: the suites that name it (qwen3-8b alone)
    s = select(repo, "suites/configs/Qwen3-8B.json")
    assert set(s["suites"]) == {"qwen3-8b"}


def test_a_mapped_kernel_path_selects_exactly_the_suites_that_run_its_ops(repo):
    from harness.inspect.trace import suite_op_names
    from harness.suite.loader import discover, load_suite

    def users(op: str) -> set[str]:
        out = set()
        for p in discover(repo / "suites"):
            ls = load_suite(p)
            if any(op in v for v in suite_op_names(ls, list(ls.suite.dtypes)).values()):
                out.add(ls.name)
        return out

    s = select(repo, "csrc/moe/route.cu")
    # DeepSeek-style routing accumulates with scatter_add; Mixtral's and Qwen's do not, nor dense models
    assert set(s["suites"]) == users("aten.scatter_add.default") == {"deepseek-v3", "kimi-k2"}
    assert "kernel path csrc/moe/route.cu -> aten.scatter_add.default" in s["suites"]["kimi-k2"]
    s = select(repo, "csrc/gemm/grouped/gemm.cu")
    assert set(s["suites"]) == users("aten._grouped_mm.default") == \
        {"deepseek-v3", "kimi-k2", "mixtral-8x7b", "qwen3-30b-a3b"}
    assert not s["everything"]


def test_docs_select_nothing_and_unmapped_paths_everything(repo):
    s = select(repo, "docs/kernels.md", args_line=True)
    assert s["run_arguments"] is None and s["args_line"] == "none" and s["ignored"] == ["docs/kernels.md"]
    assert "nothing: no changed path can affect an item" in s["text"]
    s = select(repo, "csrc/norm/rms.cu", "docs/kernels.md")  # not mapped: no proof it affects nothing
    assert s["everything"] and s["run_arguments"] == [] and "csrc/norm/rms.cu is not mapped" in s["text"]


def test_check_code_selects_that_check_everywhere(tmp_path):
    """In harness's own repository a check module's change selects that check in every suite."""
    from harness.run.select import select
    from harness.settings import Settings
    from harness.suite.loader import discover, load_suite

    suites = [load_suite(p) for p in discover(REPO_SUITES)]
    root = REPO_SUITES.parent
    s = select(["harness/checks/decode.py", "README.md"], Settings(), root, suites, lambda ls: set())
    assert s.checks == {"decode": ["check code harness/checks/decode.py changed"]} and not s.suites
    assert s.run_arguments() == ["--check", "decode"] and s.ignored == ["README.md"]
    s = select(["harness/compare/body.py"], Settings(), root, suites, lambda ls: set())
    assert s.everything and s.run_arguments() == []


def test_bad_ref_is_one_line(repo):
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HARNESS_CONFIG": str(repo / "harness.toml")}
    r = subprocess.run([str(exe), "select", "--base", "no-such-ref"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("harness select: 'no-such-ref' is not a commit of this repository"), r.stderr


def test_outside_a_repository_is_said_as_such(tmp_path):
    # issue #49: outside a git repository select said a ref was missing
    exe = Path(sys.executable).with_name("harness")
    (tmp_path / "harness.toml").write_text('suites_dir = "suites"\n')
    env = os.environ | {"HARNESS_CONFIG": str(tmp_path / "harness.toml"), "GIT_CEILING_DIRECTORIES": str(tmp_path.parent)}
    r = subprocess.run([str(exe), "select", "--base", "main"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "is not in a git repository" in r.stderr and "is not a commit" not in r.stderr, r.stderr


def run_selected(repo: Path, selection: str, *extra: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("harness")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(repo / "harness.toml"), "COLUMNS": "250"}
    return subprocess.run([str(exe), "run", "--selection", selection, "--backend", "cpu", "--results", "res", *extra],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)


def test_harness_run_runs_the_selection_and_nothing_else(repo):
    """`harness run --selection FILE` (what ci.yml's pull-request shards run): only the selected suite's
    items are collected; a selection of nothing leaves complete, empty results and exit 0; a shard
    holding none of the selected items passes; no file means every item."""
    select(repo, "suites/qwen3-8b.toml")
    r = run_selected(repo, "sel.json", "--check", "smoke", "--dtype", "float32", "--no-isolate")
    assert r.returncode == 0, r.stdout + r.stderr
    ran = [row["nodeid"] for row in json.loads((repo / "res" / "summary.json").read_text())["items"]]
    assert ran == ["suites/qwen3-8b.toml::smoke[cpu-float32]"], ran
    assert "selection: 1 suite(s): qwen3-8b (suite file suites/qwen3-8b.toml changed)" in r.stdout
    # a shard that holds none of the selected items passes (the others run them)
    r = run_selected(repo, "sel.json", "--check", "smoke", "--dtype", "float32", "--no-isolate", "-k", "no_such_item")
    assert r.returncode == 0 and "no selected item in this run" in r.stdout, r.stdout + r.stderr
    select(repo, "docs/kernels.md")
    r = run_selected(repo, "sel.json")
    assert r.returncode == 0 and "selection: nothing to run" in r.stdout, r.stdout + r.stderr
    assert 'tests="0"' in (repo / "res" / "junit.xml").read_text()
    assert json.loads((repo / "res" / "run.json").read_text())["status"] == "complete"
    (repo / "bad.json").write_text("{}")
    # the refusal is the selection file's, not the item's: without an isolated worker (its start was
    # ~5 s of this refusal's 10 s)
    r = run_selected(repo, "bad.json", "--no-isolate")
    assert r.returncode == 2 and "bad.json: not a selection file" in r.stdout
    r = run_selected(repo, "missing.json", "--check", "smoke", "--dtype", "float32", "--no-isolate", "-k", "llama")
    assert r.returncode == 0 and "selection: missing.json not found: every item" in r.stdout, r.stdout + r.stderr
    ran = [row["nodeid"] for row in json.loads((repo / "res" / "summary.json").read_text())["items"]]
    assert ran == ["suites/llama-3.1-8b.toml::smoke[cpu-float32]"]  # not limited to the last selection


def test_a_rotating_sample_joins_the_selection(repo):
    from harness.run.select import Selection

    s = Selection(suites={"qwen3-8b": ["suite file changed"]})
    picked = s.add_sample(sorted(BUNDLED), 2, "pr-17")
    assert len(picked) == 2 and "qwen3-8b" not in picked and set(s.suites) == {"qwen3-8b", *picked}
    other = Selection(suites={"qwen3-8b": ["x"]})
    assert other.add_sample(sorted(BUNDLED), 2, "pr-17") == picked  # the same seed, the same sample
    seen = set()
    for pr in range(100, 106):  # six consecutive pull requests: every one of the six suites comes round
        seen |= set(Selection().add_sample(sorted(BUNDLED), 1, str(pr)))
    assert seen == BUNDLED
    assert "rotating sample (seed pr-17)" in s.suites[picked[0]][0]
    assert Selection(everything=["x"]).add_sample(sorted(BUNDLED), 2, "s") == []


@pytest.mark.parametrize("bad, field", [
    ({"run_arguments": 5}, "run_arguments: Input should be a valid list"),
    ({"run_arguments": ["qwen3-8b", 3]}, "run_arguments.1: Input should be a valid string"),
    ({"run_arguments": ["qwen3-8b"], "files": [1]}, "files: Input should be a valid dictionary"),
    ({"run_arguments": None, "ignored": 5}, "ignored: Input should be a valid list"),
    ({"run_arguments": ["qwen3-8b"], "suites": {"qwen3-8b": "why"}}, "suites.qwen3-8b: Input should be a valid list"),
])
def test_a_selection_of_the_wrong_shape_is_one_line_naming_the_field(tmp_path, bad, field):
    """Issue #49: format 1 with a list where a dict was, or numbers where names were, gave tracebacks in
    `harness run --selection`; every field it reads is checked where the file is read."""
    from harness.run.select import SelectError, Selection, read_selection

    good = Selection(suites={"qwen3-8b": ["suite file changed"]}, files={"qwen3-8b": "suites/qwen3-8b.toml"}).to_json()
    (tmp_path / "good.json").write_text(json.dumps(good))
    assert read_selection(tmp_path / "good.json") == good  # what `harness select --json` writes reads back
    (tmp_path / "bad.json").write_text(json.dumps({**good, **bad}))
    with pytest.raises(SelectError) as e:
        read_selection(tmp_path / "bad.json")
    assert str(e.value) == (f"{tmp_path / 'bad.json'}: not a selection file of format 1: {field} (harness select "
                            "--json writes one)"), e.value
