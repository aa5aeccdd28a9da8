"""``harness bisect``: the first commit at which items went bad, in the repository harness runs in.

The repository is the vendor's project (suites, goldens, ``harness.toml``, its backend plugin or
kernels; or harness itself). Between a good and a bad commit (``git rev-list --ancestry-path``,
oldest first), a binary search; at each step the commit is checked out in a worktree of its own
(``git worktree add --detach``, removed after) and ``harness run`` runs there - the same command,
the same isolation, with the worktree first on ``PYTHONPATH`` so that its own modules (a plugin, or
harness itself) are the ones imported - selecting only the items being bisected.

Steps, as named in the report:

``bad end``   the bad commit first, with every item asked for (or, with none, every item of the
              run arguments): the items that fail there are the ones bisected - the others are
              dropped, said so; none failing: nothing to bisect (exit 1);
``step k``    the middle commit of what is left, only those items: bad if any of them failed or
              errored, good if every one passed, *skipped* if one of them does not exist there or
              the run could not produce results (the search then tries the next commit; git
              bisect's ``skip``);

and the answer: the first bad commit, with every step's verdicts per item. ``log2(n) + 1`` runs for
``n`` commits (32 commits: 6).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from harness.files import paths
from harness.settings import unset_env

BAD = ("failed", "error")


class BisectError(Exception):
    """Cannot bisect at all (not a repository, unknown commits, no path between them): one line."""


@dataclass
class Step:
    label: str
    commit: str
    subject: str
    verdicts: dict[str, str]  # item -> passed | failed | error | skipped | missing
    verdict: str  # bad | good | skip
    log: str = ""
    messages: dict[str, str] = field(default_factory=dict)  # item -> its failure's first line

    def line(self) -> str:
        items = ", ".join(f"{k} {v}" + (f": {self.messages[k]}" if self.messages.get(k) else "")
                          for k, v in sorted(self.verdicts.items()))
        point = self.commit[:12] if all(c in "0123456789abcdef" for c in self.commit) else self.commit
        return f"{self.label:<9} {point} {self.verdict:<4} {self.subject[:60]}  [{items}]" + self.why()

    def why(self) -> str:
        """Why a step was skipped, in a few words (a skip that says nothing hid a selection that ran
        other items: issue #49)."""
        if self.verdict != "skip":
            return ""
        last = (self.log.strip().splitlines() or ["no output"])[-1][:200]
        missing = sorted(k for k, v in self.verdicts.items() if v == "missing")
        if missing:
            return (f"  skipped: {', '.join(missing)} not in the run's results (do the run arguments after `--` "
                    f"select other suites or items? the run said: {last})")
        skipped = sorted(k for k, v in self.verdicts.items() if v == "skipped")
        if skipped:
            return f"  skipped: {', '.join(skipped)} skipped by the run: {self.messages.get(skipped[0]) or last}"
        return f"  skipped: the run left no results: {last}"


@dataclass
class Bisection:
    items: list[str]
    steps: list[Step] = field(default_factory=list)
    first_bad: str | None = None
    message: str = ""

    def report(self) -> str:
        lines = [s.line() for s in self.steps]
        return "\n".join(lines + ["", self.message])


def _git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise BisectError(f"git {' '.join(args)}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'failed'}")
    return r.stdout.strip()


def commits(repo: Path, good: str, bad: str) -> list[str]:
    """Commits after ``good`` up to ``bad`` (included), oldest first, on the ancestry path."""
    g, b = _git(repo, "rev-parse", "--verify", f"{good}^{{commit}}"), _git(repo, "rev-parse", "--verify", f"{bad}^{{commit}}")
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", g, b]).returncode != 0:
        raise BisectError(f"{good} is not an ancestor of {bad}: nothing to bisect between them")
    out = _git(repo, "rev-list", "--reverse", "--ancestry-path", f"{g}..{b}")
    return out.split() if out else []


def item_id(suite: str, name: str) -> str:
    """``tiny::smoke[cpu-float32]``: the suite name and the item's test name (as the summary shows them)."""
    return f"{suite}::{name}"


def read_verdicts(junit: Path, messages: dict[str, str] | None = None) -> dict[str, str]:
    """item -> outcome from a run's junit.xml (``messages``: item -> the first line of a failure's
    or error's message)."""
    out: dict[str, str] = {}
    root = ET.parse(junit).getroot()
    for tc in root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        # "s.tiny.toml" without the property: the file's stem
        suite = props.get("harness.suite") or tc.get("classname", "").removesuffix(".toml").rsplit(".", 1)[-1]
        kids = {c.tag for c in tc}
        outcome = ("failed" if "failure" in kids else "error" if "error" in kids else
                   "skipped" if "skipped" in kids else "passed")
        out[item_id(str(suite), tc.get("name", ""))] = outcome
        bad = next((c for c in tc if c.tag in ("failure", "error")), None)
        if messages is not None and bad is not None:
            messages[item_id(str(suite), tc.get("name", ""))] = (bad.get("message") or "").strip().split("\n")[0][:200]
    return out


def _selection(items: list[str]) -> tuple[list[str], str]:
    """The suites to name and the -k expression that selects exactly these items (by their suite
    file's node and their test name)."""
    suites = sorted({i.split("::", 1)[0] for i in items})
    terms = [f"({i.split('::', 1)[0]}.toml and {i.split('::', 1)[1]})" for i in sorted(items)]
    return suites, " or ".join(terms)


def run_at(repo: Path, commit: str, items: list[str] | None, run_args: list[str], work: Path,
           timeout: float, messages: dict[str, str] | None = None) -> tuple[dict[str, str] | None, str]:
    """``harness run`` at ``commit`` in a worktree of its own: (item -> outcome, or None when the run
    produced no results; the run's last output lines)."""
    # the commit's name comes from git (hex), still joined through the checked helper
    wt = paths.join(work, f"c-{commit[:12]}", source="git rev-list", field="commit")
    _git(repo, "worktree", "add", "--detach", "--force", str(wt), commit)
    results = paths.join(work, f"r-{commit[:12]}", source="git rev-list", field="commit")
    try:
        env = dict(os.environ)
        unset_env("HARNESS_CONFIG", env)  # the worktree's own harness.toml, not the one of the checkout we run from
        env["PYTHONPATH"] = os.pathsep.join([str(wt), *filter(None, [env.get("PYTHONPATH")])])
        return _run(wt, env, items, run_args, results, timeout, messages)
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(wt)], capture_output=True)


def child(cmd: list[str], folder: Path, env: dict | None, timeout: float, log_name: str, cwd: Path | None = None,
          lines: int = 5) -> tuple[int | None, str]:
    """``cmd`` under the launch layer (own session, death with this process, the whole tree killed at
    ``timeout`` and when this process is interrupted: a SIGTERM to `harness bisect` used to leave its
    step's run going): (exit code, None at the time limit; the output's last ``lines`` lines)."""
    from harness.launch.group import ProcessGroup
    from harness.launch.status import log_tail

    folder.mkdir(parents=True, exist_ok=True)
    with ProcessGroup.start(cmd, folder, env=env, log_name=log_name, cwd=cwd) as group:
        end = group.wait(deadline_s=timeout)
    return (end.code if end.how == "exited" else None), "\n".join(log_tail(group.log, lines))


def _run(cwd: Path, env: dict, items: list[str] | None, run_args: list[str], results: Path, timeout: float,
         messages: dict[str, str] | None) -> tuple[dict[str, str] | None, str]:
    """One ``harness run`` of ``items`` in ``cwd``: (item -> outcome, or None without results; the tail)."""
    cmd = [sys.executable, "-m", "harness", "run"]
    if items:
        suites, expr = _selection(items)
        cmd += [*suites, "-k", expr]
    cmd += ["--results", str(results), *run_args]
    env.setdefault("HF_HUB_OFFLINE", "1")
    code, tail = child(cmd, results.parent, env, timeout, log_name=f"{results.name}.log", cwd=cwd)
    if code is None:
        return None, f"harness run did not finish within {timeout:g} s"
    junit = results / "junit.xml"
    if not junit.exists():
        return None, tail
    try:
        return read_verdicts(junit, messages), tail
    except ET.ParseError as e:
        return None, f"{junit}: {e}"


def bisect(repo: Path, good: str, bad: str, items: list[str], run_args: list[str], *,
           timeout: float = 3600.0, say=print) -> Bisection:
    repo = Path(_git(Path(repo), "rev-parse", "--show-toplevel"))
    todo = commits(repo, good, bad)
    if not todo:
        raise BisectError(f"{bad} is {good}: nothing to bisect")
    res = Bisection(list(items))
    with tempfile.TemporaryDirectory(prefix="harness-bisect-") as d:
        work = Path(d)

        def step(label: str, commit: str, wanted: list[str] | None) -> Step:
            msgs: dict[str, str] = {}
            verdicts, tail = run_at(repo, commit, wanted, run_args, work, timeout, msgs)
            s = _judge(label, commit, _git(repo, "log", "-1", "--format=%s", commit), wanted, verdicts, tail, msgs)
            res.steps.append(s)
            say(s.line())
            return s

        _search(res, todo, step, items, bad, "commit", lambda c: _git(repo, "log", "-1", "--format=%h %s", c),
                 short=lambda c: c[:12])
    return res


def _judge(label: str, point: str, subject: str, wanted: list[str] | None, verdicts: dict[str, str] | None,
           tail: str, msgs: dict[str, str]) -> Step:
    """One step's verdict: bad if a wanted item failed or errored, skip if one is missing or skipped
    (or the run left no results, or ran no item), else good."""
    if verdicts is None or not (wanted or verdicts):
        # a run with no item in its results (pytest stopped before its first: a plugin that does not import,
        # an unknown option in PYTEST_ADDOPTS) is no verdict, never "every item passed"
        return Step(label, point, subject, {}, "skip", tail)
    mine = {i: verdicts.get(i, "missing") for i in (wanted or verdicts)}
    v = ("bad" if any(o in BAD for o in mine.values()) else
         "skip" if any(o in ("missing", "skipped") for o in mine.values()) else "good")
    return Step(label, point, subject, mine, v, tail, {i: m for i, m in msgs.items() if i in mine})


def _search(res: Bisection, todo: list[str], step, items: list[str], bad: str, what: str, describe, short) -> None:
    """The bad end first, then a binary search of ``todo[:-1]`` for the first bad point (a commit or a
    package version); ``step(label, point, items) -> Step``."""
    first = step("bad end", todo[-1], items or None)
    failing = sorted(i for i, o in first.verdicts.items() if o in BAD)
    if not failing:
        res.message = (f"not reproduced: at {bad} ({short(todo[-1])}) "
                       + ("no results: " + first.log if first.verdict == "skip" else "every item passed")
                       + "; nothing to bisect")
        return
    dropped = sorted(set(first.verdicts) - set(failing)) if items else []
    res.items = failing
    # lo..hi: the first bad is in todo[lo..hi] (todo[-1] is bad)
    lo, hi, k = 0, len(todo) - 1, 0
    skipped: set[int] = set()
    while lo < hi:
        cands = [i for i in range(lo, hi) if i not in skipped]
        if not cands:
            break
        mid = min(cands, key=lambda i: abs(i - (lo + hi) // 2))
        k += 1
        s = step(f"step {k}", todo[mid], failing)
        if s.verdict == "bad":
            hi = mid
        elif s.verdict == "good":
            lo = mid + 1
        else:
            skipped.add(mid)
    res.first_bad = todo[hi]
    unsure = [short(todo[i]) for i in sorted(skipped) if lo <= i < hi]
    res.message = (f"first bad {what}: {describe(todo[hi])} ({len(res.steps)} runs over {len(todo)} {what}s; items: "
                   f"{', '.join(failing)})"
                   + (f"; or one of the skipped {what}s before it: {', '.join(unsure)}" if unsure else "")
                   + (f"; passed at the bad end, not bisected: {', '.join(dropped)}" if dropped else ""))


# --- between two package sets -------------------------------------------------------------------

def _requirement(spec: str) -> tuple[str, str]:
    """``torch==2.14.0.dev20261201`` -> (name, version)."""
    name, sep, version = spec.partition("==")
    if not sep or not name.strip() or not version.strip() or any(c in version for c in "<>=!~,; "):
        raise BisectError(f"{spec!r}: expected NAME==VERSION (one package, one exact version)")
    return name.strip(), version.strip()


def versions_between(name: str, good: str, bad: str, pip_args: list[str]) -> list[str]:
    """The versions of ``name`` the package index has after ``good`` up to ``bad`` (included), oldest
    first, pre-releases included (``pip index versions``)."""
    from packaging.version import InvalidVersion, Version

    with tempfile.TemporaryDirectory(prefix="harness-bisect-index-") as d:
        code, out = child([sys.executable, "-m", "pip", "index", "versions", name, "--pre", *pip_args], Path(d),
                          None, 300, "pip.log", lines=200)
    if code is None:  # a package index that hangs: one line, not a TimeoutExpired traceback
        raise BisectError(f"pip index versions {name}: the package index did not answer within 300 s")
    line = next((ln for ln in out.splitlines() if ln.startswith("Available versions:")), None)
    if code != 0 or line is None:
        why = (out.strip().splitlines() or ["no versions listed"])[-1]
        raise BisectError(f"pip index versions {name}: {why}")
    try:
        g, b = Version(good), Version(bad)
        found = sorted({Version(v.strip()) for v in line.split(":", 1)[1].split(",") if v.strip()})
    except InvalidVersion as e:
        raise BisectError(f"{name}: {e}") from None
    if not g < b:
        raise BisectError(f"{name}: the good version {good} is not older than the bad one {bad}")
    todo = [str(v) for v in found if g < v <= b]
    if not todo or todo[-1] != str(b):
        raise BisectError(f"{name}=={bad} is not in the package index (versions there: "
                          f"{', '.join(map(str, found[-5:]))})")
    return todo


def bisect_packages(good: str, bad: str, items: list[str], run_args: list[str], *, pip_args: list[str] = (),
                    timeout: float = 3600.0, say=print, cwd: Path | None = None) -> Bisection:
    """The first version of one package (two nightly wheels of a vendor's torch, say) at which items
    went bad: each step installs that version alone (``pip install --no-deps --target``) into a folder
    put first on ``PYTHONPATH`` of a ``harness run`` in the current project, so it shadows the
    installed one and nothing else changes."""
    name, g = _requirement(good)
    name_b, b = _requirement(bad)
    if name_b.lower().replace("_", "-") != name.lower().replace("_", "-"):
        raise BisectError(f"--good and --bad name different packages ({name}, {name_b}): one package at a time")
    todo = versions_between(name, g, b, list(pip_args))
    res = Bisection(list(items))
    cwd = Path(cwd or ".")
    with tempfile.TemporaryDirectory(prefix="harness-bisect-") as d:
        work = Path(d)

        def step(label: str, version: str, wanted: list[str] | None) -> Step:
            target = paths.join(work, f"p-{version}", source="pip index versions", field="version")
            code, out = child([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                               str(target), f"{name}=={version}", *pip_args], work, None, 1800, f"pip-{version}.log")
            msgs: dict[str, str] = {}
            if code != 0:  # a version the index lists but pip cannot install here (or in 30 min): skipped
                verdicts, tail = None, (out.strip().splitlines() or ["pip failed or timed out"])[-1]
            else:
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [env.get("PYTHONPATH")])])
                results = paths.join(work, f"r-{version}", source="pip index versions", field="version")
                verdicts, tail = _run(cwd, env, wanted, run_args, results, timeout, msgs)
            s = _judge(label, version, f"{name}=={version}", wanted, verdicts, tail, msgs)
            res.steps.append(s)
            say(s.line())
            return s

        _search(res, todo, step, items, bad, "version", lambda v: f"{name}=={v}", short=lambda v: v)
    return res
